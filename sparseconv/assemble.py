"""Stage 4, assemble: specialised PTX -> cubin (ptxas, one function per job, then nvlink).

A cubin from a CUDA 13.x ptxas loads on a 13.0 driver, whereas PTX is JIT-compiled
by the driver only if its .version is one the driver knows. So the build prefers
ptxas, and falls back to a PTX artifact only when no ptxas is found (loading it
checks the PTX version against the driver: sparseconv.runtime). No GPU needed.
"""
from __future__ import annotations

import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional

from .compile import ToolNotFoundError, find_tool, run_tool
from .ptx import parse_module
from .shapes import Target


_CALL_RE = re.compile(r"\bcall(?:\.uni)?\s*(?:\([^)]*\)\s*,\s*)?([A-Za-z_$][\w$]*)")


def split_module(ptx: str) -> List[str]:
    """One PTX module per function, for separate compilation. ptxas time grows
    quadratically with the number of .func a module's entry calls (measured: 1
    k-block function 0.75 s, 4 of them 6 s, 16 of them 123 s), but linearly when
    each is compiled alone (`ptxas -c`) and the objects are linked (nvlink).
    Functions become .visible; each module declares the functions it calls
    .extern (the entry calls the k-block functions, a split k-block function
    its pieces). The entry's module comes last."""
    module = parse_module(ptx)
    header = "\n".join(module.header)
    decls = {}
    for f in module.functions:
        if not f.is_entry:
            head = list(f.head)
            head[0] = re.sub(r"^\s*\.func\b", ".extern .func", head[0])
            decls[f.name] = "\n".join(head) + ";"
    funcs, entries = [], []
    for f in module.functions:
        head = list(f.head)
        if not f.is_entry:
            head[0] = re.sub(r"^\s*\.func\b", ".visible .func", head[0])
        body = "\n".join(f.body)
        called = dict.fromkeys(n for n in _CALL_RE.findall(body) if n in decls) if "call" in body else {}
        text = "\n".join([header, *(decls[n] for n in called), *head, "{", body, "}", ""])
        (entries if f.is_entry else funcs).append(text)
    return funcs + entries


def assemble_cubin(ptx: str, target: Target, what: str, jobs: Optional[int] = None,
                   max_registers: int = 255, opt_level: int = 3,
                   on_function: Optional[Callable[[int, int], None]] = None) -> bytes:
    """ptxas (+ nvlink): PTX text -> cubin bytes. Raises CompileError carrying the log.
    max_registers caps every function: separately compiled functions do not see
    the entry's __launch_bounds__, and the kernel needs the most any of them uses.
    opt_level is ptxas's -O level (Tiling.ptxas_level). on_function(done, total)
    is told how many of a split module's functions are assembled, from (0, total)
    on: the minutes a big layer takes (a module of one or two functions, which
    takes seconds, reports nothing)."""
    ptxas = find_tool("ptxas")
    flags = [f"-arch={target.arch}", f"-O{opt_level}", f"-maxrregcount={max_registers}"]
    try:
        nvlink: Optional[Path] = find_tool("nvlink")
    except ToolNotFoundError:
        nvlink = None
    with tempfile.TemporaryDirectory(prefix="sparseconv-") as tmp:
        cubin = Path(tmp) / "layer.cubin"
        pieces = split_module(ptx) if nvlink is not None else [ptx]
        if len(pieces) <= 2:  # one function and its entry: nothing to gain
            src = Path(tmp) / "layer.ptx"
            src.write_text(ptx)
            run_tool([str(ptxas), *flags, str(src), "-o", str(cubin)], ptx, what)
            return cubin.read_bytes()

        def compile_piece(i: int) -> str:
            src, obj = Path(tmp) / f"part{i}.ptx", Path(tmp) / f"part{i}.o"
            src.write_text(pieces[i])
            run_tool([str(ptxas), "-c", *flags, str(src), "-o", str(obj)],
                     pieces[i], f"{what}, function {i}")
            return str(obj)

        report = on_function or (lambda done, total: None)
        report(0, len(pieces))
        objects: List[str] = []
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            for obj in pool.map(compile_piece, range(len(pieces))):  # in order, each as soon as it is done
                objects.append(obj)
                report(len(objects), len(pieces))
        run_tool([str(nvlink), f"-arch={target.arch}", *objects, "-o", str(cubin)], "", f"{what} (nvlink)")
        return cubin.read_bytes()


def have_ptxas() -> bool:
    try:
        find_tool("ptxas")
        return True
    except ToolNotFoundError:
        return False
