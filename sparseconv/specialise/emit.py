"""The emitter: the template PTX + a layer's real weights -> the layer's PTX.

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
          <load the loop state from sc_state,       (not in the first piece)
           step the counters to chunk j0>
          <chunk copies j0 .. j1-1, exactly as above>
          <store the loop state to sc_state; ret>   (the last piece: the epilogue)
      }

  The loop state is the registers the body writes that are live across a
  copy boundary (accumulators, the chunk counter), found once per template by
  dataflow over the body and the epilogue (analysis._piece_interface). Those a
  copy only steps by a constant (the chunk counter, the channel index) are not
  handed on: each piece adds j0 steps to the prologue's value, a constant
  ptxas folds into the load addresses (analysis._piece_steps). The rest goes through
  a shared array `sc_state`, one column of `threads` slots per
  register, each thread reading back only its own slots (pieces.PieceState), not
  through call parameters: the ABI passes big parameter lists on the stack,
  and that made split layers 1.1-1.8x slower on the H100, against 1.0-1.07x
  this way. Past the 48 KB a kernel may use without opting in, the array
  moves to dynamic shared memory after the input patch (VGG-16's deep
  batch-64 layers: 132 KB of state). The entry's jump table calls a split
  k-block's pieces in order, each call in its own copy of the call sequence.
  Small layers (one piece per k-block) get exactly the unsplit function; so
  does a layer whose state would not fit even there (Target.max_shared_bytes).

Speed (issue 3 asks for 500K PTX lines a second): the pass touches every
placeholder FMA of every copy, so the per-template work is done once, in
the EmissionPlan: statements no weight can change are rendered to text once and
copied with their label suffix (_copy_plan), and FMAs whose destination no
alias can involve skip the alias bookkeeping (_special_registers). The output
is the same as handling every statement and FMA one by one (tests check it).

The template's shape is checked by analysis.analyse_template (each placeholder
used by exactly `outputs per thread` FMAs of the body, none outside the loop
body, the loop has the expected shape); here, deleted FMAs must equal zero
weights x multiplicity, or SpecialiseError is raised.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np

from ..ptx import REG_RE, Stmt, reg_prefix
from ..render import KBLOCK_FUNC, RenderedTemplate
from .analysis import (BodyLiveness, PlaceholderFma, SpecialiseError, TemplateLayout, analyse_template,
                       branch_target)
from ..shapes import dynamic_shared_bytes
from .pieces import PieceState, piece_budget, plan_pieces
from .weights import arrange_weights


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
    launch_shared_bytes: int   # dynamic shared memory to launch with: the patch, and a split's state past 48 KB

    def as_dict(self) -> dict:
        return asdict(self)


class _Renamer:
    """regmap with materialisation: `alias[d] = r` means "read r where d is read".

    Inside the loop body `pos` is the body position being emitted and liveness
    says whether an alias is still read; elsewhere (pos None) every alias whose
    source is overwritten is materialised, which is always correct."""

    def __init__(self, reg_types: Dict[str, str], liveness: BodyLiveness) -> None:
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
        if isinstance(it, PlaceholderFma) and not it.pred and it.acc.startswith("%"):
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
                       liveness: BodyLiveness) -> FrozenSet[str]:
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
            written.update([item.dest] if isinstance(item, PlaceholderFma) else item.dest_regs())
    return frozenset(written & aliasable)


@dataclass(frozen=True)
class EmissionPlan:
    """How the pass emits each part of a template, worked out once per layout:
    statements no weight can change pre-rendered (_copy_plan), and the
    registers whose writes need the alias bookkeeping (_special_registers)."""
    prologue_text: _Text
    body_plan: Tuple[object, ...]
    epilogue_plan: Tuple[object, ...]
    special: FrozenSet[str]


def emission_plan(layout: TemplateLayout) -> EmissionPlan:
    fmas = [it for it in layout.loop_body if isinstance(it, PlaceholderFma)]
    aliasable = {f.dest for f in fmas} | {f.acc for f in fmas if f.acc.startswith("%")}
    ren = _Renamer(layout.reg_types, layout.liveness)  # no aliases yet: statements as they stand
    body_plan = _copy_plan(layout.loop_body, ren, layout.labels, aliasable, layout.liveness.load_consumers,
                           in_body=True)
    return EmissionPlan(prologue_text=_static_text(layout.prologue, ren, layout.labels), body_plan=body_plan,
                        epilogue_plan=_copy_plan(layout.epilogue, ren, layout.labels, aliasable, {},
                                                 in_body=False),
                        special=_special_registers(body_plan, aliasable, layout.liveness))


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


def _emit_chunks(layout: TemplateLayout, plan: EmissionPlan, w_rows: np.ndarray, b: int, j0: int, j1: int,
                 ren: "_Renamer", out: List[str], counts: List[int]) -> None:
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
        special = plan.special.union(alias, alias.values())
        for seg in plan.body_plan:
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
            if isinstance(item, PlaceholderFma):
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


def _render_plain(st: Stmt) -> str:
    return st.render() if st.kind == "instr" else st.text


def specialise(template_ptx: str, rendered: RenderedTemplate, weight: np.ndarray,
               layout: Optional[TemplateLayout] = None, piece_lines: Optional[int] = None,
               max_shared_bytes: Optional[int] = None) -> Tuple[str, SpecialiseStats]:
    """The layer's PTX and what the pass did. `weight` is (K, C/groups, R, S) float32.
    `piece_lines` bounds the estimated PTX lines of chunk copies in one function
    (default MAX_PIECE_LINES; tests make it tiny to force splitting).
    `max_shared_bytes`: the shared memory the kernel may opt in to
    (Target.max_shared_bytes; default 48 KB, no opt-in), which bounds where a
    split k-block's loop state may go (pieces.PieceState). The kernel is
    launched with stats.launch_shared_bytes of dynamic shared memory."""
    shape, tiling = rendered.shape, rendered.tiling
    weight = np.asarray(weight, dtype=np.float32)
    if weight.shape != shape.weight_shape:
        raise ValueError(f"weight shape {weight.shape} does not match the layer's {shape.weight_shape}")
    if layout is None:
        layout = analyse_template(template_ptx, rendered)
    plan = emission_plan(layout)
    arranged = arrange_weights(weight, shape, tiling)
    bits = arranged.view(np.uint32)
    kblocks, chunks, _ = arranged.shape
    labels = layout.labels
    out: List[str] = list(layout.header)
    counts = [0, 0, 0, 0]  # placeholder FMAs visited, deleted, loads dropped, template lines visited
    # Estimated lines of each chunk copy: the body's other statements plus its kept FMAs.
    cost = layout.body_other + np.count_nonzero(bits & 0x7FFFFFFF, axis=2) * layout.fmas_per_weight
    patch_bytes = dynamic_shared_bytes(shape, tiling)
    state = PieceState(layout, tiling.threads, patch_bytes, max_shared_bytes)
    budget = piece_budget(layout, state, piece_lines)
    split: Dict[int, int] = {}  # k-block -> its number of pieces, where more than one
    epi_labels = {st.text[:-1] for st in layout.epilogue if st.kind == "label"}
    skip_labels = sorted({t for t in map(branch_target, layout.prologue) if t in epi_labels})
    n_pieces = 0
    for b in range(kblocks):
        runs = plan_pieces(cost[b].tolist(), budget)
        n_pieces += len(runs)
        last = len(runs) - 1
        if last:
            split[b] = len(runs)
        for i, (j0, j1) in enumerate(runs):
            name = f"{KBLOCK_FUNC}_{b}" + (f"_p{i}" if last else "")
            sfx = f"_k{b}" + (f"p{i}" if last else "")
            head = list(layout.func_head)
            head[0] = re.sub(rf"\b{KBLOCK_FUNC}\(", f"{name}(", head[0], count=1)
            out.extend(head)
            out.append("{")
            ren = _Renamer(layout.reg_types, layout.liveness)
            if plan.prologue_text.parts:  # no aliases yet: the same text in every piece
                out.append(plan.prologue_text.render(sfx))
            if i > 0:
                out.extend(state.load())
                out.extend(state.resume(j0))
            _emit_chunks(layout, plan, bits[b], b, j0, j1, ren, out, counts)
            ren.pos = None
            counts[3] += len(layout.prologue) + (len(layout.epilogue) if i == last else 0)
            if i < last:
                out.extend(state.store(ren.alias))
                # The prologue's branch around the loop (taken only when n_chunks < 1)
                # targets an epilogue label: it lands on this piece's return instead.
                out.extend(f"{label}{sfx}:" for label in skip_labels)
                out.append("\tret;")
            else:
                for seg in plan.epilogue_plan:
                    if type(seg) is _Text:
                        out.append(seg.render(sfx))
                    else:
                        _emit(seg[1], ren, out, sfx, labels)  # reads or writes an aliased register
            out.append("}")
            out.append("")
    if split and state.bytes:  # one array for every piece of every k-block (a block runs one k-block)
        out.insert(len(layout.header), state.declaration())
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
        ptx_lines_template=layout.ptx_lines, ptx_lines_visited=n_visited, ptx_lines=text.count("\n") + 1,
        launch_shared_bytes=state.launch_bytes if split else patch_bytes)
    return text, stats
