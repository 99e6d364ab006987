"""CPU: the pieces a big k-block function is cut into (sparseconv.specialise.pieces).

The numerics of split layers are checked in test_numeric_cpu.py and ptxas
acceptance in test_specialise.py; here: how chunks are cut, and the loop
state handed from piece to piece on its own, predicates included."""
import dataclasses
import types

import numpy as np
import pytest

from sparseconv.ptx import Stmt
from sparseconv.assemble import assemble_cubin
from sparseconv.shapes import Target
from sparseconv.specialise import STATE_SYMBOL, analyse_template, pieces, plan_pieces, specialise
from sparseconv.specialise.pieces import PieceState

from ptx_interpreter import run_kernel


@pytest.mark.parametrize("costs, budget, want", [
    ([10] * 10, 1000, [(0, 10)]),                      # fits: one piece
    ([10] * 10, 50, [(0, 5), (5, 10)]),
    ([10] * 10, 35, [(0, 3), (3, 6), (6, 9), (9, 10)]),  # 4 pieces either way, none over 30
    ([40, 60], 1, [(0, 1), (1, 2)]),                    # tiny budget: one chunk each
    ([5, 50, 5, 5, 5], 20, [(0, 1), (1, 2), (2, 5)]),  # a chunk over budget stands alone
    ([1, 1, 1, 1, 1, 1, 1, 10], 12, [(0, 7), (7, 8)]),  # the smallest cap for 2 pieces is 10
])
def test_plan_pieces(costs, budget, want):
    got = plan_pieces(costs, budget)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(costs)
    assert all(a < b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))
    assert all(sum(costs[a:b]) <= max(budget, max(costs[a:b])) for a, b in got)


def test_plan_pieces_bounds_every_piece():
    rng = np.random.default_rng(0)
    for _ in range(200):
        costs = rng.integers(1, 100, rng.integers(1, 60)).tolist()
        budget = int(rng.integers(1, 800))
        got = plan_pieces(costs, budget)
        assert [c for a, b in got for c in costs[a:b]] == costs
        assert all(sum(costs[a:b]) <= budget or b - a == 1 for a, b in got)
        assert len(got) == len(plan_pieces(costs, budget))  # deterministic


def fake_layout(inputs, outputs):
    return types.SimpleNamespace(piece_inputs=inputs, piece_outputs=outputs,
                                 reg_types={"%p": "pred", "%r": "b32", "%rd": "b64", "%f": "f32"})


def test_piece_state_round_trips_registers_and_predicates():
    """What one piece stores, the next loads: f32, 64-bit and predicate
    registers (as 0/1 words), each thread in its own slot of the shared array
    (interpreter, and ptxas + nvlink)."""
    layout = fake_layout(("%p1", "%f1", "%rd2"), ("%p1", "%f1", "%rd2", "%r1"))
    state = PieceState(layout, threads=8)
    assert state.bytes == 8 * (8 + 4 + 4 + 4)
    assert state.slot["%rd2"][2] == 0  # 8-byte column first, 8-byte aligned
    alias = {"%f1": "%f3"}  # %f1 reads %f3 (a deleted FMA's alias)
    ptx = "\n".join([
        ".version 9.0", ".target sm_90", ".address_size 64",
        f".weak .shared .align 16 .b8 {STATE_SYMBOL}[{state.bytes}];",
        ".visible .entry k(.param .u64 y)", "{",
        "\t.reg .pred %p<4>;", "\t.reg .b32 %r<4>;", "\t.reg .b64 %rd<4>;", "\t.reg .f32 %f<4>;",
        "\tld.param.u64 %rd1, [y];", "\tcvta.to.global.u64 %rd1, %rd1;",
        "\tmov.u32 %r1, %tid.x;", "\tsetp.lt.u32 %p1, %r1, 3;", "\tcvt.rn.f32.u32 %f3, %r1;",
        "\tmul.wide.u32 %rd2, %r1, 4;",
        *state.store(alias),
        "\tsetp.lt.u32 %p1, %r1, 0;", "\tmov.f32 %f1, 0f00000000;", "\tmov.u64 %rd2, 0;",  # clobber
        *state.load(),
        "\tmov.f32 %f2, %f1;",
        "\t@%p1 add.f32 %f2, %f2, 0f42C80000;",  # + 100 where tid < 3
        "\tadd.s64 %rd3, %rd1, %rd2;", "\tst.global.f32 [%rd3], %f2;", "\tret;", "}", ""])
    y = np.zeros(8, np.float32)
    run_kernel(ptx, "k", grid=(1, 1, 1), block=(8, 1, 1), args=[y])
    np.testing.assert_array_equal(y, np.arange(8, dtype=np.float32) + np.where(np.arange(8) < 3, 100, 0))
    assert assemble_cubin(ptx, Target(), "piece state")[:4] == b"\x7fELF"


@pytest.mark.nvcc
def test_k_blocks_stay_whole_when_the_state_does_not_fit(monkeypatch):
    """The loop state lives next to the input patch in shared memory; when
    both would exceed the limit, k-blocks are not split."""
    from test_specialise import template

    rendered, tptx = template("multi_block_multi_chunk")
    w = np.ones(rendered.shape.weight_shape, np.float32)
    _, split = specialise(tptx, rendered, w, piece_lines=1)
    assert split.pieces > split.kblocks
    monkeypatch.setattr(pieces, "MAX_SHARED_BYTES", 0)
    ptx, whole = specialise(tptx, rendered, w, piece_lines=1)
    assert whole.pieces == whole.kblocks and STATE_SYMBOL not in ptx


@pytest.mark.nvcc
def test_k_blocks_stay_whole_when_the_prologue_has_side_effects():
    """Each piece reruns the prologue: a template whose prologue stores or
    synchronises must not be split."""
    from test_specialise import template

    rendered, tptx = template("multi_block_multi_chunk")
    layout = analyse_template(tptx, rendered)
    fake_store = Stmt("instr", "st.global.f32 [%rd1], %f1", 0, "", "st.global.f32", "", "[%rd1], %f1")
    layout = dataclasses.replace(layout, prologue=[*layout.prologue, fake_store])
    _, stats = specialise(tptx, rendered, np.ones(rendered.shape.weight_shape, np.float32), layout, piece_lines=1)
    assert stats.pieces == stats.kblocks
