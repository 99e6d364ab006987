"""CPU: execute specialised PTX in the PTX interpreter against a float64 reference.

This is how CI, which has no GPU, checks the numbers of the specialisation pass:
a renaming or weight-placement bug changes the result and fails here."""
import functools

import numpy as np
import pytest

from sparseconv.ptx import Stmt
from sparseconv.specialise import analysis, emit
from sparseconv.compile import compile_to_ptx
from sparseconv.render import ENTRY_NAME, render
from sparseconv.shapes import ConvShape, Target, Tiling, default_tiling, n_chunks, n_kblocks, patch_buffer_bytes
from sparseconv.specialise import specialise

from ptx_interpreter import PtxInterpreterError, run_kernel
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.nvcc

LAYERS = {
    # the example: C=3, K=4, 5x7 input, stride 2, padding 1
    "c3_k4_5x7_s2_p1": (ConvShape(3, 4, 5, 7, 3, 3, (2, 2), (1, 1)), None),
    "blocks_and_chunks": (ConvShape(5, 7, 9, 13, 3, 5, (2, 1), (0, 2)), Tiling(3, 2, 4, 8, 1, 2)),
    "dilated_thread_h2": (ConvShape(4, 5, 11, 10, 3, 3, (1, 1), (2, 1), (2, 1)), Tiling(2, 3, 4, 6, 2, 3)),
    "grouped": (ConvShape(6, 9, 6, 7, 3, 3, (1, 1), (1, 1), groups=3), Tiling(2, 1, 6, 7, 1, 1)),
    "depthwise_s2": (ConvShape(4, 4, 7, 7, 3, 3, (2, 2), (1, 1), groups=4), None),
    # issue 11, defect 3: bodies so small that NVVM unrolled the chunk loop (see compile.NVCC_FLAGS)
    "one_input_channel_1x1": (ConvShape(1, 64, 8, 8, 1, 1), None),
    "two_input_channels_1x1_on_1x1": (ConvShape(2, 8, 1, 1, 1, 1), None),
}


@functools.lru_cache(maxsize=None)
def template(name):
    shape, tiling = LAYERS[name]
    r = render(shape, tiling or default_tiling(shape))
    return r, compile_to_ptx(r.source, Target(), name)


def run_ptx(ptx, rendered, x, bias):
    shape, t = rendered.shape, rendered.tiling
    n = x.shape[0]
    y = np.full((n, shape.out_channels, shape.out_h, shape.out_w), np.nan, np.float32)
    tiles = -(-shape.out_h // t.tile_h) * -(-shape.out_w // t.tile_w)
    run_kernel(ptx, ENTRY_NAME, grid=(tiles, n_kblocks(shape, t), n), block=(t.threads, 1, 1),
               args=[np.ascontiguousarray(x), y, bias, n_chunks(shape, t)],
               dynamic_shared_bytes=patch_buffer_bytes(shape, t))
    return y


def check(name, sparsity, rng, batch=2):
    rendered, tptx = template(name)
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, sparsity, zero_channels=1)
    w[-1] = 0.0  # a second all-zero output channel, at the end of the last block
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    ptx, stats = specialise(tptx, rendered, w)
    y = run_ptx(ptx, rendered, x, bias)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups)
    return y, ref, stats


@pytest.mark.parametrize("sparsity", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_specialised_ptx_computes_the_convolution(name, sparsity):
    y, ref, stats = check(name, sparsity, np.random.default_rng())
    assert not np.isnan(y).any(), "outputs left unwritten"
    assert relative_l2(y, ref) <= 1e-5
    assert stats.fmas_deleted > 0


@pytest.mark.parametrize("name", ["one_input_channel_1x1", "two_input_channels_1x1_on_1x1"])
def test_tiny_layers_keep_their_chunk_loop(name):
    """Issue 11, defect 3: np.ones((64, 1, 1, 1)) on 8x8 (and 8x2x1x1 on 1x1)
    raised "expected one loop around all placeholder FMAs, found 0": NVVM had
    unrolled the small chunk loop 2x. Now the loop stays, and the all-ones
    layer computes the convolution."""
    rendered, tptx = template(name)
    shape = rendered.shape
    rng = np.random.default_rng(4)
    w = np.ones(shape.weight_shape, np.float32)
    x = rng.standard_normal((3, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    ptx, stats = specialise(tptx, rendered, w)
    assert stats.fmas_deleted == 0 and stats.fmas_kept == w.size * stats.fmas_per_weight
    y = run_ptx(ptx, rendered, x, bias)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups)
    assert relative_l2(y, ref) <= 1e-6


def test_zero_weight_channels_write_their_bias():
    rng = np.random.default_rng()
    y, ref, _ = check("blocks_and_chunks", 0.9, rng)
    np.testing.assert_array_equal(y[:, 0], ref[:, 0].astype(np.float32))
    np.testing.assert_array_equal(y[:, -1], ref[:, -1].astype(np.float32))


def test_a_renaming_bug_is_caught(monkeypatch):
    """Mutation check: if deleted FMAs forgot to alias their destination to the
    accumulator, the result must change (or the interpreter must refuse to read
    a register nothing wrote)."""
    monkeypatch.setattr(emit._Renamer, "set_alias", lambda self, d, src, out: self.before_write(d, False, out))
    with pytest.raises((AssertionError, PtxInterpreterError)):
        y, ref, _ = check("blocks_and_chunks", 0.6, np.random.default_rng())
        assert not np.isnan(y).any() and relative_l2(y, ref) <= 1e-5


def test_renamer_materialises_an_alias_before_its_source_changes():
    """d aliases c; then c is overwritten while d is still read later: the
    renamer must copy c into d first, and reads of d must not see the new c."""
    body = [Stmt("instr", "add.f32 %f2, %f2, %f9", 1, "", "add.f32", "%f2", "%f2, %f9"),
            Stmt("instr", "st.f32 [%rd1], %f1", 2, "", "st.global.f32", "", "[%rd1], %f1")]
    live = analysis._body_liveness(body, [])
    ren = emit._Renamer({"%f": "f32"}, live)
    out = []
    ren.set_alias("%f1", "%f2", out)      # a deleted FMA: %f1 = %f2
    ren.pos = 0                           # %f2 is overwritten, %f1 is read at position 1
    emit._emit(body[0], ren, out, "", set())
    ren.pos = 1
    emit._emit(body[1], ren, out, "", set())
    assert out == ["\tmov.f32 %f1, %f2;", "\tadd.f32 %f2, %f2, %f9;", "\tst.global.f32 [%rd1], %f1;"]
    # Without a later read no mov is needed.
    ren2, out2 = emit._Renamer({"%f": "f32"}, analysis._body_liveness(body[:1], [])), []
    ren2.set_alias("%f1", "%f2", out2)
    ren2.pos = 0
    emit._emit(body[0], ren2, out2, "", set())
    assert out2 == ["\tadd.f32 %f2, %f2, %f9;"]


def test_a_weight_placement_bug_is_caught(monkeypatch):
    """Mutation check: weights placed in the wrong chunk change the result."""
    real = emit.arrange_weights
    monkeypatch.setattr(emit, "arrange_weights", lambda w, s, t: np.roll(real(w, s, t), 1, axis=1))
    y, ref, _ = check("blocks_and_chunks", 0.5, np.random.default_rng())
    assert relative_l2(y, ref) > 1e-3


@pytest.mark.parametrize("name", ["blocks_and_chunks", "dilated_thread_h2", "grouped"])
def test_split_k_blocks_compute_the_same_convolution(name):
    """piece_lines=1: every chunk copy in a function of its own, the loop
    state handed on through shared memory. Bit-identical to the unsplit PTX
    (same FMAs in the same order), and right against float64."""
    rng = np.random.default_rng(7)
    rendered, tptx = template(name)
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, 0.7, zero_channels=1)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    whole, s1 = specialise(tptx, rendered, w)
    split, s2 = specialise(tptx, rendered, w, piece_lines=1)
    assert s1.pieces == s1.kblocks and s2.pieces == s2.kblocks * s2.chunks > s2.kblocks
    assert (s2.fmas_kept, s2.fmas_deleted) == (s1.fmas_kept, s1.fmas_deleted)
    y_split = run_ptx(split, rendered, x, bias)
    np.testing.assert_array_equal(y_split, run_ptx(whole, rendered, x, bias))
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups)
    assert relative_l2(y_split, ref) <= 1e-5


def test_a_piece_that_drops_an_accumulator_is_caught(monkeypatch):
    """Mutation check: if the loop state handed between pieces missed a
    register (here one of them), the result must change."""
    real = analysis._piece_interface
    monkeypatch.setattr(analysis, "_piece_interface",
                        lambda *a: tuple(tuple(r for r in regs if r != real(*a)[0][-1]) for regs in real(*a)))
    rendered, tptx = template("blocks_and_chunks")
    layout = analysis.analyse_template(tptx, rendered)
    rng = np.random.default_rng(3)
    w = pruned_weight(rng, rendered.shape.weight_shape, 0.5)
    x = rng.standard_normal((1, 5, 9, 13)).astype(np.float32)
    ptx, _ = specialise(tptx, rendered, w, layout, piece_lines=1)
    with pytest.raises((PtxInterpreterError, AssertionError)):
        y = run_ptx(ptx, rendered, x, np.zeros(7, np.float32))
        ref = conv2d_reference(x, w, None, rendered.shape.stride, rendered.shape.padding)
        assert relative_l2(y, ref) <= 1e-5
