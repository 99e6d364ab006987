"""A build worker of parallel.build_many: a fresh Python process that builds
the layers its parent sends it, one at a time.

    python -m sparseconv.build_worker PARENT_PID

It reads pickled (LayerJob, Target, cache root) tuples from stdin and writes
a pickled (True, CompiledLayer) or (False, exception) for each to the file
that was its stdout; anything else it prints goes to stderr, so a stray
print or warning cannot corrupt a result. It exits at the end of its stdin,
and when its parent dies (Linux: PR_SET_PDEATHSIG; elsewhere, and for the
moment before prctl takes effect, a thread that checks every second)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO, Tuple

from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache

_PR_SET_PDEATHSIG = 1


def build_one(job: Any, target: Any, cache_root: str) -> CompiledLayer:
    """One LayerJob built into the cache at cache_root (also build_many's in-process path)."""
    return build_conv2d(job.weight, job.shape, tiling=job.tiling, target=target, cache=ArtifactCache(cache_root),
                        name=job.name, epilogue=job.epilogue)


def die_with_parent(parent: int) -> None:
    """Exit when the process `parent` is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watcher below still catches it, within a second
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="sparseconv-parent-watch", daemon=True).start()


def _result(job: Any, target: Any, cache_root: str) -> Tuple[bool, Any]:
    """(True, layer) or (False, the exception), the exception one the parent can unpickle."""
    try:
        return True, build_one(job, target, cache_root)
    except Exception as exc:
        try:
            pickle.loads(pickle.dumps(exc))
            return False, exc
        except Exception:  # an exception that does not survive pickling: its text, traceback included
            return False, RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def serve(jobs: BinaryIO, results: BinaryIO) -> None:
    """Build each job read from `jobs` until its end, writing each result to `results`."""
    while True:
        try:
            job, target, cache_root = pickle.load(jobs)
        except EOFError:
            return
        pickle.dump(_result(job, target, cache_root), results)
        results.flush()


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints go to stderr from here on, not into the results
    serve(sys.stdin.buffer, results)


if __name__ == "__main__":
    main()
