"""sparseconv.table, the weight-table family: the table holds every nonzero
weight once and nothing else; the kernel, compiled by nvcc as NVRTC compiles
it at run time, run in the PTX interpreter (CPU) against float64 for strides,
padding, dilation, tails and every epilogue; the tiling rule; and routing's
choice among the kernel, the table and cuDNN."""

from dataclasses import replace

import numpy as np
import pytest

from sparseconv.compile import compile_to_ptx
from sparseconv.dense import epilogue_reference, max_pool_2x2
from sparseconv.routing import TABLE, choose_route
from sparseconv.shapes import ConvShape, Epilogue, Target, pooled_hw
from sparseconv.tilings import ANY_BATCH
from sparseconv.table import (FEW_BLOCKS, LONG_SHARE, MAX_TABLE_BATCH, MAX_TAPS, TAP_BITS, VERY_FEW_BLOCKS,
                              VERY_LONG_CHANNEL, TableTiling,
                              routable_table, table_grid, table_source, table_supported, table_timed, table_tiling,
                              weight_table)
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

from ptx_interpreter import run_kernel

SHAPES = {
    "3x3-pad1": ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1)),
    "3x3-pad1-16-warps": ConvShape(24, 3, 7, 7, 3, 3, padding=(1, 1)),  # ~4 entries a warp
    "1x1-stride2": ConvShape(8, 3, 9, 9, 1, 1, stride=(2, 2)),
    "3x3-dilated-nonsquare": ConvShape(4, 3, 9, 6, 3, 3, padding=(2, 2), dilation=(2, 2)),
    "5x3-stride2-pad": ConvShape(3, 2, 11, 8, 5, 3, stride=(2, 2), padding=(2, 1)),
    "7x7-stride2-stem": ConvShape(3, 4, 12, 12, 7, 7, stride=(2, 2), padding=(3, 3)),
    "3x3-unpadded": ConvShape(4, 3, 9, 8, 3, 3),  # no padding: the kernel skips the tap test
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_table_holds_each_nonzero_weight_once_in_order(name):
    shape = SHAPES[name]
    w = pruned_weight(np.random.default_rng(0), shape.weight_shape, 0.7)
    entries, starts = weight_table(w, shape)
    assert entries.dtype == starts.dtype == np.int32
    assert entries.shape == (np.count_nonzero(w), 2) and starts.shape == (shape.out_channels + 1,)
    assert starts[0] == 0 and starts[-1] == len(entries) and np.all(np.diff(starts) >= 0)
    # rebuild the weight from the table: every nonzero where it belongs, nothing else
    rebuilt = np.zeros_like(w)
    plane = shape.in_h * shape.in_w
    for k in range(shape.out_channels):
        part = entries[starts[k]:starts[k + 1]]
        first = part[:, 0].view(np.uint32).astype(np.int64)
        offset, tap = (first >> TAP_BITS) // 4, first & (MAX_TAPS - 1)
        assert np.all((first >> TAP_BITS) % 4 == 0)
        r, s = tap // shape.kernel_w, tap % shape.kernel_w
        c = offset // plane
        # the offset is the tap's place from the receptive field's top-left
        assert np.array_equal(offset - c * plane, r * shape.dilation[0] * shape.in_w + s * shape.dilation[1])
        assert np.all(np.diff(c * MAX_TAPS + tap) > 0)  # ascending (channel, tap)
        rebuilt[k, c, r, s] = part[:, 1].view(np.float32)
    np.testing.assert_array_equal(rebuilt, w)


def test_weight_table_refuses_a_weight_of_the_wrong_shape():
    shape = SHAPES["3x3-pad1"]
    with pytest.raises(ValueError, match=r"must have shape \(5, 6, 3, 3\)"):
        weight_table(np.zeros((5, 6, 1, 1), np.float32), shape)


def test_an_all_zero_weight_gives_an_empty_table():
    shape = SHAPES["3x3-pad1"]
    entries, starts = weight_table(np.zeros(shape.weight_shape, np.float32), shape)
    assert entries.shape == (0, 2) and starts.shape == (shape.out_channels + 1,) and not starts.any()


def run_table_kernel(shape, tiling, epilogue, x, w, bias, residual=None):
    entries, starts = weight_table(w, shape)
    if not len(entries):
        entries = np.zeros((1, 2), np.int32)
    out = np.full((x.shape[0], shape.out_channels) + epilogue.output_hw(shape), 12345.0, np.float32)
    ptx = compile_to_ptx(table_source(shape, tiling, epilogue), Target(), "the table kernel")
    # the staged entries' shared memory exactly as TableConv2d sizes it: the interpreter faults past it
    staged = tiling.staged_bytes(int(np.diff(starts).max()))
    run_kernel(ptx, "sc_table_conv", grid=table_grid(shape, tiling, x.shape[0], epilogue.pool),
               block=(32 * tiling.warps, 1, 1),
               args=[x, entries, starts, bias, residual if residual is not None else np.zeros(1, np.float32), out],
               dynamic_shared_bytes=staged)
    return out


@pytest.mark.nvcc
@pytest.mark.parametrize("name,tiling,batch", [
    ("3x3-pad1", TableTiling(2, 4), 1),
    ("3x3-pad1-16-warps", TableTiling(2, 16), 1),  # table_tiling's choice on very few blocks
    ("1x1-stride2", TableTiling(1, 2), 2),
    ("3x3-dilated-nonsquare", TableTiling(1, 4), 1),
    ("5x3-stride2-pad", TableTiling(2, 8), 2),
    ("7x7-stride2-stem", TableTiling(1, 4), 1),  # 49 taps: the 64-bit mask
    ("3x3-unpadded", TableTiling(1, 2), 2),
    # the entries staged in shared memory before the wait (TableTiling.staged_entries)
    ("3x3-pad1", TableTiling(2, 4, staged_entries=True), 2),
    ("7x7-stride2-stem", TableTiling(1, 2, staged_entries=True), 1),
    ("1x1-stride2", TableTiling(2, 16, staged_entries=True), 1),
])
def test_the_kernel_computes_the_conv(name, tiling, batch):
    shape = SHAPES[name]
    rng = np.random.default_rng(1)
    w = pruned_weight(rng, shape.weight_shape, 0.7)
    x = rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    out = run_table_kernel(shape, tiling, Epilogue(), x, w, bias)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation)
    assert relative_l2(out, ref) < 1e-6


@pytest.mark.nvcc
@pytest.mark.parametrize("epilogue", [Epilogue("relu"), Epilogue("relu6", residual=True),
                                      Epilogue("clip", clip=(-0.5, 0.25)), Epilogue("clip", clip=(-np.inf, 0.1))],
                         ids=["relu", "add+relu6", "clip", "clip-no-lower"])
def test_the_epilogue_is_applied_at_the_store(epilogue):
    shape = SHAPES["3x3-pad1"]
    rng = np.random.default_rng(2)
    w = pruned_weight(rng, shape.weight_shape, 0.7)
    x = rng.standard_normal((1, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    bias[1] = np.nan  # NaN stays NaN through the clamp, as in torch
    res = rng.standard_normal((1, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32) \
        if epilogue.residual else None
    out = run_table_kernel(shape, TableTiling(2, 2), epilogue, x, w, bias, res)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding)
    if res is not None:
        ref = ref + res
    lo, hi = epilogue.bounds
    lo, hi = -np.inf if lo is None else lo, np.inf if hi is None else hi
    ref = np.where(ref < lo, lo, np.where(ref > hi, hi, ref))  # NaN compares false: kept
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out).any()
    finite = ~np.isnan(ref)
    assert relative_l2(out[finite], ref[finite]) < 1e-6


@pytest.mark.nvcc
@pytest.mark.parametrize("shape,tiling,epilogue,batch", [
    # odd sides: 7x7 pools to 3x3 (36 of its 49 pixels computed, in one block of 64)
    (ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1)), TableTiling(2, 4), Epilogue("relu", pool=True), 2),
    # 120 pixels in 4 blocks of 32 (window boundaries inside no block), entries staged
    (ConvShape(3, 4, 12, 10, 3, 3, padding=(1, 1)), TableTiling(1, 2, staged_entries=True),
     Epilogue("clip", clip=(-0.5, 0.75), pool=True), 1),
    # a strided 1x1 onto an odd-by-even output (5x4: the last row dropped), no activation
    (ConvShape(8, 3, 9, 8, 1, 1, stride=(2, 2)), TableTiling(2, 8), Epilogue(pool=True), 2),
], ids=["3x3-odd-relu", "3x3-blocks-clip-staged", "1x1-stride2-odd-rows"])
def test_a_pooling_epilogue_stores_each_windows_max(shape, tiling, epilogue, batch):
    """The table with Epilogue.pool writes, bit for bit, the 2x2 max pool of
    what it writes without it (the same sums in the same order: pooling only
    reorders the pixels), and that is the float64 conv's, pooled."""
    rng = np.random.default_rng(3)
    w = pruned_weight(rng, shape.weight_shape, 0.7)
    x = rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    bias[1] = np.nan  # a NaN channel pools to NaN, as in torch
    x[0, :, 2, 2] = np.nan  # NaN at a few pixels, some not first in their window: it wins the max there
    plain = run_table_kernel(shape, tiling, replace(epilogue, pool=False), x, w, bias)
    out = run_table_kernel(shape, tiling, epilogue, x, w, bias)
    assert out.shape == (batch, shape.out_channels) + pooled_hw(shape.out_h, shape.out_w)
    want = max_pool_2x2(plain)  # NaN propagates, as in the kernel and torch
    assert np.array_equal(np.isnan(out), np.isnan(want)) and np.isnan(out[:, 1]).all() and np.isnan(out[0, 0]).any()
    assert np.array_equal(out[~np.isnan(want)], want[~np.isnan(want)])
    ref = epilogue_reference(conv2d_reference(x, w, bias, shape.stride, shape.padding), epilogue)
    finite = ~np.isnan(ref)
    assert relative_l2(out[finite], ref[finite]) < 1e-6


def test_only_an_unpadded_layer_skips_the_tap_test():
    assert "#define UNPADDED 1" in table_source(SHAPES["3x3-unpadded"], TableTiling())
    assert "#define UNPADDED 1" in table_source(SHAPES["1x1-stride2"], TableTiling())
    assert "#define UNPADDED 0" in table_source(SHAPES["3x3-pad1"], TableTiling())


def test_table_source_refuses_what_the_family_does_not_take():
    grouped = ConvShape(4, 4, 5, 5, 3, 3, groups=2)
    assert "grouped" in table_supported(grouped)
    with pytest.raises(ValueError, match="grouped"):
        table_source(grouped, TableTiling())
    assert table_supported(SHAPES["3x3-pad1"]) is None
    assert table_supported(ConvShape(2, 2, 7, 7, 7, 7, padding=(3, 3))) is None  # 49 taps: a 64-bit mask
    assert "more than 64 taps" in table_supported(ConvShape(2, 2, 9, 9, 9, 9))
    with pytest.raises(ValueError, match="more than 64 taps"):
        weight_table(np.ones((2, 2, 9, 9), np.float32), ConvShape(2, 2, 9, 9, 9, 9))
    # routing times the table where the family takes the shape and a batch is at most MAX_TABLE_BATCH
    assert table_timed(SHAPES["3x3-pad1"], (1, 64)) and not table_timed(SHAPES["3x3-pad1"], (16, 64))
    assert not table_timed(grouped, (1, 64)) and not table_timed(SHAPES["3x3-pad1"], ())
    for bad in (dict(pixels_per_lane=0), dict(warps=3), dict(staged_entries=1)):
        with pytest.raises(ValueError):
            TableTiling(**bad)


def test_the_tiling_rule_gives_long_channels_and_small_grids_more_warps():
    """table_tiling: more warps on long channels and small grids, and the
    entries staged in shared memory (STAGE_ENTRIES) in every case."""
    layer4_conv1 = ConvShape(2048, 512, 7, 7, 1, 1)                  # 512 blocks at batch 1
    downsample = ConvShape(1024, 2048, 14, 14, 1, 1, stride=(2, 2))  # 2,048 blocks, 102 entries a channel
    vgg_conv5 = ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1))    # 2,048 blocks, 461 entries a channel
    assert table_grid(layer4_conv1, TableTiling(2, 8), 1) == (1, 512, 1)
    assert table_tiling(layer4_conv1) == TableTiling(2, 16, True)  # <= VERY_FEW_BLOCKS
    assert table_tiling(layer4_conv1, batch=2) == TableTiling(2, 8, True)  # 1,024 blocks
    assert table_tiling(downsample) == TableTiling(2, 4, True)
    assert table_tiling(vgg_conv5) == TableTiling(4, 16, True)  # > VERY_LONG_CHANNEL entries a channel, 196 pixels
    # not more: shares of 64
    assert table_tiling(vgg_conv5, nonzeros=512 * VERY_LONG_CHANNEL) == TableTiling(2, 4, True)
    assert table_tiling(vgg_conv5, nonzeros=512 * 4 * LONG_SHARE) == TableTiling(2, 4, True)  # sparser: short shares
    # as long a channel on 7x7 (ResNet-50 layer4.x.conv2): 49 pixels would fill 49 of a 128-pixel block
    assert table_tiling(ConvShape(512, 512, 7, 7, 3, 3, padding=(1, 1))) == TableTiling(2, 16, True)
    # ResNet-50 layer3.x.conv2: 230 entries a channel
    assert table_tiling(ConvShape(256, 256, 14, 14, 3, 3, padding=(1, 1))) == TableTiling(2, 8, True)
    assert table_tiling(layer4_conv1, batch=4) == TableTiling(2, 4, True)  # 2,048 blocks of 51-entry shares
    assert VERY_FEW_BLOCKS < FEW_BLOCKS < 2048


def test_a_channel_stages_its_entries_only_where_they_fit_in_shared_memory():
    from sparseconv.table import MAX_SHARED_BYTES, fitting_tiling

    staged = TableTiling(2, 8, staged_entries=True)
    assert staged.staged_bytes(230) == 8 * 230 and TableTiling(2, 8).staged_bytes(230) == 0
    assert staged.shared_bytes(230) == 4 * 8 * 64 + 8 * 230  # the warps' sums, then the entries
    assert fitting_tiling(staged, 230) == staged
    longest = (MAX_SHARED_BYTES - staged.shared_bytes(0)) // 8  # the longest channel that fits
    assert fitting_tiling(staged, longest) == staged
    assert fitting_tiling(staged, longest + 1) == TableTiling(2, 8, staged_entries=False)
    assert fitting_tiling(TableTiling(2, 8), 10 ** 6) == TableTiling(2, 8)


def test_routing_takes_the_table_where_it_is_fastest():
    times = {1: (25.0, 160.0), 64: (170.0, 660.0)}
    table = {1: 15.0}
    choice = choose_route(lambda b: times[b], [1, 64], time_table=lambda b: table.get(b))
    assert choice.route == ((8, TABLE), (ANY_BATCH, "sparseconv"))
    assert choice.table_us == ((1, 15.0),)
    assert "batch 1: sparseconv 25.0 us, table 15.0 us, cuDNN fp32 160.0 us" in choice.describe()
    assert "batch 64: sparseconv 170.0 us, cuDNN fp32 660.0 us" in choice.describe()
    # a tie keeps the kernel; cuDNN still wins where it is fastest
    assert choose_route(lambda b: (3.0, 9.0), [1], time_table=lambda b: 3.0).route == ((ANY_BATCH, "sparseconv"),)
    assert choose_route(lambda b: (3.0, 1.0), [1], time_table=lambda b: 2.0).route == ((ANY_BATCH, "dense"),)


def test_the_table_kernel_is_a_public_name_that_loads_on_first_use():
    import sparseconv
    import sparseconv.table

    assert "TableConv2d" in sparseconv.__all__ and "TableConv2d" in dir(sparseconv)
    assert sparseconv.TableConv2d is sparseconv.table.TableConv2d


def test_routing_times_no_table_where_the_family_or_the_batch_sizes_rule_it_out():
    """routable_table decides for both front ends; None before anything touches a GPU."""
    w = np.ones((4, 2, 3, 3), np.float32)
    grouped = ConvShape(4, 4, 8, 8, 3, 3, padding=(1, 1), groups=2)
    assert routable_table(w, None, grouped, Epilogue(), [1], "g") is None  # grouped: not taken by the family
    plain = ConvShape(2, 4, 8, 8, 3, 3, padding=(1, 1))
    assert routable_table(w, None, plain, Epilogue(), [MAX_TABLE_BATCH + 1, 64], "p") is None  # batches too big


@pytest.mark.nvcc
@pytest.mark.parametrize("arch, hinted", [("sm_90", True), ("sm_80", True), ("sm_75", False)])
def test_weight_loads_carry_an_l2_policy_from_sm_80_and_compile_before_it(arch, hinted):
    """sparseconv.weight_loads: the table's and the gemvs' weight loads carry an
    L2 evict-first policy where the GPU has cache policies (sm_80 on); older
    GPUs get the same kernels with plain loads, not a compile error."""
    from sparseconv.gemv import gemv_source, sparse_gemv_source

    shape = SHAPES["3x3-pad1"]
    for what, source in (("table", table_source(shape, table_tiling(shape))), ("gemv", gemv_source(1)),
                         ("sparse gemv", sparse_gemv_source(2))):
        # sm_75 through nvcc's flag: Target refuses it (the code families need sm_80), but NVRTC
        # compiles these three kernels for whatever GPU they are called on (linear_gemv, TableConv2d)
        ptx = compile_to_ptx(source, Target(), what, extra_flags=[f"-arch={arch}"])
        assert ("createpolicy.fractional.L2::evict_first" in ptx) == hinted, (what, arch)
        assert ("L2::cache_hint" in ptx) == hinted, (what, arch)
