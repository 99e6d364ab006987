"""Template analysis: the template PTX -> TemplateLayout, the parts of the
k-block function the specialiser copies, checked against the invariants the
pass relies on (one chunk loop around every placeholder FMA, no branch in or
out of it, each weight feeding `outputs per thread` FMAs), plus what the
emitter and the piece planner need to know about the loop body:

* BodyLiveness: where each register is read and written in the body, so the
  emitter can tell whether an aliased register is still read later;
* the piece interface (_piece_interface): the loop state a function holding
  some chunk copies must take over and hand on, by dataflow over the body and
  the epilogue.

It knows nothing about how the layer's PTX is written (emit.py) or cut into
pieces (pieces.py).
"""
from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from ..ptx import (REG_RE, PtxParseError, Stmt, f32_immediate_bits, parse_module, parse_statements,
                   reg_prefix, register_types, split_operands)
from ..render import ENTRY_NAME, KBLOCK_FUNC, RenderedTemplate, body_index


class SpecialiseError(RuntimeError):
    """The template PTX broke an invariant of the pass. Carries the PTX line."""

    def __init__(self, message: str, line: Optional[int] = None, text: str = "") -> None:
        where = f" (template PTX line {line}: {text.strip()!r})" if line else ""
        super().__init__(message + where)
        self.line = line


@dataclass(frozen=True)
class PlaceholderFma:
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
    loop_body: List[object]      # Stmt or PlaceholderFma, in order
    epilogue: List[Stmt]
    labels: Set[str]             # labels defined in the function
    reg_types: Dict[str, str]    # register prefix -> PTX type
    entry_head: List[str]
    entry_stmts: List[Stmt]
    entry_call: Stmt
    entry_callseq: Tuple[int, int]  # indices of the '{' and '}' around the call
    fmas_per_weight: int
    ptx_lines: int
    liveness: "BodyLiveness"
    body_other: int              # body items that are not placeholder FMAs (lines of a copy, FMAs aside)
    piece_inputs: Tuple[str, ...]   # loop-carried: written by a copy, live at its start (a piece loads them)
    piece_outputs: Tuple[str, ...]  # written by a copy and live after it (a piece stores them)
    # Loop-carried registers a copy only steps by a constant (the chunk counter,
    # the channel index): (register, step). A piece does not hand these on; it
    # recomputes them from the prologue's value (pieces.PieceState.resume).
    piece_steps: Tuple[Tuple[str, int], ...] = ()


@dataclass(frozen=True)
class BodyLiveness:
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


def _body_liveness(body: List[object], epilogue: List[Stmt], extra_live: Tuple[str, ...] = ()) -> BodyLiveness:
    reads: Dict[str, List[int]] = defaultdict(list)
    defs: Dict[str, List[int]] = defaultdict(list)
    fma_reads: Dict[str, List[Tuple[int, int]]] = defaultdict(list)  # reg -> (pos, weight index)
    upward: Set[str] = set()
    for pos, item in enumerate(body):
        if isinstance(item, PlaceholderFma):
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
    return BodyLiveness(dict(reads), dict(defs), live_out, consumers)


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
            if isinstance(it, PlaceholderFma):
                srcs, dests, pred = [it.input, it.acc] + REG_RE.findall(it.pred), [it.dest], it.pred
            elif it.kind == "instr":
                srcs, dests, pred = it.src_regs(), it.dest_regs(), it.pred
                if it.base_opcode in ("ret", "exit") and not pred:
                    self.succ[i] = ()
                tgt = branch_target(it)
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
        if isinstance(it, PlaceholderFma):
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


_STEP_RE = re.compile(r"add\.[su](32|64)")
_MOV_RE = re.compile(r"mov\.[bsu](32|64)")


def _piece_steps(body: List[object], inputs: Tuple[str, ...]) -> Tuple[Tuple[str, int], ...]:
    """Those of the loop-carried `inputs` that a copy of the body only steps by
    a constant: at the copy's end the register holds its value at the copy's
    start plus `step`, through unguarded `add.{s,u}{32,64}` of an integer and
    `mov`s alone (the direct family's counter goes `add t, r, 1; ...; mov r, t`).
    After c copies it holds the loop's start value plus c * step (mod 2^bits,
    as the adds wrap). A piece starting at chunk j0 then sets it to the
    prologue's value plus j0 * step, a constant ptxas folds into every address
    computed from it. Loaded from shared memory instead, the value is unknown
    to ptxas, which then computes each load's address at run time: ~1 integer
    multiply a load, +26% of a VGG-16 512-channel k-block's instructions cut
    into 6 pieces, and +25-38% of its run time at batch 64 (docs/PERFORMANCE.md,
    session 28)."""
    value: Dict[str, Tuple[str, int]] = {}  # register -> (a register's value at the copy's start, + offset)
    written: Set[str] = set()

    def known(reg: str) -> Optional[Tuple[str, int]]:
        return value.get(reg, (reg, 0) if reg not in written else None)

    for it in body:
        if isinstance(it, PlaceholderFma):
            dests = [it.dest]
            tracked = None
        elif it.kind == "instr":
            dests = it.dest_regs()
            ops = it.operands()
            tracked = None
            if not it.pred and len(dests) == 1:
                if _STEP_RE.fullmatch(it.opcode) and len(ops) == 3 and re.fullmatch(r"-?\d+", ops[2]):
                    src = known(ops[1])
                    tracked = (src[0], src[1] + int(ops[2])) if src else None
                elif _MOV_RE.fullmatch(it.opcode) and len(ops) == 2 and REG_RE.fullmatch(ops[1]):
                    tracked = known(ops[1])
        else:
            continue
        for d in dests:
            written.add(d)
            value.pop(d, None)
        if tracked is not None:
            value[dests[0]] = tracked
    return tuple((r, value[r][1]) for r in inputs if r in value and value[r][0] == r)


def branch_target(st: Stmt) -> Optional[str]:
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

    def placeholder_fma(st: Stmt) -> Optional[PlaceholderFma]:
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
        return PlaceholderFma(st.pred, st.opcode, st.dest, ops[1 - wp], ops[2], index, st.line)

    fma_at = {i: f for i, f in ((i, placeholder_fma(st)) for i, st in enumerate(stmts)) if f is not None}
    if not fma_at:
        raise SpecialiseError("no placeholder FMA found in the template PTX")
    first, last = min(fma_at), max(fma_at)
    # The chunk loop: a label before the first placeholder FMA, closed by a
    # branch back to it after the last. (NVVM marks it `.pragma "nounroll"`,
    # but drops the mark once the body holds cp.async, so it is no anchor.)
    branches_after: Dict[str, int] = {}
    for j in range(last + 1, len(stmts)):
        tgt = branch_target(stmts[j])
        if tgt is not None:
            branches_after[tgt] = j
    enclosing = [(i, branches_after[st.text[:-1]], st.text[:-1]) for i, st in enumerate(stmts[:first])
                 if st.kind == "label" and st.text[:-1] in branches_after]
    if len(enclosing) != 1:
        raise SpecialiseError(f"expected one loop around all placeholder FMAs, found {len(enclosing)} "
                              "(did NVVM unroll the chunk loop? see compile.NVCC_FLAGS)")
    start, end, loop_label = enclosing[0]
    back_edge = stmts[end]

    labels = {st.text[:-1] for st in stmts if st.kind == "label"}
    inner_labels = {st.text[:-1] for st in stmts[start + 1:end] if st.kind == "label"}
    for i, st in enumerate(stmts):
        tgt = branch_target(st)
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
        body_other=sum(1 for it in body if not isinstance(it, PlaceholderFma)),
        piece_inputs=ins, piece_outputs=outs, piece_steps=_piece_steps(body, ins))
