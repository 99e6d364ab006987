"""Piece planning: cutting a k-block's chunk copies into bounded functions,
and the loop state those functions hand on through shared memory.

A k-block function's chunk copies grow with C (a 512-channel VGG layer: 256
copies, ~100K lines), and ptxas time per copy grows with the function's
length. plan_pieces cuts them into runs of consecutive chunks of at most
MAX_PIECE_LINES estimated lines; PieceState lays out the loop state (the
analysis' piece interface) in a shared array: static while it fits beside the
input patch in the 48 KB a block gets without opting in, else in dynamic
shared memory after the patch, up to what the target lets a kernel opt in to
(Target.max_shared_bytes). The emitter (emit.py) writes the pieces.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..ptx import reg_prefix
from ..shapes import MAX_PATCH_BYTES
from .analysis import TemplateLayout

# Bound on the estimated PTX lines of chunk copies in one function (see the
# module docstring). ptxas time per line grows with a function's length
# (2-core machine, ptxas 13.0 -O3: ~50 us a line at 5K lines, 76 at 41K;
# bench/ptxas_scaling.py). But every piece costs the kernel a call, its
# prologue, the ABI's register saves and the state hand-over, ~400
# instructions, and at batch 64 the deep layers wait on instruction fetch.
# VGG-16's 512-channel batch-64 k-blocks (~41K lines), H100 and 2-core
# machine, session 28 (docs/PERFORMANCE.md):
#   8K pieces (6 a k-block):  build 179 -> 151 s, those layers +7 to +8.5%
#   24K pieces (2 a k-block): build 179 -> 167 s, those layers 0 to +2%
# (run times measured with each piece's chunk counters resumed as constants, not
# handed on: analysis._piece_steps). 24K also cut ResNet-50's layer4 3x3
# k-blocks (~26K lines) in two, +2-4% at batch 64 for little build time, so
# the bound sits between 26K and 41K: no ResNet-50 variant is cut. 28K, which
# cuts VGG-16's wave-fitted conv5_x k-blocks (~30K) in two, took 24 s of ptxas
# off them but none off the 2-core cold build (session 51).
MAX_PIECE_LINES = 32_000
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



def piece_budget(layout: TemplateLayout, state: "PieceState", piece_lines: Optional[int] = None) -> int:
    """Estimated lines of chunk copies one function may hold: `piece_lines`
    (default MAX_PIECE_LINES), or no bound (k-blocks stay whole) when the loop
    state fits nowhere in shared memory (PieceState.fits), or when the
    prologue, which every piece reruns, does more than compute."""
    rerun_ok = not any(st.kind == "instr" and st.base_opcode in _SIDE_EFFECTS for st in layout.prologue)
    if not state.fits or not rerun_ok:
        return 1 << 62
    return MAX_PIECE_LINES if piece_lines is None else piece_lines

_STATE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8, "pred": 4}
# Each piece reruns the prologue, which is fine only while it just computes.
_SIDE_EFFECTS = frozenset({"st", "bar", "barrier", "atom", "red", "call", "membar", "fence", "cp"})
STATE_SYMBOL = "sc_state"


class PieceState:
    """Where a piece leaves the loop state for the next one: a shared array,
    one column of `threads` slots per register (8-byte columns first), each
    thread at its own slot (bank-conflict free; only the thread that stored a
    slot reads it, so no barrier is needed). Predicates are stored as 0/1 words.

    The array is static (`.weak .shared`) while it fits beside the kernel's
    dynamic shared memory (`patch_bytes`: input patches, a cluster sum's
    partial tile) in the 48 KB every kernel may use. Past that it goes after
    the patch in dynamic shared memory (`.extern .shared`, at `base`), and the
    kernel must be launched with `launch_bytes` and opt in to them above 48 KB
    (runtime.allow_shared_bytes). VGG-16's 512-channel layers at batch 64 need
    this: 66 registers x 512 threads x 4 bytes = 132 KB. `fits` is False when
    even that exceeds `max_shared_bytes` (what the target allows; by default
    the 48 KB): then k-blocks stay whole."""

    def __init__(self, layout: TemplateLayout, threads: int, patch_bytes: int = 0,
                 max_shared_bytes: Optional[int] = None) -> None:
        self.steps = dict(layout.piece_steps)  # recomputed by each piece (resume), not handed on
        regs = {r: None for r in layout.piece_outputs + layout.piece_inputs if r not in self.steps}
        typed = [(r, layout.reg_types[reg_prefix(r)]) for r in regs]
        width = {r: _STATE_BYTES.get(t if t == "pred" else t[1:], 4) for r, t in typed}
        self.slot: Dict[str, Tuple[str, int, int]] = {}  # reg -> (type, width, column offset)
        off = 0
        for r, t in sorted(typed, key=lambda rt: -width[rt[0]]):  # stable: widest first
            self.slot[r] = (t, width[r], off)
            off += width[r] * threads
        self.bytes = off
        self.ins = tuple(r for r in layout.piece_inputs if r not in self.steps)
        self.outs = tuple(r for r in layout.piece_outputs if r not in self.steps)
        self._step_types = {r: layout.reg_types[reg_prefix(r)] for r in self.steps}
        limit = MAX_SHARED_BYTES if max_shared_bytes is None else max(max_shared_bytes, MAX_SHARED_BYTES)
        self.dynamic = self.bytes + patch_bytes > MAX_SHARED_BYTES
        self.base = -(-patch_bytes // 16) * 16 if self.dynamic else 0   # 8-byte columns stay aligned
        self.launch_bytes = self.base + self.bytes if self.dynamic else patch_bytes
        self.fits = self.launch_bytes <= limit

    def declaration(self) -> str:
        """The array's module-level declaration (every extern shared array
        starts where dynamic shared memory does, so the dynamic one is
        addressed at `base`)."""
        if self.dynamic:
            return f".extern .shared .align 16 .b8 {STATE_SYMBOL}[];"
        return f".weak .shared .align 16 .b8 {STATE_SYMBOL}[{self.bytes}];"

    def _bases(self) -> List[str]:
        widths = sorted({w for _, w, _ in self.slot.values()})
        out = ["\t.reg .b32 %sc_pw, " + ", ".join(f"%sc_s{w}" for w in widths) + ";"]
        for w in widths:
            out += [f"\tmov.u32 %sc_s{w}, %tid.x;", f"\tmul.lo.u32 %sc_s{w}, %sc_s{w}, {w};",
                    f"\tmov.u32 %sc_pw, {STATE_SYMBOL};", f"\tadd.u32 %sc_s{w}, %sc_s{w}, %sc_pw;"]
        return out

    def load(self) -> List[str]:
        if not self.ins:  # everything carried is stepped (resume)
            return []
        out = ["\t// loop state from the previous piece", "\t{", *self._bases()]
        for r in self.ins:
            t, w, col = self.slot[r]
            col += self.base
            if t == "pred":
                out += [f"\tld.shared.b32 %sc_pw, [%sc_s{w}+{col}];", f"\tsetp.ne.b32 {r}, %sc_pw, 0;"]
            else:
                out.append(f"\tld.shared.{t} {r}, [%sc_s{w}+{col}];")
        return out + ["\t}"]

    def resume(self, first_chunk: int) -> List[str]:
        """The stepped registers (analysis._piece_steps) of a piece whose first
        copy is chunk `first_chunk`: the prologue's value plus first_chunk steps,
        wrapped as the adds would wrap, a constant ptxas can fold."""
        out = []
        for r, step in self.steps.items():
            bits = 64 if self._step_types[r].endswith("64") else 32
            total = first_chunk * step % (1 << bits)
            if total >= 1 << (bits - 1):
                total -= 1 << bits
            out.append(f"\tadd.s{bits} {r}, {r}, {total};")
        return out

    def store(self, alias: Dict[str, str]) -> List[str]:
        """`alias`: the emitter's register aliases (a deleted FMA's destination reads its accumulator)."""
        if not self.outs:
            return []
        out = ["\t// loop state for the next piece", "\t{", *self._bases()]
        for r in self.outs:
            t, w, col = self.slot[r]
            col += self.base
            src = alias.get(r, r)
            if t == "pred":
                out += [f"\tselp.b32 %sc_pw, 1, 0, {src};", f"\tst.shared.b32 [%sc_s{w}+{col}], %sc_pw;"]
            else:
                out.append(f"\tst.shared.{t} [%sc_s{w}+{col}], {src};")
        return out + ["\t}"]
