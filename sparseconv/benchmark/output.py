"""Result files of the bench (JSON, PNG) written whole or not at all: a run
that fails half way through a write (a full disk, matplotlib raising, Ctrl-C)
leaves the previous file, or none, never a truncated one."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union


def write_atomically(path: Union[str, Path], write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a temporary path in path's folder, with path's
    suffix (matplotlib picks the format from it), then move it onto path.
    On any exception the temporary file is removed and path is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
