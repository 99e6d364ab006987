"""Exact NumPy interpreter for the subset of NVIDIA PTX that sparseconv kernels use.

CI machines have no GPU. This module executes generated PTX on the CPU so that
a test can compare a kernel's output, bit for bit, with a NumPy reference::

    run_kernel(ptx, "sc_conv2d", grid=(gx, gy, gz), block=(bx, by, bz),
               args=[x, y, bias, n_chunks], dynamic_shared_bytes=nbytes)

Execution model
    Blocks run one after another. The threads of a block run together, SIMT
    style: every register holds one NumPy array with one lane per thread, so an
    instruction costs a few NumPy calls for the whole block. Threads that
    diverge are split into groups, each parked at its next pc; the group with
    the lowest pc runs next, and groups that reach the same pc merge again.
    That is how GPUs reconverge structured code, and it keeps each lane's
    result identical to running the thread alone (for race-free kernels).
    `bar.sync` parks the arriving lanes until every thread of the block that
    has not exited waits at that same barrier instruction; waiting at two
    different barrier instructions is reported as a deadlock. A `.func`
    call runs the callee to completion for the calling lanes, with a fresh
    register file per activation. `.uni` branches that diverge inside a warp
    of 32 threads are errors.
    Thread-block clusters (an entry with .reqnctapercluster): the blocks of
    one cluster run together, each in its own Python thread, and meet at
    `barrier.cluster.wait` (a block-wide barrier first, then the cluster's);
    `barrier.cluster.arrive` is taken as part of the wait that follows it.
    `mapa.shared::cluster.u32` maps a shared address to cluster rank r's copy
    (a fake window: address + (r + 1) << 20), which ld.shared::cluster reads.
    A block that ends while another waits at a cluster barrier is a deadlock.

Supported subset (anything else raises PtxInterpreterError naming the
instruction and its line)
    structure   .version/.target/.address_size/.file/.loc/.pragma/.section
                (ignored);
                .entry and .func (with return params) definitions, prototypes;
                .maxntid/.reqntid (checked against the launch);
                .explicitcluster/.reqnctapercluster (the launch's cluster); .reg (incl.
                %r<N> ranges), .param, .shared (module level, function level,
                .extern dynamic), module-level .global arrays without an
                initializer (zero at launch, as at module load), nested { }
                scopes, labels, .branchtargets;
                // and /* */ comments; statements spanning lines.
    operands    registers, %tid/%ntid/%ctaid/%nctaid.{x,y,z}, %laneid, %warpid,
                %cluster_ctarank, %cluster_nctarank;
                integer immediates (dec/hex/octal/binary, negative), 0fXXXXXXXX
                and 0dXXXXXXXXXXXXXXXX float immediates, decimal floats;
                shared and global symbols as values; [reg], [reg+imm],
                [reg+-imm], [reg-imm], [sym], [sym+imm], [imm]; vectors {a, b, ...} and _.
    memory      ld/st .param .global (.nc and cache hints ignored) .shared and
                generic, ld.shared::cluster (with mapa.shared::cluster.u32),
                scalar and .v2/.v4, 8-64 bit and f32/f64, dest/source
                registers wider than the type (ld/st/cvt extension rules);
                cvta(.to).{global,shared}.{u32,u64}.
    integer     add sub mul.{lo,hi,wide} mad.{lo,hi,wide} div rem neg abs min
                max and or xor not shl shr (arithmetic for .s types), 16/32/64
                bit, wrapping; add/sub .sat.s32; mul.hi.{s,u}64 exactly;
                bfi.b32/.b64.
    float       add sub mul fma.rn mad.rn neg abs min max div.rn rcp.rn sqrt.rn
                for .f32 (+ .ftz, .sat), add sub mul neg abs min max div.rn
                sqrt.rn for .f64; explicit .rn rounding only.
    compare     setp.{eq,ne,lt,le,gt,ge,lo,ls,hi,hs} ints, float ordered and
                unordered (equ, ltu, num, nan, ...), .and/.or/.xor combine
                with a (negated) predicate, two destinations p|q; selp;
                and/or/xor/not .pred.
    convert     cvt int<->int, int->float (.rn), float->int (.rni .rzi .rmi
                .rpi, saturating, NaN -> 0), f32<->f64, f32 round to integral.
    control     @p / @!p guards on any instruction; bra(.uni); brx.idx(.uni);
                call(.uni) with params and return params; ret; exit;
                bar.sync / barrier(.cta).sync(.aligned) with a constant id;
                barrier.cluster.arrive(.release|.relaxed)(.aligned) and
                barrier.cluster.wait(.acquire)(.aligned);
                membar/fence (no-ops: the interpreter is sequential);
                createpolicy.fractional.L2::* (an opaque value) and the
                policy operand of ld.global(.nc).L2::cache_hint (must be
                written; no other effect);
                griddepcontrol.wait / .launch_dependents (no-ops: one
                kernel at a time, so the one before has always finished);
                shfl.sync.bfly.b32 over whole warps (constant lane mask),
                shfl.sync.idx.b32 over whole warps (any source lane);
                cp.async.{ca,cg}.shared.global with src-size zero fill,
                cp.async.commit_group, wait_group N, wait_all (a copy lands
                in shared memory only when a wait covers its group);
                prefetch{.global}.{L1,L2} (no effect; its address is checked).

Checks (each raises PtxInterpreterError): global accesses must fall inside
one argument array (each array gets a fake base address, 0x1000_0000 apart)
and be aligned to the access size (the whole vector for .v2/.v4); shared
accesses must fall inside the block's shared window (static symbols, then
dynamic_shared_bytes); reading a register, or a lane of one, never written;
integer division by zero; barrier deadlock; a runaway loop (STEP_LIMIT);
and, when the module is loaded, a call whose arguments were stored with
st.param only before an earlier call (CHECK_CALL_ARGUMENT_STORES): PTX's text
allows that, but ptxas hands the stores to the first call only and the GPU
runs the later calls on garbage. Shared memory starts filled with 0xFF bytes
(NaN for f32), so a kernel that reads shared memory it never wrote produces
garbage rather than plausible zeros.

Exactness: integer ops wrap at their width. f32 add/sub/mul/div/sqrt are the
IEEE float32 NumPy ops (round to nearest even, subnormals kept unless .ftz).
fma.rn.f32 is a true fused multiply-add: the float64 product of two float32 is
exact, and the float64 sum is rounded only once more; that second rounding
can differ from a single rounding only when the float64 sum lands exactly on
a float32 halfway point (or in the float32 subnormal range), and those rare
lanes are redone exactly with the TwoSum error term. NaN payloads are not
modelled (any NaN result is some NaN; GPUs give 0x7FFFFFFF), nor is the sign
of min/max(+0, -0). tests/test_ptx_interpreter.py, run with
PTX_INTERPRETER_CROSSCHECK=1 on a GPU machine, checks all of this against
the hardware (bit-identical on an H100 with CUDA 13.0).

LAST_RUN_STATS holds the instruction counts of the last launch.
"""
from __future__ import annotations

import copy
import functools
import re
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PtxInterpreterError", "run_kernel", "LAST_RUN_STATS"]


class PtxInterpreterError(Exception):
    """Unsupported PTX, bad memory access, uninitialised read or deadlock."""

    located = False  # set once the message carries the function and line


# Statistics of the last run_kernel call: "thread_instructions" (one per
# active lane per executed instruction), "group_instructions" (instructions
# the scheduler issued, each for a whole group of lanes) and "blocks".
LAST_RUN_STATS: Dict[str, int] = {}

# Reject calls whose arguments were stored (st.param) only before an earlier
# call: real GPUs run such PTX wrongly (see _Decoder._check_call_arguments).
CHECK_CALL_ARGUMENT_STORES = True

# Give up (as if deadlocked) after this many issued instructions in a launch:
# a kernel that loops forever must fail the test, not hang CI.
STEP_LIMIT = 200_000_000

# Argument array i starts at (i + 1) << 28 | 1 << 27: in the middle of its own
# 256 MiB window, so that an access a little before or after it is still
# reported against the right array.
_GLOBAL_SPACING_BITS = 28
_GLOBAL_MAX_BYTES = 1 << 27
_SHARED_GENERIC_BASE = 0x7F0 << _GLOBAL_SPACING_BITS  # generic address of shared offset 0
_GLOBAL_SYMBOL_SLOT = 0x400  # address slot of the first module-level .global array
_INF = 1 << 62

# ------------------------------------------------------------------ types
_NP: Dict[str, np.dtype] = {
    t: np.dtype(d) for t, d in {
        "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
        "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
        "b8": np.uint8, "b16": np.uint16, "b32": np.uint32, "b64": np.uint64,
        "f32": np.float32, "f64": np.float64, "pred": np.bool_,
    }.items()
}
_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_SIGNED = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}
_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)
_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


def _is_int(t: str) -> bool:
    return t[0] in "sub" and t != "pred"


def _is_float(t: str) -> bool:
    return t[0] == "f"


def _size(t: str) -> int:
    """Bytes of a type (.pred counts as 1, it only matters for matching)."""
    return _NP[t].itemsize


def _same_width_dtype(dt: np.dtype, signed: bool) -> np.dtype:
    return (_SIGNED if signed else _UNSIGNED)[dt.itemsize]


# ------------------------------------------------------------------ lexing
_COMMENT_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?\*/', re.S)
_TOKEN_RE = re.compile(r"[;{}]|[^;{}]+")
_LABEL_RE = re.compile(r"\s*([A-Za-z_$%][\w$]*)\s*:(?!:)")
_HEADER_RE = re.compile(r"\.(entry|func)\b")


# Directives that end at the end of their line, without a ';', and debug
# sections (`.section .debug_info { ... }`, emitted with -G).
_LINE_DIRECTIVE_RE = re.compile(r"^[ \t]*\.(?:version|target|address_size|file|loc)\b[^\n]*", re.M)
_SECTION_RE = re.compile(r"^[ \t]*\.section\b[^{;]*\{[^}]*\}", re.M)


def _strip_comments(text: str) -> str:
    """Blank out comments, line directives and debug sections, keeping the
    line structure (statement line numbers stay right)."""
    def blank(m: "re.Match[str]") -> str:
        s = m.group(0)
        return s if s.startswith('"') else "\n" * s.count("\n")
    text = _COMMENT_RE.sub(blank, text)
    text = _SECTION_RE.sub(blank, text)
    return _LINE_DIRECTIVE_RE.sub("", text)


def _statements(text: str) -> List[Tuple[str, str, int]]:
    """Split PTX into (kind, text, line): kind is 'stmt' (ends in ';'), 'label',
    'header' (a function header, the text before its body's '{'), 'open' or
    'close' (a scope brace). Braces inside a statement (vector operands,
    initialisers) stay part of that statement."""
    text = _strip_comments(text)
    out: List[Tuple[str, str, int]] = []
    buf: List[str] = []
    buf_line = 0
    inner = 0  # depth of braces inside the current statement
    line = 1

    def pending() -> bool:
        return any(s.strip() for s in buf)

    for m in _TOKEN_RE.finditer(text):
        tok = m.group(0)
        if tok == ";":
            if inner:
                raise PtxInterpreterError(f"line {line}: ';' inside braces")
            if pending():
                out.append(("stmt", " ".join("".join(buf).split()), buf_line))
            buf = []
        elif tok == "{":
            if inner or (pending() and not _HEADER_RE.search("".join(buf))):
                buf.append("{")
                inner += 1
            else:
                if pending():
                    out.append(("header", " ".join("".join(buf).split()), buf_line))
                    buf = []
                out.append(("open", "{", line))
        elif tok == "}":
            if inner:
                buf.append("}")
                inner -= 1
            else:
                if pending():
                    raise PtxInterpreterError(f"line {buf_line}: statement not ended by ';' before '}}'")
                buf = []
                out.append(("close", "}", line))
        else:
            pos = 0
            if not pending():
                # Labels can only start a statement.
                while True:
                    lm = _LABEL_RE.match(tok, pos)
                    if not lm:
                        break
                    out.append(("label", lm.group(1), line + tok.count("\n", 0, lm.start(1))))
                    pos = lm.end()
                rest = tok[pos:]
                if rest.strip():
                    stripped = len(rest) - len(rest.lstrip())
                    buf_line = line + tok.count("\n", 0, pos + stripped)
            buf.append(tok[pos:])
            line += tok.count("\n")
            continue
        line += tok.count("\n")
    if pending() or inner:
        raise PtxInterpreterError(f"line {buf_line}: unterminated statement at end of module")
    return out


def _split_operands(s: str) -> List[str]:
    """Split at commas that are not inside [], {} or ()."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    last = "".join(cur).strip()
    if last:
        out.append(last)
    return out


# ------------------------------------------------------------------ immediates
_INT_RE = re.compile(r"^([+-]?)(0[xX][0-9a-fA-F]+|0[bB][01]+|0[0-7]+|\d+)[uU]?$")
_F32_RE = re.compile(r"^0[fF]([0-9a-fA-F]{8})$")
_F64_RE = re.compile(r"^0[dD]([0-9a-fA-F]{16})$")
_DEC_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def _parse_int(tok: str) -> Optional[int]:
    m = _INT_RE.match(tok.replace(" ", ""))
    if not m:
        return None
    body = m.group(2)
    if body[:2] in ("0x", "0X"):
        v = int(body, 16)
    elif body[:2] in ("0b", "0B"):
        v = int(body[2:], 2)
    elif len(body) > 1 and body[0] == "0":
        v = int(body, 8)
    else:
        v = int(body)
    return -v if m.group(1) == "-" else v


def _immediate(tok: str, t: str):
    """A literal as a NumPy scalar of type t, or None if tok is no literal."""
    dt = _NP[t]
    m32, m64, iv = _F32_RE.match(tok), _F64_RE.match(tok), _parse_int(tok)
    if t == "pred":
        return None if iv is None else np.bool_(iv != 0)
    if _is_float(t):
        if m32:
            value = np.array(int(m32.group(1), 16), np.uint32).view(np.float32)[()]
        elif m64:
            value = np.array(int(m64.group(1), 16), np.uint64).view(np.float64)[()]
        elif iv is not None:
            value = np.float64(iv)
        elif _DEC_FLOAT_RE.match(tok):
            value = np.float64(float(tok))
        else:
            return None
        return dt.type(value)
    if m32 or m64:  # a float bit pattern used as an integer (mov.b32 %r, 0f3F800000)
        iv = int((m32 or m64).group(1), 16)
    if iv is None:
        return None
    bits = dt.itemsize * 8
    return np.array(iv & ((1 << bits) - 1), _UNSIGNED[dt.itemsize]).view(dt)[()]


# ------------------------------------------------------------------ module
class _Func:
    """A parsed .entry/.func: declarations now, decoded code after _decode."""

    def __init__(self, name: str, is_entry: bool, params, rets, directives: str, line: int):
        self.name = name
        self.is_entry = is_entry
        self.params: List[Tuple[str, str]] = params  # (name, type)
        self.rets: List[Tuple[str, str]] = rets
        self.directives = directives
        self.line = line
        self.body: List[Tuple[str, str, int]] = []
        self.reg_types: Dict[str, str] = {}
        self.reg_ranges: Dict[str, Tuple[int, str]] = {}
        self.param_decls: Dict[str, str] = {n: t for n, t in params + rets}
        self.local_shared: Dict[str, str] = {}  # name -> module-level key
        self.slots: Dict[str, int] = {}
        self.code: List["_Ins"] = []
        self.labels: Dict[str, int] = {}
        self.targets: Dict[str, List[str]] = {}
        self.maxntid: Optional[int] = None
        self.reqntid: Optional[Tuple[int, ...]] = None
        self.cluster: Optional[Tuple[int, int, int]] = None  # .reqnctapercluster

    def reg_type(self, name: str) -> Optional[str]:
        """Declared type of a register name (None: not a register)."""
        t = self.reg_types.get(name)
        if t is not None:
            return t
        m = re.match(r"^(.*?)(\d+)$", name)
        if m and m.group(1) in self.reg_ranges:
            count, t = self.reg_ranges[m.group(1)]
            if int(m.group(2)) < count:
                self.reg_types[name] = t  # memoise: decoding asks again and again
                return t
        return None

    def slot(self, name: str) -> int:
        s = self.slots.get(name)
        if s is None:
            s = self.slots[name] = len(self.slots)
        return s


class _SharedSym:
    def __init__(self, key: str, align: int, size: int, extern: bool):
        self.key, self.align, self.size, self.extern = key, align, size, extern
        self.offset = 0


class _GlobalSym:
    """A module-level .global array: its own buffer in the fake address space."""

    def __init__(self, name: str, base: int, size: int):
        self.name, self.base, self.size = name, base, size


class _Module:
    def __init__(self, ptx: str, check_call_arguments: bool = True):
        self.check_call_arguments = check_call_arguments
        self.funcs: Dict[str, _Func] = {}
        self.shared: Dict[str, _SharedSym] = {}  # key -> symbol (key = name or func::name)
        self.globals: Dict[str, _GlobalSym] = {}
        self._parse(_statements(ptx))
        decoders = [_Decoder(self, f) for f in self.funcs.values()]
        for d in decoders:
            d.declare_all()  # collects function-level .shared too, so lay out after
        self._layout_shared()
        for d in decoders:
            d.decode_all()

    # -- parsing -----------------------------------------------------------
    def _parse(self, stmts: List[Tuple[str, str, int]]) -> None:
        i = 0
        while i < len(stmts):
            kind, text, line = stmts[i]
            if kind == "header":
                func = self._parse_header(text, line)
                if i + 1 >= len(stmts) or stmts[i + 1][0] != "open":
                    raise PtxInterpreterError(f"line {line}: function body expected")
                depth, i = 1, i + 2
                while depth:
                    if i >= len(stmts):
                        raise PtxInterpreterError(f"line {line}: unterminated body of {func.name}")
                    k = stmts[i][0]
                    depth += (k == "open") - (k == "close")
                    if depth:
                        func.body.append(stmts[i])
                    i += 1
                if func.name in self.funcs:
                    raise PtxInterpreterError(f"line {line}: function {func.name} defined twice")
                self.funcs[func.name] = func
                continue
            if kind == "stmt":
                self._module_directive(text, line)
            elif kind in ("open", "close", "label"):
                raise PtxInterpreterError(f"line {line}: unexpected {text!r} at module level")
            i += 1

    def _module_directive(self, text: str, line: int) -> None:
        first = text.split()[0]
        if first in (".version", ".target", ".address_size", ".file", ".loc", ".section"):
            return
        if _HEADER_RE.search(text):  # a prototype: `.func foo(...)` / `.extern .func`
            return
        if ".shared" in text.split():
            sym = _parse_shared_decl(text, line, key_prefix="")
            self.shared[sym.key] = sym
            return
        if ".global" in text.split():
            m = _GLOBAL_DECL_RE.match(text)
            if not m:
                raise PtxInterpreterError(f"line {line}: unsupported .global declaration (initialised?): {text}")
            size = _size(m.group("type")) * int(m.group("count"))
            # slots above every argument's (see _kernel_params)
            base = ((_GLOBAL_SYMBOL_SLOT + len(self.globals)) << _GLOBAL_SPACING_BITS) + _GLOBAL_MAX_BYTES
            if size > _GLOBAL_MAX_BYTES:
                raise PtxInterpreterError(f"line {line}: .global arrays larger than 128 MiB are not supported")
            self.globals[m.group("name")] = _GlobalSym(m.group("name"), base, size)
            return
        raise PtxInterpreterError(f"line {line}: unsupported module-level directive: {text}")

    def _parse_header(self, text: str, line: int) -> _Func:
        m = re.match(r"^(?P<pre>.*?)\.(?P<kind>entry|func)\s*(?:\((?P<ret>[^)]*)\))?\s*"
                     r"(?P<name>[A-Za-z_$][\w$]*)\s*(?:\((?P<params>[^)]*)\))?(?P<post>.*)$", text)
        if not m:
            raise PtxInterpreterError(f"line {line}: cannot parse function header: {text}")
        params = _parse_param_list(m.group("params") or "", line)
        rets = _parse_param_list(m.group("ret") or "", line)
        func = _Func(m.group("name"), m.group("kind") == "entry", params, rets, m.group("post"), line)
        for d in re.finditer(r"\.(maxntid|reqntid|reqnctapercluster)\s+([\d,\s]+)", m.group("post")):
            dims = tuple(int(v) for v in d.group(2).replace(",", " ").split())
            if d.group(1) == "maxntid":
                func.maxntid = int(np.prod(dims))
            elif d.group(1) == "reqntid":
                func.reqntid = dims
            else:
                func.cluster = tuple(dims + (1,) * (3 - len(dims)))  # type: ignore[assignment]
        return func

    def _layout_shared(self) -> None:
        """Static shared symbols first (in declaration order), then the dynamic
        region, where every .extern .shared symbol starts (they alias, as in CUDA)."""
        end = 0
        ext_align = 16
        for sym in self.shared.values():
            if sym.extern:
                ext_align = max(ext_align, sym.align)
                continue
            sym.offset = -(-end // sym.align) * sym.align
            end = sym.offset + sym.size
        self.dynamic_base = -(-end // ext_align) * ext_align
        for sym in self.shared.values():
            if sym.extern:
                sym.offset = self.dynamic_base


def _parse_param_list(text: str, line: int) -> List[Tuple[str, str]]:
    out = []
    for p in _split_operands(text):
        words = p.replace(",", " ").split()
        if not words or words[0] != ".param":
            raise PtxInterpreterError(f"line {line}: cannot parse parameter {p!r}")
        types = [w[1:] for w in words if w.startswith(".") and w[1:] in _NP]
        name = words[-1]
        if "[" in name or len(types) != 1:
            out.append((name.split("[")[0], "unsupported:" + p))  # e.g. .b8 arrays (structs by value)
        else:
            out.append((name, types[0]))
    return out


_GLOBAL_DECL_RE = re.compile(
    r"^(?:\.(?:visible|weak)\s+)*\.global\s+(?:\.align\s+\d+\s+)?"
    r"\.(?P<type>\w+)\s+(?P<name>[A-Za-z_$][\w$]*)\s*\[\s*(?P<count>\d+)\s*\]$")
_SHARED_DECL_RE = re.compile(
    r"^(?P<ext>\.extern\s+)?(?:\.(?:visible|weak)\s+)*\.shared(?:::cta)?\s+(?:\.align\s+(?P<align>\d+)\s+)?"
    r"\.(?P<type>\w+)\s+(?P<name>[A-Za-z_$][\w$]*)(?P<dims>(?:\s*\[\s*\d*\s*\])*)$")


def _parse_shared_decl(text: str, line: int, key_prefix: str) -> _SharedSym:
    m = _SHARED_DECL_RE.match(text.replace(".visible ", "").strip())
    if not m or m.group("type") not in _NP:
        raise PtxInterpreterError(f"line {line}: unsupported .shared declaration: {text}")
    elem = _size(m.group("type"))
    count = 1
    for d in re.findall(r"\[\s*(\d*)\s*\]", m.group("dims")):
        count *= int(d) if d else 0
    extern = bool(m.group("ext"))
    if not extern and not count:
        raise PtxInterpreterError(f"line {line}: unsized static .shared array: {text}")
    align = int(m.group("align") or elem)
    return _SharedSym(key_prefix + m.group("name"), align, elem * count, extern)


# ------------------------------------------------------------------ decoded code
PLAIN, BRA, BRX, CALL, RET, EXIT, BAR = range(7)


class _Ins:
    __slots__ = ("kind", "fn", "guard", "line", "text", "target", "targets", "index",
                 "callee", "args", "rets", "uni", "stores_param", "cluster_wait")

    def __init__(self, kind: int, line: int, text: str):
        self.kind, self.line, self.text = kind, line, text
        self.cluster_wait = False
        self.fn = self.guard = self.index = self.callee = self.stores_param = None
        self.target = 0
        self.targets: List[int] = []
        self.args: List[str] = []
        self.rets: List[str] = []
        self.uni = False


Getter = Callable[["_Frame", Optional[np.ndarray]], object]

_SPECIALS = {f"%{n}.{d}" for n in ("tid", "ntid", "ctaid", "nctaid") for d in "xyz"} | {
    "%laneid", "%warpid", "%nwarpid", "%cluster_ctarank", "%cluster_nctarank"}
# mapa.shared::cluster.u32 gives rank r's copy of a shared address at
# address + (r + 1) * _CLUSTER_WINDOW (shared offsets stay below it).
_CLUSTER_WINDOW = 1 << 20
_CACHE_QUALIFIERS = {"nc", "ca", "cg", "cs", "lu", "cv", "wb", "wt", "volatile", "weak", "relaxed",
                     "acquire", "release", "cta", "gpu", "sys", "uni"}
_SPACES = {"param", "global", "shared", "local", "const"}


def _write(fr: "_Frame", slot: int, val, m: Optional[np.ndarray]) -> None:
    """Store val (array or NumPy scalar) into a register, for the lanes in m
    (None: every lane). Arrays are never modified in place, so registers can
    share them."""
    if m is None:
        if val.ndim == 0:
            val = np.full(fr.ctx.T, val, val.dtype)
        fr.regs[slot] = val
        if fr.wr[slot] is not None:
            fr.wr[slot] = None
        return
    old = fr.regs[slot]
    if old is None:
        fr.regs[slot] = np.where(m, val, val.dtype.type(0))
        fr.wr[slot] = m
        return
    if old.dtype != val.dtype:
        old = old.view(val.dtype)
    fr.regs[slot] = np.where(m, val, old)
    w = fr.wr[slot]
    if w is not None:
        w = w | m
        fr.wr[slot] = w if np.greater(fr.M, w).any() else None


class _Decoder:
    """Turns each instruction of one function into an _Ins holding a closure
    fn(frame, mask) that does the work with NumPy (mask None: every lane)."""

    def __init__(self, module: _Module, func: _Func):
        self.mod, self.f = module, func

    # -- declarations and labels ---------------------------------------------
    def declare_all(self) -> None:
        """First pass: declarations, labels and the instruction list."""
        f = self.f
        pending_labels: List[str] = []
        insts: List[Tuple[str, int]] = []
        for kind, text, line in f.body:
            if kind == "label":
                pending_labels.append(text)
                continue
            if kind in ("open", "close"):
                continue
            if text.startswith("."):
                if text.startswith(".branchtargets"):
                    if not pending_labels:
                        raise PtxInterpreterError(f"line {line}: .branchtargets without a label")
                    names = _split_operands(text[len(".branchtargets"):])
                    f.targets[pending_labels.pop()] = names
                else:
                    self._declaration(text, line)
                continue
            for lab in pending_labels:
                f.labels[lab] = len(insts)
            pending_labels = []
            insts.append((text, line))
        for lab in pending_labels:
            f.labels[lab] = len(insts)  # running into it is reported at run time
        self.insts = insts

    def decode_all(self) -> None:
        """Second pass, once all functions and shared symbols are known."""
        f = self.f
        for text, line in self.insts:
            try:
                f.code.append(self.decode(text, line))
            except PtxInterpreterError as e:
                if e.located:
                    raise
                raise _located(f, _Ins(PLAIN, line, text), e) from None
        if self.mod.check_call_arguments:
            self._check_call_arguments()

    def _check_call_arguments(self) -> None:
        """Every call needs its own st.param of each argument, after the
        previous call in program order. ptxas binds argument stores to the
        first call that follows them: a later call that reuses them (two calls
        in a row, if/else arms, or the cases of a brx.idx jump table after one
        shared set of stores) reads garbage on the GPU, e.g. faults with an
        illegal address (seen with CUDA 13.0 ptxas, sm_90, H100), although
        the PTX reads as if it were fine."""
        code = self.f.code
        for i, ins in enumerate(code):
            if ins.kind != CALL:
                continue
            for arg in ins.args:
                for j in range(i - 1, -1, -1):
                    if code[j].stores_param == arg:
                        break
                    if code[j].kind == CALL:
                        raise _located(self.f, ins, (
                            f"argument {arg} is not stored (st.param) between the previous call "
                            f"(line {code[j].line}) and this one; ptxas passes it to that earlier call "
                            f"only, so on a GPU this call gets garbage. Store every argument again "
                            f"right before each call (CHECK_CALL_ARGUMENT_STORES=False skips this check)"))
                else:
                    raise _located(self.f, ins, f"argument {arg} is never stored (st.param) before the call")

    def _declaration(self, text: str, line: int) -> None:
        f = self.f
        words = text.replace(",", " ").split()
        head = words[0]
        if head in (".pragma", ".loc", ".file", ".maxnreg", ".maxntid", ".reqntid", ".minnctapersm",
                    ".explicitcluster", ".reqnctapercluster", ".maxclusterrank"):
            return
        if head == ".reg":
            types = [w[1:] for w in words[1:] if w.startswith(".")]
            if len(types) != 1 or types[0] not in _NP:
                raise PtxInterpreterError(f"line {line}: unsupported register declaration: {text}")
            for name in (w for w in words[1:] if not w.startswith(".")):
                rm = re.match(r"^(.*)<(\d+)>$", name)
                if rm:
                    f.reg_ranges[rm.group(1)] = (int(rm.group(2)), types[0])
                else:
                    f.reg_types[name] = types[0]
            return
        if head == ".param":
            types = [w[1:] for w in words[1:] if w.startswith(".") and w[1:] in _NP]
            name = words[-1]
            if "[" in name or len(types) != 1:
                raise PtxInterpreterError(f"line {line}: unsupported .param declaration: {text}")
            f.param_decls[name] = types[0]
            return
        if ".shared" in words:
            sym = _parse_shared_decl(text, line, key_prefix=f.name + "::")
            self.mod.shared[sym.key] = sym
            f.local_shared[sym.key.split("::", 1)[1]] = sym.key
            return
        raise PtxInterpreterError(f"line {line}: unsupported directive: {text}")

    # -- operands ----------------------------------------------------------------
    def _shared_sym(self, name: str) -> Optional[_SharedSym]:
        key = self.f.local_shared.get(name, name)
        return self.mod.shared.get(key)

    def _reg(self, tok: str, t: str, wider_ok: bool = False) -> Tuple[int, str]:
        """Slot and declared type of register tok, checking it fits type t."""
        rt = self.f.reg_type(tok)
        if rt is None:
            raise PtxInterpreterError(f"undeclared register {tok}")
        if (rt == "pred") != (t == "pred"):
            raise PtxInterpreterError(f"register {tok} (.{rt}) used as .{t}")
        if t != "pred":
            rs, ts = _size(rt), _size(t)
            if rs < ts or (rs > ts and not wider_ok):
                raise PtxInterpreterError(f"register {tok} (.{rt}) does not match .{t}")
        return self.f.slot(tok), rt

    def src(self, tok: str, t: str, wider_ok: bool = False) -> Getter:
        """A getter for a source operand, returning values as NumPy type t."""
        tok = tok.strip()
        dt = _NP[t]
        if tok.startswith("!"):
            if t != "pred":
                raise PtxInterpreterError(f"negated operand {tok} must be a predicate")
            g = self.src(tok[1:], t)
            return lambda fr, m: np.logical_not(g(fr, m))
        if tok in _SPECIALS:
            if _size(t) != 4:
                raise PtxInterpreterError(f"{tok} is 32-bit, used as .{t}")
            return lambda fr, m: fr.ctx.special[tok].view(dt)
        if self.f.reg_type(tok) is not None:
            slot, rt = self._reg(tok, t, wider_ok)
            narrow = _UNSIGNED[dt.itemsize] if (wider_ok and _size(rt) > dt.itemsize) else None

            def get(fr, m):
                v = fr.regs[slot]
                if v is None or fr.wr[slot] is not None:
                    v = fr.checked_read(slot, m, tok)
                if narrow is not None:  # source wider than the type: keep the low bits
                    v = v.view(_UNSIGNED[v.dtype.itemsize]).astype(narrow)
                return v if v.dtype is dt else v.view(dt)
            return get
        sym = self._shared_sym(tok)
        if sym is not None:
            if not _is_int(t) or _size(t) < 4:
                raise PtxInterpreterError(f"address of {tok} used as .{t}")
            address = dt.type(sym.offset)  # offset in the shared window
            return lambda fr, m: address
        gsym = self.mod.globals.get(tok)
        if gsym is not None:
            if not _is_int(t) or _size(t) != 8:
                raise PtxInterpreterError(f"address of .global {tok} used as .{t}")
            gaddress = dt.type(gsym.base)
            return lambda fr, m: gaddress
        imm = _immediate(tok, t)
        if imm is None:
            raise PtxInterpreterError(f"unknown operand {tok!r}")
        return lambda fr, m: imm

    def dst(self, tok: str, t: str, wider_ok: bool = False) -> Tuple[int, np.dtype]:
        """Slot and storage dtype of a destination register; the storage dtype
        is t's dtype widened to the register when wider_ok (ld/cvt)."""
        tok = tok.strip()
        slot, rt = self._reg(tok, t, wider_ok)
        dt = _NP[t]
        if t != "pred" and _size(rt) > dt.itemsize:
            dt = _same_width_dtype(_NP[rt], t[0] == "s")
        return slot, dt

    def address(self, tok: str) -> Tuple[Optional[Getter], int]:
        """[base+imm] -> (getter of int64 base addresses or None, constant part)."""
        if not (tok.startswith("[") and tok.endswith("]")):
            raise PtxInterpreterError(f"memory operand expected, got {tok!r}")
        inner = tok[1:-1].replace(" ", "")
        m = re.match(r"^([A-Za-z_$%][\w$.]*)?(?:([+-])(.+))?$", inner)
        if not m:
            iv = _parse_int(inner)
            if iv is None:
                raise PtxInterpreterError(f"cannot parse address {tok}")
            return None, iv
        base, sign, rest = m.groups()
        off = 0
        if rest is not None:
            iv = _parse_int(rest)
            if iv is None:
                raise PtxInterpreterError(f"cannot parse address offset in {tok}")
            off = -iv if sign == "-" else iv
        if base is None:
            return None, off
        sym = self._shared_sym(base)
        if sym is not None:
            return None, off + sym.offset
        if base in self.mod.globals:
            return None, off + self.mod.globals[base].base
        rt = self.f.reg_type(base)
        if rt is None:
            raise PtxInterpreterError(f"unknown address base {base!r} in {tok}")
        if rt not in ("u32", "s32", "b32", "u64", "s64", "b64"):
            raise PtxInterpreterError(f"address register {base} has type .{rt}")
        get = self.src(base, "u64" if _size(rt) == 8 else "u32")
        if _size(rt) == 8:
            return (lambda fr, m: get(fr, m).view(_I64)), off
        return (lambda fr, m: get(fr, m).astype(_I64)), off

    # -- instructions --------------------------------------------------------
    def decode(self, text: str, line: int) -> _Ins:
        m = re.match(r"^(?:@(!?)(\S+)\s+)?([A-Za-z][\w.:]*)\s*(.*)$", text)
        if not m:
            raise PtxInterpreterError("cannot parse instruction")
        neg, guard, opcode, rest = m.groups()
        parts = opcode.split(".")
        handler = getattr(self, "op_" + parts[0], None)
        if handler is None:
            raise PtxInterpreterError(f"unsupported instruction {opcode}")
        ins = _Ins(PLAIN, line, text)
        ops = _split_operands(rest)
        result = handler(ins, parts, ops)
        if result is not None:
            ins.fn = result
        if guard is not None:
            g = self.src(guard, "pred")
            ins.guard = (lambda fr, mm: np.logical_not(g(fr, mm))) if neg else g
        return ins

    def _need(self, ops: Sequence[str], n: int, parts: Sequence[str]) -> None:
        if len(ops) != n:
            raise PtxInterpreterError(f"{'.'.join(parts)} takes {n} operands, got {len(ops)}")

    @staticmethod
    def _type(parts: Sequence[str]) -> str:
        t = parts[-1]
        if t not in _NP:
            raise PtxInterpreterError(f"unsupported type .{t} in {'.'.join(parts)}")
        return t

    def _simple(self, ins, parts, ops, n_src, fn, t_srcs=None, t_dst=None):
        """d = fn(a, b, ...) with all operands of the instruction type."""
        t = self._type(parts)
        self._need(ops, n_src + 1, parts)
        t_srcs = t_srcs or [t] * n_src
        d, _ = self.dst(ops[0], t_dst or t)
        g = [self.src(o, ts) for o, ts in zip(ops[1:], t_srcs)]
        if n_src == 1:
            a, = g
            return lambda fr, m: _write(fr, d, fn(a(fr, m)), m)
        if n_src == 2:
            a, b = g
            return lambda fr, m: _write(fr, d, fn(a(fr, m), b(fr, m)), m)
        a, b, c = g
        return lambda fr, m: _write(fr, d, fn(a(fr, m), b(fr, m), c(fr, m)), m)

    def _float_mods(self, parts, allowed=("rn",)):
        """(ftz, sat) of a float instruction; rounding other than allowed fails."""
        mods = set(parts[1:-1])
        ftz, sat = "ftz" in mods, "sat" in mods
        mods -= {"ftz", "sat"}
        if mods - set(allowed):
            raise PtxInterpreterError(f"unsupported modifier(s) {sorted(mods - set(allowed))} in {'.'.join(parts)}")
        return ftz, sat

    def _float_op(self, ins, parts, ops, n_src, fn, allowed=("rn",)):
        t = self._type(parts)
        ftz, sat = self._float_mods(parts, allowed)
        if (ftz or sat) and t != "f32":
            raise PtxInterpreterError(f".ftz/.sat only supported for .f32: {'.'.join(parts)}")
        if ftz or sat:
            inner = fn

            def fn(*xs):
                r = inner(*[_flush(x) for x in xs] if ftz else xs)
                if ftz:
                    r = _flush(r)
                return _saturate(r) if sat else r
        return self._simple(ins, parts, ops, n_src, fn)

    # arithmetic ---------------------------------------------------------------
    def _int_or_float(self, ins, parts, ops, int_fn, float_fn, n_src=2):
        t = self._type(parts)
        if _is_float(t):
            return self._float_op(ins, parts, ops, n_src, float_fn)
        mods = parts[1:-1]
        if mods == ["sat"] and t == "s32" and int_fn in (np.add, np.subtract):
            return self._simple(ins, parts, ops, n_src, functools.partial(_sat_s32, int_fn))
        if mods:
            raise PtxInterpreterError(f"unsupported modifier(s) {mods} in {'.'.join(parts)}")
        return self._simple(ins, parts, ops, n_src, int_fn)

    def op_add(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.add, np.add)

    def op_sub(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.subtract, np.subtract)

    def op_min(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.minimum, np.fmin)

    def op_max(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.maximum, np.fmax)

    def op_neg(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.negative, np.negative, n_src=1)

    def op_abs(self, ins, parts, ops):
        return self._int_or_float(ins, parts, ops, np.abs, np.abs, n_src=1)

    def op_mul(self, ins, parts, ops):
        t = self._type(parts)
        if _is_float(t):
            return self._float_op(ins, parts, ops, 2, np.multiply)
        mode = parts[1] if len(parts) == 3 else None
        if mode == "lo":
            return self._simple(ins, parts, ops, 2, np.multiply)
        if mode == "hi":
            return self._simple(ins, parts, ops, 2, _mul_hi)
        if mode == "wide" and _size(t) <= 4:
            wt = ("s" if t[0] == "s" else "u") + str(_size(t) * 16)
            wdt = _NP[wt]
            return self._simple(ins, parts, ops, 2, lambda a, b: np.multiply(a, b, dtype=wdt), t_dst=wt)
        raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")

    def op_mad(self, ins, parts, ops):
        t = self._type(parts)
        if _is_float(t):
            if "rn" not in parts:
                raise PtxInterpreterError("mad.f32 without .rn is not supported (use mad.rn / fma.rn)")
            return self.op_fma(ins, parts, ops)
        mode = parts[1] if len(parts) == 3 else None
        if mode == "lo":
            return self._simple(ins, parts, ops, 3, lambda a, b, c: a * b + c)
        if mode == "hi":
            return self._simple(ins, parts, ops, 3, lambda a, b, c: _mul_hi(a, b) + c)
        if mode == "wide" and _size(t) <= 4:
            wt = ("s" if t[0] == "s" else "u") + str(_size(t) * 16)
            wdt = _NP[wt]
            return self._simple(ins, parts, ops, 3, lambda a, b, c: np.multiply(a, b, dtype=wdt) + c,
                                t_srcs=[t, t, wt], t_dst=wt)
        raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")

    def op_fma(self, ins, parts, ops):
        t = self._type(parts)
        if t != "f32" or "rn" not in parts:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)} (only fma.rn.f32)")
        return self._float_op(ins, parts, ops, 3, _fma_f32)

    def op_div(self, ins, parts, ops):
        t = self._type(parts)
        if _is_float(t):
            if "rn" not in parts:
                raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)} (only div.rn is exact)")
            return self._float_op(ins, parts, ops, 2, np.divide)
        return self._int_div(ins, parts, ops, want_rem=False)

    def op_rem(self, ins, parts, ops):
        return self._int_div(ins, parts, ops, want_rem=True)

    def _int_div(self, ins, parts, ops, want_rem):
        t = self._type(parts)
        if not _is_int(t) or len(parts) != 2:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 3, parts)
        d, _ = self.dst(ops[0], t)
        a, b = self.src(ops[1], t), self.src(ops[2], t)
        signed = t[0] == "s"

        def run(fr, m):
            bv = b(fr, m)
            zero = bv == 0
            lanes = m if m is not None else fr.Mnone
            if np.any(zero if lanes is None or np.ndim(zero) == 0 else zero & lanes):
                raise PtxInterpreterError("integer division by zero")
            _write(fr, d, _divmod_trunc(a(fr, m), np.where(zero, bv.dtype.type(1), bv), signed)[want_rem], m)
        return run

    def op_rcp(self, ins, parts, ops):
        if "rn" not in parts:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)} (only rcp.rn is exact)")
        t = self._type(parts)
        one = _NP[t].type(1)
        return self._float_op(ins, parts, ops, 1, lambda x: one / x)

    def op_sqrt(self, ins, parts, ops):
        if "rn" not in parts:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)} (only sqrt.rn is exact)")
        return self._float_op(ins, parts, ops, 1, np.sqrt)

    # bits -----------------------------------------------------------------------
    def _bitop(self, ins, parts, ops, fn, n_src=2):
        t = self._type(parts)
        if not (t == "pred" or t[0] == "b"):
            raise PtxInterpreterError(f"unsupported type in {'.'.join(parts)}")
        return self._simple(ins, parts, ops, n_src, fn)

    def op_and(self, ins, parts, ops):
        return self._bitop(ins, parts, ops, np.bitwise_and)

    def op_or(self, ins, parts, ops):
        return self._bitop(ins, parts, ops, np.bitwise_or)

    def op_xor(self, ins, parts, ops):
        return self._bitop(ins, parts, ops, np.bitwise_xor)

    def op_not(self, ins, parts, ops):
        return self._bitop(ins, parts, ops, np.invert, n_src=1)

    def _shift(self, ins, parts, ops, left):
        t = self._type(parts)
        if not _is_int(t) or len(parts) != 2:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 3, parts)
        bits = _size(t) * 8
        # .b and .u shift right logically, .s arithmetically (sign fill).
        arith = t[0] == "s" and not left
        vt = t if (arith or left) else "u" + t[1:]
        d, _ = self.dst(ops[0], t)
        a, s = self.src(ops[1], vt), self.src(ops[2], "u32")
        dt = _NP[vt]
        shift = np.left_shift if left else np.right_shift
        const = _immediate(ops[2].strip(), "u32")
        if const is not None:  # the usual case: fold the clamp at decode time
            n = int(const)
            if arith:
                amount = dt.type(min(n, bits - 1))
                return lambda fr, m: _write(fr, d, shift(a(fr, m), amount), m)
            if n >= bits:
                return lambda fr, m: _write(fr, d, np.zeros_like(a(fr, m)), m)
            amount = dt.type(n)
            return lambda fr, m: _write(fr, d, shift(a(fr, m), amount), m)

        def run(fr, m):
            n = s(fr, m).astype(dt)
            if arith:
                r = shift(a(fr, m), np.minimum(n, dt.type(bits - 1)))
            else:
                r = np.where(n >= bits, dt.type(0), shift(a(fr, m), n & dt.type(bits - 1)))
            _write(fr, d, r, m)
        return run

    def op_bfi(self, ins, parts, ops):
        """bfi.bN d, a, b, pos, len: b with bits pos..pos+len-1 replaced by
        a's low len bits (pos and len are their low 8 bits; bits past N drop)."""
        t = self._type(parts)
        if t not in ("b32", "b64"):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 5, parts)
        bits = _size(t) * 8
        d, _ = self.dst(ops[0], t)
        a, b = self.src(ops[1], t), self.src(ops[2], t)
        pos, length = self.src(ops[3], "u32"), self.src(ops[4], "u32")
        dt = _NP[t]

        def run(fr, m):
            p = np.minimum(np.asarray(pos(fr, m)).astype(np.uint64) & np.uint64(0xFF), np.uint64(bits))
            n = np.minimum(np.asarray(length(fr, m)).astype(np.uint64) & np.uint64(0xFF), np.uint64(bits))
            ones = np.where(n >= 64, np.uint64(2**64 - 1),
                            (np.uint64(1) << np.minimum(n, np.uint64(63))) - np.uint64(1))
            mask = np.where(p >= 64, np.uint64(0), ones << np.minimum(p, np.uint64(63)))
            av = np.asarray(a(fr, m)).view(_UNSIGNED[dt.itemsize]).astype(np.uint64)
            bv = np.asarray(b(fr, m)).view(_UNSIGNED[dt.itemsize]).astype(np.uint64)
            shifted = np.where(p >= 64, np.uint64(0), av << np.minimum(p, np.uint64(63)))
            out = (bv & ~mask) | (shifted & mask)
            _write(fr, d, out.astype(_UNSIGNED[dt.itemsize]).view(dt), m)
        return run

    def op_shl(self, ins, parts, ops):
        return self._shift(ins, parts, ops, left=True)

    def op_shr(self, ins, parts, ops):
        return self._shift(ins, parts, ops, left=False)

    # compare / select -----------------------------------------------------------
    def op_setp(self, ins, parts, ops):
        t = self._type(parts)
        mods = parts[1:-1]
        if mods and mods[-1] == "ftz":
            if t != "f32":
                raise PtxInterpreterError(".ftz only for .f32")
            mods = mods[:-1]
        ftz = "ftz" in parts
        if len(mods) not in (1, 2):
            raise PtxInterpreterError(f"cannot parse {'.'.join(parts)}")
        cmp_name, bool_name = mods[0], (mods[1] if len(mods) == 2 else None)
        cmp = _compare_fn(cmp_name, t)
        dests = ops[0].split("|")
        self._need(ops, 4 if bool_name else 3, parts)
        p = self.dst(dests[0], "pred")[0]
        q = self.dst(dests[1], "pred")[0] if len(dests) == 2 else None
        a, b = self.src(ops[1], t), self.src(ops[2], t)
        c = self.src(ops[3], "pred") if bool_name else None
        combine = {None: None, "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}.get(bool_name, 0)
        if combine == 0:
            raise PtxInterpreterError(f"unsupported boolean operator .{bool_name}")

        def run(fr, m):
            av, bv = a(fr, m), b(fr, m)
            if ftz:
                av, bv = _flush(av), _flush(bv)
            r = cmp(av, bv)
            if combine is None:
                _write(fr, p, r, m)
                if q is not None:
                    _write(fr, q, np.logical_not(r), m)
            else:
                cv = c(fr, m)
                _write(fr, p, combine(r, cv), m)
                if q is not None:
                    _write(fr, q, combine(np.logical_not(r), cv), m)
        return run

    def op_shfl(self, ins, parts, ops):
        """shfl.sync.bfly.b32 d[|p], a, lane_mask, 0x1f, 0xffffffff: lane l gets
        a from lane l ^ lane_mask of its warp, the lane mask the same for every
        lane; shfl.sync.idx.b32 d[|p], a, b, 0x1f, 0xffffffff: lane l gets a
        from lane b & 31 of its warp (b may differ between lanes). p: true (the
        source lane is in range, as it always is with clamp 0x1f). Whole warps
        only: every lane of each warp taking part."""
        if parts[1:] not in (["sync", "bfly", "b32"], ["sync", "idx", "b32"]):
            raise PtxInterpreterError(f"only shfl.sync.bfly.b32 and shfl.sync.idx.b32 are supported, "
                                      f"not {'.'.join(parts)}")
        mode = parts[2]
        self._need(ops, 5, parts)
        dst, _, pred = ops[0].partition("|")
        d, _ = self.dst(dst, "b32")
        p = self.dst(pred, "pred")[0] if pred else None
        a, lane_mask, clamp, members = (self.src(o, "b32") for o in ops[1:5])

        def uniform(get, fr, m, lanes, what):
            v = np.asarray(get(fr, m))
            vals = np.unique(v[lanes]) if v.ndim else [v]
            if len(vals) != 1:
                raise PtxInterpreterError(f"shfl.sync.bfly: the {what} differs between lanes")
            return int(vals[0])

        def run(fr, m):
            T = fr.ctx.T
            lanes = fr.M if m is None else m
            if uniform(clamp, fr, m, lanes, "clamp") != 0x1F \
                    or uniform(members, fr, m, lanes, "member mask") != 0xFFFFFFFF:
                raise PtxInterpreterError(f"shfl.sync.{mode}: only a full warp (clamp 0x1f, member mask "
                                          "0xffffffff) is supported")
            full = T - T % 32  # the threads of whole warps
            for w in np.unique(np.arange(T)[lanes] // 32):
                if w * 32 + 32 > full or not lanes[w * 32:w * 32 + 32].all():
                    raise PtxInterpreterError("shfl.sync with only part of a warp taking part")
            tid = np.arange(T)
            if mode == "bfly":
                bfly = uniform(lane_mask, fr, m, lanes, "lane mask")
                if bfly >= 32:
                    raise PtxInterpreterError("shfl.sync.bfly: the lane mask must be < 32")
                src = tid ^ bfly
            else:  # idx: each lane names its source lane
                b = np.broadcast_to(np.asarray(lane_mask(fr, m)), (T,)).astype(np.int64)
                src = np.where(lanes, tid - tid % 32 + (b & 31), tid)
            v = a(fr, m)
            _write(fr, d, v if np.ndim(v) == 0 else v[src], m)
            if p is not None:
                _write(fr, p, np.ones(T, bool), m)
        return run

    def op_selp(self, ins, parts, ops):
        t = self._type(parts)
        return self._simple(ins, parts, ops, 3, lambda a, b, c: np.where(c, a, b), t_srcs=[t, t, "pred"])

    # moves / conversions ----------------------------------------------------------
    def op_mov(self, ins, parts, ops):
        self._need(ops, 2, parts)
        if ops[0].startswith("{") or ops[1].startswith("{"):
            raise PtxInterpreterError("vector mov (pack/unpack) is not supported")
        return self._simple(ins, parts, ops, 1, lambda x: x)

    def op_cvt(self, ins, parts, ops):
        self._need(ops, 2, parts)
        if len(parts) < 3:
            raise PtxInterpreterError("cvt needs two types")
        dt_name, at_name = parts[-2], parts[-1]
        if dt_name not in _NP or at_name not in _NP or "pred" in (dt_name, at_name):
            raise PtxInterpreterError(f"unsupported conversion {'.'.join(parts)}")
        mods = set(parts[1:-2])
        ftz, sat = "ftz" in mods, "sat" in mods
        rnd = mods - {"ftz", "sat"}
        if len(rnd) > 1:
            raise PtxInterpreterError(f"cannot parse {'.'.join(parts)}")
        rnd_name = rnd.pop() if rnd else None
        conv = _converter(dt_name, at_name, rnd_name, ftz, sat)
        d, store_dt = self.dst(ops[0], dt_name, wider_ok=True)
        a = self.src(ops[1], at_name, wider_ok=True)
        if store_dt == _NP[dt_name]:
            return lambda fr, m: _write(fr, d, conv(a(fr, m)), m)
        return lambda fr, m: _write(fr, d, conv(a(fr, m)).astype(store_dt), m)

    def op_cvta(self, ins, parts, ops):
        t = self._type(parts)
        self._need(ops, 2, parts)
        spaces = [p.split("::")[0] for p in parts[1:-1] if p != "to"]
        if spaces not in (["global"], ["shared"]) or t not in ("u32", "u64"):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        if spaces == ["global"]:
            return self._simple(ins, parts, ops, 1, lambda x: x)  # generic == global here
        base = _NP[t].type(_SHARED_GENERIC_BASE if t == "u64" else 0)
        if "to" in parts:
            return self._simple(ins, parts, ops, 1, lambda x: x - base)
        return self._simple(ins, parts, ops, 1, lambda x: x + base)

    # memory -------------------------------------------------------------------------
    def _mem_parts(self, parts):
        """(space, vector length, type) of ld/st; unknown qualifiers fail."""
        space, vec = None, 1
        for p in parts[1:-1]:
            base = p.split("::")[0]
            if p == "shared::cluster":
                space = "cluster"
            elif base in _SPACES:
                space = base
            elif re.match(r"^v[248]$", p):
                vec = int(p[1:])
            elif base in _CACHE_QUALIFIERS or "::" in p:
                if p.endswith("cache_hint") and p != "L2::cache_hint":
                    raise PtxInterpreterError(f"unsupported qualifier .{p}")
            else:
                raise PtxInterpreterError(f"unsupported qualifier .{p} in {'.'.join(parts)}")
        if space in ("local", "const"):
            raise PtxInterpreterError(f".{space} memory is not supported")
        if "nc" in parts and space != "global":
            raise PtxInterpreterError(".nc needs .global")
        return space, vec, self._type(parts)

    def _vector(self, tok: str, n: int) -> List[str]:
        if n == 1:
            if tok.startswith("{"):
                raise PtxInterpreterError("vector operand on a scalar access")
            return [tok]
        if not (tok.startswith("{") and tok.endswith("}")):
            raise PtxInterpreterError(f"vector operand expected, got {tok!r}")
        items = _split_operands(tok[1:-1])
        if len(items) != n:
            raise PtxInterpreterError(f"vector of {len(items)} for .v{n}")
        return items

    def op_ld(self, ins, parts, ops):
        space, vec, t = self._mem_parts(parts)
        if "L2::cache_hint" in parts:
            # the cache policy operand: read (it must have been written), no other effect
            if space != "global":
                raise PtxInterpreterError(".L2::cache_hint needs .global")
            self._need(ops, 3, parts)
            policy = self.src(ops[2], "b64")
            load = self.op_ld(ins, [q for q in parts if q != "L2::cache_hint"], ops[:2])

            def run_hinted(fr, m):
                policy(fr, m)
                load(fr, m)
            return run_hinted
        self._need(ops, 2, parts)
        if space == "param":
            if vec != 1:
                raise PtxInterpreterError("vector ld.param is not supported")
            name = self._param_name(ops[1])
            d, store_dt = self.dst(ops[0], t, wider_ok=True)
            conv = _param_reader(_NP[t], store_dt)

            def run_param(fr, m):
                v = fr.params.get(name)
                if v is None:
                    raise PtxInterpreterError(f"param {name} read before it was written")
                _write(fr, d, conv(v), m)
            return run_param
        base, off = self.address(ops[1])
        dests = []
        for tok in self._vector(ops[0], vec):
            dests.append(None if tok == "_" else self.dst(tok, t, wider_ok=True))
        dt = _NP[t]
        if _is_float(t) and any(x is not None and x[1] != dt for x in dests):
            raise PtxInterpreterError("float load into a wider register")

        def run(fr, m):
            vals = fr.ctx.load(space, _addr(fr, m, base, off), m if m is not None else fr.Mnone, dt, vec)
            for dd, v in zip(dests, vals):
                if dd is not None:
                    _write(fr, dd[0], v if dd[1] == dt else v.astype(dd[1]), m)
        return run

    def op_st(self, ins, parts, ops):
        space, vec, t = self._mem_parts(parts)
        if "L2::cache_hint" in parts:
            raise PtxInterpreterError("unsupported qualifier .L2::cache_hint on st (loads only)")
        self._need(ops, 2, parts)
        if space == "cluster":
            raise PtxInterpreterError("st.shared::cluster is not supported")
        dt = _NP[t]
        if space == "param":
            if vec != 1:
                raise PtxInterpreterError("vector st.param is not supported")
            name = self._param_name(ops[0])
            ins.stores_param = name
            val = self.src(ops[1], t, wider_ok=True)

            def run_param(fr, m):
                v = val(fr, m)
                if np.ndim(v) == 0:
                    v = np.full(fr.ctx.T, v, dt)
                old = fr.params.get(name)
                if m is not None and old is not None:
                    v = np.where(m, v, old.view(dt) if old.dtype.itemsize == dt.itemsize else dt.type(0))
                fr.params[name] = v
            return run_param
        base, off = self.address(ops[0])
        vals = [self.src(tok, t, wider_ok=True) for tok in self._vector(ops[1], vec)]

        def run(fr, m):
            fr.ctx.store(space, _addr(fr, m, base, off), m if m is not None else fr.Mnone,
                         dt, [g(fr, m) for g in vals])
        return run

    def _param_name(self, tok: str) -> str:
        inner = tok.strip()
        if not (inner.startswith("[") and inner.endswith("]")):
            raise PtxInterpreterError(f"param operand expected, got {tok!r}")
        m = re.match(r"^([A-Za-z_$][\w$]*)(?:\+(\d+))?$", inner[1:-1].replace(" ", ""))
        if not m or m.group(1) not in self.f.param_decls:
            raise PtxInterpreterError(f"unknown param {tok}")
        if m.group(2) and int(m.group(2)) != 0:
            raise PtxInterpreterError(f"param offsets are not supported: {tok}")
        if self.f.param_decls[m.group(1)].startswith("unsupported"):
            raise PtxInterpreterError(f"unsupported param type of {m.group(1)}")
        return m.group(1)

    # control -----------------------------------------------------------------------------
    def _label(self, name: str) -> int:
        name = name.strip()
        if name not in self.f.labels:
            raise PtxInterpreterError(f"unknown label {name}")
        return self.f.labels[name]

    def op_bra(self, ins, parts, ops):
        if parts[1:] not in ([], ["uni"]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 1, parts)
        ins.kind, ins.uni, ins.target = BRA, len(parts) == 2, self._label(ops[0])

    def op_brx(self, ins, parts, ops):
        if parts[1:] not in (["idx"], ["idx", "uni"]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 2, parts)
        names = self.f.targets.get(ops[1].strip())
        if names is None:
            raise PtxInterpreterError(f"{ops[1]} is not a .branchtargets list")
        ins.kind, ins.uni = BRX, "uni" in parts
        ins.targets = [self._label(n) for n in names]
        ins.index = self.src(ops[0], "u32")

    def op_call(self, ins, parts, ops):
        if parts[1:] not in ([], ["uni"]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        rets: List[str] = []
        if ops and ops[0].startswith("("):
            rets = _split_operands(ops[0][1:-1])
            ops = ops[1:]
        if not ops or ops[0].startswith("%") or ops[0] not in self.mod.funcs:
            raise PtxInterpreterError(f"unknown or indirect call target {ops[0] if ops else ''!r}")
        callee = self.mod.funcs[ops[0]]
        if callee.is_entry:
            raise PtxInterpreterError(f"cannot call the entry {callee.name}")
        args = _split_operands(ops[1][1:-1]) if len(ops) > 1 else []
        if len(ops) > 2 or (len(ops) == 2 and not ops[1].startswith("(")):
            raise PtxInterpreterError("cannot parse call operands")
        if len(args) != len(callee.params) or len(rets) != len(callee.rets):
            raise PtxInterpreterError(
                f"{callee.name} takes {len(callee.params)} params and {len(callee.rets)} return values, "
                f"called with {len(args)} and {len(rets)}")
        for n in args + rets:
            if n not in self.f.param_decls:
                raise PtxInterpreterError(f"call argument {n} is not a declared .param")
        ins.kind, ins.uni, ins.callee, ins.args, ins.rets = CALL, len(parts) == 2, callee, args, rets

    def op_ret(self, ins, parts, ops):
        if parts[1:] not in ([], ["uni"]) or ops:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        ins.kind = RET

    def op_exit(self, ins, parts, ops):
        if parts[1:] or ops:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        ins.kind = EXIT

    def op_bar(self, ins, parts, ops):
        if [p for p in parts[1:] if p not in ("cta", "aligned")] != ["sync"]:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        if len(ops) != 1 or _parse_int(ops[0]) is None:
            raise PtxInterpreterError("only bar.sync with a constant barrier id (and no thread count)")
        ins.kind = BAR

    def op_barrier(self, ins, parts, ops):
        if parts[1:2] != ["cluster"]:
            return self.op_bar(ins, parts, ops)
        rest = [p for p in parts[2:] if p != "aligned"]
        if ops or rest not in (["arrive"], ["arrive", "release"], ["arrive", "relaxed"], ["wait"],
                               ["wait", "acquire"]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        if rest[0] == "arrive":
            return lambda fr, m: None  # taken as part of the wait that follows
        ins.kind, ins.cluster_wait = BAR, True

    def op_mapa(self, ins, parts, ops):
        if parts[1:] != ["shared::cluster", "u32"]:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)} (only mapa.shared::cluster.u32)")

        def fn(a, rank):
            if (a >= _CLUSTER_WINDOW).any():
                raise PtxInterpreterError("mapa of an address that is not a shared::cta address")
            return a + (rank + np.uint32(1)) * np.uint32(_CLUSTER_WINDOW)
        return self._simple(ins, parts, ops, 2, fn)

    def op_cp(self, ins, parts, ops):
        """cp.async (4/8/16 bytes, global -> shared, zero-fill via src-size),
        cp.async.commit_group, cp.async.wait_group N / wait_all. A copy reads
        global memory when issued and writes shared memory only when a wait
        covers its group, so a kernel that reads a buffer before waiting for
        it reads stale data here as it may on the GPU."""
        if parts[1:2] != ["async"]:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        rest = parts[2:]
        if rest == ["commit_group"]:
            return lambda fr, m: fr.ctx.async_commit(m if m is not None else fr.Mnone)
        if rest in (["wait_group"], ["wait_all"]):
            keep = 0
            if rest == ["wait_group"]:
                self._need(ops, 1, parts)
                keep = _parse_int(ops[0])
                if keep is None:
                    raise PtxInterpreterError("cp.async.wait_group needs a constant")
            return lambda fr, m: fr.ctx.async_wait(m if m is not None else fr.Mnone, keep)
        spaces = [p.split("::")[0] for p in rest[1:]]
        if not rest or rest[0] not in ("ca", "cg") or spaces != ["shared", "global"]:
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        if len(ops) not in (3, 4):
            raise PtxInterpreterError(f"{'.'.join(parts)} needs [dst], [src], cp-size[, src-size]")
        cp_size = _parse_int(ops[2])
        if cp_size not in (4, 8, 16) or (rest[0] == "cg" and cp_size != 16):
            raise PtxInterpreterError(f"bad cp-size {ops[2]} for {'.'.join(parts)}")
        dst_base, dst_off = self.address(ops[0])
        src_base, src_off = self.address(ops[1])
        src_size = self.src(ops[3], "u32") if len(ops) == 4 else None
        words = cp_size // 4

        def run(fr, m):
            ctx = fr.ctx
            mask = m if m is not None else fr.Mnone
            lanes = np.ones(ctx.T, bool) if mask is None else mask.copy()
            size = np.full(ctx.T, cp_size, np.int64) if src_size is None else \
                np.broadcast_to(np.asarray(src_size(fr, m), np.int64), (ctx.T,))
            src = np.broadcast_to(np.asarray(_addr(fr, m, src_base, src_off), np.int64), (ctx.T,))
            vals = []
            for k in range(words):  # bytes past src-size are zeros, and are not read
                read = lanes & (size >= 4 * (k + 1))
                v = np.zeros(ctx.T, np.uint32)
                if read.any():
                    v = np.where(read, ctx.load("global", src + 4 * k, read, np.dtype(np.uint32), 1)[0], v)
                vals.append(v)
            dst = np.broadcast_to(np.asarray(_addr(fr, m, dst_base, dst_off), np.int64), (ctx.T,)).copy()
            ctx.async_issue(dst, lanes, vals)
        return run

    def op_prefetch(self, ins, parts, ops):
        """prefetch{.global}.{L1,L2} [a]: a hint with no effect here, but its
        address must lie in memory the kernel may read (a prefetch past a
        buffer would be a bug in the kernel's clamping)."""
        if len(parts) not in (2, 3) or parts[-1] not in ("L1", "L2") or parts[1:-1] not in ([], ["global"]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        self._need(ops, 1, parts)
        space = "global" if parts[1] == "global" else None
        base, off = self.address(ops[0])

        def run(fr, m):
            a, _ = fr.ctx._lanes(_addr(fr, m, base, off), m if m is not None else fr.Mnone)
            if a.size:
                fr.ctx._resolve(space, a, 1)
        return run

    def op_createpolicy(self, ins, parts, ops):
        # createpolicy.fractional.L2::<priority>{.L2::<priority>}.b64 d{, fraction}: an opaque
        # policy the loads' .L2::cache_hint take; its bits mean nothing to a sequential run.
        if len(parts) < 4 or parts[1] != "fractional" or parts[-1] != "b64" or \
                not all(q.startswith("L2::evict_") for q in parts[2:-1]):
            raise PtxInterpreterError(f"unsupported instruction {'.'.join(parts)}")
        if len(ops) not in (1, 2):
            raise PtxInterpreterError(f"{'.'.join(parts)} takes 1 or 2 operands, got {len(ops)}")
        if len(ops) == 2 and not 0.0 < float(ops[1]) <= 1.0:
            raise PtxInterpreterError(f"createpolicy fraction must be in (0, 1], got {ops[1]}")
        d, _ = self.dst(ops[0], "b64")
        return lambda fr, m: _write(fr, d, np.uint64(0x5C_0001), m)

    def op_membar(self, ins, parts, ops):
        return lambda fr, m: None  # one thread at a time: memory is always coherent

    op_fence = op_membar
    op_griddepcontrol = op_membar


def _addr(fr, m, base, off):
    """Address operand value: int64 array (per lane) or a Python int."""
    if base is None:
        return off
    a = base(fr, m)
    return a + np.int64(off) if off else a


# ------------------------------------------------------------------ numeric helpers
_TINY32 = np.float32(np.finfo(np.float32).tiny)


def _flush(x):
    """.ftz: float32 subnormals become zero of the same sign."""
    return np.where(np.abs(x) < _TINY32, x * np.float32(0), x)


def _saturate(x):
    """.sat: clamp to [0, 1], NaN -> 0."""
    return np.where(x > 0, np.minimum(x, x.dtype.type(1)), x.dtype.type(0))


def _sat_s32(fn, a, b):
    r = fn(a.astype(_I64), b.astype(_I64))
    return np.clip(r, -2**31, 2**31 - 1).astype(np.int32)


def _mulhi_u64(a, b):
    """High 64 bits of a 64x64-bit unsigned product, from 32-bit limbs."""
    lo32, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    a0, a1, b0, b1 = a & lo32, a >> s32, b & lo32, b >> s32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> s32) + (p01 & lo32) + (p10 & lo32)
    return p11 + (p01 >> s32) + (p10 >> s32) + (mid >> s32)


def _mul_hi(a, b):
    dt = np.result_type(a, b)
    if dt.itemsize < 8:
        wide = _I64 if dt.kind == "i" else _U64
        return (np.multiply(a, b, dtype=wide) >> (dt.itemsize * 8)).astype(dt)
    if dt.kind == "u":
        return _mulhi_u64(a, b)
    hi = _mulhi_u64(a.view(_U64), b.view(_U64))  # signed: correct the unsigned product
    hi = hi - np.where(a < 0, b.view(_U64), np.uint64(0)) - np.where(b < 0, a.view(_U64), np.uint64(0))
    return hi.view(_I64)


def _divmod_trunc(a, b, signed):
    """PTX integer division truncates towards zero; the remainder has the
    dividend's sign. NumPy floors, so fix up the signed case."""
    q = a // b
    if signed:
        q = np.where(((a % b) != 0) & ((a < 0) != (b < 0)), q + q.dtype.type(1), q)
    return q, a - q * b


_MID_MASK, _MID_BITS = np.uint64(0x1FFFFFFF), np.uint64(0x10000000)
_ABS_MASK, _ONE64 = np.uint64(0x7FFFFFFFFFFFFFFF), np.uint64(1)
_TINY_MINUS_1 = np.uint64(0x380FFFFFFFFFFFFF)  # bits of 2^-126 (float64), minus 1


def _fma_f32(a, b, c):
    """Exact fma.rn.f32 (see the module docstring)."""
    p = np.multiply(a, b, dtype=_F64)  # exact: 24 + 24 significant bits
    s = np.add(p, c, dtype=_F64)
    r = s.astype(_F32)
    bits = np.asarray(s).view(_U64)
    # Candidates for a wrong double rounding: s exactly halfway between two
    # float32 (low 29 of the 52 fraction bits are 1000...0) or s nonzero and
    # below the float32 normal range (where the float32 grid is coarser).
    cand = (bits & _MID_MASK) == _MID_BITS
    cand |= ((bits & _ABS_MASK) - _ONE64) < _TINY_MINUS_1
    if np.count_nonzero(cand):
        c64 = np.asarray(c, _F64)
        r = _fma_fix(np.broadcast_to(p, s.shape), np.broadcast_to(c64, s.shape), s, r, cand)
    return r


def _fma_fix(p, c, s, r, cand):
    """Redo the candidate lanes of _fma_f32 exactly."""
    r = np.array(r, _F32, copy=True)
    idx = np.flatnonzero(cand) if r.ndim else None
    pp, cc, ss = (p[idx], c[idx], s[idx]) if idx is not None else (p, c, s)
    # TwoSum: ss + e == pp + cc exactly.
    bb = ss - pp
    e = (pp - (ss - bb)) + (cc - bb)
    rr = ss.astype(_F32)
    # If ss is exactly halfway between its float32 neighbours lo and hi, the
    # exact value pp + cc lies on the side that e says: step there. Otherwise
    # rounding ss is rounding the exact value (rounding is monotonic and the
    # halfway points are float64 numbers).
    lo = np.where(rr.astype(_F64) > ss, np.nextafter(rr, np.float32(-np.inf)), rr)
    hi = np.nextafter(lo, np.float32(np.inf))
    # Past FLT_MAX the next grid point is 2^128 (where rounding overflows).
    lo64 = np.where(np.isinf(lo), np.copysign(2.0 ** 128, lo), lo.astype(_F64))
    hi64 = np.where(np.isinf(hi), np.copysign(2.0 ** 128, hi), hi.astype(_F64))
    tie = (ss == (lo64 + hi64) * 0.5) & (e != 0) & np.isfinite(ss)
    rr = np.where(tie, np.where(e > 0, hi, lo), rr)
    if idx is None:
        return rr.astype(_F32)
    r[idx] = rr
    return r


def _compare_fn(name: str, t: str):
    if _is_float(t):
        fns = {
            "eq": np.equal, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
            "ne": lambda a, b: np.less(a, b) | np.greater(a, b),  # ordered: false if a NaN
            "equ": lambda a, b: ~(np.less(a, b) | np.greater(a, b)),
            "neu": np.not_equal,
            "ltu": lambda a, b: ~np.greater_equal(a, b), "leu": lambda a, b: ~np.greater(a, b),
            "gtu": lambda a, b: ~np.less_equal(a, b), "geu": lambda a, b: ~np.less(a, b),
            "num": lambda a, b: np.equal(a, a) & np.equal(b, b),
            "nan": lambda a, b: np.not_equal(a, a) | np.not_equal(b, b),
        }
        if name in fns:
            return fns[name]
    elif t != "pred":
        if t[0] == "b" and name not in ("eq", "ne"):
            raise PtxInterpreterError(f"setp.{name} needs a signed or unsigned type, not .{t}")
        signed = t[0] == "s"
        if name in ("lo", "ls", "hi", "hs"):
            if signed:
                raise PtxInterpreterError(f"setp.{name} is for unsigned types")
            name = {"lo": "lt", "ls": "le", "hi": "gt", "hs": "ge"}[name]
        fns = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
               "gt": np.greater, "ge": np.greater_equal}
        if name in fns:
            return fns[name]  # the operands already have the instruction's signedness
    raise PtxInterpreterError(f"unsupported comparison setp.{name}.{t}")


_INT_ROUND = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}


def _converter(dt_name: str, at_name: str, rnd: Optional[str], ftz: bool, sat: bool):
    """cvt semantics as a function of the source values."""
    dst, src = _NP[dt_name], _NP[at_name]
    spec = f"cvt{'.' + rnd if rnd else ''}.{dt_name}.{at_name}"
    if _is_int(dt_name) and _is_int(at_name):
        if rnd or ftz or sat:
            raise PtxInterpreterError(f"unsupported modifiers in {spec}")
        return lambda x: x.astype(dst)
    if _is_float(dt_name) and _is_int(at_name):
        if rnd != "rn" or ftz:
            raise PtxInterpreterError(f"unsupported {spec} (only .rn int-to-float)")
        return (lambda x: _saturate(x.astype(dst))) if sat else (lambda x: x.astype(dst))
    if _is_int(dt_name) and _is_float(at_name):
        if rnd not in _INT_ROUND or sat:
            raise PtxInterpreterError(f"unsupported {spec} (float-to-int needs .rni/.rzi/.rmi/.rpi)")
        info = np.iinfo(dst)
        lo, hi_excl = float(info.min), float(info.max) + 1.0  # both exact powers of two (or 0)
        rounder = _INT_ROUND[rnd]

        def f2i(x):
            if ftz:
                x = _flush(x)
            r = rounder(np.asarray(x, _F64))
            safe = np.where(np.isnan(r) | (r < lo) | (r >= hi_excl), 0.0, r).astype(dst)
            # PTX saturates to the destination range and turns NaN into 0.
            return np.where(r >= hi_excl, dst.type(info.max), np.where(r < lo, dst.type(info.min), safe))
        return f2i
    # float -> float
    if dt_name == at_name:
        if rnd in _INT_ROUND:
            fn = _INT_ROUND[rnd]
        elif rnd is None:
            fn = lambda x: x
        else:
            raise PtxInterpreterError(f"unsupported {spec}")
    elif dst.itemsize > src.itemsize:
        if rnd is not None:
            raise PtxInterpreterError(f"unsupported {spec}")
        fn = lambda x: x.astype(dst)
    else:
        if rnd != "rn":
            raise PtxInterpreterError(f"unsupported {spec} (only .rn narrowing)")
        fn = lambda x: x.astype(dst)
    if not (ftz or sat):
        return fn

    def ff(x):
        if ftz and at_name == "f32":
            x = _flush(x)
        r = fn(x)
        if ftz and dt_name == "f32":
            r = _flush(r)
        return _saturate(r) if sat else r
    return ff


def _param_reader(dt: np.dtype, store_dt: np.dtype):
    """ld.param: reinterpret (or truncate) the stored value as dt, then extend
    to the destination register like any load."""
    def conv(v):
        if v.dtype.itemsize > dt.itemsize:
            v = v.view(_UNSIGNED[v.dtype.itemsize]).astype(_UNSIGNED[dt.itemsize])
        elif v.dtype.itemsize < dt.itemsize:
            raise PtxInterpreterError(f"ld.param of {dt.itemsize} bytes from a {v.dtype.itemsize}-byte param")
        v = v.view(dt) if v.dtype != dt else v
        return v if store_dt == dt else v.astype(store_dt)
    return conv


# ------------------------------------------------------------------ runtime
class _Frame:
    """One activation of a function: its registers and params, and the lanes M
    that run it. Lanes outside M hold garbage that is never observed."""

    __slots__ = ("func", "ctx", "regs", "wr", "params", "M", "nM", "Mnone")

    def __init__(self, func: _Func, ctx: "_Launch", M: np.ndarray):
        self.func, self.ctx, self.M = func, ctx, M
        n = len(func.slots)
        self.regs: List[Optional[np.ndarray]] = [None] * n
        # wr[slot]: None when every lane of M has written the register, else a
        # bool mask of the lanes that have.
        self.wr: List[Optional[np.ndarray]] = [None] * n
        self.params: Dict[str, object] = {}
        self.nM = int(np.count_nonzero(M))
        self.Mnone = None if self.nM == ctx.T else M

    def checked_read(self, slot: int, m: Optional[np.ndarray], name: str) -> np.ndarray:
        v = self.regs[slot]
        if v is None:
            raise PtxInterpreterError(f"read of register {name}, never written")
        need = self.M if m is None else m
        missing = np.greater(need, self.wr[slot])
        if missing.any():
            raise PtxInterpreterError(
                f"read of register {name}, never written by thread(s) {np.flatnonzero(missing)[:8].tolist()}")
        return v


class _Buffer:
    """A byte range in the fake address space: one argument array or the
    shared memory of the block."""

    def __init__(self, name: str, base: int, u8: np.ndarray, nbytes: int):
        self.name, self.base, self.u8, self.nbytes = name, base, u8, nbytes
        self._views: Dict[np.dtype, np.ndarray] = {}

    def view(self, dt: np.dtype) -> np.ndarray:
        v = self._views.get(dt)
        if v is None:
            n = self.u8.size - self.u8.size % dt.itemsize
            v = self._views[dt] = self.u8[:n].view(dt)
        return v


class _Launch:
    def __init__(self, mod: _Module, entry: _Func, grid, block, args, dyn_shared: int):
        self.mod, self.entry = mod, entry
        self.grid, self.block = grid, block
        bx, by, bz = block
        T = self.T = bx * by * bz
        lin = np.arange(T, dtype=np.uint32)
        self.special: Dict[str, np.ndarray] = {
            "%tid.x": lin % bx, "%tid.y": (lin // bx) % by, "%tid.z": lin // (bx * by),
            "%laneid": lin % 32, "%warpid": lin // 32,
            "%nwarpid": np.full(T, -(-T // 32), np.uint32),
        }
        for d, n, g in zip("xyz", block, grid):
            self.special["%ntid." + d] = np.full(T, n, np.uint32)
            self.special["%nctaid." + d] = np.full(T, g, np.uint32)
        self.buffers: Dict[int, _Buffer] = {}
        self.params = self._kernel_params(args)
        for g in mod.globals.values():  # zero, as at module load
            self.buffers[g.base >> _GLOBAL_SPACING_BITS] = _Buffer(f".global {g.name}", g.base, np.zeros(g.size, np.uint8),
                                                                   g.size)
        size = mod.dynamic_base + dyn_shared
        self.shared_u8 = np.empty(max(16, -(-size // 16) * 16), np.uint8)
        self.shared = _Buffer("shared memory", 0, self.shared_u8, size)
        self.shared_generic = _Buffer("shared memory", _SHARED_GENERIC_BASE, self.shared_u8, size)
        # Race check, per 4-byte shared word: who last wrote / read it, in which
        # barrier interval (epoch); -2 as reader: several threads.
        words = self.shared_u8.size // 4
        self.sh_w_epoch, self.sh_w_thread = np.empty(words, np.int64), np.empty(words, np.int64)
        self.sh_r_epoch, self.sh_r_thread = np.empty(words, np.int64), np.empty(words, np.int64)
        self.epoch = 0
        self.steps = 0
        self.thread_steps = 0
        self.peers: List["_Launch"] = []  # the blocks of this block's cluster, by rank
        self.cluster_barrier: Optional[_ClusterBarrier] = None

    def _kernel_params(self, args) -> Dict[str, object]:
        params = self.entry.params
        if len(args) != len(params):
            raise PtxInterpreterError(f"{self.entry.name} takes {len(params)} params, got {len(args)} args")
        out: Dict[str, object] = {}
        for i, ((name, t), arg) in enumerate(zip(params, args)):
            if t.startswith("unsupported"):
                raise PtxInterpreterError(f"param {name}: {t}")
            dt = _NP[t]
            if isinstance(arg, np.ndarray):
                if dt.itemsize != 8 or not _is_int(t):
                    raise PtxInterpreterError(f"array passed for param {name} of type .{t}")
                if not arg.flags.c_contiguous:
                    raise PtxInterpreterError(f"arg {i}: arrays must be C-contiguous (they are written in place)")
                if arg.nbytes > _GLOBAL_MAX_BYTES:
                    raise PtxInterpreterError(f"arg {i}: arrays larger than 128 MiB are not supported")
                base = ((i + 1) << _GLOBAL_SPACING_BITS) + _GLOBAL_MAX_BYTES
                self.buffers[base >> _GLOBAL_SPACING_BITS] = _Buffer(
                    f"arg {i} ({name})", base, arg.reshape(-1).view(np.uint8), arg.nbytes)
                out[name] = _U64.type(base)
            elif isinstance(arg, (int, np.integer)) and not isinstance(arg, bool) and _is_int(t):
                out[name] = np.array(int(arg) & ((1 << (8 * dt.itemsize)) - 1), _UNSIGNED[dt.itemsize]).view(dt)[()]
            elif isinstance(arg, (float, np.floating, int, np.integer)) and _is_float(t):
                out[name] = dt.type(arg)
            else:
                raise PtxInterpreterError(f"arg {i} ({type(arg).__name__}) does not fit param {name} of type .{t}")
        return out

    # -- memory -------------------------------------------------------------------
    def _resolve(self, space: Optional[str], a: np.ndarray, nbytes: int):
        """Split lane addresses into (buffer, selected lanes or None, offsets)."""
        if space == "shared":
            return [self._check(self.shared, None, a, nbytes)]
        if space == "cluster":
            return self._resolve_cluster(a, nbytes)
        hi = a >> _GLOBAL_SPACING_BITS
        h0 = hi[0]
        if (hi == h0).all():
            groups = [(int(h0), None)]
        else:
            groups = [(int(h), np.flatnonzero(hi == h)) for h in np.unique(hi)]
        out = []
        for h, sel in groups:
            buf = self.buffers.get(h)
            if buf is None and space is None and h == _SHARED_GENERIC_BASE >> _GLOBAL_SPACING_BITS:
                buf = self.shared_generic
            if buf is None:
                bad = int((a if sel is None else a[sel])[0])
                what = "global" if space == "global" else "generic"
                raise PtxInterpreterError(f"{what} address {bad:#x} is not inside any argument array")
            out.append(self._check(buf, sel, a if sel is None else a[sel], nbytes))
        return out

    def _resolve_cluster(self, a: np.ndarray, nbytes: int):
        """shared::cluster addresses: own shared memory below _CLUSTER_WINDOW,
        else cluster rank (a // _CLUSTER_WINDOW - 1)'s (mapa)."""
        window = a // _CLUSTER_WINDOW
        out = []
        for w in np.unique(window):
            sel = None if window.size == 1 or (window == w).all() else np.flatnonzero(window == w)
            rank = int(w) - 1
            if rank >= len(self.peers):
                raise PtxInterpreterError(f"shared::cluster address {int(a[0] if sel is None else a[sel][0]):#x} "
                                          f"names cluster rank {rank}, but the cluster has {len(self.peers)} blocks")
            buf = self.shared if rank < 0 else self.peers[rank].shared
            lanes = a if sel is None else a[sel]
            out.append(self._check(buf, sel, lanes - (w * _CLUSTER_WINDOW), nbytes))
        return out

    @staticmethod
    def _check(buf: _Buffer, sel, a: np.ndarray, nbytes: int):
        off = a - buf.base
        lo, hi = int(off.min()), int(off.max())
        if lo < 0 or hi + nbytes > buf.nbytes:
            bad = int(off[(off < 0) | (off + nbytes > buf.nbytes)][0])
            raise PtxInterpreterError(
                f"out-of-bounds access of {nbytes} bytes at byte offset {bad} of {buf.name} "
                f"({buf.nbytes} bytes)")
        if (off & (nbytes - 1)).any():
            bad = int(off[(off & (nbytes - 1)) != 0][0])
            raise PtxInterpreterError(f"misaligned access of {nbytes} bytes at byte offset {bad} of {buf.name}")
        return buf, sel, off

    def _race_check(self, groups, lanes, nbytes: int, write: bool) -> None:
        """Raise on a shared-memory data race between barriers: a word written by
        one thread and read or written by another in the same barrier interval.
        (Threads run in lockstep here, so such a race would otherwise go unseen.)"""
        for buf, sel, off in groups:
            if buf is not self.shared and buf is not self.shared_generic:
                continue
            ids = np.arange(self.T) if lanes is None else lanes
            ids = ids if sel is None else ids[sel]
            first = off >> 2
            for k in range(max(1, nbytes // 4)):
                w = first + k
                e = self.epoch
                clash = (self.sh_w_epoch[w] == e) & (self.sh_w_thread[w] != ids)
                if write:
                    clash |= (self.sh_r_epoch[w] == e) & (self.sh_r_thread[w] != ids)
                if clash.any():
                    i = int(np.flatnonzero(clash)[0])
                    other = self.sh_w_thread[w[i]] if self.sh_w_epoch[w[i]] == e else self.sh_r_thread[w[i]]
                    other = "several threads" if other == -2 else f"thread {other}"
                    raise PtxInterpreterError(
                        f"shared memory race: thread {ids[i]} {'writes' if write else 'reads'} byte offset "
                        f"{4 * int(w[i])}, which {other} {'read or ' if write else ''}wrote since the last barrier")
                if write:
                    self.sh_w_epoch[w], self.sh_w_thread[w] = e, ids
                    if (self.sh_w_thread[w] != ids).any():
                        raise PtxInterpreterError("shared memory race: two threads write one word in one access")
                else:
                    seen = self.sh_r_epoch[w] == e
                    reader = np.where(seen & (self.sh_r_thread[w] != ids), -2, ids)
                    self.sh_r_thread[w] = reader  # a word several lanes read: one of them stays...
                    self.sh_r_thread[w[self.sh_r_thread[w] != reader]] = -2  # ...so mark it shared
                    self.sh_r_epoch[w] = e

    def _lanes(self, addr, mask):
        """Addresses of the active lanes (int64 array) and their indices."""
        lanes = None if mask is None else np.flatnonzero(mask)
        if isinstance(addr, np.ndarray):
            return (addr if lanes is None else addr[lanes]), lanes
        return np.full(self.T if lanes is None else lanes.size, addr, np.int64), lanes

    def load(self, space, addr, mask, dt: np.dtype, n: int) -> List[np.ndarray]:
        a, lanes = self._lanes(addr, mask)
        if a.size == 0:
            return [np.zeros(self.T, dt) for _ in range(n)]
        groups = self._resolve(space, a, dt.itemsize * n)
        self._race_check(groups, lanes, dt.itemsize * n, write=False)
        shift = dt.itemsize.bit_length() - 1
        if len(groups) == 1 and groups[0][1] is None:
            buf, _, off = groups[0]
            view, idx = buf.view(dt), off >> shift
            vals = [view[idx + k] if k else view[idx] for k in range(n)]
        else:
            vals = [np.empty(a.size, dt) for _ in range(n)]
            for buf, sel, off in groups:
                view, idx = buf.view(dt), off >> shift
                for k in range(n):
                    vals[k][sel] = view[idx + k]
        if lanes is None:
            return vals
        out = []
        for v in vals:
            full = np.zeros(self.T, dt)
            full[lanes] = v
            out.append(full)
        return out

    def store(self, space, addr, mask, dt: np.dtype, values: List[object]) -> None:
        a, lanes = self._lanes(addr, mask)
        if a.size == 0:
            return
        n = len(values)
        vals = []
        for v in values:  # the getters already return dtype dt
            v = np.asarray(v)
            if v.ndim == 0:
                v = np.full(a.size, v, dt)
            elif lanes is not None:
                v = v[lanes]
            vals.append(v)
        shift = dt.itemsize.bit_length() - 1
        groups = self._resolve(space, a, dt.itemsize * n)
        self._race_check(groups, lanes, dt.itemsize * n, write=True)
        try:
            for buf, sel, off in groups:
                view, idx = buf.view(dt), off >> shift
                for k in range(n):
                    view[idx + k] = vals[k] if sel is None else vals[k][sel]
        except ValueError as e:  # a read-only argument array
            raise PtxInterpreterError(f"store failed: {e}") from None

    # -- cp.async: copies wait, per thread, in numbered groups -----------------------
    def async_reset(self) -> None:
        self.async_copies: List[List[np.ndarray]] = []   # [dst, lanes, group, *values]
        self.async_groups = np.zeros(self.T, np.int64)   # groups each thread has committed

    def async_issue(self, dst: np.ndarray, lanes: np.ndarray, vals: List[np.ndarray]) -> None:
        ids = np.flatnonzero(lanes)
        if ids.size:  # the copy may land any time from now: a write, for the race check
            self._race_check(self._resolve("shared", dst[ids], 4 * len(vals)), ids, 4 * len(vals), write=True)
        self.async_copies.append([dst, lanes, np.full(self.T, -1, np.int64), *vals])

    def async_commit(self, mask) -> None:
        m = np.ones(self.T, bool) if mask is None else mask
        for c in self.async_copies:
            new = c[1] & m & (c[2] < 0)
            c[2][new] = self.async_groups[new]
        self.async_groups[m] += 1

    def async_wait(self, mask, keep: int) -> None:
        """Land the copies of every group but each thread's newest `keep`."""
        m = np.ones(self.T, bool) if mask is None else mask
        left = []
        for c in self.async_copies:
            done = c[1] & m & (c[2] >= 0) & (c[2] < self.async_groups - keep)
            for k, v in enumerate(c[3:]):
                if done.any():
                    self.store("shared", c[0] + 4 * k, done, np.dtype(np.uint32), [v])
            c[1] = c[1] & ~done
            if c[1].any():
                left.append(c)
        self.async_copies = left

    # -- execution ------------------------------------------------------------------
    def run(self) -> None:
        gx, gy, gz = self.grid
        cx, cy, cz = self.entry.cluster or (1, 1, 1)
        if gx % cx or gy % cy or gz % cz:
            raise PtxInterpreterError(f"grid {self.grid} is not a whole number of clusters {(cx, cy, cz)}")
        for bz in range(0, gz, cz):
            for by in range(0, gy, cy):
                for bx in range(0, gx, cx):
                    blocks = [self._block(bx + x, by + y, bz + z, x + cx * (y + cy * z), cx * cy * cz)
                              for z in range(cz) for y in range(cy) for x in range(cx)]
                    if len(blocks) == 1:
                        self._run_block(blocks[0])
                    else:
                        self._run_cluster(blocks)
                    for b in blocks:
                        self.steps += b.steps
                        self.thread_steps += b.thread_steps

    def _block(self, bx: int, by: int, bz: int, rank: int, cluster_size: int) -> "_Launch":
        """This launch's state for one block: shared memory, barriers and the
        block's special registers of its own; global memory shared."""
        b = copy.copy(self)
        b.special = dict(self.special)
        for d, v in zip("xyz", (bx, by, bz)):
            b.special["%ctaid." + d] = np.full(self.T, v, np.uint32)
        b.special["%cluster_ctarank"] = np.full(self.T, rank, np.uint32)
        b.special["%cluster_nctarank"] = np.full(self.T, cluster_size, np.uint32)
        b.shared_u8 = np.full(self.shared_u8.size, 0xFF, np.uint8)  # uninitialised shared memory reads as NaN
        size = self.shared.nbytes
        b.shared = _Buffer("shared memory", 0, b.shared_u8, size)
        b.shared_generic = _Buffer("shared memory", _SHARED_GENERIC_BASE, b.shared_u8, size)
        b.sh_w_epoch, b.sh_w_thread = np.full(self.sh_w_epoch.size, -1, np.int64), np.empty_like(self.sh_w_thread)
        b.sh_r_epoch, b.sh_r_thread = np.full(self.sh_r_epoch.size, -1, np.int64), np.empty_like(self.sh_r_thread)
        b.async_reset()
        b.exited = np.zeros(self.T, bool)
        b.any_exited = False
        b.steps = b.thread_steps = 0
        b.where = f"block ({bx}, {by}, {bz})"
        return b

    @staticmethod
    def _run_block(b: "_Launch") -> None:
        fr = _Frame(b.entry, b, np.ones(b.T, bool))
        fr.params = dict(b.params)
        try:
            b._activate(fr)
        except PtxInterpreterError as e:
            raise PtxInterpreterError(f"{b.where}: {e}") from None

    @classmethod
    def _run_cluster(cls, blocks: List["_Launch"]) -> None:
        """The blocks of one cluster, each in a thread of its own, so that each
        can wait at a cluster barrier for the others. A block that ends (or
        fails) breaks the barrier: whoever waits at it, or arrives later, never
        meets that block there, which on a GPU is a hang."""
        barrier = _ClusterBarrier(len(blocks))
        errors: List[BaseException] = []

        def run(b: "_Launch") -> None:
            try:
                with np.errstate(all="ignore"):  # per thread: run_kernel's does not reach here
                    cls._run_block(b)
            except BaseException as e:  # reported below, after every thread has ended
                errors.append(e)
            finally:
                barrier.end()

        for b in blocks:
            b.peers, b.cluster_barrier = blocks, barrier
        threads = [threading.Thread(target=run, args=(b,), daemon=True) for b in blocks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not getattr(e, "broken_barrier", False)]
        if real or errors:
            raise (real or errors)[0]

    def _cluster_wait(self, func, ins) -> None:
        if self.cluster_barrier is None:
            raise _located(func, ins, "barrier.cluster.wait in a kernel launched without clusters "
                                      "(no .reqnctapercluster)")
        if not self.cluster_barrier.wait():
            err = _located(func, ins, "cluster barrier deadlock: another block of the cluster ended "
                                      "(or failed) without arriving here")
            err.broken_barrier = True
            raise err

    def _exit(self, lanes: np.ndarray) -> None:
        self.exited = self.exited | lanes
        self.any_exited = True

    def _activate(self, fr: _Frame) -> None:
        """Run one function activation until all its lanes have returned."""
        func = fr.func
        code = func.code
        ncode = len(code)
        M, nM = fr.M, fr.nM
        parked: Dict[int, np.ndarray] = {}  # pc -> lanes waiting to run from there
        pmin = _INF  # min(parked)
        at_bar: Dict[int, np.ndarray] = {}  # pc of a bar.sync -> lanes waiting there
        pc, cur, cur_n = 0, M, nM
        full = True  # cur == M: instructions may skip masking
        steps = thread_steps = 0
        step_limit = STEP_LIMIT - self.steps
        ins = None

        while True:
            if pc >= ncode:
                raise _located(func, code[-1] if code else None,
                               "execution ran past the end of the function (missing ret?)")
            ins = code[pc]
            steps += 1
            thread_steps += cur_n
            # Lanes the instruction applies to: m (None: all of cur and cur is M).
            if ins.guard is None:
                m, mn = (None if full else cur), cur_n
            else:
                try:
                    g = ins.guard(fr, None if full else cur)
                except PtxInterpreterError as e:
                    raise _located(func, ins, e) from None
                m = np.logical_and(g, cur)
                mn = int(np.count_nonzero(m))
                if mn == cur_n:
                    m = None if full else cur
            kind = ins.kind
            switch = False  # does the current group stop here?

            if kind == PLAIN:
                if mn:
                    try:
                        ins.fn(fr, m)
                    except PtxInterpreterError as e:
                        raise _located(func, ins, e) from None
                    except Exception as e:  # NumPy trouble: report where it happened
                        raise _located(func, ins, f"internal error: {type(e).__name__}: {e}") from e
                pc += 1
            elif kind == BRA:
                if steps > step_limit:  # only branches can loop
                    raise _located(func, ins, f"more than {STEP_LIMIT} instructions issued: infinite loop?")
                if mn == cur_n:
                    pc = ins.target
                elif mn == 0:
                    pc += 1
                else:
                    if ins.uni:
                        self._check_uniform(func, ins, cur, m)
                    parked, pmin = _park(parked, pmin, ins.target, m)
                    parked, pmin = _park(parked, pmin, pc + 1, np.greater(cur, m))
                    switch = True
            elif kind == BRX:
                taken = cur if m is None else m
                try:
                    idx = np.broadcast_to(ins.index(fr, None if full else cur), (self.T,))
                except PtxInterpreterError as e:
                    raise _located(func, ins, e) from None
                values = np.unique(idx[taken])
                if values.size and int(values[-1]) >= len(ins.targets):
                    raise _located(func, ins, f"brx.idx index {int(values[-1])} out of range "
                                              f"({len(ins.targets)} targets)")
                if values.size == 1 and mn == cur_n:
                    pc = ins.targets[int(values[0])]
                else:
                    if ins.uni and values.size > 1:
                        for v in values[1:]:
                            self._check_uniform(func, ins, taken, taken & (idx == v))
                    for v in values:
                        parked, pmin = _park(parked, pmin, ins.targets[int(v)], taken & (idx == v))
                    if mn != cur_n:
                        parked, pmin = _park(parked, pmin, pc + 1, np.greater(cur, taken))
                    switch = True
            elif kind == CALL:
                if mn:
                    self._call(fr, ins, cur if m is None else m)
                    if self.any_exited:
                        cur = np.greater(cur, self.exited)
                        cur_n = int(np.count_nonzero(cur))
                        full = cur_n == nM
                pc += 1
                switch = cur_n == 0
            elif kind == RET or kind == EXIT:
                if mn:
                    leaving = cur if m is None else m
                    if kind == EXIT or func.is_entry:
                        self._exit(leaving)
                    if mn == cur_n:
                        switch, cur_n = True, 0
                    else:
                        cur = np.greater(cur, leaving)
                        cur_n -= mn
                        full = False
                pc += 1
            else:  # BAR
                if mn:
                    arriving = cur if m is None else m
                    old = at_bar.get(pc)
                    at_bar[pc] = arriving if old is None else (old | arriving)
                    if mn == cur_n:
                        switch, cur_n = True, 0
                    else:
                        cur = np.greater(cur, arriving)
                        cur_n -= mn
                        full = False
                pc += 1

            if not switch:
                if pc < pmin:
                    continue
                if cur_n:
                    parked, pmin = _park(parked, pmin, pc, cur)
            # Pick the next group: the lowest parked pc, else release a barrier.
            if parked:
                pc = pmin
                cur = parked.pop(pc)
                pmin = min(parked) if parked else _INF
            elif at_bar:
                pc, cur = self._release_barrier(func, code, fr, at_bar)
                at_bar = {}
            else:
                break
            cur_n = int(np.count_nonzero(cur))
            full = cur_n == nM
        self.steps += steps
        self.thread_steps += thread_steps

    def _release_barrier(self, func, code, fr: _Frame, at_bar: Dict[int, np.ndarray]):
        if len(at_bar) > 1:
            lines = ", ".join(str(code[p].line) for p in sorted(at_bar))
            raise _located(func, code[min(at_bar)],
                           f"barrier deadlock: threads wait at different bar.sync instructions (lines {lines})")
        (bpc, lanes), = at_bar.items()
        others = ~(fr.M | self.exited)
        if others.any():
            raise _located(func, code[bpc], "bar.sync inside a call made by only part of the block "
                                             f"(threads {np.flatnonzero(others)[:8].tolist()} are elsewhere)")
        if code[bpc].cluster_wait:
            self._cluster_wait(func, code[bpc])
        self.epoch += 1
        return bpc + 1, lanes

    def _check_uniform(self, func, ins, cur, taken):
        """.uni promises that the threads of a warp do not diverge."""
        pad = -self.T % 32
        c = np.concatenate([cur, np.zeros(pad, bool)]).reshape(-1, 32)
        t = np.concatenate([taken, np.zeros(pad, bool)]).reshape(-1, 32)
        split = t.any(axis=1) & (c & ~t).any(axis=1)
        if split.any():
            raise _located(func, ins, f".uni branch diverges inside warp {int(np.flatnonzero(split)[0])}")

    def _call(self, fr: _Frame, ins: _Ins, lanes: np.ndarray) -> None:
        callee = ins.callee
        cfr = _Frame(callee, self, lanes)
        for (formal, _), actual in zip(callee.params, ins.args):
            v = fr.params.get(actual)
            if v is None:
                raise _located(fr.func, ins, f"param {actual} passed before it was written")
            cfr.params[formal] = v
        self._activate(cfr)
        for (formal, _), actual in zip(callee.rets, ins.rets):
            v = cfr.params.get(formal)
            if v is not None:
                old = fr.params.get(actual)
                fr.params[actual] = v if old is None or old.dtype != v.dtype else np.where(lanes, v, old)


class _ClusterBarrier:
    """The barrier of one cluster's blocks (threads). It can never complete
    once a block has ended, so a wait then reports a deadlock (False)."""

    def __init__(self, n: int):
        self.n, self.waiting, self.generation, self.ended = n, 0, 0, 0
        self.cond = threading.Condition()

    def wait(self) -> bool:
        with self.cond:
            if self.ended:
                return False
            generation = self.generation
            self.waiting += 1
            if self.waiting == self.n:
                self.waiting, self.generation = 0, generation + 1
                self.cond.notify_all()
                return True
            while generation == self.generation and not self.ended:
                self.cond.wait()
            return generation != self.generation

    def end(self) -> None:
        with self.cond:
            self.ended += 1
            self.cond.notify_all()


def _park(parked: Dict[int, np.ndarray], pmin: int, pc: int, lanes: np.ndarray):
    old = parked.get(pc)
    parked[pc] = lanes if old is None else (old | lanes)
    return parked, min(pmin, pc)


def _located(func: _Func, ins: Optional[_Ins], e) -> PtxInterpreterError:
    if isinstance(e, PtxInterpreterError) and e.located:
        return e
    where = f"{func.name}, line {ins.line}: `{ins.text}`" if ins is not None else func.name
    err = PtxInterpreterError(f"{where}: {e}")
    err.located = True
    return err


@functools.lru_cache(maxsize=32)
def _parse(ptx: str, check_call_arguments: bool = True) -> _Module:
    return _Module(ptx, check_call_arguments)


def run_kernel(ptx: str, entry: str, grid: Tuple[int, int, int], block: Tuple[int, int, int],
               args: list, dynamic_shared_bytes: int = 0) -> None:
    """Execute `entry` of the PTX module for every block and thread. `args` are the kernel
    parameters in order: numpy arrays (passed as global pointers; the kernel may write them
    in place) or Python ints (passed as the .b32/.u32/.s32/.b64 param value). Raises
    PtxInterpreterError on any unsupported instruction, out-of-bounds global/shared access,
    read of a register never written, or barrier deadlock."""
    grid, block = tuple(int(v) for v in grid), tuple(int(v) for v in block)
    if len(grid) != 3 or len(block) != 3 or min(grid + block) < 1:
        raise PtxInterpreterError(f"grid and block need three positive sizes, got {grid} and {block}")
    if dynamic_shared_bytes < 0:
        raise PtxInterpreterError("dynamic_shared_bytes must be >= 0")
    mod = _parse(ptx, CHECK_CALL_ARGUMENT_STORES)
    func = mod.funcs.get(entry)
    if func is None or not func.is_entry:
        raise PtxInterpreterError(f"no .entry named {entry!r} in the module")
    nthreads = block[0] * block[1] * block[2]
    if func.maxntid is not None and nthreads > func.maxntid:
        raise PtxInterpreterError(f"{entry} has .maxntid {func.maxntid}, launched with {nthreads} threads")
    if func.reqntid is not None and tuple(func.reqntid) + (1,) * (3 - len(func.reqntid)) != block:
        raise PtxInterpreterError(f"{entry} has .reqntid {func.reqntid}, launched with block {block}")
    launch = _Launch(mod, func, grid, block, list(args), int(dynamic_shared_bytes))
    LAST_RUN_STATS.clear()
    with np.errstate(all="ignore"):
        launch.run()
    LAST_RUN_STATS.update(thread_instructions=launch.thread_steps, group_instructions=launch.steps,
                          blocks=grid[0] * grid[1] * grid[2])
