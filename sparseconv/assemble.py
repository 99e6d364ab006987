"""Stage 4, assemble: specialised PTX -> cubin (ptxas on functions alone or in groups, then nvlink).

A cubin from a CUDA 13.x ptxas loads on a 13.0 driver, whereas PTX is JIT-compiled
by the driver only if its .version is one the driver knows. So the build prefers
ptxas, and falls back to a PTX artifact only when no ptxas is found (loading it
checks the PTX version against the driver: sparseconv.runtime). No GPU needed.
"""
from __future__ import annotations

import os
import re
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .compile import ToolNotFoundError, find_tool, run_tool
from .ptx import parse_module
from .shapes import Target


_CALL_RE = re.compile(r"\bcall(?:\.uni)?\s*(?:\([^)]*\)\s*,\s*)?([A-Za-z_$][\w$]*)")


# ptxas starts in ~20 ms, and a batch-1 split variant has up to 128 k-block
# functions of 2-5K lines each (VGG-16: 1,055 functions in 25 variants). So
# consecutive functions that call no other share one ptxas run, up to this
# many lines: with -c each is compiled as alone (the same code bytes, compared
# section by section on VGG-16, session 37), and ptxas's time a line grows past
# ~30K lines a module (docs/PERFORMANCE.md, sessions 27 and 37).
GROUP_LINES = 32_000


def split_module(ptx: str, group_lines: int = 0, min_modules: int = 1) -> List[str]:
    """The module cut for separate compilation: one module per function, or
    with group_lines, consecutive functions that call none sharing a module up
    to that many lines, and no more of them than leaves min_modules modules
    (enough ptxas runs to keep every thread busy). ptxas time grows
    quadratically with the number of .func a module's entry calls (measured:
    1 k-block function 0.75 s, 4 of them 6 s, 16 of them 123 s), but
    linearly when each is compiled alone (`ptxas -c`) and the objects are
    linked (nvlink). Functions become .visible; each
    module declares the functions it calls .extern (the entry calls the
    k-block functions, a split k-block function its pieces). The entry's
    module comes last, alone."""
    module = parse_module(ptx)
    header = "\n".join(module.header)
    decls = {}
    for f in module.functions:
        if not f.is_entry:
            head = list(f.head)
            head[0] = re.sub(r"^\s*\.func\b", ".extern .func", head[0])
            decls[f.name] = "\n".join(head) + ";"
    units: List[List[str]] = []  # each: the texts (declarations, then functions) of one module
    entries = []
    per_module = max(1, len(decls) // max(1, min_modules))  # functions a module may take
    group_size = 0  # lines in units[-1], while it takes more functions
    for f in module.functions:
        head = list(f.head)
        if not f.is_entry:
            head[0] = re.sub(r"^\s*\.func\b", ".visible .func", head[0])
        body = "\n".join(f.body)
        called = dict.fromkeys(n for n in _CALL_RE.findall(body) if n in decls) if "call" in body else {}
        text = "\n".join([*(decls[n] for n in called), *head, "{", body, "}"])
        if f.is_entry:
            entries.append([text])
            continue
        lines = len(f.body)
        if called or not group_size or group_size + lines > group_lines or len(units[-1]) >= per_module:
            units.append([text])
            group_size = lines if not called and lines < group_lines else 0
        else:
            units[-1].append(text)
            group_size += lines
    return ["\n".join([header, *texts, ""]) for texts in units + entries]


def function_code(obj: bytes) -> Dict[str, bytes]:
    """The machine code of each function in an ELF object of ptxas -c, by
    section name (.text.<function>): what tests and bench/ptxas_groups.py
    compare between a function compiled alone and in a group."""
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", obj, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    code = {}
    for name_at, _, _, _, offset, size in heads:
        name = obj[names + name_at:obj.index(b"\0", names + name_at)].decode()
        if name.startswith(".text."):
            code[name] = obj[offset:offset + size]
    return code


_DEFINED_RE = re.compile(r"^\s*\.(?:visible \.func|visible \.entry|entry)\s*(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", re.M)


def module_functions(module_text: str) -> List[str]:
    """The functions (entries included) a module of split_module defines, in order."""
    return _DEFINED_RE.findall(module_text)


def _naming(functions: List[str]) -> str:
    """A piece's functions as an error names them: where ptxas failed."""
    if len(functions) == 1:
        return f"function {functions[0]}"
    return f"functions {functions[0]} to {functions[-1]} ({len(functions)}, compiled together)"


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
        workers = jobs or os.cpu_count() or 1
        # two ptxas runs a thread at least: grouping must not leave a thread idle
        pieces = split_module(ptx, GROUP_LINES, 2 * workers) if nvlink is not None else [ptx]
        if len(pieces) <= 2 and len(module_functions(pieces[0])) <= 1:  # one function and its entry: nothing to gain
            src = Path(tmp) / "layer.ptx"
            src.write_text(ptx)
            run_tool([str(ptxas), *flags, str(src), "-o", str(cubin)], ptx, what)
            return cubin.read_bytes()

        functions = [len(names) for names in map(module_functions, pieces)]

        def compile_piece(i: int) -> str:
            src, obj = Path(tmp) / f"part{i}.ptx", Path(tmp) / f"part{i}.o"
            src.write_text(pieces[i])
            run_tool([str(ptxas), "-c", *flags, str(src), "-o", str(obj)],
                     pieces[i], f"{what}, {_naming(module_functions(pieces[i]))}")
            return str(obj)

        report = on_function or (lambda done, total: None)
        report(0, sum(functions))
        objects: List[str] = []
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for obj in pool.map(compile_piece, range(len(pieces))):  # in order, each as soon as it is done
                objects.append(obj)
                report(sum(functions[:len(objects)]), sum(functions))
        run_tool([str(nvlink), f"-arch={target.arch}", *objects, "-o", str(cubin)], "", f"{what} (nvlink)")
        return cubin.read_bytes()


def have_ptxas() -> bool:
    try:
        find_tool("ptxas")
        return True
    except ToolNotFoundError:
        return False
