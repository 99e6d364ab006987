"""GPU tests: specialised kernels against a float64 reference on fresh random inputs.

Outputs are poisoned with NaN before each run, so an element the kernel never
writes fails the comparison."""
import numpy as np
import pytest

import sparseconv
from sparseconv.operators import benchmark_operators
from sparseconv.shapes import Tiling, launch_grid, pixel_blocks

from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.gpu
TOL = 1e-5


def run_and_check(conv, w, bias, shape, batch, rng, stream=None):
    import cupy as cp

    x = cp.asarray(rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32))
    out = cp.full(conv.output_shape(batch), np.nan, dtype=cp.float32)
    if stream is not None:  # x and out were written on the current stream, which a non-blocking one does not wait for
        cp.cuda.get_current_stream().synchronize()
    y = conv(x, out=out, stream=stream)
    assert y is out
    if stream is not None:
        stream.synchronize()
    ref = conv2d_reference(x, cp.asarray(w), None if bias is None else cp.asarray(bias), shape.stride,
                           shape.padding, shape.dilation, shape.groups, xp=cp)
    assert y.shape == ref.shape
    assert not bool(cp.isnan(y).any()), "some outputs were never written (NaN poison left)"
    err = relative_l2(y, ref, xp=cp)
    assert err <= TOL, f"relative L2 error {err:.3g} > {TOL}"
    return err


OPERATORS = benchmark_operators()


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("op", OPERATORS, ids=[o.name for o in OPERATORS])
def test_benchmark_layer(op, sparsity, session_cache_dir):
    rng = np.random.default_rng()
    s = op.shape
    w = pruned_weight(rng, s.weight_shape, sparsity, zero_channels=1)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=bias, stride=s.stride,
                                     padding=s.padding, cache_dir=str(session_cache_dir), name=op.name)
    assert conv.stats["fmas_deleted"] >= (w.size - np.count_nonzero(w)) * conv.stats["fmas_per_weight"]
    for batch in (1, 3):
        run_and_check(conv, w, bias, s, batch, rng)


def _pointwise(loads, k_block, c_block, threads, pixels, slices=1):
    """A pointwise tiling whose chunk input is `loads` (Tiling.input_loads)."""
    return Tiling(k_block, c_block, 1, threads * pixels, 1, pixels, family="pointwise", slices=slices,
                  input_loads=loads)


ODD_LAYERS = {
    # name: (C, K, H, W, R, S, stride, padding, dilation, groups, tiling or None)
    "strided_rect": (3, 4, 5, 7, 3, 3, (2, 2), (1, 1), (1, 1), 1, None),
    "stride_2x1_pad_0x2": (5, 6, 9, 13, 3, 5, (2, 1), (0, 2), (1, 1), 1, None),
    "dilated": (8, 12, 17, 15, 3, 3, (1, 1), (2, 2), (2, 2), 1, None),
    "dilated_asym": (4, 5, 12, 19, 3, 2, (1, 2), (3, 1), (2, 3), 1, None),
    "grouped": (12, 18, 10, 10, 3, 3, (1, 1), (1, 1), (1, 1), 3, None),
    "depthwise": (16, 16, 14, 14, 3, 3, (1, 1), (1, 1), (1, 1), 16, None),
    "depthwise_mult2_stride2": (8, 16, 15, 15, 5, 5, (2, 2), (2, 2), (1, 1), 8, None),
    # 5x5 depthwise at 2 pixels a thread (outputs of 28x28 and more), odd sizes, a tap test a tap
    "depthwise_5x5_two_pixels": (6, 6, 31, 29, 5, 5, (1, 1), (2, 2), (1, 1), 6, None),
    # 5x5 depthwise at 4 groups a block, 2 blocks an SM, a pointer a tap (session 44), strided, odd sizes
    "depthwise_5x5_4_groups_a_block": (12, 12, 23, 17, 5, 5, (2, 2), (2, 2), (1, 1), 12, None),
    "pointwise": (24, 40, 7, 9, 1, 1, (1, 1), (0, 0), (1, 1), 1, None),
    "kernel_7x1": (6, 10, 11, 6, 7, 1, (1, 1), (3, 0), (1, 1), 1, None),
    "k1_c1": (1, 1, 4, 4, 2, 2, (1, 1), (0, 0), (1, 1), 1, None),
    "image_1x1": (7, 9, 1, 1, 1, 1, (1, 1), (0, 0), (1, 1), 1, None),
    "kernel_wider_than_image": (3, 5, 3, 4, 3, 5, (1, 1), (1, 2), (1, 1), 1, None),
    "odd_tiling_thread_h2": (10, 13, 19, 23, 3, 3, (1, 1), (1, 1), (1, 1), 1, Tiling(5, 3, 6, 12, 2, 3)),
    "tiling_tile_bigger_than_image": (4, 6, 5, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1, Tiling(3, 2, 8, 8, 1, 2)),
    # issue 11 defect 3: chunk loops small enough that NVVM used to unroll them
    "one_input_channel_1x1": (1, 64, 8, 8, 1, 1, (1, 1), (0, 0), (1, 1), 1, None),
    "two_input_channels_1x1_on_1x1": (2, 8, 1, 1, 1, 1, (1, 1), (0, 0), (1, 1), 1, None),
    # the pointwise family's chunk input staged by cp.async (Tiling.input_loads): a padded 3x3 whose last
    # chunk is half past the channels, a k-block tail; a strided 1x1 at 2 pixels a thread; a conv4_2-like
    # block past 48 KB of shared memory (138 KB, opted in); a split reduction
    "staged_3x3_padded_chunks": (10, 13, 12, 11, 3, 3, (1, 1), (1, 1), (1, 1), 1, _pointwise("staged", 8, 4, 64, 1)),
    "staged_1x1_stride2_2px": (24, 40, 15, 13, 1, 1, (2, 2), (0, 0), (1, 1), 1, _pointwise("staged", 16, 8, 128, 2)),
    "staged_3x3_138KB": (64, 40, 14, 14, 3, 3, (1, 1), (1, 1), (1, 1), 1, _pointwise("staged", 32, 2, 640, 1)),
    "staged_3x3_split": (32, 16, 9, 9, 3, 3, (1, 1), (1, 1), (1, 1), 1, _pointwise("staged", 16, 2, 64, 1, slices=2)),
    # and prefetched into L1 (Tiling.input_loads "prefetched"): a padded last chunk; a split, 2 pixels a thread
    "prefetched_3x3_padded_chunks": (10, 13, 12, 11, 3, 3, (1, 1), (1, 1), (1, 1), 1,
                                     _pointwise("prefetched", 8, 4, 64, 1)),
    "prefetched_1x1_stride2_split": (24, 40, 15, 13, 1, 1, (2, 2), (0, 0), (1, 1), 1,
                                     _pointwise("prefetched", 16, 4, 128, 2, slices=2)),
}


@pytest.mark.parametrize("sparsity", [0.0, 0.7, 0.95])
@pytest.mark.parametrize("name", sorted(ODD_LAYERS))
def test_odd_layer(name, sparsity, session_cache_dir):
    rng = np.random.default_rng()
    c, k, h, wd, r, s, stride, padding, dilation, groups, tiling = ODD_LAYERS[name]
    w = pruned_weight(rng, (k, c // groups, r, s), sparsity, zero_channels=1 if k > 1 else 0)
    bias = rng.standard_normal(k).astype(np.float32) if name != "k1_c1" else None
    conv = sparseconv.compile_conv2d(w, input_size=(h, wd), bias=bias, stride=stride, padding=padding,
                                     dilation=dilation, groups=groups, tiling=tiling,
                                     cache_dir=str(session_cache_dir), name=name)
    for batch in (1, 3):
        run_and_check(conv, w, bias, conv.shape, batch, rng)


def test_compile_conv2d_with_an_explicit_target(session_cache_dir):
    """Issue 11 defect 9: target= builds for the named target; the kernel
    loads and computes on the current device."""
    from sparseconv.runtime import device_target

    rng = np.random.default_rng(2)
    w = pruned_weight(rng, (6, 5, 3, 3), 0.8)
    target = device_target()
    conv = sparseconv.compile_conv2d(w, input_size=(9, 11), padding=1, target=target,
                                     cache_dir=str(session_cache_dir), name="explicit_target")
    assert conv.layer.target == target
    run_and_check(conv, w, None, conv.shape, 2, rng)


def test_all_zero_weights_write_bias_or_zero(session_cache_dir):
    import cupy as cp

    rng = np.random.default_rng()
    w = np.zeros((6, 4, 3, 3), np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    for b in (None, bias):
        conv = sparseconv.compile_conv2d(w, input_size=(9, 9), bias=b, padding=1, cache_dir=str(session_cache_dir))
        assert conv.stats["fmas_kept"] == 0
        x = cp.asarray(rng.standard_normal((2, 4, 9, 9)).astype(np.float32))
        y = conv(x, out=cp.full((2, 6, 9, 9), np.nan, cp.float32))
        want = np.zeros((2, 6, 9, 9), np.float32) + (0 if b is None else b[None, :, None, None])
        np.testing.assert_array_equal(cp.asnumpy(y), want)


def test_nonfinite_weights_match_reference(session_cache_dir):
    """NaN/Inf weights are accepted and give what the reference gives (padding
    zeros times NaN or Inf is NaN there too)."""
    import cupy as cp

    rng = np.random.default_rng()
    w = pruned_weight(rng, (4, 3, 3, 3), 0.5)
    w[0, 0, 1, 1] = np.nan
    w[1, 2, 0, 0] = np.inf
    w[2, 1, 2, 2] = -np.inf
    conv = sparseconv.compile_conv2d(w, input_size=(6, 7), padding=1, cache_dir=str(session_cache_dir))
    x = cp.asarray(rng.standard_normal((2, 3, 6, 7)).astype(np.float32))
    y = cp.asnumpy(conv(x))
    ref = cp.asnumpy(conv2d_reference(x, cp.asarray(w), padding=(1, 1), xp=cp))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(y), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(y), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert finite.any() and (~finite).any()
    assert relative_l2(y[finite], ref[finite]) <= TOL


def test_large_batch_and_stream_and_torch(session_cache_dir):
    import cupy as cp

    rng = np.random.default_rng()
    w = pruned_weight(rng, (8, 4, 3, 3), 0.8)
    conv = sparseconv.compile_conv2d(w, input_size=(8, 8), padding=1, cache_dir=str(session_cache_dir))
    stream = cp.cuda.Stream(non_blocking=True)
    run_and_check(conv, w, None, conv.shape, 70, rng, stream=stream)
    torch = pytest.importorskip("torch")
    xt = torch.randn(2, 4, 8, 8, device="cuda")
    with torch.no_grad():
        y = conv(xt, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    ref = conv2d_reference(cp.asarray(xt), cp.asarray(w), padding=(1, 1), xp=cp)
    assert relative_l2(y, ref, xp=cp) <= TOL


def test_call_time_checks(session_cache_dir):
    import cupy as cp

    rng = np.random.default_rng()
    w = pruned_weight(rng, (4, 3, 3, 3), 0.5)
    conv = sparseconv.compile_conv2d(w, input_size=(6, 6), cache_dir=str(session_cache_dir), name="check")
    good = cp.asarray(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    with pytest.raises(TypeError, match="NumPy"):
        conv(cp.asnumpy(good))
    with pytest.raises(TypeError, match="float32"):
        conv(good.astype(cp.float64))
    with pytest.raises(ValueError, match=r"\(N, 3, 6, 6\)"):
        conv(good[:, :2])
    with pytest.raises(ValueError, match="C-contiguous"):
        conv(cp.asarray(rng.standard_normal((2, 3, 6, 12)).astype(np.float32))[:, :, :, ::2])
    with pytest.raises(ValueError, match="out must be"):
        conv(good, out=cp.empty((2, 4, 4, 5), cp.float32))
    with pytest.raises(TypeError, match="stream"):
        conv(good, stream="default")
    assert conv(good[:0]).shape == (0, 4, 4, 4)


# --------------------------------------------------------------------------- kernel families, split variants, epilogues

FAMILY_LAYERS = {
    # name: ConvShape args (C, K, H, W, R, S, stride, padding): real-network classes
    # ResNet layer1 1x1; at batch 1 16-channel blocks of 512 threads (tilings.expanding_pointwise_blocks)
    "pointwise_56": (64, 256, 56, 56, 1, 1, (1, 1), (0, 0)),
    "pointwise_downsample_s2": (512, 1024, 28, 28, 1, 1, (2, 2), (0, 0)),
    "pointwise_deep_7x7": (2048, 512, 7, 7, 1, 1, (1, 1), (0, 0)),    # split variant at small batch
    "pointwise_grouped_13x13": (1024, 256, 13, 13, 1, 1, (1, 1), (0, 0)),  # batch 33: L2 groups, one extra block
    "pointwise_padded": (24, 40, 9, 9, 1, 1, (1, 1), (1, 1)),
    "pointwise_odd_channels": (37, 19, 11, 13, 1, 1, (1, 1), (0, 0)),
    "wide_deep_7x7": (512, 512, 7, 7, 3, 3, (1, 1), (1, 1)),          # 3x3 on the pointwise family, split
    "wide_14x14": (256, 256, 14, 14, 3, 3, (1, 1), (1, 1)),
    # batch 33 runs these four on tilings refitted to the waves of batch 64 (tilings.wave_fitted_tiling):
    # wide_deep_7x7 20 channels x 640 threads, wide_14x14 52 x 512, the two below 52 x 256 and 40 x 640
    "pointwise_deep_14x14_two_an_sm": (1024, 256, 14, 14, 1, 1, (1, 1), (0, 0)),
    "wide_deep_14x14": (512, 512, 14, 14, 3, 3, (1, 1), (1, 1)),
    "wide_strided_14_to_7": (512, 512, 14, 14, 3, 3, (2, 2), (1, 1)),
    "mixed_28x28": (128, 128, 28, 28, 3, 3, (1, 1), (1, 1)),           # pointwise, its split variant direct
    "mixed_56x56": (64, 64, 56, 56, 3, 3, (1, 1), (1, 1)),             # pointwise, its split variant direct
    # its split variant direct with 4 channels a chunk (tilings.SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS)
    # (64x64: at 56x56 and below, 256 channels take tilings.whole_image_split)
    "mixed_64x64_wide_chunk": (256, 64, 64, 64, 3, 3, (1, 1), (1, 1)),
    # its split variant one 800-thread pointwise block over the image (tilings.whole_image_split)
    "deep_28x28_whole_image": (256, 64, 28, 28, 3, 3, (1, 1), (1, 1)),
    # ... and four such blocks over the 56x56 image
    "deep_56x56_whole_image": (256, 32, 56, 56, 3, 3, (1, 1), (1, 1)),
    # ... and with 128 input channels, in 2 slices
    "mid_56x56_whole_image": (128, 32, 56, 56, 3, 3, (1, 1), (1, 1)),
    # its batch-1 variant 800-thread blocks of 16 channels, unsplit (tilings.large_image_blocks)
    "mid_112x112_large_image": (64, 32, 112, 112, 3, 3, (1, 1), (1, 1)),
    "direct_56x56": (32, 32, 56, 56, 3, 3, (1, 1), (1, 1)),            # split variant at small batch
    # the image layer: 16-channel blocks of 256 threads at batch 1 (tilings.image_layer_blocks)
    "direct_image_layer": (3, 64, 224, 224, 7, 7, (2, 2), (3, 3)),
}


# the families' layers whose any-batch tiling is refitted: (k_block, threads) a block
WAVE_FITTED_LAYERS = {"wide_deep_7x7": (20, 640), "wide_14x14": (52, 512),
                      "pointwise_deep_14x14_two_an_sm": (52, 256), "wide_deep_14x14": (40, 640)}


def _family_shape(name):
    from sparseconv.shapes import ConvShape

    c, k, h, w, r, s, st, pad = FAMILY_LAYERS[name]
    return ConvShape(c, k, h, w, r, s, st, pad)


@pytest.mark.parametrize("name", sorted(FAMILY_LAYERS))
def test_kernel_families_and_their_batch_variants(name, session_cache_dir):
    """Each layer class through its default family, at batch sizes that take
    the split variant (where the layer has one) and the unsplit one."""
    rng = np.random.default_rng()
    s = _family_shape(name)
    w = pruned_weight(rng, s.weight_shape, 0.9, zero_channels=1)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=bias, stride=s.stride, padding=s.padding,
                                     cache_dir=str(session_cache_dir), name=name)
    assert conv.layer.tiling.family == ("direct" if name.startswith("direct") else "pointwise")
    if name.startswith("mixed"):  # measured faster split on the direct family (tilings.SMALL_BATCH_POINTWISE_OUTPUT)
        assert conv.variant(1)[1].tiling.family == "direct"
        assert conv.variant(1)[1].tiling.c_block == (4 if name.endswith("wide_chunk") else 2)
    if name.endswith("whole_image"):
        from sparseconv.tilings import whole_image_split

        assert conv.variant(1)[1].tiling == whole_image_split(s) and whole_image_split(s).threads == 800
        assert launch_grid(s, whole_image_split(s), 1)[0] == (1 if s.out_h == 28 else 4)  # pixel blocks
    if name.endswith("image_layer"):
        from sparseconv.tilings import default_tiling, image_layer_blocks

        assert conv.variant(1)[1].tiling == image_layer_blocks(s, default_tiling(s))
        assert conv.variant(2)[1].tiling == default_tiling(s)
    if name == "pointwise_56":
        from sparseconv.tilings import default_tiling, expanding_pointwise_blocks

        assert conv.variant(1)[1].tiling == expanding_pointwise_blocks(s, default_tiling(s))
        assert conv.variant(1)[1].tiling.threads == 512 and conv.variant(2)[1].tiling == default_tiling(s)
    if name.endswith("large_image"):
        from sparseconv.tilings import large_image_blocks

        assert conv.variant(1)[1].tiling == large_image_blocks(s)
        assert launch_grid(s, large_image_blocks(s), 1) == (16, 2, 1)  # 16 pixel blocks x 2 k-blocks
    if name in WAVE_FITTED_LAYERS:
        from sparseconv.tilings import default_tiling, wave_fitted_tiling

        fitted = wave_fitted_tiling(s, default_tiling(s))
        assert conv.variant(33)[1].tiling == fitted != default_tiling(s)
        assert (fitted.k_block, fitted.threads) == WAVE_FITTED_LAYERS[name]
    variants = conv.stats.get("variants")
    batches = (1, 2, 33) if variants else (1, 5)
    for batch in batches:
        run_and_check(conv, w, bias, s, batch, rng)
    if name == "pointwise_grouped_13x13":  # the batch-33 run had a block past the batch in its last group
        gx, _, gz = conv.variant(33)[1].grid(33)
        assert gz > 1 and gx * gz > pixel_blocks(s, conv.variant(33)[1].tiling, 33)
    if "deep" in name or name.startswith("mixed") or name == "direct_56x56":
        assert variants and variants[0]["up_to_batch"] >= 1, "a deep small layer gets a split variant"


@pytest.mark.parametrize("activation,clip", [("relu", None), ("relu6", None), ("clip", (-0.3, 0.4))])
@pytest.mark.parametrize("name", ["pointwise_deep_7x7", "wide_14x14", "mixed_28x28", "mixed_56x56", "direct_56x56",
                                  "pointwise_56"])
def test_fused_epilogue_residual_and_activation(name, activation, clip, session_cache_dir):
    """y = act(conv(x) + bias + residual), against float64, through both
    variants of a split layer; residual may be the output buffer itself."""
    import cupy as cp

    rng = np.random.default_rng()
    s = _family_shape(name)
    w = pruned_weight(rng, s.weight_shape, 0.9)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=bias, stride=s.stride, padding=s.padding,
                                     activation=activation, clip=clip, residual=True,
                                     cache_dir=str(session_cache_dir), name=f"{name}-{activation}")
    lo, hi = {"relu": (0.0, None), "relu6": (0.0, 6.0), "clip": clip}[activation]
    for batch in (1, 9):
        x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
        r = cp.asarray(rng.standard_normal(conv.output_shape(batch)).astype(np.float32))
        ref = conv2d_reference(x, cp.asarray(w), cp.asarray(bias), s.stride, s.padding, xp=cp) + r
        ref = cp.maximum(ref, lo) if lo is not None else ref
        ref = cp.minimum(ref, hi) if hi is not None else ref
        y = conv(x, residual=r)
        assert relative_l2(y, ref, xp=cp) <= TOL
        inplace = r.copy()
        conv(x, out=inplace, residual=inplace)  # the residual's buffer as the output
        assert relative_l2(inplace, ref, xp=cp) <= TOL
    with pytest.raises(ValueError, match="residual"):
        conv(x)


def test_split_reduction_is_deterministic(session_cache_dir):
    """The slices are added in a fixed order: the same input gives bit-identical
    outputs run after run."""
    import cupy as cp

    rng = np.random.default_rng()
    s = _family_shape("pointwise_deep_7x7")
    w = pruned_weight(rng, s.weight_shape, 0.9)
    conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), cache_dir=str(session_cache_dir),
                                     name="determinism")
    assert conv.variant(1)[1].tiling.slices > 1
    x = cp.asarray(rng.standard_normal((1, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
    first = conv(x)
    for _ in range(5):
        assert bool((conv(x) == first).all())


@pytest.mark.parametrize("name", ["pointwise_deep_7x7", "wide_14x14", "mixed_28x28", "wide_strided_14_to_7"])
def test_cluster_sum_matches_reference_and_the_workspace_sum(name, session_cache_dir):
    """The split variant with its slices summed inside a thread-block cluster
    (8 or 16 blocks, pointwise and direct families), residual and ReLU fused:
    within TOL of float64, and bit-identical to the same tiling summed through
    the workspace and the reduction kernel (the same order of additions)."""
    import cupy as cp
    from dataclasses import replace

    from sparseconv.tilings import variant_for_batch

    rng = np.random.default_rng()
    s = _family_shape(name)
    w = pruned_weight(rng, s.weight_shape, 0.9)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    split = variant_for_batch(s, 1)
    assert split.slices > 1
    convs = {how: sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=bias, stride=s.stride,
                                            padding=s.padding, activation="relu", residual=True,
                                            tiling=replace(split, slice_sum=how),
                                            cache_dir=str(session_cache_dir), name=f"{name}-{how}")
             for how in ("cluster", "kernel")}
    assert convs["cluster"].layer.tiling.slice_sum == "cluster"
    for batch in (1, 3):
        x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
        r = cp.asarray(rng.standard_normal(convs["cluster"].output_shape(batch)).astype(np.float32))
        ref = cp.maximum(conv2d_reference(x, cp.asarray(w), cp.asarray(bias), s.stride, s.padding, xp=cp) + r, 0)
        ys = {how: conv(x, out=cp.full(conv.output_shape(batch), np.nan, cp.float32), residual=r)
              for how, conv in convs.items()}
        assert relative_l2(ys["cluster"], ref, xp=cp) <= TOL
        assert bool((ys["cluster"].view(cp.uint32) == ys["kernel"].view(cp.uint32)).all())


def test_pieces_with_their_state_in_dynamic_shared_memory(session_cache_dir):
    """VGG-16 conv5_2's batch-64 tiling (64 output channels a thread, 512
    threads) on 512 input channels: its k-block is cut into pieces whose loop
    state (66 registers x 512 threads, 132 KB) goes through dynamic shared
    memory past 48 KB, which the kernel opts in to at load."""
    rng = np.random.default_rng()
    s = sparseconv.ConvShape(512, 64, 14, 14, 3, 3, padding=(1, 1))
    w = pruned_weight(rng, s.weight_shape, 0.9)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    tiling = Tiling(64, 4, 1, 512, 1, 1, family="pointwise")
    conv = sparseconv.compile_conv2d(w, input_size=(14, 14), bias=bias, padding=1, tiling=tiling,
                                     cache_dir=str(session_cache_dir), name="dynamic_state")
    assert conv.stats["pieces"] > conv.stats["kblocks"] == 1
    assert conv.layer.shared_bytes == conv.stats["launch_shared_bytes"] > 48 * 1024
    for batch in (1, 2):
        run_and_check(conv, w, bias, s, batch, rng)
