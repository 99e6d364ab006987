"""CPU: execute specialised PTX in the PTX interpreter against a float64 reference.

This is how CI, which has no GPU, checks the numbers of the specialisation pass:
a renaming or weight-placement bug changes the result and fails here."""
import functools
from dataclasses import replace

import numpy as np
import pytest

from sparseconv.ptx import Stmt
from sparseconv.specialise import analysis, emit
from sparseconv.compile import compile_to_ptx
from sparseconv.render import ENTRY_NAME, render
from sparseconv.shapes import (ConvShape, Epilogue, Target, Tiling, dynamic_shared_bytes, launch_grid, n_chunks,
                               residual_after_loop)
from sparseconv.tilings import default_tiling, image_layer_blocks
from sparseconv.specialise import specialise

from ptx_interpreter import PtxInterpreterError, run_kernel
from specialised_runs import apply_epilogue, run_ptx
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.nvcc

LAYERS = {
    # the example: C=3, K=4, 5x7 input, stride 2, padding 1
    "c3_k4_5x7_s2_p1": (ConvShape(3, 4, 5, 7, 3, 3, (2, 2), (1, 1)), None),
    "blocks_and_chunks": (ConvShape(5, 7, 9, 13, 3, 5, (2, 1), (0, 2)), Tiling(3, 2, 4, 8, 1, 2)),
    "dilated_thread_h2": (ConvShape(4, 5, 11, 10, 3, 3, (1, 1), (2, 1), (2, 1)), Tiling(2, 3, 4, 6, 2, 3)),
    "grouped": (ConvShape(6, 9, 6, 7, 3, 3, (1, 1), (1, 1), groups=3), Tiling(2, 1, 6, 7, 1, 1)),
    "depthwise_s2": (ConvShape(4, 4, 7, 7, 3, 3, (2, 2), (1, 1), groups=4), None),
    # depthwise with a channel multiplier of 2, the default (pointwise family, the batch in the pixels)
    "depthwise_mult2": (ConvShape(4, 8, 6, 6, 3, 3, (1, 1), (1, 1), groups=4), None),
    # several depthwise groups a block (shapes.kernel_shape, session 43): 3 by default on 6 groups,
    # and 2 groups of multiplier 2 from a user's tiling (block-diagonal weights, zeros deleted)
    "depthwise_3_groups_a_block": (ConvShape(6, 6, 7, 6, 3, 3, (1, 1), (1, 1), groups=6), None),
    "depthwise_mult2_2_groups_a_block": (ConvShape(4, 8, 6, 5, 3, 3, (1, 1), (1, 1), groups=4),
                                         Tiling(4, 2, 1, 64, 1, 1, 1, "pointwise")),
    # 5x5 depthwise, stride 2 (MNASNet's), the default since session 43: pointwise, a tap test a tap
    "depthwise_5x5_s2": (ConvShape(3, 3, 9, 8, 5, 5, (2, 2), (2, 2), groups=3), None),
    # and at 4 groups a block (session 44): a pointer a tap, padding taps read the zero buffer
    "depthwise_5x5_4_groups_a_block": (ConvShape(8, 8, 7, 9, 5, 5, (1, 1), (2, 2), groups=8), None),
    # the pointwise family at 2 pixels a thread on a depthwise layer, and on a 4-group 3x3 (ResNeXt's
    # kind): the candidates docs/pending asks to time next
    "depthwise_2px": (ConvShape(6, 6, 9, 9, 3, 3, (1, 1), (1, 1), groups=6), Tiling(1, 1, 1, 64, 1, 2, 1, "pointwise")),
    "grouped_pointwise": (ConvShape(16, 16, 7, 7, 3, 3, (1, 1), (1, 1), groups=4),
                          Tiling(4, 4, 1, 64, 1, 1, 1, "pointwise")),
    # the direct family on a depthwise layer, as before session 41 (what a user's tiling may still ask for)
    "depthwise_direct": (ConvShape(4, 4, 7, 7, 3, 3, (1, 1), (1, 1), groups=4), Tiling(1, 1, 7, 7, 1, 1)),
    # two outputs along W a thread with no k-block tail: the per-channel branch
    # is kept only to order the stores (templates/conv2d_direct.cu.j2); the
    # right-hand tile is partial, so its second column stores nothing
    "thread_w2_no_k_tail": (ConvShape(3, 8, 6, 9, 3, 3, (1, 1), (1, 1)), Tiling(4, 1, 3, 8, 1, 2)),
    # issue 11, defect 3: bodies so small that NVVM unrolled the chunk loop (see compile.NVCC_FLAGS)
    "one_input_channel_1x1": (ConvShape(1, 64, 8, 8, 1, 1), None),
    "two_input_channels_1x1_on_1x1": (ConvShape(2, 8, 1, 1, 1, 1), None),
}


@functools.lru_cache(maxsize=None)
def template(name):
    shape, tiling = LAYERS[name]
    r = render(shape, tiling or default_tiling(shape))
    return r, compile_to_ptx(r.source, Target(), name)


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


# --------------------------------------------------------------------------- kernel families, split-K, epilogues

def _pointwise(kb, cb, pixels, threads, slices=1, slice_sum="kernel"):
    return Tiling(kb, cb, 1, threads * pixels, 1, pixels, family="pointwise", slices=slices, slice_sum=slice_sum)


def _staged(tiling):
    return replace(tiling, input_loads="staged")


FAMILY_LAYERS = {
    # 1x1 convs through the pointwise family: batch folded into the pixels,
    # stride, zero padding, groups, one input channel, partial chunks, several
    # pixels per thread, a split reduction.
    "pw_basic": (ConvShape(8, 12, 5, 6, 1, 1), _pointwise(8, 4, 2, 32), Epilogue()),
    # pixels in 2x2 quads (Tiling.pixel_order): a 3x3 with padding, a k-block
    # tail and a residual, the batch's last block partial; two pixels a thread
    # at stride 2; and a cluster sum, which stores by the same walk
    "pw3x3_quads_residual": (ConvShape(4, 6, 6, 8, 3, 3, (1, 1), (1, 1)),
                             replace(_pointwise(4, 2, 1, 32), pixel_order="quads"), Epilogue("relu", residual=True)),
    "pw_quads_stride2_2px": (ConvShape(6, 8, 8, 12, 1, 1, (2, 2)),
                             replace(_pointwise(8, 4, 2, 32), pixel_order="quads"), Epilogue()),
    "pw_quads_cluster": (ConvShape(8, 4, 4, 6, 1, 1),
                         replace(_pointwise(4, 2, 1, 32, 2, "cluster"), pixel_order="quads"), Epilogue("relu6")),
    # the 2x2 max pool in the epilogue (Epilogue.pool), taken among a quad's
    # lanes: a 3x3 with a k-block tail after a ReLU, the batch's last block
    # partial; and two pixels a thread, two warps, no activation
    "pw3x3_quads_pool": (ConvShape(4, 6, 6, 8, 3, 3, (1, 1), (1, 1)),
                         replace(_pointwise(4, 2, 1, 32), pixel_order="quads"), Epilogue("relu", pool=True)),
    "pw_quads_pool_2px": (ConvShape(6, 8, 8, 12, 1, 1),
                          replace(_pointwise(8, 4, 2, 64), pixel_order="quads"), Epilogue(pool=True)),
    "pw_stride2_split": (ConvShape(10, 12, 7, 6, 1, 1, (2, 2)), _pointwise(4, 4, 2, 32, 2), Epilogue()),
    "pw_padding_clip": (ConvShape(6, 8, 5, 5, 1, 1, (1, 1), (1, 1)), _pointwise(8, 4, 1, 32),
                        Epilogue("clip", clip=(-0.5, 0.7))),
    "pw_groups_split": (ConvShape(8, 6, 6, 6, 1, 1, groups=2), _pointwise(3, 2, 1, 32, 2), Epilogue()),
    "pw_one_channel": (ConvShape(1, 4, 4, 4, 1, 1), _pointwise(4, 1, 1, 32), Epilogue()),
    "pw_se_1x1_input": (ConvShape(2, 8, 1, 1, 1, 1), _pointwise(8, 2, 1, 32), Epilogue("relu")),
    "pw_residual_relu": (ConvShape(8, 12, 5, 6, 1, 1), _pointwise(8, 3, 1, 32), Epilogue("relu", residual=True)),
    "pw_split_residual_relu6": (ConvShape(12, 8, 3, 3, 1, 1), _pointwise(8, 2, 1, 32, 3),
                                Epilogue("relu6", residual=True)),
    # one k-block holds every output channel: the residual is added after the
    # chunk loop (shapes.residual_after_loop); two pixels a thread, and a
    # stride with a padded last chunk (5 channels in chunks of 2)
    "pw_residual_after_loop": (ConvShape(8, 12, 5, 6, 1, 1), _pointwise(12, 3, 2, 32), Epilogue("relu", residual=True)),
    "pw_stride2_residual_after_loop": (ConvShape(5, 7, 7, 6, 1, 1, (2, 2)), _pointwise(7, 2, 1, 32),
                                       Epilogue("relu6", residual=True)),
    # 5 chunks over 4 slices of 2: the last slice lies wholly past the channels
    # (all its weights zero, its loads clamped in bounds): it adds zeros
    "pw_empty_last_slice": (ConvShape(5, 4, 3, 3, 1, 1), _pointwise(4, 1, 1, 32, 4), Epilogue()),
    "direct_empty_last_slice": (ConvShape(5, 4, 5, 5, 3, 3, (1, 1), (1, 1)), Tiling(4, 1, 5, 5, 1, 1, slices=4),
                                Epilogue()),
    # the pointwise family on kernels wider than 1x1: one load per (channel,
    # tap), stride, dilation, groups, a split; zero padding by a zero buffer,
    # or by a test a load where a pixel needs few loads from its group
    # (shapes.tap_predicates: the dilated 2-channel groups below, 18 loads;
    # pw_padding_clip, a padded 1x1; here 45 loads, the buffer)
    "pw3x3_padding": (ConvShape(5, 8, 6, 7, 3, 3, (1, 1), (1, 1)), _pointwise(8, 2, 1, 32), Epilogue("relu")),
    "pw3x3_stride2_split": (ConvShape(6, 4, 9, 8, 3, 3, (2, 2), (1, 1)), _pointwise(4, 2, 2, 32, 2), Epilogue()),
    "pw3x3_dilation_groups": (ConvShape(4, 6, 8, 8, 3, 3, (1, 1), (2, 2), (2, 2), groups=2), _pointwise(3, 1, 1, 32),
                              Epilogue("relu6", residual=True)),
    "pw5x3_nopad": (ConvShape(3, 4, 7, 6, 5, 3), _pointwise(4, 3, 1, 32), Epilogue()),
    "pw7x7_stride2_pad3": (ConvShape(3, 4, 11, 10, 7, 7, (2, 2), (3, 3)), _pointwise(4, 1, 1, 32), Epilogue()),
    # the wave-fitted tilings (tilings.wave_fitted_tiling) in
    # miniature: a k_block that does not divide the channels (12 in blocks of
    # 5: a tail of 2) and a block of 3 warps (96 threads; the fit takes up to
    # 640), 105 pixels: a second, partial block
    "pw3x3_k_tail_96_threads": (ConvShape(4, 12, 5, 7, 3, 3, (1, 1), (1, 1)), _pointwise(5, 2, 1, 96),
                                Epilogue("relu")),
    # the chunk input staged by cp.async (Tiling.input_loads): a padded 3x3
    # whose last chunk is half past the channels; two pixels a thread and a
    # k-block tail, a residual; a split 1x1 at stride 2; one chunk in all
    # (fewer than the stages), pooled by quads; eight chunks, the ring of
    # stages wrapping round twice
    "pw3x3_staged_padded_chunks": (ConvShape(5, 8, 6, 7, 3, 3, (1, 1), (1, 1)),
                                   _staged(_pointwise(8, 2, 1, 32)), Epilogue("relu")),
    "pw3x3_staged_2px_k_tail_residual": (ConvShape(6, 10, 7, 6, 3, 3, (1, 1), (1, 1)),
                                         _staged(_pointwise(4, 2, 2, 32)), Epilogue("relu6", residual=True)),
    "pw_staged_stride2_split": (ConvShape(12, 8, 7, 6, 1, 1, (2, 2)), _staged(_pointwise(8, 3, 1, 32, 2)), Epilogue()),
    "pw3x3_staged_one_chunk_quads_pool": (ConvShape(3, 6, 8, 10, 3, 3),
                                          replace(_staged(_pointwise(6, 3, 1, 32)), pixel_order="quads"),
                                          Epilogue("relu", pool=True)),
    "pw_staged_eight_chunks": (ConvShape(8, 4, 5, 5, 1, 1), _staged(_pointwise(4, 1, 1, 32)), Epilogue()),
    # the chunk input prefetched into L1 (Tiling.input_loads "prefetched"): a padded 3x3 with a padded last
    # chunk, and a split 2-pixel 1x1 at stride 2 with a residual (the interpreter checks each prefetch's address)
    "pw3x3_prefetched_padded_chunks": (ConvShape(5, 8, 6, 7, 3, 3, (1, 1), (1, 1)),
                                       replace(_pointwise(8, 2, 1, 32), input_loads="prefetched"), Epilogue("relu")),
    "pw_prefetched_stride2_2px_split_residual": (ConvShape(12, 8, 7, 6, 1, 1, (2, 2)),
                                                 replace(_pointwise(8, 3, 2, 32, 2), input_loads="prefetched"),
                                                 Epilogue("relu", residual=True)),
    # the direct family with a split reduction and epilogues
    "direct_split": (ConvShape(6, 5, 7, 7, 3, 3, (1, 1), (1, 1)), Tiling(4, 2, 4, 7, 1, 1, slices=2), Epilogue()),
    "direct_split_uneven_residual": (ConvShape(5, 5, 6, 6, 3, 3, (1, 1), (1, 1)), Tiling(4, 1, 3, 6, 1, 2, slices=2),
                                     Epilogue("relu", residual=True)),
    "direct_residual_relu6": (ConvShape(6, 5, 7, 7, 3, 3, (1, 1), (1, 1)), Tiling(4, 2, 4, 7, 1, 1),
                              Epilogue("relu6", residual=True)),
    # the slices summed inside a thread-block cluster: 3 slices sharing 8
    # channels unevenly, a k-block tail (5 channels a group, k_block 4), two
    # pixels a thread, an empty last slice, a direct tile with a partial edge
    "pw_cluster_residual_relu6": (ConvShape(12, 8, 3, 3, 1, 1), _pointwise(8, 2, 1, 32, 3, "cluster"),
                                  Epilogue("relu6", residual=True)),
    "pw_cluster_groups_k_tail": (ConvShape(8, 10, 4, 4, 1, 1, groups=2), _pointwise(4, 2, 1, 32, 2, "cluster"),
                                 Epilogue("relu")),
    "pw3x3_cluster_stride2": (ConvShape(6, 4, 9, 8, 3, 3, (2, 2), (1, 1)), _pointwise(4, 2, 2, 32, 2, "cluster"),
                              Epilogue()),
    "pw_cluster_empty_last_slice": (ConvShape(5, 4, 3, 3, 1, 1), _pointwise(4, 1, 1, 32, 4, "cluster"), Epilogue()),
    "direct_cluster_residual": (ConvShape(5, 5, 6, 6, 3, 3, (1, 1), (1, 1)),
                                Tiling(4, 1, 3, 6, 1, 2, slices=2, slice_sum="cluster"),
                                Epilogue("relu", residual=True)),
    "direct_cluster_k_tail": (ConvShape(6, 6, 7, 7, 3, 3, (1, 1), (1, 1)),
                              Tiling(4, 2, 4, 7, 1, 1, slices=3, slice_sum="cluster"), Epilogue("clip", clip=(-1, 2))),
    # two chunks a slice, so that a k-block can be cut into pieces (below)
    "pw_cluster_two_chunks": (ConvShape(16, 8, 3, 3, 1, 1), _pointwise(8, 4, 1, 32, 2, "cluster"),
                              Epilogue("relu", residual=True)),
    # tilings.whole_image_split in miniature: one block over the whole 5x6
    # image (30 pixels, 32 threads), a 3x3 with padding, 4 slices of 2 channels
    "pw3x3_whole_image_split": (ConvShape(8, 6, 5, 6, 3, 3, (1, 1), (1, 1)), _pointwise(4, 2, 1, 32, 4),
                                Epilogue("relu")),
    "direct_cluster_two_chunks": (ConvShape(8, 6, 7, 7, 3, 3, (1, 1), (1, 1)),
                                  Tiling(4, 2, 4, 7, 1, 1, slices=2, slice_sum="cluster"),
                                  Epilogue("relu", residual=True)),
    # tilings.image_layer_blocks in miniature: a 7x7 stride-2 image layer in
    # 16-channel blocks (20 channels: a k-block tail), one output a thread
    "direct_image_layer_7x7_s2": (ConvShape(3, 20, 23, 21, 7, 7, (2, 2), (3, 3)),
                                  image_layer_blocks(ConvShape(3, 20, 23, 21, 7, 7, (2, 2), (3, 3)),
                                                     default_tiling(ConvShape(3, 20, 23, 21, 7, 7, (2, 2), (3, 3)))),
                                  Epilogue("relu")),
    # 4 channels staged a chunk (tilings.SPLIT_DIRECT_WIDE_C_BLOCK): 10 channels
    # make a last chunk half past the channels, its staged loads masked to zero
    "direct_cluster_wide_chunk_partial": (ConvShape(10, 6, 7, 7, 3, 3, (1, 1), (1, 1)),
                                          Tiling(4, 4, 4, 7, 1, 1, slices=2, slice_sum="cluster"), Epilogue("relu")),
}


@functools.lru_cache(maxsize=None)
def family_template(name):
    shape, tiling, epilogue = FAMILY_LAYERS[name]
    r = render(shape, tiling, epilogue)
    return r, compile_to_ptx(r.source, Target(), name)


def test_two_family_layers_add_the_residual_after_the_chunk_loop():
    for name in ["pw_residual_after_loop", "pw_stride2_residual_after_loop"]:
        shape, tiling, epilogue = FAMILY_LAYERS[name]
        assert epilogue.residual and residual_after_loop(shape, tiling), name


@pytest.mark.parametrize("name", sorted(FAMILY_LAYERS))
def test_kernel_families_compute_the_convolution(name):
    """Every family, split or not, with its epilogue: specialised PTX run in
    the interpreter against the float64 reference of act(conv + bias + residual)."""
    w, stats = check_family_layer(name, 3)
    assert stats.fmas_deleted > 0 or not (w == 0).any()


def test_a_pooling_pointwise_kernel_keeps_a_nan_wherever_it_falls_in_its_window():
    """The pointwise template's window shuffles take sparseconv.pool's NaN
    rule (sc_pool_max): a NaN output anywhere in a 2x2 window is that
    window's max, as in torch. A 1x1 conv: a NaN input pixel makes the
    outputs at that pixel NaN wherever a kept weight reads it (a deleted
    zero weight never does), at a window's bottom-right, top-right and
    bottom-left pixel here; the rest match float64."""
    rendered, tptx = family_template("pw_quads_pool_2px")
    shape = rendered.shape
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, 0.6)
    w[0, 0] = 1.0  # output channel 0 reads channel 0: it has NaNs
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    for n, h, col in [(0, 1, 1), (0, 2, 5), (1, 5, 8)]:
        x[n, 0, h, col] = np.nan
    ptx, _ = specialise(tptx, rendered, w)
    y = run_ptx(ptx, rendered, x, bias)
    reads = (w[:, :, 0, 0] != 0).astype(np.float64)
    hit = np.einsum("kc,nchw->nkhw", reads, np.isnan(x).astype(np.float64)) > 0
    conv = conv2d_reference(np.nan_to_num(x, nan=0.0), w, bias, shape.stride, shape.padding, shape.dilation,
                            shape.groups)
    ref = apply_epilogue(np.where(hit, np.nan, conv), rendered.epilogue, None)
    assert np.isnan(ref[:, 0]).sum() == 3  # one window each, NaN at no window's top-left pixel
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert relative_l2(np.nan_to_num(y), np.nan_to_num(ref)) <= 1e-5


def check_family_layer(name, n):
    """Run FAMILY_LAYERS[name] on n fresh random images in the interpreter and
    check every output against float64; returns (weight, specialiser stats)."""
    rng = np.random.default_rng()
    rendered, tptx = family_template(name)
    shape, epilogue = rendered.shape, rendered.epilogue
    w = pruned_weight(rng, shape.weight_shape, 0.6)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((n, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    res = rng.standard_normal((n, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32) \
        if epilogue.residual else None
    ptx, stats = specialise(tptx, rendered, w)
    y = run_ptx(ptx, rendered, x, bias, res)
    ref = apply_epilogue(conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups),
                         epilogue, res)
    assert not np.isnan(y).any(), "outputs left unwritten"
    assert relative_l2(y, ref) <= 1e-5
    return w, stats


@pytest.mark.parametrize("name", sorted(n for n in FAMILY_LAYERS if "staged" in n))
def test_staged_kernels_read_their_input_from_shared_memory_and_stay_whole(name):
    """The staged path's PTX: every global read is a cp.async (none left in
    registers' way), a read of shared memory that only deleted FMAs use is
    dropped, and the copies before the chunk loop keep a k-block whole even
    where the piece budget asks for a function a chunk."""
    rendered, tptx = family_template(name)
    shape = rendered.shape
    rng = np.random.default_rng(3)
    w = pruned_weight(rng, shape.weight_shape, 0.8)
    ptx, stats = specialise(tptx, rendered, w, piece_lines=1)
    kblocks = ptx.split(".entry")[0]
    assert "cp.async.ca.shared.global" in kblocks and "ld.shared.f32" in kblocks
    assert rendered.epilogue.residual or "ld.global.nc" not in kblocks  # the input (and a residual) take __ldg
    assert stats.pieces == stats.kblocks and stats.loads_dropped > 0
    assert stats.launch_shared_bytes == dynamic_shared_bytes(shape, rendered.tiling) > 0


@pytest.mark.parametrize("name", sorted(n for n in FAMILY_LAYERS if "prefetched" in n))
def test_prefetched_kernels_ask_for_each_load_ahead_and_may_be_cut_into_pieces(name):
    """The prefetched path's PTX: in every chunk a prefetch.L1 of each
    channel at the first and last tap of each kernel row (their lines hold
    the taps between) for each pixel, loads as before, no shared memory; a
    hint has no side effect, so a k-block is cut into pieces as without it
    (piece_lines=1: one a chunk), and the pieces compute the convolution."""
    rendered, tptx = family_template(name)
    shape, t = rendered.shape, rendered.tiling
    rng = np.random.default_rng(4)
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    ptx, stats = specialise(tptx, rendered, w, piece_lines=1)
    row_ends = shape.kernel_h * min(shape.kernel_w, 2)
    assert ptx.count("prefetch.L1") == t.c_block * row_ends * t.thread_w * n_chunks(shape, t) * stats.kblocks
    assert stats.pieces == stats.kblocks * n_chunks(shape, t) and stats.launch_shared_bytes == 0
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    res = rng.standard_normal((2, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32)
    y = run_ptx(ptx, rendered, x, bias, res)
    ref = apply_epilogue(conv2d_reference(x, w, bias, shape.stride, shape.padding), rendered.epilogue, res)
    assert relative_l2(y, ref) <= 1e-5


def test_slices_split_the_reduction_and_their_sum_is_the_convolution():
    """A split layer's slices each hold part of the sum: no slice alone is the
    answer, and the bias is added by slice 0 only."""
    rng = np.random.default_rng(5)
    rendered, tptx = family_template("pw_stride2_split")
    shape, t = rendered.shape, rendered.tiling
    w = pruned_weight(rng, shape.weight_shape, 0.3)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    ptx, _ = specialise(tptx, rendered, w)
    parts = np.full((t.slices, 2, shape.out_channels, shape.out_h, shape.out_w), np.nan, np.float32)
    run_kernel(ptx, ENTRY_NAME, grid=launch_grid(shape, t, 2), block=(t.threads, 1, 1),
               args=[x, parts, bias, 0, 2, n_chunks(shape, t)])
    ref = conv2d_reference(x, w, None, shape.stride, shape.padding)
    assert relative_l2(parts[1], ref) > 1e-2 and relative_l2(parts[0] - bias[:, None, None], ref) > 1e-2
    assert relative_l2(parts[0] + parts[1], ref + bias[:, None, None]) <= 1e-5


@pytest.mark.parametrize("name", ["pw_cluster_residual_relu6", "direct_cluster_residual"])
def test_a_cluster_sum_equals_the_workspace_sum_bit_for_bit(name):
    """Summed in a cluster, the slices are added in the order the reduction
    kernel adds them (rank 0, 1, ...; then the residual, then the clamp), so
    the output is bit-identical to the workspace path's, not just close."""
    rng = np.random.default_rng(11)
    rendered, tptx = family_template(name)
    shape, epilogue = rendered.shape, rendered.epilogue
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    res = rng.standard_normal((2, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32)
    in_cluster = run_ptx(specialise(tptx, rendered, w)[0], rendered, x, bias, res)
    kernel_sum = render(shape, replace(rendered.tiling, slice_sum="kernel"), epilogue)
    kptx = compile_to_ptx(kernel_sum.source, Target(), name)
    in_workspace = run_ptx(specialise(kptx, kernel_sum, w)[0], kernel_sum, x, bias, res)
    assert not np.isnan(in_cluster).any()
    np.testing.assert_array_equal(in_cluster.view(np.uint32), in_workspace.view(np.uint32))


@pytest.mark.parametrize("name", ["pw_cluster_two_chunks", "direct_cluster_two_chunks"])
def test_a_cluster_sum_survives_k_blocks_cut_into_pieces(name):
    """piece_lines=1 on a cluster-sum layer: the loop state goes through
    sc_state while the partial tile goes through the dynamic shared memory
    (the direct family's patch buffers); bit-identical to the whole k-blocks."""
    rng = np.random.default_rng(13)
    rendered, tptx = family_template(name)
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    res = rng.standard_normal((2, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32)
    whole, s1 = specialise(tptx, rendered, w)
    cut, s2 = specialise(tptx, rendered, w, piece_lines=1)
    assert s2.pieces > s2.kblocks == s1.pieces
    y = run_ptx(cut, rendered, x, bias, res)
    np.testing.assert_array_equal(y, run_ptx(whole, rendered, x, bias, res))
    ref = apply_epilogue(conv2d_reference(x, w, bias, shape.stride, shape.padding), rendered.epilogue, res)
    assert relative_l2(y, ref) <= 1e-5


@pytest.mark.parametrize("name", ["pw_cluster_residual_relu6", "direct_cluster_residual"])
def test_cluster_sum_ptx_keeps_what_made_it_fast(name):
    """Two measured lessons (docs/PERFORMANCE.md, session 15), checked on the
    template's PTX: every distributed shared-memory load is issued before the
    first add (one at a time, each waited out a round trip), and the exit
    barrier arrives relaxed (a release arrive after the output stores
    compiled to MEMBAR.ALL.GPU, waiting for them)."""
    _, tptx = family_template(name)
    entry = [line.strip() for line in tptx[tptx.index(".entry"):].splitlines()]
    arrives = [line for line in entry if line.startswith("barrier.cluster.arrive")]
    assert arrives == ["barrier.cluster.arrive.release.aligned;", "barrier.cluster.arrive.relaxed.aligned;"]
    loads = [i for i, line in enumerate(entry) if line.startswith("ld.shared::cluster")]
    adds = [i for i, line in enumerate(entry) if line.startswith("add.f32") and i > loads[0]]
    assert loads and adds and max(loads) < min(adds)


def test_a_slice_placement_bug_is_caught(monkeypatch):
    """Mutation check: weights arranged into the wrong slice change the result."""
    real = emit.arrange_weights
    t = FAMILY_LAYERS["direct_split"][1]
    monkeypatch.setattr(emit, "arrange_weights",
                        lambda w, s, tl: np.roll(real(w, s, tl).reshape(-1, t.slices, *real(w, s, tl).shape[1:]),
                                                 1, axis=1).reshape(real(w, s, tl).shape))
    rng = np.random.default_rng(2)
    rendered, tptx = family_template("direct_split")
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    ptx, _ = specialise(tptx, rendered, w)
    y = run_ptx(ptx, rendered, x, np.zeros(shape.out_channels, np.float32))
    assert relative_l2(y, conv2d_reference(x, w, None, shape.stride, shape.padding)) > 1e-3


@pytest.mark.parametrize("name", ["pw_residual_relu", "pw_stride2_split", "pw3x3_stride2_split"])
def test_pointwise_groups_of_pixel_blocks_cover_the_batch(name, monkeypatch):
    """The pointwise grid is (group, k-blocks, groups): with groups of two pixel
    blocks and an odd number of blocks, the last group has a block past the
    batch, which must store nothing, and every output is still written."""
    import sparseconv.shapes as shapes

    rendered, _ = family_template(name)
    shape, t = rendered.shape, rendered.tiling
    per_block = t.tile_w * shape.c_per_group * shape.stride[1] * 4
    monkeypatch.setattr(shapes, "L2_GROUP_BYTES", 2 * per_block)
    n = next(n for n in range(1, 64) if shapes.pixel_blocks(shape, t, n) % 2 == 1 and
             shapes.pixel_blocks(shape, t, n) >= 3)  # an odd number of blocks: the last group has an extra one
    blocks = shapes.pixel_blocks(shape, t, n)
    grid = launch_grid(shape, t, n)
    assert grid[0] == 2 and grid[2] == -(-blocks // 2) >= 2 and blocks % 2 == 1
    check_family_layer(name, n)


@pytest.mark.parametrize("name", ["blocks_and_chunks", "direct_cluster_two_chunks", "pw_cluster_two_chunks"])
def test_pieces_hand_their_state_through_dynamic_shared_memory(name, monkeypatch):
    """Where the loop state does not fit in the 48 KB a kernel gets without
    opting in (here: a limit of 0 bytes), it goes after the input patch in
    dynamic shared memory, and the kernel is launched with both. The patch
    (and a cluster sum's partial tile) and the state must not overlap:
    bit-identical to the whole k-blocks, and right against float64."""
    from sparseconv.specialise import pieces

    rng = np.random.default_rng(17)
    rendered, tptx = family_template(name) if name != "blocks_and_chunks" else template(name)
    shape = rendered.shape
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    res = (rng.standard_normal((2, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32)
           if rendered.epilogue.residual else None)
    whole, s1 = specialise(tptx, rendered, w)
    monkeypatch.setattr(pieces, "MAX_SHARED_BYTES", 0)
    cut, s2 = specialise(tptx, rendered, w, piece_lines=1, max_shared_bytes=Target().max_shared_bytes)
    patch = dynamic_shared_bytes(shape, rendered.tiling)
    assert s2.pieces > s2.kblocks == s1.pieces
    assert f".extern .shared .align 16 .b8 {pieces.STATE_SYMBOL}[];" in cut
    assert s2.launch_shared_bytes > patch == s1.launch_shared_bytes
    y = run_ptx(cut, rendered, x, bias, res, shared_bytes=s2.launch_shared_bytes)
    np.testing.assert_array_equal(y.view(np.uint32), run_ptx(whole, rendered, x, bias, res).view(np.uint32))
    ref = apply_epilogue(conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups),
                         rendered.epilogue, res)
    assert relative_l2(y, ref) <= 1e-5
    with pytest.raises(PtxInterpreterError):  # the state's last bytes are read: launched short, it fails
        run_ptx(cut, rendered, x, bias, res, shared_bytes=s2.launch_shared_bytes - 4)
