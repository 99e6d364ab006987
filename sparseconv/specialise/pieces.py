"""Piece planning: cutting a k-block's chunk copies into bounded functions,
and the loop state those functions hand on through shared memory.

A k-block function's chunk copies grow with C (a 512-channel VGG layer: 256
copies, ~100K lines), and ptxas time per copy grows with the function's
length. plan_pieces cuts them into runs of consecutive chunks of at most
MAX_PIECE_LINES estimated lines; PieceState lays out the loop state (the
analysis' piece interface) in a static shared array. The emitter (emit.py)
writes the pieces.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..ptx import reg_prefix
from ..shapes import MAX_PATCH_BYTES, ConvShape, Tiling, dynamic_shared_bytes
from .analysis import TemplateLayout

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
# a k-block is split, the loop state its pieces hand on (see PieceState).
MAX_SHARED_BYTES = MAX_PATCH_BYTES


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



def piece_budget(layout: TemplateLayout, state: "PieceState", shape: ConvShape, tiling: Tiling,
                 piece_lines: Optional[int] = None) -> int:
    """Estimated lines of chunk copies one function may hold: `piece_lines`
    (default MAX_PIECE_LINES), or no bound (k-blocks stay whole) when the loop
    state would not fit in shared memory next to the dynamic shared memory
    (input patches, a cluster sum's partial tile), or when the prologue,
    which every piece reruns, does more than compute."""
    rerun_ok = not any(st.kind == "instr" and st.base_opcode in _SIDE_EFFECTS for st in layout.prologue)
    if state.bytes + dynamic_shared_bytes(shape, tiling) > MAX_SHARED_BYTES or not rerun_ok:
        return 1 << 62
    return MAX_PIECE_LINES if piece_lines is None else piece_lines

_STATE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8, "pred": 4}
# Each piece reruns the prologue, which is fine only while it just computes.
_SIDE_EFFECTS = frozenset({"st", "bar", "barrier", "atom", "red", "call", "membar", "fence", "cp"})
STATE_SYMBOL = "sc_state"


class PieceState:
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

    def store(self, alias: Dict[str, str]) -> List[str]:
        """`alias`: the emitter's register aliases (a deleted FMA's destination reads its accumulator)."""
        out = ["\t// loop state for the next piece", "\t{", *self._bases()]
        for r in self.outs:
            t, w, col = self.slot[r]
            src = alias.get(r, r)
            if t == "pred":
                out += [f"\tselp.b32 %sc_pw, 1, 0, {src};", f"\tst.shared.b32 [%sc_s{w}+{col}], %sc_pw;"]
            else:
                out.append(f"\tst.shared.{t} [%sc_s{w}+{col}], {src};")
        return out + ["\t}"]
