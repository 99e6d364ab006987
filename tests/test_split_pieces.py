"""CPU: the pieces a big k-block function is cut into (sparseconv.specialise.pieces).

The numerics of split layers are checked in test_numeric_cpu.py and ptxas
acceptance in test_specialise.py; here: how chunks are cut, and the loop
state handed from piece to piece on its own, predicates included."""
import dataclasses
import re
import types

import numpy as np
import pytest

from sparseconv.ptx import Stmt
from sparseconv.assemble import assemble_cubin
from sparseconv.shapes import Target
from sparseconv.specialise import STATE_SYMBOL, analyse_template, analysis, pieces, plan_pieces, specialise
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
    return types.SimpleNamespace(piece_inputs=inputs, piece_outputs=outputs, piece_steps=(),
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


def test_piece_state_goes_to_dynamic_shared_memory_past_48_kb():
    """Static while state + patch fit the 48 KB that need no opt-in; past
    that, after the patch (16-byte aligned) in dynamic shared memory, up to
    what the target allows; beyond that it fits nowhere. VGG-16's deep
    batch-64 layers: 66 registers x 512 threads = 132 KB, which the H100
    (227 KB) takes."""
    regs = tuple(f"%f{i}" for i in range(65)) + ("%r1",)
    layout = fake_layout(regs, regs)
    small = PieceState(layout, threads=128, patch_bytes=1000, max_shared_bytes=Target().max_shared_bytes)
    assert (small.bytes, small.dynamic, small.base, small.launch_bytes, small.fits) == (66 * 512, False, 0, 1000, True)
    assert small.declaration() == f".weak .shared .align 16 .b8 {STATE_SYMBOL}[{66 * 512}];"
    vgg = PieceState(layout, threads=512, patch_bytes=1000, max_shared_bytes=Target("sm_90").max_shared_bytes)
    assert (vgg.bytes, vgg.dynamic, vgg.base, vgg.fits) == (66 * 2048, True, 1008, True)
    assert vgg.launch_bytes == 1008 + 66 * 2048 <= 227 * 1024
    assert vgg.declaration() == f".extern .shared .align 16 .b8 {STATE_SYMBOL}[];"
    assert all(line.count("+") == 0 or int(line.split("+")[1].split("]")[0]) >= 1008
               for line in vgg.load() if "ld.shared" in line)  # every slot after the patch
    assert not PieceState(layout, threads=512, patch_bytes=1000).fits                     # no opt-in asked
    assert not PieceState(layout, threads=512, max_shared_bytes=Target("sm_86").max_shared_bytes).fits  # 99 KB


@pytest.mark.parametrize("arch, kb", [("sm_90", 227), ("sm_90a", 227), ("sm_80", 163), ("sm_86", 99),
                                      ("sm_999", 48)])
def test_targets_know_the_shared_memory_a_block_may_opt_in_to(arch, kb):
    assert Target(arch).max_shared_bytes == kb * 1024


@pytest.mark.parametrize("arch", ["sm_75", "sm_70", "sm_52"])
def test_a_target_older_than_sm_80_is_refused_with_what_to_do(arch):
    # not after minutes of building, by ptxas on the direct family's cp.async
    with pytest.raises(ValueError, match=rf"sm_80 and newer GPUs .*{arch} is older.*PyTorch"):
        Target(arch)


def test_piece_state_round_trips_through_dynamic_shared_memory(monkeypatch):
    """The same hand-over with the state after a 100-byte patch in dynamic
    shared memory (the no-opt-in limit set to 0 bytes to put it there): every
    thread also fills the patch, which must survive (interpreter, launched
    with exactly launch_bytes; and ptxas + nvlink)."""
    monkeypatch.setattr(pieces, "MAX_SHARED_BYTES", 0)
    layout = fake_layout(("%f1", "%rd2"), ("%f1", "%rd2"))
    state = PieceState(layout, threads=8, patch_bytes=100, max_shared_bytes=Target().max_shared_bytes)
    assert (state.dynamic, state.base, state.launch_bytes) == (True, 112, 112 + 8 * 12)
    ptx = "\n".join([
        ".version 9.0", ".target sm_90", ".address_size 64",
        ".extern .shared .align 16 .b8 patch[];", state.declaration(),
        ".visible .entry k(.param .u64 y)", "{",
        "\t.reg .b32 %r<6>;", "\t.reg .b64 %rd<4>;", "\t.reg .f32 %f<4>;",
        "\tld.param.u64 %rd1, [y];", "\tcvta.to.global.u64 %rd1, %rd1;",
        "\tmov.u32 %r1, %tid.x;", "\tcvt.rn.f32.u32 %f1, %r1;", "\tmul.wide.u32 %rd2, %r1, 4;",
        "\tmov.u32 %r2, patch;", "\tmul.lo.u32 %r3, %r1, 12;", "\tadd.u32 %r2, %r2, %r3;",
        "\tst.shared.u32 [%r2], %r1;",  # the patch: bytes 0..95, every thread's word at 12 * tid
        *state.store({}),
        "\tmov.f32 %f1, 0f00000000;", "\tmov.u64 %rd2, 0;",  # clobber
        *state.load(),
        "\tld.shared.u32 %r4, [%r2];", "\tcvt.rn.f32.u32 %f2, %r4;",
        "\tadd.f32 %f2, %f2, %f1;",  # 2 * tid if neither the patch nor the state was overwritten
        "\tadd.s64 %rd3, %rd1, %rd2;", "\tst.global.f32 [%rd3], %f2;", "\tret;", "}", ""])
    y = np.zeros(8, np.float32)
    run_kernel(ptx, "k", grid=(1, 1, 1), block=(8, 1, 1), args=[y], dynamic_shared_bytes=state.launch_bytes)
    np.testing.assert_array_equal(y, 2 * np.arange(8, dtype=np.float32))
    assert assemble_cubin(ptx, Target(), "piece state, dynamic")[:4] == b"\x7fELF"


def _stmt(text):
    from sparseconv.ptx import parse_statements
    return [s for s in parse_statements([f"\t{text};"]) if s.kind == "instr"][0]


@pytest.mark.parametrize("body, want", [
    (["add.s32 %r5, %r5, 4", "add.s64 %rd2, %rd2, -784"], (("%r5", 4), ("%rd2", -784))),
    (["add.u32 %r5, %r5, 1"], (("%r5", 1),)),
    (["@%p1 add.s32 %r5, %r5, 4"], ()),                   # guarded: not every copy steps it
    (["add.s32 %r5, %r5, 4", "add.s32 %r5, %r5, 4"], (("%r5", 8),)),  # twice: 8 a copy
    (["add.s32 %r5, %r5, %r6"], ()),                       # by a register
    (["add.s32 %r5, %r6, 4"], ()),                         # from another register
    (["add.s32 %r9, %r5, 1", "setp.ne.s32 %p1, %r5, 0", "mov.u32 %r5, %r9"], (("%r5", 1),)),  # the direct family's
    (["add.s32 %r9, %r5, 1", "add.s32 %r9, %r9, 2", "mov.u32 %r5, %r9"], (("%r5", 3),)),
    (["add.s32 %r9, %r5, 1", "shl.b32 %r9, %r9, 1", "mov.u32 %r5, %r9"], ()),  # then not a step
    (["mov.u32 %r5, %r6"], ()),
    (["mul.lo.s32 %r5, %r5, 4"], ()),
    (["add.f32 %f5, %f5, 0f3F800000"], ()),
])
def test_piece_steps_are_registers_a_copy_only_adds_a_constant_to(body, want):
    got = analysis._piece_steps([_stmt(t) for t in body], ("%r5", "%rd2", "%f5"))
    assert got == want


def test_a_piece_resumes_its_stepped_registers_as_constants():
    """A piece starting at chunk j0 adds j0 steps to what the prologue set,
    wrapped as the copies' adds would wrap; nothing of them goes through
    shared memory."""
    layout = fake_layout(("%f1", "%r3", "%rd4"), ("%f1", "%r3", "%rd4"))
    layout.piece_steps = (("%r3", 4), ("%rd4", -784))
    state = PieceState(layout, threads=8)
    assert list(state.slot) == ["%f1"] and state.ins == state.outs == ("%f1",)
    assert state.resume(0) == ["\tadd.s32 %r3, %r3, 0;", "\tadd.s64 %rd4, %rd4, 0;"]
    assert state.resume(5) == ["\tadd.s32 %r3, %r3, 20;", "\tadd.s64 %rd4, %rd4, -3920;"]
    assert state.resume(1 << 30)[0] == "\tadd.s32 %r3, %r3, 0;"            # 2^32 wraps to 0
    assert state.resume(3 << 28)[0] == f"\tadd.s32 %r3, %r3, {-(1 << 30)};"  # 3 * 2^30 wraps to -2^30


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ["multi_block_multi_chunk", "pointwise"])
def test_split_pieces_recompute_the_chunk_counters(name):
    """On real templates the chunk counter (and the pointwise family's channel
    index) are stepped registers: each piece after the first sets them from
    the prologue's value with a constant, and does not load them from
    sc_state. Loaded, ptxas could not fold them into the load addresses
    (one multiply a load: +26% instructions, +25-38% run time on VGG-16's
    512-channel layers at batch 64; docs/PERFORMANCE.md, session 28)."""
    from test_specialise import template

    rendered, tptx = template(name)
    layout = analyse_template(tptx, rendered)
    assert layout.piece_steps and all(r in layout.piece_inputs for r, _ in layout.piece_steps)
    w = np.ones(rendered.shape.weight_shape, np.float32)
    ptx, stats = specialise(tptx, rendered, w, layout, piece_lines=1)
    assert stats.pieces == stats.kblocks * stats.chunks > stats.kblocks
    for r, step in layout.piece_steps:
        assert not re.search(rf"ld\.shared\.\w+ {re.escape(r)},", ptx)
        resumed = re.findall(rf"add\.s(?:32|64) {re.escape(r)}, {re.escape(r)}, (-?\d+);", ptx)
        assert resumed == [str(j * step) for _ in range(stats.kblocks) for j in range(1, stats.chunks)]


def test_a_state_of_stepped_registers_only_goes_through_no_shared_memory():
    layout = fake_layout(("%r3",), ("%r3",))
    layout.piece_steps = (("%r3", 1),)
    state = PieceState(layout, threads=8)
    assert (state.bytes, state.load(), state.store({})) == (0, [], [])
    assert state.resume(2) == ["\tadd.s32 %r3, %r3, 2;"]
