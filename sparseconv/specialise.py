"""Stage 3, specialise: the template PTX + a layer's real weights -> the layer's PTX.

This is where a layer's weights enter the PTX (the paper's Algorithm 2), in one
linear pass:

* The template holds ONE bounded body: k_block x c_block x R x S placeholder
  weights, inside the chunk loop of the `.func sc_kblock`. For every block of
  output channels the pass writes a copy of that function, and inside it one
  copy of the loop body per chunk of input channels (the loop has no other
  exit, so running its body n times in a row is the loop). Each copy gets that
  (channel block, chunk)'s weights.
* A placeholder reaches an FMA either as `mov.f32 %fA, 0fPLACEHOLDER` then
  `fma.rn.f32 %fD, %fX, %fA, %fC` (what NVVM emits), or as an immediate operand.
  Either way the FMA is rewritten with the real weight as an immediate and the
  placeholder movs are dropped.
* An FMA whose weight is 0 is deleted and `regmap[D] = C`: later reads of D
  read C instead, so the accumulation chain stays intact. PTX registers are
  not single-assignment across copies, so before an instruction redefines a
  register R, every D still aliased to R is first materialised (`mov D, R`);
  ptxas removes the movs nobody reads.
* The entry's single call becomes a jump table over the copies (brx.idx on
  blockIdx.y).
* Bounded functions for ptxas. A k-block function's chunk copies grow with C
  (a 512-channel VGG layer: 256 copies, ~100K lines), and ptxas time per copy
  grows with the function's length. So when a k-block's copies are estimated
  (per copy: the body's other statements plus its kept FMAs) at more than
  MAX_PIECE_LINES lines, they are cut into runs of consecutive chunks
  (plan_pieces), each a function `sc_kblock_<b>_p<i>` with the template
  function's own parameters:

      .func sc_kblock_3_p1(<x, y, bias, kblock, n, n_chunks>)
      {   <the prologue, as in the template>        recomputes every loop invariant
          <load the loop state from sc_state>       (not in the first piece)
          <chunk copies j0 .. j1-1, exactly as above>
          <store the loop state to sc_state; ret>   (the last piece: the epilogue)
      }

  The loop state is the registers the body writes that are live across a
  copy boundary (accumulators, the chunk counter), found once per template by
  dataflow over the body and the epilogue (_piece_interface). It goes through
  a static shared array `sc_state`, one column of `threads` slots per
  register, each thread reading back only its own slots (_PieceState), not
  through call parameters: the ABI passes big parameter lists on the stack,
  and that made split layers 1.1-1.8x slower on the H100, against 1.0-1.07x
  this way. The entry's jump table calls a split k-block's pieces in order,
  each call in its own copy of the call sequence. Small layers (one piece per
  k-block) get exactly the unsplit function; so does a layer whose state
  would not fit in shared memory next to the input patch (MAX_SHARED_BYTES).

Speed (issue 3 asks for 500K PTX lines a second): the pass touches every
placeholder FMA of every copy, so the per-template work is done once, in
TemplateLayout: statements no weight can change are rendered to text once and
copied with their label suffix (_copy_plan), and FMAs whose destination no
alias can involve skip the alias bookkeeping (_special_registers). The output
is the same as handling every statement and FMA one by one (tests check it).

Invariants are checked by raising SpecialiseError: each placeholder is used by
exactly `outputs per thread` FMAs of the body, none outside the loop body, the
loop has the expected shape, and deleted FMAs == zero weights x multiplicity.
"""
from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np

from .ptx import (REG_RE, PtxParseError, Stmt, f32_immediate_bits, parse_module, parse_statements,
                  reg_prefix, register_types, split_operands)
from .render import ENTRY_NAME, KBLOCK_FUNC, RenderedTemplate, body_index
from .shapes import MAX_PATCH_BYTES, ConvShape, Tiling, n_chunks, n_kblocks, patch_buffer_bytes


# Bound on the estimated PTX lines of chunk copies in one function (see the
# module docstring). Measured on the 2-core machine (ptxas 13.0 -O3, one
# k-block of VGG-16's 512->512 layer at 28x28, 90% zeros, 256 chunk copies):
# ptxas costs about 30 ms per copy in functions up to ~13K lines and more
# beyond (102K lines whole: 59 ms per copy, 14-15 s). Split at 8K / 12K / 16K
# lines, the k-block's functions took 5.9 / 5.9 / 6.2 s in all; over whole
# models (ResNet-50's 1x1 layers), 12K assembled slower than 8K. Every piece
# costs the kernel a call, a prologue and a state hand-over: on the H100, with
# 8K, split layers ran at 1.00-1.07x the time of the same layers unsplit.
MAX_PIECE_LINES = 8_000
# Shared memory a block may use without opting in: the input patch plus, when
# a k-block is split, the loop state its pieces hand on (see _PieceState).
MAX_SHARED_BYTES = MAX_PATCH_BYTES


class SpecialiseError(RuntimeError):
    """The template PTX broke an invariant of the pass. Carries the PTX line."""

    def __init__(self, message: str, line: Optional[int] = None, text: str = "") -> None:
        where = f" (template PTX line {line}: {text.strip()!r})" if line else ""
        super().__init__(message + where)
        self.line = line


@dataclass(frozen=True)
class SpecialiseStats:
    kblocks: int               # copies of the k-block function
    chunks: int                # copies of the loop body in each
    pieces: int                # functions holding chunk copies (== kblocks when no k-block was split)
    weights: int               # K * C/groups * R * S of the layer
    nonzero_weights: int
    fmas_per_weight: int       # outputs per thread: FMAs one weight feeds in the body
    fmas_before: int           # placeholder FMAs over all copies, padding included
    fmas_deleted: int
    fmas_kept: int
    loads_dropped: int         # shared loads that fed only deleted FMAs
    ptx_lines_template: int
    ptx_lines_visited: int     # template statements the pass walked (its input, copies counted)
    ptx_lines: int

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- weights

def arrange_weights(weight: np.ndarray, shape: ConvShape, tiling: Tiling) -> np.ndarray:
    """(K, C/groups, R, S) -> (kblocks, chunks, body) in placeholder body order,
    k-block copy b = blockIdx.y = output-channel block * slices + slice, each
    slice its own run of chunks. Channels past K or C of a group (padding up to
    whole blocks, chunks and slices) get weight 0."""
    g, kpg, cpg = shape.groups, shape.k_per_group, shape.c_per_group
    kb, cb, sl = tiling.k_block, tiling.c_block, tiling.slices
    kbpg = n_kblocks(shape, tiling) // (g * sl)
    nch = n_chunks(shape, tiling)  # per slice
    r, s = shape.kernel_h, shape.kernel_w
    w = np.asarray(weight, dtype=np.float32).reshape(g, kpg, cpg, r, s)
    padded = np.zeros((g, kbpg * kb, sl * nch * cb, r, s), dtype=np.float32)
    padded[:, :kpg, :cpg] = w
    padded = padded.reshape(g, kbpg, kb, sl, nch, cb, r, s).transpose(0, 1, 3, 4, 2, 5, 6, 7)
    return np.ascontiguousarray(padded.reshape(g * kbpg * sl, nch, kb * cb * r * s))


# --------------------------------------------------------------------------- template analysis

@dataclass(frozen=True)
class _Fma:
    """A placeholder FMA of the loop body: d = input * w[index] + acc."""
    pred: str
    opcode: str
    dest: str
    input: str
    acc: str
    index: int
    line: int


@dataclass(frozen=True)
class TemplateLayout:
    header: List[str]
    func_head: List[str]
    prologue: List[Stmt]
    loop_label: str
    loop_body: List[object]      # Stmt or _Fma, in order
    epilogue: List[Stmt]
    labels: Set[str]             # labels defined in the function
    reg_types: Dict[str, str]    # register prefix -> PTX type
    entry_head: List[str]
    entry_stmts: List[Stmt]
    entry_call: Stmt
    entry_callseq: Tuple[int, int]  # indices of the '{' and '}' around the call
    fmas_per_weight: int
    ptx_lines: int
    liveness: "_BodyLiveness"
    body_other: int              # body items that are not placeholder FMAs (lines of a copy, FMAs aside)
    piece_inputs: Tuple[str, ...]   # loop-carried: written by a copy, live at its start (a piece loads them)
    piece_outputs: Tuple[str, ...]  # written by a copy and live after it (a piece stores them)
    # Derived here, not passed in (so dataclasses.replace keeps them in step):
    # how the pass emits each part, statements no weight can change pre-rendered.
    prologue_text: "_Text" = field(init=False, repr=False, compare=False)
    body_plan: Tuple[object, ...] = field(init=False, repr=False, compare=False)
    epilogue_plan: Tuple[object, ...] = field(init=False, repr=False, compare=False)
    special: FrozenSet[str] = field(init=False, repr=False, compare=False)  # see _special_registers

    def __post_init__(self) -> None:
        fmas = [it for it in self.loop_body if isinstance(it, _Fma)]
        aliasable = {f.dest for f in fmas} | {f.acc for f in fmas if f.acc.startswith("%")}
        ren = _Renamer(self.reg_types, self.liveness)  # no aliases yet: statements as they stand
        body_plan = _copy_plan(self.loop_body, ren, self.labels, aliasable, self.liveness.load_consumers,
                               in_body=True)
        object.__setattr__(self, "prologue_text", _static_text(self.prologue, ren, self.labels))
        object.__setattr__(self, "body_plan", body_plan)
        object.__setattr__(self, "epilogue_plan", _copy_plan(self.epilogue, ren, self.labels, aliasable,
                                                             {}, in_body=False))
        object.__setattr__(self, "special", _special_registers(body_plan, aliasable, self.liveness))


@dataclass(frozen=True)
class _BodyLiveness:
    """Where each register is read and written in the loop body, computed once
    per template so the pass can tell, in O(log n), whether an aliased register
    is still read later (and so needs a mov before its source is overwritten)."""
    reads: Dict[str, List[int]]
    defs: Dict[str, List[int]]
    live_out: Set[str]                       # read by the next copy or the epilogue
    load_consumers: Dict[int, Tuple[int, ...]]  # body position of a droppable load -> weight indices
    # still_read's answers per body position, (registers asked about, those
    # read again): every copy asks the same questions.
    _memo: Dict[int, Tuple[Set[str], Set[str]]] = field(default_factory=dict, compare=False, repr=False)

    def still_read(self, regs: Set[str], pos: int) -> Set[str]:
        """Those of `regs` whose value at body position `pos` is read again."""
        memo = self._memo.get(pos)
        if memo is None:
            memo = self._memo[pos] = (set(), set())
        asked, live = memo
        for reg in regs - asked:
            if self.read_later(reg, pos):
                live.add(reg)
            asked.add(reg)
        return regs & live

    def read_later(self, reg: str, pos: int) -> bool:
        """Is `reg`'s value at body position `pos` (just before the instruction
        there writes something) read again?"""
        reads, defs = self.reads.get(reg, ()), self.defs.get(reg, ())
        nxt_def = defs[bisect_right(defs, pos)] if defs and defs[-1] > pos else None
        i = bisect_left(reads, pos)
        if i < len(reads) and (nxt_def is None or reads[i] <= nxt_def):
            return True
        return nxt_def is None and reg in self.live_out


def _body_liveness(body: List[object], epilogue: List[Stmt], extra_live: Tuple[str, ...] = ()) -> _BodyLiveness:
    reads: Dict[str, List[int]] = defaultdict(list)
    defs: Dict[str, List[int]] = defaultdict(list)
    fma_reads: Dict[str, List[Tuple[int, int]]] = defaultdict(list)  # reg -> (pos, weight index)
    upward: Set[str] = set()
    for pos, item in enumerate(body):
        if isinstance(item, _Fma):
            srcs, dests = [item.input, item.acc] + REG_RE.findall(item.pred), [item.dest]
            fma_reads[item.input].append((pos, item.index))
        elif item.kind == "instr":
            srcs, dests = item.src_regs(), item.dest_regs()
        else:
            continue
        for r in srcs:
            if r.startswith("%"):
                reads[r].append(pos)
                if r not in defs:
                    upward.add(r)
        for d in dests:
            defs[d].append(pos)
    live_out = upward | {r for st in epilogue if st.kind == "instr" for r in st.src_regs()} | set(extra_live)
    consumers: Dict[int, Tuple[int, ...]] = {}
    for pos, item in enumerate(body):
        if not (isinstance(item, Stmt) and item.kind == "instr" and item.opcode.startswith("ld.shared")
                and not item.pred):
            continue
        regs = item.dest_regs()
        idx: List[int] = []
        for r in regs:
            if len(defs[r]) != 1 or r in live_out or len(fma_reads[r]) != len(reads[r]):
                break  # read by something other than placeholder FMAs: always keep
            idx.extend(i for _, i in fma_reads[r])
        else:
            consumers[pos] = tuple(idx)
    return _BodyLiveness(dict(reads), dict(defs), live_out, consumers)


class _Dataflow:
    """Backward liveness over a straight run of code whose branches stay inside
    it (a branch out of it counts as "everything live") and whose end falls
    through to code where `live_end` is live. Register sets are bitmasks over
    `bit`. Guarded writes kill nothing. Iterated to a fixpoint: the staging
    loop inside the chunk body is a loop."""

    def __init__(self, items: List[object], bit: Dict[str, int]) -> None:
        n = len(items)
        self.uses, self.kills, self.succ = [0] * n, [0] * n, [(i + 1,) for i in range(n)]
        self.read = self.written = 0
        labels = {it.text[:-1]: i for i, it in enumerate(items) if isinstance(it, Stmt) and it.kind == "label"}
        for i, it in enumerate(items):
            if isinstance(it, _Fma):
                srcs, dests, pred = [it.input, it.acc] + REG_RE.findall(it.pred), [it.dest], it.pred
            elif it.kind == "instr":
                srcs, dests, pred = it.src_regs(), it.dest_regs(), it.pred
                if it.base_opcode in ("ret", "exit") and not pred:
                    self.succ[i] = ()
                tgt = _branch_target(it)
                if tgt is not None:
                    t = labels.get(tgt, -1)
                    self.succ[i] = (t,) if not pred else (t, i + 1)
            else:
                continue
            u = k = w = 0
            for r in srcs:
                if r in bit:
                    u |= 1 << bit[r]
            for d in dests:
                if d in bit:
                    w |= 1 << bit[d]
            if not pred:
                k = w
            self.uses[i], self.kills[i] = u, k
            self.read |= u
            self.written |= w

    def live_in(self, live_end: int) -> int:
        n = len(self.uses)
        uses, kills, succ = self.uses, self.kills, self.succ
        everything = live_end | self.read
        live = [0] * (n + 1)
        live[n] = live_end
        changed = True
        while changed:
            changed = False
            for i in range(n - 1, -1, -1):
                out = 0
                for s in succ[i]:
                    out |= everything if s < 0 else live[s]
                v = uses[i] | (out & ~kills[i])
                if v != live[i]:
                    live[i], changed = v, True
        return live[0]


def _piece_interface(body: List[object], epilogue: List[Stmt], reg_types: Dict[str, str]
                     ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The loop state a function holding some chunk copies must take over and
    hand on: registers the body writes that are live at the start of a copy
    (loop-carried: accumulators, the chunk counter) and those the body writes
    that are live after a copy (in the next copy or the epilogue). Everything
    else live in the body is loop-invariant: each piece recomputes it in its
    copy of the prologue."""
    regs: List[str] = []
    seen: Set[str] = set()
    for it in list(body) + list(epilogue):
        if isinstance(it, _Fma):
            found = [it.dest, it.input, it.acc] + REG_RE.findall(it.pred)
        elif it.kind == "instr":
            found = it.dest_regs() + it.src_regs()
        else:
            continue
        for r in found:
            if r not in seen and reg_prefix(r) in reg_types:  # special registers (%tid ...) are not passed
                seen.add(r)
                regs.append(r)
    bit = {r: i for i, r in enumerate(regs)}
    flow_body = _Dataflow(body, bit)
    epi_in = _Dataflow(epilogue, bit).live_in(0)
    body_in = 0
    while True:  # live at the end of a copy = live at the next copy's start or at the epilogue's
        end = body_in | epi_in
        nxt = flow_body.live_in(end)
        if nxt == body_in:
            break
        body_in = nxt
    ins = body_in & flow_body.written
    outs = end & flow_body.written
    return (tuple(r for r in regs if ins >> bit[r] & 1), tuple(r for r in regs if outs >> bit[r] & 1))


def _branch_target(st: Stmt) -> Optional[str]:
    if st.kind == "instr" and st.base_opcode == "bra":
        return st.srcs.strip()
    return None


def analyse_template(ptx: str, rendered: RenderedTemplate) -> TemplateLayout:
    """Find the pieces of the template PTX the pass copies, checking its shape."""
    shape, tiling = rendered.shape, rendered.tiling
    bits_to_index = {bits: body_index(shape, tiling, *pos) for bits, pos in rendered.placeholders.items()}
    try:
        module = parse_module(ptx)
        func = module.function(KBLOCK_FUNC)
        entry = module.function(ENTRY_NAME)
        stmts = parse_statements(func.body, func.body_first_line)
        entry_stmts = parse_statements(entry.body, entry.body_first_line)
    except PtxParseError as exc:
        raise SpecialiseError(f"template PTX does not parse: {exc}") from None

    # Registers that hold a placeholder (mov.f32 %fA, 0fPLACEHOLDER).
    ph_reg: Dict[str, int] = {}
    defs: Dict[str, int] = defaultdict(int)
    for st in stmts:
        if st.kind != "instr":
            continue
        for d in st.dest_regs():
            defs[d] += 1
        if st.opcode in ("mov.f32", "mov.b32"):
            bits = f32_immediate_bits(st.srcs.strip())
            if bits is not None and bits in bits_to_index:
                if st.pred:
                    raise SpecialiseError("predicated placeholder mov", st.line, st.text)
                prev = ph_reg.get(st.dest)
                if prev is not None and prev != bits_to_index[bits]:
                    raise SpecialiseError(f"register {st.dest} holds two placeholders", st.line, st.text)
                ph_reg[st.dest] = bits_to_index[bits]
    ph_movs: Dict[str, int] = defaultdict(int)
    for st in stmts:
        if st.kind == "instr" and st.dest in ph_reg and st.opcode in ("mov.f32", "mov.b32"):
            ph_movs[st.dest] += 1
    for reg in ph_reg:
        if defs[reg] != ph_movs[reg]:
            raise SpecialiseError(f"placeholder register {reg} is also written by other instructions")

    def placeholder_fma(st: Stmt) -> Optional[_Fma]:
        """Decode a placeholder FMA, or None for any other statement."""
        if st.kind != "instr" or (st.base_opcode == "mov" and st.dest in ph_reg):
            return None
        ops = split_operands(st.srcs)
        uses = [r for r in st.src_regs() if r in ph_reg]
        imm = [i for i, op in enumerate(ops) if f32_immediate_bits(op) in bits_to_index]
        if not uses and not imm:
            return None
        if st.base_opcode != "fma" or not st.opcode.endswith(".f32") or len(ops) != 3:
            raise SpecialiseError(f"placeholder used by {st.opcode}, expected only fma.*.f32", st.line, st.text)
        weight_pos = [i for i in (0, 1) if ops[i] in ph_reg or i in imm]
        if len(weight_pos) != 1 or ops[2] in ph_reg or 2 in imm:
            raise SpecialiseError("FMA must have exactly one placeholder multiplicand", st.line, st.text)
        wp = weight_pos[0]
        index = ph_reg[ops[wp]] if ops[wp] in ph_reg else bits_to_index[f32_immediate_bits(ops[wp])]
        return _Fma(st.pred, st.opcode, st.dest, ops[1 - wp], ops[2], index, st.line)

    fma_at = {i: f for i, f in ((i, placeholder_fma(st)) for i, st in enumerate(stmts)) if f is not None}
    if not fma_at:
        raise SpecialiseError("no placeholder FMA found in the template PTX")
    first, last = min(fma_at), max(fma_at)
    # The chunk loop: a label before the first placeholder FMA, closed by a
    # branch back to it after the last. (NVVM marks it `.pragma "nounroll"`,
    # but drops the mark once the body holds cp.async, so it is no anchor.)
    branches_after: Dict[str, int] = {}
    for j in range(last + 1, len(stmts)):
        tgt = _branch_target(stmts[j])
        if tgt is not None:
            branches_after[tgt] = j
    enclosing = [(i, branches_after[st.text[:-1]], st.text[:-1]) for i, st in enumerate(stmts[:first])
                 if st.kind == "label" and st.text[:-1] in branches_after]
    if len(enclosing) != 1:
        raise SpecialiseError(f"expected one loop around all placeholder FMAs, found {len(enclosing)}")
    start, end, loop_label = enclosing[0]
    back_edge = stmts[end]

    labels = {st.text[:-1] for st in stmts if st.kind == "label"}
    inner_labels = {st.text[:-1] for st in stmts[start + 1:end] if st.kind == "label"}
    for i, st in enumerate(stmts):
        tgt = _branch_target(st)
        if st.kind == "instr" and st.base_opcode == "brx":  # its targets would need renaming per copy
            raise SpecialiseError(f"{st.opcode} in {KBLOCK_FUNC}: indirect branches are not supported",
                                  st.line, st.text)
        if st.kind == "instr" and st.base_opcode in ("ret", "exit") and start < i < end:
            raise SpecialiseError(f"{st.opcode} inside the chunk loop", st.line, st.text)
        if tgt is None or i == end:
            continue
        inside = start < i < end
        if tgt == loop_label:
            raise SpecialiseError("a second branch to the chunk loop header", st.line, st.text)
        if inside and tgt not in inner_labels:
            raise SpecialiseError("a branch leaves the chunk loop early", st.line, st.text)
        if not inside and tgt in inner_labels:
            raise SpecialiseError("a branch enters the chunk loop from outside", st.line, st.text)
    if back_edge.pred == "":
        raise SpecialiseError("chunk loop back edge is unconditional", back_edge.line, back_edge.text)

    # Each weight must feed exactly thread_h * thread_w FMAs.
    per_weight = tiling.fmas_per_weight
    counts = np.bincount([f.index for f in fma_at.values()], minlength=len(bits_to_index))
    if len(counts) != len(bits_to_index) or not np.all(counts == per_weight):
        missing = int(np.sum(counts == 0))
        raise SpecialiseError(f"placeholder FMA counts do not add up: expected {per_weight} per weight for "
                              f"{len(bits_to_index)} weights; {missing} weights never used, counts range "
                              f"{int(counts.min())}..{int(counts.max())}")

    body: List[object] = []
    for i in range(start + 1, end):
        st = stmts[i]
        if i in fma_at:
            body.append(fma_at[i])
        elif i == start + 1 and st.text.strip() == '.pragma "nounroll";':
            continue  # the loop mark, if NVVM kept it
        elif not (st.kind == "instr" and st.dest in ph_reg and st.base_opcode == "mov"):
            body.append(st)
    outside = [st for st in stmts[:start] + stmts[end + 1:]
               if not (st.kind == "instr" and st.dest in ph_reg and st.base_opcode == "mov")]
    for st in outside:
        if st.kind == "instr" and any(r in ph_reg for r in st.src_regs()):
            raise SpecialiseError("placeholder register read outside the chunk loop", st.line, st.text)
    kept = {id(st) for st in outside}  # identity: Stmt equality compares every field (slow)
    prologue = [st for st in stmts[:start] if id(st) in kept]
    epilogue = [st for st in stmts[end + 1:] if id(st) in kept]

    calls = [i for i, st in enumerate(entry_stmts)
             if st.kind == "instr" and st.base_opcode == "call" and re.search(rf"\b{KBLOCK_FUNC}\b", st.srcs)]
    if len(calls) != 1:
        raise SpecialiseError(f"expected one call of {KBLOCK_FUNC} in {ENTRY_NAME}, found {len(calls)}")
    c = calls[0]
    depth, open_at = 0, -1
    for i in range(c - 1, -1, -1):
        kind = entry_stmts[i].kind
        depth += (kind == "close") - (kind == "open")
        if depth < 0:
            open_at = i
            break
    depth, close_at = 0, -1
    for i in range(c + 1, len(entry_stmts)):
        kind = entry_stmts[i].kind
        depth += (kind == "open") - (kind == "close")
        if depth < 0:
            close_at = i
            break
    if open_at < 0 or close_at < 0:
        raise SpecialiseError(f"the call of {KBLOCK_FUNC} is not inside a {{ }} call sequence block",
                              entry_stmts[c].line, entry_stmts[c].text)
    if not re.search(rf"\b{KBLOCK_FUNC}\(", func.head[0]):
        raise SpecialiseError(f"unexpected declaration line of {KBLOCK_FUNC}: {func.head[0]!r}")
    reg_types = register_types(stmts)
    ins, outs = _piece_interface(body, epilogue, reg_types)
    return TemplateLayout(
        header=module.header, func_head=func.head, prologue=prologue, loop_label=loop_label,
        loop_body=body, epilogue=epilogue, labels=labels,
        reg_types=reg_types, entry_head=entry.head,
        entry_stmts=entry_stmts, entry_call=entry_stmts[c], entry_callseq=(open_at, close_at),
        fmas_per_weight=per_weight, ptx_lines=len(ptx.splitlines()),
        liveness=_body_liveness(body, epilogue, outs),  # a piece's outputs are read after its last copy
        body_other=sum(1 for it in body if not isinstance(it, _Fma)),
        piece_inputs=ins, piece_outputs=outs)


# --------------------------------------------------------------------------- the pass

class _Renamer:
    """regmap with materialisation: `alias[d] = r` means "read r where d is read".

    Inside the loop body `pos` is the body position being emitted and liveness
    says whether an alias is still read; elsewhere (pos None) every alias whose
    source is overwritten is materialised, which is always correct."""

    def __init__(self, reg_types: Dict[str, str], liveness: _BodyLiveness) -> None:
        self.alias: Dict[str, str] = {}
        self.aliased_by: Dict[str, Set[str]] = defaultdict(set)
        self.reg_types = reg_types
        self.liveness = liveness
        self.pos: Optional[int] = None

    def mov(self, dst: str, src: str, pred: str = "") -> str:
        return f"\t{pred}mov.{self.reg_types.get(reg_prefix(dst), 'b32')} {dst}, {src};"

    def rename(self, text: str) -> str:
        alias = self.alias
        return REG_RE.sub(lambda m: alias.get(m.group(0), m.group(0)), text)

    def before_write(self, reg: str, predicated: bool, out: List[str]) -> None:
        """`reg` is about to be written: registers still read through it get its
        old value first; its own alias ends (kept as a mov if the write may not
        happen)."""
        readers = self.aliased_by.pop(reg, None)
        if readers:
            live = readers if self.pos is None else self.liveness.still_read(readers, self.pos)
            for d in sorted(live):
                out.append(self.mov(d, reg))
            for d in readers:
                del self.alias[d]
        src = self.alias.pop(reg, None)
        if src is not None:
            self.aliased_by[src].discard(reg)
            if predicated:
                out.append(self.mov(reg, src))

    def end_of_copy(self) -> None:
        """Aliases of registers the next copy and the epilogue never read before
        writing them are dead: drop them, so later writes need not check them.
        Few are left (the loop state): aliased_by is rebuilt from them."""
        alias = self.alias
        kept = {d: alias[d] for d in alias.keys() & self.liveness.live_out}
        alias.clear()
        alias.update(kept)
        self.aliased_by.clear()
        for d, src in alias.items():
            self.aliased_by[src].add(d)

    def set_alias(self, d: str, src: str, out: List[str]) -> None:
        self.before_write(d, False, out)
        if src != d:
            self.alias[d] = src
            self.aliased_by[src].add(d)


def _emit(st: Stmt, ren: _Renamer, out: List[str], label_sfx: str, labels: Set[str]) -> None:
    if st.kind == "label":
        out.append(f"{st.text[:-1]}{label_sfx}:")
        return
    if st.kind != "instr":
        out.append(st.text)
        return
    srcs, pred = st.srcs, st.pred
    if ren.alias:
        srcs, pred = ren.rename(srcs), ren.rename(pred)
    if st.base_opcode == "bra" and srcs.strip() in labels:
        srcs = srcs.strip() + label_sfx
    for d in st.dest_regs():
        ren.before_write(d, bool(pred), out)
    ops = st.dest + (", " if st.dest and srcs else "") + srcs
    out.append(f"\t{pred}{st.opcode} {ops};")


# Where a copy's label suffix goes in text rendered once per template.
_SFX = "\x00"


@dataclass(frozen=True)
class _Text:
    """Statements no weight can change, rendered once per template: in a copy
    they read the same, bar the labels' suffix, joined in between the parts."""
    parts: Tuple[str, ...]

    def render(self, sfx: str) -> str:
        return sfx.join(self.parts)


@dataclass(frozen=True)
class _FmaRun:
    """Consecutive placeholder FMAs without a guard and with a register
    accumulator (all of them, from NVVM), as (body position, opcode, d, input,
    acc, weight index): the pass's innermost loop, kept to tuple unpacking."""
    fmas: Tuple[Tuple[int, str, str, str, str, int], ...]


@dataclass(frozen=True)
class _Load:
    """A shared load only placeholder FMAs read: a copy leaves it out when the
    weights of all those FMAs are 0."""
    text: _Text
    weights: Tuple[int, ...]


def _static_text(stmts: List[Stmt], ren: _Renamer, labels: Set[str]) -> _Text:
    """`stmts` rendered as _emit renders them with no alias about."""
    lines: List[str] = []
    for st in stmts:
        if _SFX in st.text:
            raise SpecialiseError("NUL character in a statement", st.line, st.text)
        _emit(st, ren, lines, _SFX, labels)
    return _Text(tuple("\n".join(lines).split(_SFX)) if lines else ())


def _copy_plan(items: List[object], ren: _Renamer, labels: Set[str], aliasable: Set[str],
               consumers: Dict[int, Tuple[int, ...]], in_body: bool) -> Tuple[object, ...]:
    """How the pass emits `items` (the loop body, or the epilogue after the last
    copy). A statement that reads and writes no register a deleted FMA's alias
    can involve (`aliasable`: FMA destinations and accumulators) comes out the
    same in every copy: runs of them become one _Text, a droppable load a
    _Load. Unguarded FMAs with a register accumulator become _FmaRuns. The
    rest stays (body position, item), handled one by one (position None
    outside the body)."""
    plan: List[object] = []
    texts: List[Stmt] = []
    fmas: List[Tuple[int, str, str, str, str, int]] = []

    def flush() -> None:
        if texts:
            plan.append(_static_text(texts, ren, labels))
            texts.clear()
        if fmas:
            plan.append(_FmaRun(tuple(fmas)))
            fmas.clear()

    for pos, it in enumerate(items):
        if isinstance(it, _Fma) and not it.pred and it.acc.startswith("%"):
            if texts:
                flush()
            fmas.append((pos, it.opcode, it.dest, it.input, it.acc, it.index))
            continue
        if fmas:
            flush()
        if isinstance(it, Stmt) and (it.kind != "instr" or aliasable.isdisjoint(it.dest_regs() + it.src_regs())):
            if pos in consumers:
                flush()
                plan.append(_Load(_static_text([it], ren, labels), consumers[pos]))
            else:
                texts.append(it)
            continue
        flush()
        plan.append((pos if in_body else None, it))
    flush()
    return tuple(plan)


def _special_registers(body_plan: Tuple[object, ...], aliasable: Set[str],
                       liveness: _BodyLiveness) -> FrozenSet[str]:
    """The registers (of `aliasable`) whose writes in a copy may find them
    aliased, or aliased to, and so need _Renamer.before_write: those written
    more than once in the body, those live into or out of a copy (aliases
    survive end_of_copy only for those), and those written by items the pass
    handles one by one. Any other register is written once per copy, by an
    FMA of a run, and is read only after that write: no alias can involve its
    old value. The pass adds, per copy, the registers the surviving aliases
    point to."""
    written = {r for r in aliasable if len(liveness.defs.get(r, ())) > 1} | (aliasable & liveness.live_out)
    for seg in body_plan:
        if type(seg) is tuple:
            item = seg[1]
            written.update([item.dest] if isinstance(item, _Fma) else item.dest_regs())
    return frozenset(written & aliasable)


def plan_pieces(costs: List[int], budget: int) -> List[Tuple[int, int]]:
    """Cut a k-block's chunk copies (estimated lines `costs`) into runs
    [j0, j1) of at most `budget` lines each (a chunk bigger than that alone):
    as few runs as greedy packing needs, then evened out (the smallest cap
    that still gives that many runs), so no piece is much bigger than another."""
    def greedy(cap: int) -> List[Tuple[int, int]]:
        runs, start, acc = [], 0, 0
        for j, c in enumerate(costs):
            if j > start and acc + c > cap:
                runs.append((start, j))
                start, acc = j, 0
            acc += c
        runs.append((start, len(costs)))
        return runs

    runs = greedy(budget)
    lo, hi = min(budget, -(-sum(costs) // len(runs))), budget
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= len(runs):
            hi = mid
        else:
            lo = mid + 1
    return greedy(lo)


def _emit_fma(ren: _Renamer, out: List[str], wb: int, pred: str, opcode: str, d: str, x: str, a: str) -> bool:
    """The FMA `[pred] opcode d, x, <weight>, a` with its weight's float32 bits
    `wb` put in as an immediate, or deleted when the weight is 0 (+-0): then d
    reads as a from here on. Returns whether it was deleted. The general form;
    _emit_chunks inlines the common one."""
    alias, aliased_by = ren.alias, ren.aliased_by
    acc = alias.get(a, a)
    # Fast path: d is neither an alias nor the source of one.
    clean = d not in alias and not aliased_by.get(d) and not pred
    if wb & 0x7FFFFFFF == 0:      # zero weight: delete, d becomes acc
        if pred or acc[0] != "%":
            ren.before_write(d, bool(pred), out)
            out.append(ren.mov(d, acc, ren.rename(pred)))
        elif clean and acc != d:
            alias[d] = acc
            aliased_by[acc].add(d)
        else:
            ren.set_alias(d, acc, out)
        return True
    x = alias.get(x, x)
    if not clean:
        pred = ren.rename(pred) if pred else ""
        ren.before_write(d, bool(pred), out)
    out.append(f"\t{pred}{opcode} {d}, {x}, 0f{wb:08X}, {acc};")
    return False


def _emit_chunks(layout: TemplateLayout, w_rows: np.ndarray, b: int, j0: int, j1: int, ren: "_Renamer",
                 out: List[str], counts: List[int]) -> None:
    """Copies j0..j1-1 of the loop body for output-channel block b, each with
    its chunk's weights (w_rows[j] in body order, as float32 bits)."""
    labels = layout.labels
    alias, aliased_by = ren.alias, ren.aliased_by
    consumers = layout.liveness.load_consumers
    n_fma = n_deleted = n_loads_dropped = 0
    for j in range(j0, j1):
        w_bits = w_rows[j].tolist()
        w_nonzero = (w_rows[j] & 0x7FFFFFFF).tolist()  # 0 for +-0
        csfx = f"_k{b}c{j}"
        out.append(f"\t// chunk {j} of output-channel block {b}")
        # Registers whose writes need before_write in this copy (_special_registers).
        special = layout.special.union(alias, alias.values())
        for seg in layout.body_plan:
            if type(seg) is _FmaRun:
                # Where the weights enter the PTX: each FMA gets its weight as an
                # immediate, or is deleted. _emit_fma does it for any FMA; here,
                # inlined, for those whose destination is not special, which
                # need none of its alias bookkeeping.
                n_fma += len(seg.fmas)
                for pos, opcode, d, x, a, wi in seg.fmas:
                    wb = w_bits[wi]
                    if d in special:  # may be an alias or aliased to: the general form
                        ren.pos = pos
                        n_deleted += _emit_fma(ren, out, wb, "", opcode, d, x, a)
                        continue
                    acc = alias.get(a, a)
                    if not wb & 0x7FFFFFFF:  # zero weight: delete, d becomes acc
                        n_deleted += 1
                        alias[d] = acc
                        if acc in special:  # only a write of a special register looks for its aliases
                            aliased_by[acc].add(d)
                        continue
                    out.append(f"\t{opcode} {d}, {alias.get(x, x)}, 0f{wb:08X}, {acc};")
                continue
            if type(seg) is _Text:
                out.append(seg.render(csfx))
                continue
            if type(seg) is _Load:
                if any(map(w_nonzero.__getitem__, seg.weights)):
                    out.append(seg.text.render(csfx))
                else:
                    n_loads_dropped += 1  # a load only zero-weight FMAs read
                continue
            pos, item = seg
            ren.pos = pos
            if isinstance(item, _Fma):
                n_fma += 1
                n_deleted += _emit_fma(ren, out, w_bits[item.index], item.pred, item.opcode, item.dest,
                                       item.input, item.acc)
                continue
            used_by = consumers.get(pos)
            if used_by is not None and not any(w_bits[i] & 0x7FFFFFFF for i in used_by):
                n_loads_dropped += 1
                continue  # a load only zero-weight FMAs read
            _emit(item, ren, out, csfx, labels)
        ren.end_of_copy()
    counts[0] += n_fma
    counts[1] += n_deleted
    counts[2] += n_loads_dropped
    counts[3] += (j1 - j0) * len(layout.loop_body)


_STATE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8, "pred": 4}
# Each piece reruns the prologue, which is fine only while it just computes.
_SIDE_EFFECTS = frozenset({"st", "bar", "barrier", "atom", "red", "call", "membar", "fence", "cp"})
STATE_SYMBOL = "sc_state"


class _PieceState:
    """Where a piece leaves the loop state for the next one: a static shared
    array, one column of `threads` slots per register (8-byte columns first),
    each thread at its own slot (bank-conflict free; only the thread that
    stored a slot reads it, so no barrier is needed). Predicates are stored as
    0/1 words."""

    def __init__(self, layout: TemplateLayout, threads: int) -> None:
        regs = dict.fromkeys(layout.piece_outputs + layout.piece_inputs)
        typed = [(r, layout.reg_types[reg_prefix(r)]) for r in regs]
        width = {r: _STATE_BYTES.get(t if t == "pred" else t[1:], 4) for r, t in typed}
        self.slot: Dict[str, Tuple[str, int, int]] = {}  # reg -> (type, width, column offset)
        off = 0
        for r, t in sorted(typed, key=lambda rt: -width[rt[0]]):  # stable: widest first
            self.slot[r] = (t, width[r], off)
            off += width[r] * threads
        self.bytes = off
        self.ins, self.outs = layout.piece_inputs, layout.piece_outputs

    def _bases(self) -> List[str]:
        widths = sorted({w for _, w, _ in self.slot.values()})
        out = ["\t.reg .b32 %sc_pw, " + ", ".join(f"%sc_s{w}" for w in widths) + ";"]
        for w in widths:
            out += [f"\tmov.u32 %sc_s{w}, %tid.x;", f"\tmul.lo.u32 %sc_s{w}, %sc_s{w}, {w};",
                    f"\tmov.u32 %sc_pw, {STATE_SYMBOL};", f"\tadd.u32 %sc_s{w}, %sc_s{w}, %sc_pw;"]
        return out

    def load(self) -> List[str]:
        out = ["\t// loop state from the previous piece", "\t{", *self._bases()]
        for r in self.ins:
            t, w, col = self.slot[r]
            if t == "pred":
                out += [f"\tld.shared.b32 %sc_pw, [%sc_s{w}+{col}];", f"\tsetp.ne.b32 {r}, %sc_pw, 0;"]
            else:
                out.append(f"\tld.shared.{t} {r}, [%sc_s{w}+{col}];")
        return out + ["\t}"]

    def store(self, ren: "_Renamer") -> List[str]:
        out = ["\t// loop state for the next piece", "\t{", *self._bases()]
        for r in self.outs:
            t, w, col = self.slot[r]
            src = ren.alias.get(r, r)
            if t == "pred":
                out += [f"\tselp.b32 %sc_pw, 1, 0, {src};", f"\tst.shared.b32 [%sc_s{w}+{col}], %sc_pw;"]
            else:
                out.append(f"\tst.shared.{t} [%sc_s{w}+{col}], {src};")
        return out + ["\t}"]


def _render_plain(st: Stmt) -> str:
    return st.render() if st.kind == "instr" else st.text


def specialise(template_ptx: str, rendered: RenderedTemplate, weight: np.ndarray,
               layout: Optional[TemplateLayout] = None,
               piece_lines: Optional[int] = None) -> Tuple[str, SpecialiseStats]:
    """The layer's PTX and what the pass did. `weight` is (K, C/groups, R, S) float32.
    `piece_lines` bounds the estimated PTX lines of chunk copies in one function
    (default MAX_PIECE_LINES; tests make it tiny to force splitting)."""
    shape, tiling = rendered.shape, rendered.tiling
    weight = np.asarray(weight, dtype=np.float32)
    if weight.shape != shape.weight_shape:
        raise ValueError(f"weight shape {weight.shape} does not match the layer's {shape.weight_shape}")
    if layout is None:
        layout = analyse_template(template_ptx, rendered)
    arranged = arrange_weights(weight, shape, tiling)
    bits = arranged.view(np.uint32)
    kblocks, chunks, _ = arranged.shape
    labels = layout.labels
    out: List[str] = list(layout.header)
    counts = [0, 0, 0, 0]  # placeholder FMAs visited, deleted, loads dropped, template lines visited
    budget = MAX_PIECE_LINES if piece_lines is None else piece_lines
    # Estimated lines of each chunk copy: the body's other statements plus its kept FMAs.
    cost = layout.body_other + np.count_nonzero(bits & 0x7FFFFFFF, axis=2) * layout.fmas_per_weight
    state = _PieceState(layout, tiling.threads)
    rerun_ok = not any(st.kind == "instr" and st.base_opcode in _SIDE_EFFECTS for st in layout.prologue)
    if state.bytes + patch_buffer_bytes(shape, tiling) > MAX_SHARED_BYTES or not rerun_ok:
        budget = 1 << 62  # the state does not fit next to the patch, or the prologue must run once: keep whole
    split: Dict[int, int] = {}  # k-block -> its number of pieces, where more than one
    epi_labels = {st.text[:-1] for st in layout.epilogue if st.kind == "label"}
    skip_labels = sorted({t for t in map(_branch_target, layout.prologue) if t in epi_labels})
    n_pieces = 0
    for b in range(kblocks):
        pieces = plan_pieces(cost[b].tolist(), budget)
        n_pieces += len(pieces)
        last = len(pieces) - 1
        if last:
            split[b] = len(pieces)
        for i, (j0, j1) in enumerate(pieces):
            name = f"{KBLOCK_FUNC}_{b}" + (f"_p{i}" if last else "")
            sfx = f"_k{b}" + (f"p{i}" if last else "")
            head = list(layout.func_head)
            head[0] = re.sub(rf"\b{KBLOCK_FUNC}\(", f"{name}(", head[0], count=1)
            out.extend(head)
            out.append("{")
            ren = _Renamer(layout.reg_types, layout.liveness)
            if layout.prologue_text.parts:  # no aliases yet: the same text in every piece
                out.append(layout.prologue_text.render(sfx))
            if i > 0:
                out.extend(state.load())
            _emit_chunks(layout, bits[b], b, j0, j1, ren, out, counts)
            ren.pos = None
            counts[3] += len(layout.prologue) + (len(layout.epilogue) if i == last else 0)
            if i < last:
                out.extend(state.store(ren))
                # The prologue's branch around the loop (taken only when n_chunks < 1)
                # targets an epilogue label: it lands on this piece's return instead.
                out.extend(f"{label}{sfx}:" for label in skip_labels)
                out.append("\tret;")
            else:
                for seg in layout.epilogue_plan:
                    if type(seg) is _Text:
                        out.append(seg.render(sfx))
                    else:
                        _emit(seg[1], ren, out, sfx, labels)  # reads or writes an aliased register
            out.append("}")
            out.append("")
    if split:  # one array for every piece of every k-block (a block runs one k-block)
        out.insert(len(layout.header), f".weak .shared .align 16 .b8 {STATE_SYMBOL}[{state.bytes}];")
    n_fma, n_deleted, n_loads_dropped, n_visited = counts

    # Entry: a jump table on blockIdx.y picks one copy of the call sequence
    # (one per piece, in order, where the k-block is split).
    # The whole `{ .param ...; st.param ...; call ...; }` block is copied per
    # call: ptxas lowers parameter passing per call site, so param stores
    # shared by several calls are not seen by them (measured: garbage pointers).
    entry = layout.entry_stmts
    open_at, close_at = layout.entry_callseq
    out.extend(layout.entry_head)
    out.append("{")
    out.extend(_render_plain(st) for st in entry[:open_at])
    out.append("\t.reg .b32 %sc_kb;")
    out.append("\tmov.u32 %sc_kb, %ctaid.y;")
    out.append(f"\t$sc_targets: .branchtargets {', '.join(f'$sc_kb_{b}' for b in range(kblocks))};")
    out.append("\tbrx.idx.uni %sc_kb, $sc_targets;")
    call_re = re.compile(rf"\b{KBLOCK_FUNC}\b(?!_)")
    for b in range(kblocks):
        out.append(f"$sc_kb_{b}:")
        names = [f"{KBLOCK_FUNC}_{b}_p{i}" for i in range(split[b])] if b in split else [f"{KBLOCK_FUNC}_{b}"]
        for name in names:
            for st in entry[open_at:close_at + 1]:
                text = _render_plain(st)
                if st is layout.entry_call:
                    text = call_re.sub(name, text, count=1)
                out.append(text)
        out.append("\tbra.uni $sc_done;")
    out.append("$sc_done:")
    out.extend(_render_plain(st) for st in entry[close_at + 1:])
    out.append("}")
    out.append("")

    # Deleted FMAs must be exactly the zero weights (padding included) times
    # the FMAs each weight feeds.
    zeros = int(np.count_nonzero((bits & 0x7FFFFFFF) == 0))
    if n_deleted != zeros * layout.fmas_per_weight:
        raise SpecialiseError(f"deleted {n_deleted} FMAs but the weights have {zeros} zeros x "
                              f"{layout.fmas_per_weight} FMAs each")
    if n_fma != arranged.size * layout.fmas_per_weight:
        raise SpecialiseError(f"visited {n_fma} placeholder FMAs, expected {arranged.size * layout.fmas_per_weight}")
    text = "\n".join(out)
    stats = SpecialiseStats(
        kblocks=kblocks, chunks=chunks, pieces=n_pieces, weights=int(weight.size),
        nonzero_weights=int(np.count_nonzero(weight)), fmas_per_weight=layout.fmas_per_weight,
        fmas_before=n_fma, fmas_deleted=n_deleted, fmas_kept=n_fma - n_deleted, loads_dropped=n_loads_dropped,
        ptx_lines_template=layout.ptx_lines, ptx_lines_visited=n_visited, ptx_lines=text.count("\n") + 1)
    return text, stats
