"""CPU: the kernel-family records (sparseconv.shapes) and rules (sparseconv.tilings): tilings of
each family, split-K variants, batch variants, launch grids, the epilogue."""
import math
from dataclasses import replace

import numpy as np
import pytest

from sparseconv.build import build_conv2d
from sparseconv.render import epilogue_code, render, template_name
import sparseconv.shapes as shapes
import sparseconv.tilings as tilings
from sparseconv.shapes import (L2_GROUP_BYTES, MAX_GRID_Z, ConvShape, Epilogue, Tiling, check_tiling, launch_grid,
                               max_batch_per_launch, n_chunks, n_kblocks, padded_channels, patch_buffer_bytes,
                               pixel_blocks, pixel_group)
from sparseconv.tilings import ONE_WAVE
from sparseconv.tilings import (ANY_BATCH, COLD_SPLIT_MAX_PIXELS, COLD_SPLIT_TWO_WAVE_MAX_THREADS, MAX_SPLIT_BATCH,
                                SMALL_BATCH_POINTWISE_OUTPUT, batch_variants, blocks_per_image, candidate_tilings,
                                default_direct_tiling, default_tiling, pointwise_tiling, small_batch_tiling)
from sparseconv.shapes import INPUT_STAGES, MAX_PATCH_BYTES, Target, dynamic_shared_bytes, staged_input_bytes
from sparseconv.tilings import (WHOLE_IMAGE_SPLIT_C_BLOCK, WHOLE_IMAGE_SPLIT_K_BLOCK, WHOLE_IMAGE_SPLIT_MID_CHANNELS,
                                WHOLE_IMAGE_SPLIT_MID_SLICES, WHOLE_IMAGE_SPLIT_SLICES)
from sparseconv.tilings import (CLUSTER_WAVE_SMS, SPLIT_DIRECT_WIDE_C_BLOCK, SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS,
                                WHOLE_IMAGE_SPLIT_MAX_THREADS, WHOLE_IMAGE_SPLIT_MIN_CHANNELS, large_image_blocks,
                                register_resident_blocks, summed_in_cluster, variant_for_batch, whole_image_split,
                                widest_fitting_chunk)
from sparseconv.zoo import mnasnet1_0, mobilenet_v2, resnet50, resnext50, vgg16


def test_1x1_convs_get_the_pointwise_family_by_depth():
    shallow = default_tiling(ConvShape(64, 256, 56, 56, 1, 1))
    assert (shallow.family, shallow.k_block, shallow.threads) == ("pointwise", 64, 128)
    # 512 threads an SM either way: one block below 512 inputs, two capped blocks of 256 from there
    assert default_tiling(ConvShape(256, 256, 56, 56, 1, 1)).threads == 256
    assert default_tiling(ConvShape(512, 256, 28, 28, 1, 1)).threads * 2 == 512
    assert default_tiling(ConvShape(1024, 256, 14, 14, 1, 1)).threads * 2 == 512
    assert default_tiling(ConvShape(256, 512, 56, 56, 1, 1, (2, 2))).threads == 256
    narrow = default_tiling(ConvShape(512, 128, 28, 28, 1, 1))  # one block of 128 covers K: x read once
    assert (narrow.k_block, narrow.threads) == (128, 128)
    assert default_tiling(ConvShape(32, 32, 56, 56, 3, 3, padding=(1, 1))).family == "direct"


def test_1x1_exceptions_chosen_on_cold_times():
    """Widening layers from 128 inputs: 32 channels x 128 threads, 4 blocks
    per SM; strided from 512 inputs: 64 x 256, 2 blocks per SM; 7x7 images:
    32 x 512 (tilings.default_pointwise_tiling)."""
    rows = {ConvShape(128, 512, 28, 28, 1, 1): (32, 128, 4),              # layer2.x.conv3
            ConvShape(512, 2048, 7, 7, 1, 1): (32, 128, 4),               # layer4.x.conv3
            ConvShape(64, 256, 56, 56, 1, 1): (64, 128, 1),               # layer1.x.conv3: old rule
            ConvShape(512, 1024, 28, 28, 1, 1, (2, 2)): (64, 256, 2),     # layer3.0.downsample
            ConvShape(512, 256, 28, 28, 1, 1): (32, 256, 2),              # layer3.0.conv1 (DEEP_POINTWISE_...)
            ConvShape(1024, 1024, 14, 14, 1, 1): (64, 256, 2),            # ResNeXt-50 layer4.0.conv1
            ConvShape(1024, 256, 14, 14, 1, 1): (64, 256, 2),             # layer3.x.conv1
            ConvShape(256, 128, 56, 56, 1, 1): (128, 128, 1),             # layer2.0.conv1: one block covers K
            ConvShape(256, 256, 56, 56, 1, 1): (64, 256, 1),              # ResNeXt-50 layer2.0.conv1: below
            ConvShape(1024, 2048, 14, 14, 1, 1, (2, 2)): (64, 256, 2),    # layer4.0.downsample
            ConvShape(2048, 512, 7, 7, 1, 1): (32, 512, 1),               # layer4.x.conv1
            ConvShape(1024, 512, 14, 14, 1, 1): (32, 256, 2)}             # layer4.0.conv1: by waves, below
    for shape, want in rows.items():
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.threads, t.min_blocks) == ("pointwise",) + want, shape.describe()
    assert default_tiling(ConvShape(128, 512, 28, 28, 1, 1)).max_registers == 128
    linear_like = default_tiling(ConvShape(4096, 1000, 1, 1, 1, 1))  # one pixel: not the 7x7 rule
    assert (linear_like.k_block, linear_like.threads) == (64, 512)


def test_deep_1x1_with_1024_inputs_takes_32_or_64_channels_by_waves():
    """From 1,024 inputs a deep 1x1 takes 32-channel blocks only where their
    waves of two blocks an SM at batch 64, each counted at 0.6 of a wave of
    64-channel blocks, come to less (tilings.deep_pointwise_tiling)."""
    from sparseconv.tilings import NARROW_DEEP_POINTWISE_WAVE_COST, large_batch_waves

    def waves(shape, k_block):
        return large_batch_waves(shape, replace(default_tiling(shape), k_block=k_block))
    # (K, image): 64-channel waves, 32-channel waves, the choice
    for k, hw, wide, narrow, want in [(512, 14, 2, 3, 32),     # ResNeXt-50 layer3.x.conv1: 2 > 3 x 0.6
                                      (256, 14, 1, 2, 64),     # ResNet-50 layer3.x.conv1: 1 < 1.2
                                      (1024, 14, 3, 6, 64),    # ResNeXt-50 layer4.0.conv1: 3 < 3.6
                                      (512, 28, 7, 13, 64)]:   # 4x the pixels, groups rounded up: 7 < 7.8
        shape = ConvShape(1024, k, hw, hw, 1, 1)
        assert (waves(shape, 64), waves(shape, 32)) == (wide, narrow), shape.describe()
        assert (narrow * NARROW_DEEP_POINTWISE_WAVE_COST < wide) == (want == 32)
        assert default_tiling(shape).k_block == want, shape.describe()
    # below 1,024 inputs, 32 whatever the waves (here 13 x 0.6 > 7: by waves it would be 64);
    # 7x7 images take their own rule
    below = ConvShape(512, 512, 28, 28, 1, 1)                 # ResNeXt-50 layer3.0.conv1
    assert (waves(below, 64), waves(below, 32)) == (7, 13)
    assert default_tiling(below).k_block == 32
    assert default_tiling(ConvShape(1024, 512, 7, 7, 1, 1)).threads == 512


def test_deep_defaults_are_refitted_to_the_waves_of_batch_64_only_where_a_wave_was_short():
    """The any-batch tiling of a deep pointwise default takes fewer output
    channels (and at one block an SM up to 640 threads) where that fills the
    waves of batch 64 with less code a block (tilings.wave_fitted_tiling); the
    layers probed in session 49, and those left as they were."""
    from sparseconv.tilings import (SMALL_GRID_BATCH, WAVE_FIT_MAX_THREADS, WAVE_FIT_OTHER_REGISTERS, code_variants,
                                    large_batch_waves as waves, wave_fitted_tiling)

    layers = {**{f"resnet50:{n}": s for n, s in resnet50()}, **{f"vgg16:{n}": s for n, s in vgg16()}}
    # layer: (k_block, threads, blocks at batch 64) before -> after
    changed = {"resnet50:layer3.1.conv2": ((64, 512, 104), (52, 512, 130)),
               "resnet50:layer4.1.conv2": ((32, 512, 112), (20, 640, 130)),
               "resnet50:layer3.1.conv1": ((64, 256, 196), (52, 256, 245)),
               "vgg16:conv5_1": ((64, 512, 224), (40, 640, 260))}
    for name, (before, after) in changed.items():
        shape = layers[name]
        base, fitted = default_tiling(shape), variant_for_batch(shape, SMALL_GRID_BATCH)
        for t, (k_block, threads, blocks) in ((base, before), (fitted, after)):
            gx, gy, gz = launch_grid(shape, t, SMALL_GRID_BATCH)
            assert (t.k_block, t.threads, gx * gy * gz) == (k_block, threads, blocks), name
        assert waves(shape, fitted) == waves(shape, base), name      # no wave added
        assert fitted.min_blocks == base.min_blocks and fitted.threads <= WAVE_FIT_MAX_THREADS
        assert fitted.k_block + WAVE_FIT_OTHER_REGISTERS <= fitted.max_registers
        check_tiling(shape, fitted)
        assert variant_for_batch(shape, 1) == variant_for_batch(shape, 1, base), name  # small batches as before
        # where the table runs small batches, the one code variant built is the fitted one too
        assert code_variants(shape, base, table_at_small_batches=True)[-1][1] == fitted, name
    # a full wave already (layer4.0.conv2: 128 of 132 blocks), a strided 3x3 whose
    # fewer channels would add a wave, 28x28 layers of ~6 full waves, a 1x1 whose gain is under 5%
    for name in ["resnet50:layer4.0.conv2", "resnet50:layer3.0.conv2", "vgg16:conv4_2",
                 "resnet50:layer4.0.downsample", "resnet50:layer3.0.conv1"]:
        shape = layers[name]
        assert variant_for_batch(shape, SMALL_GRID_BATCH) == default_tiling(shape), name
    # only defaults are refitted: a tiling the caller names is built as named
    shape = layers["resnet50:layer3.1.conv2"]
    named = pointwise_tiling(shape, 64, 1, 512)
    assert batch_variants(shape, replace(named, c_block=2))[-1][1] == replace(named, c_block=2)
    assert wave_fitted_tiling(shape, replace(named, thread_w=2, tile_w=1024)).thread_w == 2  # not its kind
    # grouped and depthwise layers keep their rules: no ResNeXt-50, MobileNetV2 or MNASNet layer moves
    for net in (resnext50, mobilenet_v2, mnasnet1_0):
        for name, shape in net():
            assert variant_for_batch(shape, SMALL_GRID_BATCH) == batch_variants(shape, default_tiling(shape))[-1][1]
            assert batch_variants(shape, default_tiling(shape))[-1][1] == default_tiling(shape), name


def test_depthwise_convs_get_the_pointwise_family_with_the_batch_in_the_pixels():
    """One input channel a group (MobileNet's 3x3): the pointwise family, 256
    threads x 1 pixel, or 128 threads x 2 pixels at outputs of 28x28 or more;
    the direct family gave each block one channel of one image (sessions
    41-42). With one output channel a group, up to 4 groups a block
    (c_block = k_block = G, session 43); with more, one group's output
    channels a block (up to 8)."""
    for shape, k_block, threads, pixels, groups_a_block in [
            (ConvShape(32, 32, 112, 112, 3, 3, padding=(1, 1), groups=32), 4, 128, 2, 4),
            (ConvShape(144, 144, 56, 56, 3, 3, (2, 2), (1, 1), groups=144), 4, 128, 2, 4),   # 28x28 out
            (ConvShape(192, 192, 28, 28, 3, 3, (2, 2), (1, 1), groups=192), 4, 256, 1, 4),   # 14x14 out
            (ConvShape(960, 960, 7, 7, 3, 3, padding=(1, 1), groups=960), 4, 256, 1, 4),
            (ConvShape(96, 96, 112, 112, 3, 3, (2, 2), (1, 1), groups=96), 4, 128, 2, 4),
            (ConvShape(6, 6, 9, 9, 3, 3, padding=(1, 1), groups=6), 3, 256, 1, 3),           # 4 does not divide 6
            (ConvShape(7, 7, 9, 9, 3, 3, padding=(1, 1), groups=7), 1, 256, 1, 1),
            (ConvShape(8, 8, 9, 9, 3, 3, groups=8), 1, 256, 1, 1),                          # unpadded: no tap tests
            (ConvShape(8, 16, 15, 15, 3, 3, (2, 2), (1, 1), groups=8), 2, 256, 1, 1),     # multiplier 2
            (ConvShape(4, 64, 9, 9, 3, 3, padding=(1, 1), groups=4), 8, 256, 1, 1)]:      # 16 a group
        assert tilings.is_depthwise(shape) and not tilings.is_shallow_grouped(shape)
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.c_block, t.threads, t.thread_w) == \
            ("pointwise", k_block, groups_a_block, threads, pixels), shape.describe()
        check_tiling(shape, t)
        kernel = shapes.kernel_shape(shape, t)
        assert kernel == replace(shape, groups=shape.groups // groups_a_block)
        assert shapes.kernel_shape(kernel, t) == kernel  # idempotent
        # the whole batch, any size, in one variant: no split (one chunk) and no batch-1 blocks
        assert batch_variants(shape, t) == [(ANY_BATCH, t)]
        assert launch_grid(shape, t, 64)[1] == n_kblocks(shape, t) == \
            shape.groups // groups_a_block * -(-shape.k_per_group * groups_a_block // k_block)
    with pytest.raises(ValueError, match="3 depthwise groups a block must divide the 8 groups"):
        check_tiling(ConvShape(8, 8, 9, 9, 3, 3, padding=(1, 1), groups=8), Tiling(3, 3, 1, 64, 1, 1, 1, "pointwise"))
    dw = [s for _, s in mobilenet_v2() if s.groups > 1]
    assert len(dw) == 17 and all(default_tiling(s).family == "pointwise" for s in dw)
    # 5x5 depthwise (MNASNet's, session 43) takes the pointwise family too: 4 groups a block at 1 pixel
    # a thread and 2 blocks an SM, a pointer a tap (session 44), or where 4 does not divide the groups
    # one group a block (2 measured slower), with a tap test a tap; 7x7 stays direct
    for shape, groups_a_block, pixels, min_blocks in [
            (ConvShape(120, 120, 28, 28, 5, 5, padding=(2, 2), groups=120), 4, 1, 2),
            (ConvShape(480, 480, 14, 14, 5, 5, padding=(2, 2), groups=480), 4, 1, 2),
            (ConvShape(72, 72, 56, 56, 5, 5, (2, 2), (2, 2), groups=72), 4, 1, 2),
            (ConvShape(90, 90, 28, 28, 5, 5, padding=(2, 2), groups=90), 1, 2, 1),    # 2 divides, 4 does not
            (ConvShape(6, 6, 14, 14, 5, 5, padding=(2, 2), groups=6), 1, 1, 1)]:
        assert tilings.is_depthwise(shape), shape.describe()
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.c_block, t.thread_w, t.min_blocks) == \
            ("pointwise", groups_a_block, groups_a_block, pixels, min_blocks), shape.describe()
        assert shapes.tap_predicates(shape, t) == (groups_a_block == 1)
        check_tiling(shape, t)
    assert [default_tiling(s).c_block for _, s in mnasnet1_0() if s.kernel_h == 5] == [4] * 10
    assert [default_tiling(s).family for _, s in mnasnet1_0() if s.kernel_h == 5] == ["pointwise"] * 10
    shape = ConvShape(32, 32, 28, 28, 7, 7, padding=(3, 3), groups=32)
    assert not tilings.is_depthwise(shape) and not tilings.is_shallow_grouped(shape)
    assert default_tiling(shape).family == "direct"


def test_shallow_grouped_convs_get_the_pointwise_family():
    """A few input channels a group (ResNeXt-50's 32-group 3x3, 4-16 a group):
    the pointwise family, one group's output channels a block, 512 threads
    from 8 output channels a group, else 256 (session 42); deeper groups
    (ResNeXt's layer4, 32 a group) take the deep layers' rule, and large
    kernels stay direct."""
    for shape, k_block, c_block, threads in [
            (ConvShape(128, 128, 56, 56, 3, 3, padding=(1, 1), groups=32), 4, 4, 256),      # layer1.x.conv2
            (ConvShape(256, 256, 56, 56, 3, 3, (2, 2), (1, 1), groups=32), 8, 8, 512),      # layer2.0.conv2
            (ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1), groups=32), 16, 16, 512),    # layer3.x.conv2
            # 64 output channels a group: blocks of 32, and the body bound halves the chunk
            (ConvShape(32, 128, 20, 20, 3, 3, padding=(1, 1), groups=2), 32, 8, 512)]:
        assert tilings.is_shallow_grouped(shape) and not tilings.is_depthwise(shape)
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.c_block, t.threads, t.thread_w) == \
            ("pointwise", k_block, c_block, threads, 1), shape.describe()
        check_tiling(shape, t)
        assert launch_grid(shape, t, 64)[1] == n_kblocks(shape, t) == shape.groups * (shape.k_per_group // k_block)
    deep = ConvShape(1024, 1024, 7, 7, 3, 3, padding=(1, 1), groups=32)  # layer4.x.conv2: 288 MACs an output
    assert not tilings.is_shallow_grouped(deep) and default_tiling(deep).family == "pointwise"
    for shape in [ConvShape(32, 32, 28, 28, 5, 5, padding=(2, 2), groups=8),      # 25 taps
                  ConvShape(256, 256, 28, 28, 3, 3, padding=(1, 1), groups=2)]:   # 128 a group: deep
        assert not tilings.is_shallow_grouped(shape)
    grouped = [s for _, s in resnext50() if s.groups > 1]
    assert len(grouped) == 16 and all(default_tiling(s).family == "pointwise" for s in grouped)


def test_deep_convs_with_small_outputs_get_the_pointwise_family():
    """Deep 3x3 convs with outputs up to 28x28 take the pointwise family at
    large batches: 512 threads where strided or 256+ channels (32 output
    channels a block at 7x7, to fill a wave; 640 threads x 32 channels, two
    input channels a chunk, above 14x14 from 512 channels, unstrided), else
    128 threads x 32 channels at 4 blocks per SM (measured cold,
    tilings.default_tiling); shallow layers and large kernels stay direct."""
    expected = {ConvShape(512, 512, 7, 7, 3, 3, (1, 1), (1, 1)): (32, 512, 8),     # layer4.1.conv2: 7x7
               ConvShape(512, 512, 14, 14, 3, 3, (2, 2), (1, 1)): (32, 512, 8),   # layer4.0.conv2: 14 -> 7
               ConvShape(256, 256, 14, 14, 3, 3, (1, 1), (1, 1)): (64, 512, 4),   # layer3.1.conv2
               ConvShape(256, 256, 28, 28, 3, 3, (2, 2), (1, 1)): (64, 512, 4),   # layer3.0.conv2: strided
               ConvShape(512, 512, 14, 14, 3, 3, (1, 1), (1, 1)): (64, 512, 4),   # VGG-16 conv5_x
               ConvShape(128, 128, 28, 28, 3, 3, (1, 1), (1, 1)): (32, 128, 8),   # layer2.1.conv2
               ConvShape(512, 512, 28, 28, 3, 3, (1, 1), (1, 1)): (32, 640, 2),   # VGG-16 conv4_2
               ConvShape(256, 512, 28, 28, 3, 3, (1, 1), (1, 1)): (64, 512, 4),   # VGG-16 conv4_1
               ConvShape(512, 512, 28, 28, 3, 3, (2, 2), (1, 1)): (64, 512, 4)}   # strided: 14x14 out
    for shape, (k_block, threads, c_block) in expected.items():
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.threads, t.c_block) == ("pointwise", k_block, threads, c_block)
        assert t.min_blocks == (4 if threads == 128 else 1)
        split = small_batch_tiling(shape, t)
        if shape.out_h * shape.out_w <= SMALL_BATCH_POINTWISE_OUTPUT:
            # batch 1: the reduction split until the blocks fill one wave (cold_pointwise_split),
            # two where a block is two warps (7x7 outputs), which an SM runs two at a time
            waves = 2 if split.threads <= COLD_SPLIT_TWO_WAVE_MAX_THREADS else 1
            assert split.family == "pointwise" and split.slices >= 8
            assert ONE_WAVE * waves // 2 < math.prod(launch_grid(shape, split, 1)) <= ONE_WAVE * waves
            assert register_resident_blocks(split) >= waves
        else:  # 28x28: the direct family's split measured faster at batch 1, below 256 channels
            direct = small_batch_tiling(shape, default_direct_tiling(shape))
            assert direct.family == "direct" and direct.slices >= 2
            if shape.c_per_group >= WHOLE_IMAGE_SPLIT_MIN_CHANNELS and shape.stride == (1, 1):
                assert split == whole_image_split(shape)  # one pointwise block over the image
            else:
                assert split == direct
    for shape in (ConvShape(32, 32, 56, 56, 3, 3, (1, 1), (1, 1)), ConvShape(3, 64, 14, 14, 3, 3, (1, 1), (1, 1)),
                  ConvShape(64, 64, 14, 14, 5, 5, (1, 1), (2, 2))):
        assert default_tiling(shape).family == "direct"


def test_deep_convs_with_larger_outputs_take_the_pointwise_family():
    """From LARGE_OUTPUT_POINTWISE_MIN_CHANNELS input channels, 3x3 convs
    above 28x28 take the pointwise family too (measured cold at batch 64):
    64 output channels x 256 threads, and from
    LARGE_OUTPUT_MANY_THREADS_MIN_CHANNELS 32 x 512 threads, one input
    channel a chunk. Their small-batch variant is whole_image_split's (256+
    input channels) or large_image_blocks' (112x112 images of 64-128
    channels) where one applies, else the direct family's split."""
    for shape, (k_block, threads, c_block) in {
            ConvShape(64, 64, 56, 56, 3, 3, (1, 1), (1, 1)): (64, 256, 4),      # ResNet-50 layer1.x.conv2
            ConvShape(64, 64, 224, 224, 3, 3, (1, 1), (1, 1)): (64, 256, 4),    # VGG-16 conv1_2
            ConvShape(64, 128, 112, 112, 3, 3, (1, 1), (1, 1)): (64, 256, 4),   # VGG-16 conv2_1
            ConvShape(128, 128, 112, 112, 3, 3, (1, 1), (1, 1)): (32, 512, 1),  # VGG-16 conv2_2
            ConvShape(256, 256, 56, 56, 3, 3, (1, 1), (1, 1)): (32, 512, 1)}.items():  # VGG-16 conv3_x
        t = default_tiling(shape)
        assert (t.family, t.k_block, t.threads, t.c_block, t.min_blocks) == ("pointwise", k_block, threads, c_block, 1)
        assert tilings.wave_fitted_tiling(shape, t) == t  # the large-batch build is the default itself
        split = small_batch_tiling(shape, t)
        whole = whole_image_split(shape) or tilings.large_image_blocks(shape)
        if shape.c_per_group >= WHOLE_IMAGE_SPLIT_MIN_CHANNELS or shape.out_h == 112:
            assert split == whole and split.family == "pointwise"
        else:
            assert whole is None and (split is None or split.family == "direct")


def test_pointwise_tilings_prefer_a_c_block_that_divides_the_channels():
    assert pointwise_tiling(ConvShape(1024, 256, 14, 14, 1, 1), 64).c_block == 32
    t = pointwise_tiling(ConvShape(37, 19, 11, 13, 1, 1), 64)
    assert t.k_block == 19 and 37 % t.c_block == 0
    assert not padded_channels(ConvShape(1024, 256, 14, 14, 1, 1), pointwise_tiling(ConvShape(1024, 256, 14, 14, 1, 1)))


def test_tiling_records_refuse_what_no_template_serves():
    with pytest.raises(ValueError, match="family must be one of"):
        Tiling(8, 4, 1, 32, family="winograd")
    with pytest.raises(ValueError, match="tile_h 1"):
        Tiling(8, 4, 2, 32, family="pointwise")
    with pytest.raises(ValueError, match="slices must be a positive int"):
        Tiling(8, 4, 1, 32, slices=0)
    with pytest.raises(ValueError, match="ptxas_level must be 1, 2 or 3"):
        Tiling(8, 4, 1, 32, ptxas_level=4)
    with pytest.raises(ValueError, match="at most 64 taps"):
        check_tiling(ConvShape(8, 8, 19, 19, 9, 9), Tiling(8, 1, 1, 32, family="pointwise"))
    check_tiling(ConvShape(8, 8, 9, 9, 3, 3), Tiling(8, 4, 1, 32, family="pointwise"))  # larger kernels: served
    with pytest.raises(ValueError, match="slices but only"):
        check_tiling(ConvShape(8, 8, 9, 9, 1, 1), Tiling(8, 4, 1, 32, family="pointwise", slices=3))
    with pytest.raises(ValueError, match="slice_sum must be one of"):
        Tiling(8, 4, 1, 32, slices=2, slice_sum="atomic")
    with pytest.raises(ValueError, match="pixel_order must be one of"):
        Tiling(8, 4, 1, 32, family="pointwise", pixel_order="zigzag")
    with pytest.raises(ValueError, match="pointwise-family order"):
        Tiling(8, 4, 4, 8, pixel_order="quads")
    with pytest.raises(ValueError, match="output, which is 5x6"):  # an odd side has no whole 2x2 windows
        check_tiling(ConvShape(8, 8, 5, 6, 1, 1), Tiling(8, 4, 1, 32, family="pointwise", pixel_order="quads"))
    check_tiling(ConvShape(8, 8, 8, 8, 3, 3, (2, 2), (1, 1)),  # a 4x4 output: served
                 Tiling(8, 4, 1, 32, family="pointwise", pixel_order="quads"))
    for slices in (1, 17):  # a cluster sum needs a split, and one cluster holds at most 16 blocks
        with pytest.raises(ValueError, match="cluster sum takes 2 to 16 slices"):
            Tiling(8, 4, 1, 32, slices=slices, slice_sum="cluster")
    # the partial tile (k_block x outputs a thread x threads floats) must fit in shared memory
    with pytest.raises(ValueError, match="bytes of shared memory"):
        check_tiling(ConvShape(64, 64, 32, 32, 1, 1),
                     Tiling(64, 8, 1, 256, 1, 1, family="pointwise", slices=2, slice_sum="cluster"))


def test_staged_and_prefetched_input_are_pointwise_paths_checked_against_the_target():
    """Tiling.input_loads "staged": INPUT_STAGES chunks of c_block x taps
    values for each pixel of each thread, in dynamic shared memory (past the
    48 KB a block gets without opting in), refused where it cannot run."""
    shape = ConvShape(512, 512, 28, 28, 3, 3, (1, 1), (1, 1))  # VGG-16's conv4_2
    t = Tiling(32, 2, 1, 640, 1, 1, family="pointwise", input_loads="staged")
    assert staged_input_bytes(shape, t) == dynamic_shared_bytes(shape, t) == INPUT_STAGES * 2 * 9 * 640 * 4
    assert staged_input_bytes(shape, replace(t, input_loads="registers")) == 0
    assert "input staged by cp.async" in t.describe()
    check_tiling(shape, t)
    with pytest.raises(ValueError, match="input_loads must be one of"):
        Tiling(8, 4, 1, 32, family="pointwise", input_loads="texture")
    with pytest.raises(ValueError, match="pointwise-family path"):
        Tiling(8, 4, 4, 8, input_loads="staged")
    with pytest.raises(ValueError, match="cannot take a cluster sum"):
        Tiling(8, 4, 1, 32, family="pointwise", slices=2, slice_sum="cluster", input_loads="staged")
    # prefetched: loads as before plus a hint, no shared memory, a cluster sum allowed
    prefetched = replace(t, input_loads="prefetched")
    assert dynamic_shared_bytes(shape, prefetched) == 0 and "prefetched into L1" in prefetched.describe()
    Tiling(8, 4, 1, 32, family="pointwise", slices=2, slice_sum="cluster", input_loads="prefetched")
    with pytest.raises(ValueError, match="'prefetched' is a pointwise-family path"):
        Tiling(8, 4, 4, 8, input_loads="prefetched")
    with pytest.raises(ValueError, match="stages 442368 bytes of input an SM"):  # two blocks of 221,184 bytes
        check_tiling(shape, Tiling(32, 4, 1, 512, 1, 1, min_blocks=2, family="pointwise", input_loads="staged"))
    for loads in ("staged", "prefetched"):
        with pytest.raises(ValueError, match="taps sit behind tests"):  # 2 channels x 9 taps: tap_predicates
            check_tiling(ConvShape(2, 8, 6, 6, 3, 3, (1, 1), (1, 1)),
                         Tiling(8, 2, 1, 32, family="pointwise", input_loads=loads))
    with pytest.raises(ValueError, match="lets a block use"):  # sm_86 lets a block opt in to 99 KB
        build_conv2d(np.zeros(shape.weight_shape, np.float32), shape, tiling=t, target=Target("sm_86"),
                     name="conv4_2")


def test_slices_multiply_the_kblock_copies_and_divide_the_chunks():
    shape = ConvShape(10, 12, 7, 6, 1, 1)
    t = Tiling(4, 3, 1, 32, 1, 1, family="pointwise", slices=2)
    assert n_kblocks(shape, t) == 3 * 2                       # ceil(12/4) channel blocks x 2 slices
    assert n_chunks(shape, t) == 2                            # ceil(ceil(10/3) / 2) chunks per slice
    assert padded_channels(shape, t)                          # 2 slices x 2 chunks x 3 > 10 channels
    assert patch_buffer_bytes(shape, t) == 0                  # the pointwise family stages nothing


def test_launch_grids_of_both_families():
    pw = ConvShape(8, 12, 5, 6, 1, 1)
    t = Tiling(8, 4, 1, 64, 1, 2, family="pointwise")         # 32 threads x 2 pixels
    assert launch_grid(pw, t, 3) == (math.ceil(3 * 30 / 64), 2, 1)  # the batch folded into the pixels
    d = ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1))
    td = Tiling(4, 2, 4, 7, 1, 1, slices=2)
    assert launch_grid(d, td, 3) == (2, 2 * 2, 3)


def test_pointwise_grids_group_pixel_blocks_within_the_l2_budget():
    """ResNet-50's layer2.0.downsample at batch 64: 256 input channels x 256
    pixels x stride 2 is 512 KB of input per pixel block, so 16 blocks a group
    (8 MB); the group's blocks go through all 8 k-blocks before the next group."""
    s = ConvShape(256, 512, 56, 56, 1, 1, (2, 2))
    t = default_tiling(s)
    assert (t.family, t.tile_w, n_kblocks(s, t)) == ("pointwise", 256, 8)
    assert pixel_group(s, t) == L2_GROUP_BYTES // (256 * 256 * 2 * 4) == 16
    blocks = pixel_blocks(s, t, 64)
    assert launch_grid(s, t, 64) == (16, 8, -(-blocks // 16))
    assert launch_grid(s, t, 1)[0] == pixel_blocks(s, t, 1) < 16  # one small batch: one group


def test_pointwise_grids_without_k_blocks_to_share_have_no_groups_and_few_extra_blocks():
    """One k-block reads the input once whatever the order, so no groups (and no
    block past the batch: one extra block can add a wave). Elsewhere the groups
    are of nearly equal size."""
    s = ConvShape(512, 128, 28, 28, 1, 1)  # ResNet-50's layer2.1.conv1
    t = default_tiling(s)
    assert n_kblocks(s, t) == 1 and launch_grid(s, t, 64) == (pixel_blocks(s, t, 64), 1, 1)
    s = ConvShape(512, 1024, 28, 28, 1, 1, (2, 2))  # layer3.0.downsample
    t = default_tiling(s)
    for n in (7, 33, 64):
        gx, _, gz = launch_grid(s, t, n)
        assert gx <= pixel_group(s, t) and 0 <= gx * gz - pixel_blocks(s, t, n) < gz


@pytest.mark.parametrize("shape", [ConvShape(64, 256, 56, 56, 1, 1), ConvShape(2048, 512, 7, 7, 1, 1),
                                   ConvShape(3, 8, 1024, 1024, 1, 1), ConvShape(512, 512, 7, 7, 3, 3, padding=(1, 1))])
def test_the_largest_launch_fits_cuda_and_32_bit_pixel_indices(shape):
    t = default_tiling(shape)
    if t.family != "pointwise":
        t = pointwise_tiling(shape, 64, 1, 128)
    n = max_batch_per_launch(shape, t)
    gx, _, gz = launch_grid(shape, t, n)
    assert gz <= MAX_GRID_Z and gx * gz * t.tile_w <= 2**31 - 1
    gx2, _, gz2 = launch_grid(shape, t, 2 * n)  # twice that breaks a limit
    assert gz2 > MAX_GRID_Z or gx2 * gz2 * t.tile_w > 2**31 - 1 - gx2 * t.tile_w


def test_split_variants_only_where_one_image_leaves_the_gpu_idle():
    stem = ConvShape(3, 64, 224, 224, 7, 7, (2, 2), (3, 3))
    # too little work per output to split: its small-batch variant is smaller blocks, unsplit
    assert small_batch_tiling(stem, default_tiling(stem)).slices == 1
    big = ConvShape(64, 256, 112, 112, 1, 1)
    assert small_batch_tiling(big, default_tiling(big)) is None     # one image fills the GPU
    one_chunk = ConvShape(64, 64, 56, 56, 1, 1)
    assert small_batch_tiling(one_chunk, default_tiling(one_chunk)) is None  # one chunk of channels: nothing to split
    # 56x56 (layer1.1.conv1): past COLD_SPLIT_MAX_PIXELS the old rule leaves it whole (measured faster cold)
    wide = ConvShape(256, 64, 56, 56, 1, 1)
    assert wide.out_h * wide.out_w > COLD_SPLIT_MAX_PIXELS and small_batch_tiling(wide, default_tiling(wide)) is None


def test_a_small_batch_1x1_takes_the_least_code_per_block():
    """Cold, a split block's time follows its code bytes (COLD_SPLIT_K_BLOCK):
    one block of pixels per image where the threads allow, 32 output channels
    a block, and slices up to one wave (two for blocks of two warps, which
    share an SM: COLD_SPLIT_TWO_WAVE_MAX_THREADS)."""
    deep = ConvShape(2048, 512, 7, 7, 1, 1)
    split = small_batch_tiling(deep, default_tiling(deep))
    assert (split.k_block, split.threads, split.ptxas_level) == (32, 64, 1)  # 49 pixels: one block of 64 threads
    assert default_tiling(deep).ptxas_level == 3
    blocks = launch_grid(deep, split, 1)
    assert blocks == (1, 16 * split.slices, 1) and split.slices & (split.slices - 1) == 0
    assert 16 * split.slices <= 2 * ONE_WAVE < 16 * split.slices * 2 and split.slices == 16
    # ResNet-50's layer3.x.conv3: the candidate measured fastest cold (12.9 us against 24.9, session 8)
    s = ConvShape(256, 1024, 14, 14, 1, 1)
    split = small_batch_tiling(s, default_tiling(s))
    assert (split.k_block, split.threads, split.slices, n_kblocks(s, split)) == (32, 224, 4, 128)
    # A Linear layer (one pixel per image) keeps the channel-count rule
    fc = ConvShape(4096, 1000, 1, 1, 1, 1)
    split = small_batch_tiling(fc, pointwise_tiling(fc, 64, 1, 32))
    assert split is not None and (split.k_block, split.threads) == (64, 32)


def test_batch_variants_end_with_one_for_any_batch():
    for _, shape in resnet50() + vgg16():
        variants = batch_variants(shape, default_tiling(shape))
        assert variants[-1][0] == ANY_BATCH and len(variants) in (1, 2)
        if len(variants) == 2:
            up_to, split = variants[0]
            assert 1 <= up_to <= MAX_SPLIT_BATCH
            if split == tilings.batch1_blocks(shape, default_tiling(shape)):  # smaller blocks at batch 1
                assert up_to == 1 and split.slices == 1
                continue
            assert split.slices > 1 or split == large_image_blocks(shape)  # smaller blocks, not split
            assert blocks_per_image(shape, split) / split.slices < ONE_WAVE


def test_the_image_layer_takes_16_channel_blocks_of_256_threads_at_batch_1_only():
    from sparseconv.tilings import default_direct_tiling, image_layer_blocks, variant_for_batch

    r50, vgg = dict(resnet50()), dict(vgg16())
    for s in (r50["conv1"], vgg["conv1_1"]):
        t = variant_for_batch(s, 1)
        assert (t.family, t.k_block, t.thread_w, t.thread_h, t.threads, t.slices) == ("direct", 16, 1, 1, 256, 1)
        assert variant_for_batch(s, 2) == default_tiling(s) == default_direct_tiling(s)
    # a 32x32 image (CIFAR): its blocks would leave room for more images, but only batch 1 was measured
    small = ConvShape(3, 64, 32, 32, 3, 3, (1, 1), (1, 1))
    (up_to, variant), _ = batch_variants(small, default_tiling(small))
    assert up_to == 1 and variant == image_layer_blocks(small, default_tiling(small))
    image = ConvShape(3, 64, 224, 224, 7, 7, (2, 2), (3, 3))
    assert image_layer_blocks(image, Tiling(8, 1, 4, 32, 1, 1)) is None  # a tiling of the user's own
    assert image_layer_blocks(ConvShape(16, 64, 56, 56, 3, 3, (1, 1), (1, 1)),
                              default_tiling(ConvShape(16, 64, 56, 56, 3, 3, (1, 1), (1, 1)))) is None
    grouped = ConvShape(4, 8, 32, 32, 3, 3, (1, 1), (1, 1), groups=2)
    assert image_layer_blocks(grouped, default_tiling(grouped)) is None


def test_expanding_1x1_convs_take_16_channel_blocks_in_one_wave_at_batch_1_only():
    from sparseconv.tilings import default_pointwise_tiling, expanding_pointwise_blocks, variant_for_batch

    r50 = dict(resnet50())
    # layer1's conv3 and first downsample (64 -> 256, 56x56): 512 threads, 7 x 16 blocks;
    # layer2's conv3 (128 -> 512, 28x28): 256 threads, 4 x 32 (512 would leave half the SMs idle)
    for name, threads, grid in (("layer1.0.conv3", 512, (7, 16, 1)), ("layer1.0.downsample", 512, (7, 16, 1)),
                                ("layer2.1.conv3", 256, (4, 32, 1))):
        s = r50[name]
        t = variant_for_batch(s, 1)
        assert (t.family, t.k_block, t.threads, t.slices, t.ptxas_level) == ("pointwise", 16, threads, 1, 3), name
        assert launch_grid(s, t, 1) == grid and math.prod(grid) <= ONE_WAVE
        assert variant_for_batch(s, 2) == default_tiling(s)
    # measured no faster: strided, narrowing, and on 14x14 or smaller images
    for name in ("layer2.0.downsample", "layer1.1.conv1", "layer3.0.conv3", "layer4.0.conv3"):
        s = r50[name]
        assert expanding_pointwise_blocks(s, default_tiling(s)) is None, name
    s = r50["layer1.0.conv3"]
    assert expanding_pointwise_blocks(s, pointwise_tiling(s, 32, 1, 256)) is None  # a tiling of the user's own
    grouped = ConvShape(64, 256, 56, 56, 1, 1, groups=2)
    assert expanding_pointwise_blocks(grouped, default_pointwise_tiling(grouped)) is None
    big = ConvShape(64, 256, 112, 112, 1, 1)  # past the images measured
    assert expanding_pointwise_blocks(big, default_pointwise_tiling(big)) is None
    wide = ConvShape(128, 1024, 56, 56, 1, 1)  # 64 k-blocks: no block size keeps one wave
    assert expanding_pointwise_blocks(wide, default_pointwise_tiling(wide)) is None


def test_epilogue_records_and_their_code():
    assert Epilogue().bounds == (None, None) and Epilogue("relu").bounds == (0.0, None)
    assert Epilogue("relu6").bounds == (0.0, 6.0)
    assert Epilogue("clip", clip=(-float("inf"), 2)).bounds == (None, 2.0)
    code = epilogue_code(Epilogue("clip", clip=(-0.5, 0.7), residual=True))
    assert "0xBF000000" in code and "0x3F333333" in code  # -0.5 and 0.7, exact to the bit
    assert "residual" not in code  # the templates start each sum with it (HAS_RESIDUAL)
    assert Epilogue("relu6", residual=True).describe() == "bias + residual -> relu6"


def test_each_family_renders_its_own_template():
    pw = ConvShape(8, 12, 5, 6, 1, 1)
    r = render(pw, Tiling(8, 4, 1, 32, family="pointwise"), Epilogue("relu"))
    assert template_name("pointwise") in r.source and "__ldg" in r.source and "cp.async" not in r.source
    assert len(r.placeholders) == 8 * 4
    d = render(ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1)), Tiling(4, 2, 4, 7, slices=2))
    assert template_name("direct") in d.source and "#define SLICES         2" in d.source


def test_variant_for_batch_picks_the_split_variant_only_for_small_batches():
    from sparseconv.tilings import variant_for_batch

    deep = ConvShape(2048, 512, 7, 7, 1, 1)
    (up_to, split), (_, full) = batch_variants(deep, default_tiling(deep))
    assert variant_for_batch(deep, 1) == split and variant_for_batch(deep, up_to) == split
    assert variant_for_batch(deep, up_to + 1) == full == default_tiling(deep)
    # of a given tiling: a 64-channel 56x56 3x3 on the direct family splits at batch 1
    mixed = ConvShape(64, 64, 56, 56, 3, 3, (1, 1), (1, 1))
    direct = default_direct_tiling(mixed)
    assert variant_for_batch(mixed, 1, direct) == batch_variants(mixed, direct)[0][1]
    assert variant_for_batch(mixed, 1, direct).slices > 1 and variant_for_batch(mixed, 64, direct) == direct


def test_pointwise_layers_of_at_most_64_channels_take_ptxas_O1():
    """-O1 keeps a chunk's loads ahead of its FMAs: measured faster where K <= 64
    (ResNet-50 layer1.x.conv1) and slower at K = 128 (layer2.x.conv1)."""
    assert default_tiling(ConvShape(256, 64, 56, 56, 1, 1)).ptxas_level == 1
    assert default_tiling(ConvShape(64, 64, 56, 56, 1, 1)).ptxas_level == 1
    assert default_tiling(ConvShape(256, 128, 56, 56, 1, 1)).ptxas_level == 3
    assert default_tiling(ConvShape(512, 256, 28, 28, 1, 1)).ptxas_level == 3
    # and so do the 3x3 layers above 28x28 with K <= 64, whose -O3 schedule
    # depends on the weights (VGG-16 conv1_2: 882 or 2,050 us at batch 64)
    assert default_tiling(ConvShape(64, 64, 224, 224, 3, 3, (1, 1), (1, 1))).ptxas_level == 1
    assert default_tiling(ConvShape(64, 64, 56, 56, 3, 3, (1, 1), (1, 1))).ptxas_level == 1
    assert default_tiling(ConvShape(128, 128, 112, 112, 3, 3, (1, 1), (1, 1))).ptxas_level == 3


def test_tuning_candidates_of_a_deep_3x3_include_512_pointwise_threads():
    """Cold, a deep layer's code costs less the more warps share it (session
    11: layer4.x.conv2 at batch 64 273 us cold with 256 threads, 158 with 512),
    so `tiling="auto"` gets a 512-thread pointwise candidate to time, and one
    of 32 channels and one input channel a chunk (session 55)."""
    deep = ConvShape(512, 512, 7, 7, 3, 3, (1, 1), (1, 1))
    threads = {t.threads for t in candidate_tilings(deep) if t.family == "pointwise"}
    assert {128, 256, 512} <= threads
    for shape in (deep, ConvShape(64, 64, 56, 56, 3, 3, (1, 1), (1, 1))):
        cands = candidate_tilings(shape)
        assert any((t.family, t.k_block, t.threads, t.c_block) == ("pointwise", 32, 512, 1) for t in cands)
        assert len(cands) == len(set(cands)) <= 9


def test_slices_summed_in_a_cluster_where_measured_faster():
    """The rule (tilings.summed_in_cluster, measured on the H100 in session 15):
    pointwise splits whose SM holds two or more blocks, or clusters of 2, sum
    in a cluster, the direct family too (2 blocks an SM); one 224-256-thread
    block an SM with more slices and grids of more clusters than one wave
    holds keep the reduction kernel."""
    r50, vgg = dict(resnet50()), dict(vgg16())

    def split(shape):
        return variant_for_batch(shape, 1)

    for name in ("layer4.1.conv1", "layer4.1.conv2", "layer4.0.downsample", "layer2.0.downsample"):
        t = split(r50[name])
        assert t.slice_sum == "cluster", name
        assert t.family == "pointwise" and (t.slices == 2 or register_resident_blocks(t) >= 2)
    for name in ("layer3.1.conv1", "layer3.1.conv2", "layer2.1.conv1", "layer4.0.conv1"):  # one big block an SM
        t = split(r50[name])
        assert t.slices > 2 and register_resident_blocks(t) == 1 and t.slice_sum == "kernel", name
    assert split(r50["layer2.1.conv2"]).family == "direct" and split(r50["layer2.1.conv2"]).slice_sum == "cluster"
    # 64 clusters of 4 direct blocks: more than one wave holds (62 at 2 blocks an SM). VGG-16
    # conv4_2's direct split as it was before whole_image_split took its batch-1 variant:
    direct = replace(default_direct_tiling(vgg["conv4_2"]), slices=4)
    assert summed_in_cluster(vgg["conv4_2"], direct).slice_sum == "kernel"
    assert math.ceil(blocks_per_image(vgg["conv4_2"], direct)) > CLUSTER_WAVE_SMS[4] * 2
    assert register_resident_blocks(Tiling(32, 64, 1, 64, family="pointwise")) == 4  # 64 threads, 255 registers


def test_a_cluster_sum_falls_back_to_the_reduction_kernel_before_sm_90(tmp_path):
    """Clusters need sm_90: built for an older GPU, the same tiling sums its
    slices through the workspace, and says so."""
    import numpy as np

    from sparseconv.build import build_conv2d
    from sparseconv.cache import ArtifactCache
    from sparseconv.shapes import Target

    shape = ConvShape(16, 8, 4, 4, 1, 1)
    t = Tiling(8, 4, 1, 32, family="pointwise", slices=2, slice_sum="cluster")
    w = np.ones(shape.weight_shape, np.float32)
    assert Target("sm_90").has_clusters and Target("sm_100a").has_clusters and not Target("sm_80").has_clusters
    old = build_conv2d(w, shape, tiling=t, target=Target("sm_80"), cache=ArtifactCache(tmp_path))
    assert old.tiling == replace(t, slice_sum="kernel") and "cluster" not in old.stats["tiling"]
    new = build_conv2d(w, shape, tiling=t, target=Target("sm_90"), cache=ArtifactCache(tmp_path))
    assert new.tiling == t and "summed in a cluster" in new.stats["tiling"]
    assert new.shared_bytes == 8 * 32 * 4 and old.shared_bytes == 0  # the partial tile: k_block x threads floats


def test_deep_28x28_and_56x56_convs_split_as_few_blocks_over_the_image():
    """whole_image_split: VGG-16's conv4_x (256+ channels, 3x3, 28x28) split
    on the pointwise family, one 800-thread block over the 784 pixels, and
    conv3_2 / conv3_3 (56x56) four such blocks over the 3,136; 16 channels
    and 4 slices a block, from their default (pointwise) tiling; a direct
    tiling keeps the direct split. conv3_1 (128 input channels, 56x56) too,
    in 2 slices; not ResNet-50's 128-channel layer2.x.conv2 (28x28: one
    block), not a 1x1, a strided or a grouped conv, not an image larger
    than 56x56."""
    vgg, r50 = dict(vgg16()), dict(resnet50())
    for name in ("conv4_1", "conv4_2", "conv4_3", "conv3_2", "conv3_3", "conv3_1"):
        split = variant_for_batch(vgg[name], 1)
        assert split == whole_image_split(vgg[name])
        slices = WHOLE_IMAGE_SPLIT_MID_SLICES if name == "conv3_1" else WHOLE_IMAGE_SPLIT_SLICES
        assert (split.family, split.threads, split.k_block, split.c_block, split.slices, split.slice_sum) == \
            ("pointwise", 800, WHOLE_IMAGE_SPLIT_K_BLOCK, WHOLE_IMAGE_SPLIT_C_BLOCK, slices, "kernel")
        check_tiling(vgg[name], split)
        assert default_tiling(vgg[name]).family == "pointwise"
        assert small_batch_tiling(vgg[name], default_direct_tiling(vgg[name])).family == "direct"
        assert variant_for_batch(vgg[name], 64) == default_tiling(vgg[name])  # unsplit: untouched
        assert launch_grid(vgg[name], split, 1)[0] == (1 if vgg[name].out_h == 28 else 4)  # pixel blocks
    for shape in (vgg["conv5_1"], r50["layer2.1.conv2"], r50["layer2.0.conv2"], r50["layer3.1.conv1"]):
        assert whole_image_split(shape) is None
    # 128 channels qualify only where the image takes several blocks (conv3_1, not layer2.1.conv2)
    assert vgg["conv3_1"].c_per_group == r50["layer2.1.conv2"].c_per_group == WHOLE_IMAGE_SPLIT_MID_CHANNELS
    assert whole_image_split(replace(vgg["conv3_1"], in_channels=64)) is None
    deep = vgg["conv4_2"]
    assert whole_image_split(replace(deep, groups=2)) is None
    assert whole_image_split(replace(deep, in_h=57, in_w=57)) is None  # 3,249 pixels: past the largest measured
    assert whole_image_split(replace(deep, in_h=14, in_w=14)) is None  # 196: SMALL_BATCH_POINTWISE_OUTPUT
    # 1,089 pixels: two blocks sharing them evenly, whole warps, within the thread cap
    split = whole_image_split(replace(deep, in_h=33, in_w=33))
    assert split.threads == 576 and launch_grid(replace(deep, in_h=33, in_w=33), split, 1)[0] == 2
    assert split.threads <= WHOLE_IMAGE_SPLIT_MAX_THREADS


def test_112x112_convs_run_16_channel_800_thread_blocks_at_batch_1():
    """large_image_blocks: VGG-16's conv2_1 and conv2_2 (64 and 128 input
    channels, 3x3, 112x112) run batch 1 in unsplit pointwise blocks of 800
    threads and 16 output channels, one wave (16 x 8 = 128 blocks), and
    batch 2 on in their default. Not conv1_2 (224x224), not the 56x56 layers
    (ResNet-50's layer1.x.conv2 lost), not 32 or 256 input channels, not where the
    blocks would pass one wave, not strided, 1x1 or grouped convs."""
    vgg, r50 = dict(vgg16()), dict(resnet50())
    for name in ("conv2_1", "conv2_2"):
        shape = vgg[name]
        small = variant_for_batch(shape, 1)
        assert small == large_image_blocks(shape)
        assert (small.family, small.threads, small.k_block, small.c_block, small.slices) == \
            ("pointwise", 800, WHOLE_IMAGE_SPLIT_K_BLOCK, WHOLE_IMAGE_SPLIT_C_BLOCK, 1)
        assert launch_grid(shape, small, 1) == (16, 8, 1) and 16 * 8 <= ONE_WAVE
        check_tiling(shape, small)
        assert variant_for_batch(shape, 2) == default_tiling(shape)
        assert small_batch_tiling(shape, default_direct_tiling(shape)) != small  # a direct tiling is left alone
    for shape in (vgg["conv1_2"], vgg["conv3_1"], vgg["conv3_2"], r50["layer1.1.conv2"], r50["conv1"]):
        assert large_image_blocks(shape) is None
    wide = vgg["conv2_2"]
    assert large_image_blocks(replace(wide, in_channels=32, out_channels=32)) is None
    assert large_image_blocks(replace(wide, in_channels=256, in_h=64, in_w=64)) is None  # not measured
    assert large_image_blocks(replace(wide, out_channels=256)) is None  # 16 x 16 blocks: two waves
    assert large_image_blocks(replace(wide, stride=(2, 2))) is None
    assert large_image_blocks(replace(wide, groups=2)) is None
    assert large_image_blocks(replace(wide, kernel_h=1, kernel_w=1, padding=(0, 0))) is None


def test_direct_splits_of_deep_convs_stage_wider_chunks_where_they_fit():
    """SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS: VGG-16's 256+-channel direct splits
    stage 4 channels a chunk; ResNet-50's 64- and 128-channel ones keep 2, as
    do unsplit direct tilings; a chunk too wide for shared memory is halved.
    (VGG-16's conv3_x and conv4_x take whole_image_split from their default
    tiling, so their direct tilings and a 64x64 image stand in.)"""
    vgg, r50 = dict(vgg16()), dict(resnet50())
    for shape, tiling in ((vgg["conv3_2"], default_direct_tiling(vgg["conv3_2"])),
                          (vgg["conv4_2"], default_direct_tiling(vgg["conv4_2"])),
                          (replace(vgg["conv3_2"], in_h=64, in_w=64), None)):
        split = variant_for_batch(shape, 1, tiling)
        assert shape.c_per_group >= SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS
        assert split.family == "direct" and split.slices >= 2 and split.c_block == SPLIT_DIRECT_WIDE_C_BLOCK
        check_tiling(shape, split)  # raises where the body or the shared memory is over its bound
        assert variant_for_batch(shape, 64, tiling) == (tiling or default_tiling(shape))  # unsplit: untouched
        assert default_direct_tiling(shape).c_block == 2
    for shape in (vgg["conv3_1"], r50["layer1.1.conv2"], r50["layer2.0.conv2"], r50["layer2.1.conv2"]):
        split = variant_for_batch(shape, 1, default_direct_tiling(shape))  # conv3_1's default: whole_image_split
        assert split.family == "direct" and split.c_block == 2
    # a tile whose 4-channel patch overflows shared memory falls back to 2 channels
    strided = r50["layer2.0.conv2"]
    split = variant_for_batch(strided, 1)
    assert patch_buffer_bytes(strided, replace(split, c_block=8)) > MAX_PATCH_BYTES
    assert widest_fitting_chunk(strided, split, 8).c_block == 4
    assert widest_fitting_chunk(strided, split, 2) == split


def test_padded_taps_take_a_test_a_load_only_where_a_group_has_few_loads():
    """Depthwise and narrow grouped 3x3 convs (up to TAP_PREDICATE_MAX_LOADS
    loads a pixel from its group's input) load each tap at a constant offset
    behind a test; deep 3x3 convs keep a pointer a tap and the zero buffer
    (session 42), and unpadded convs need neither."""
    cases = [(ConvShape(32, 32, 112, 112, 3, 3, padding=(1, 1), groups=32), True),     # MobileNetV2 features.1
             (ConvShape(128, 128, 56, 56, 3, 3, padding=(1, 1), groups=32), True),     # ResNeXt-50 layer1: 36
             (ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1), groups=32), False),    # ResNeXt-50 layer3: 144
             (ConvShape(512, 512, 7, 7, 3, 3, padding=(1, 1)), False),                 # ResNet-50 layer4.x.conv2
             # VGG-16 conv5_1: 4 channels a chunk (36 loads) but 128 chunks: counted over the group
             (ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1)), False),
             (ConvShape(64, 256, 56, 56, 1, 1), False)]                                # 1x1: nothing to pad
    for shape, predicates in cases:
        t = default_tiling(shape)
        assert shapes.tap_predicates(shape, t) == predicates, shape.describe()
        assert f"#define TAP_PREDICATES {int(predicates)}" in render(shape, t).source
    assert default_tiling(cases[4][0]).c_block == 4  # the VGG-16 case is what it says
    dw5x5 = ConvShape(6, 6, 7, 7, 5, 5, padding=(2, 2), groups=6)  # one group a block: 25 loads (session 43)
    assert default_tiling(dw5x5).family == "pointwise" and shapes.tap_predicates(dw5x5, default_tiling(dw5x5))
    dw5x5 = ConvShape(1152, 1152, 7, 7, 5, 5, padding=(2, 2), groups=1152)  # MNASNet's: 4 groups, 100 loads
    assert default_tiling(dw5x5).family == "pointwise" and not shapes.tap_predicates(dw5x5, default_tiling(dw5x5))
    dw7x7 = ConvShape(96, 96, 14, 14, 7, 7, padding=(3, 3), groups=96)  # ConvNeXt's: the direct family stages it
    assert default_tiling(dw7x7).family == "direct" and not shapes.tap_predicates(dw7x7, default_tiling(dw7x7))


def test_7x7_pointwise_convs_of_under_half_a_wave_take_16_channel_blocks():
    """tilings.SMALL_GRID_BATCH: a 7x7 1x1 conv whose 32-channel blocks are
    under half a wave at batch 64 takes 16-channel blocks (session 44's
    probe); with more blocks it keeps 32 (those were slower at 16)."""
    layers = dict(mnasnet1_0()) | {f"v2:{n}": s for n, s in mobilenet_v2()} | {f"r50:{n}": s for n, s in resnet50()}
    for name in ["layers.12.0.layers.6", "layers.12.1.layers.6", "v2:features.14.conv.2", "v2:features.16.conv.2"]:
        t = default_tiling(layers[name])
        assert (t.k_block, t.threads) == (16, 512), name
        assert launch_grid(layers[name], t, 64)[1] == layers[name].out_channels // 16
    for name in ["v2:features.17.conv.2", "r50:layer4.1.conv1", "r50:layer4.0.conv3"]:
        assert default_tiling(layers[name]).k_block == 32, name


def test_the_residual_goes_after_the_chunk_loop_only_where_one_block_holds_every_channel_at_O3():
    """shapes.residual_after_loop: session 45's probe had MNASNet's 480 -> 80
    and 576 -> 96 projections faster with the residual added after the loop,
    and ResNet-50's conv3 layers (blocks of 32 or 64 of 256-2048 channels)
    20-45% slower; -O1 tilings keep their loads' order either way."""
    mnas, v2, r50 = dict(mnasnet1_0()), dict(mobilenet_v2()), dict(resnet50())
    takes = [mnas["layers.10.1.layers.6"], mnas["layers.10.2.layers.6"], mnas["layers.11.1.layers.6"],
             v2["features.12.conv.2"], v2["features.13.conv.2"]]
    keeps = [r50[f"layer{i}.1.conv3"] for i in range(1, 5)] + [
        v2["features.15.conv.2"],  # 32-channel blocks of 160
        v2["features.5.conv.2"], mnas["layers.9.1.layers.6"]]  # one block of all channels, at -O1
    assert all(shapes.residual_after_loop(s, default_tiling(s)) for s in takes)
    assert not any(shapes.residual_after_loop(s, default_tiling(s)) for s in keeps)
    s = mnas["layers.10.1.layers.6"]
    assert not shapes.residual_after_loop(s, replace(default_tiling(s), slices=2))  # the reduce kernel adds it


def test_the_table_runs_small_batches_of_deep_convs_on_small_images():
    """Exactly VGG-16's conv5_x and ResNet-50's layer4.x.conv2 among the five
    zoo networks; code_variants then drops their split variant, and only
    where the caller times the table."""
    from sparseconv.tilings import code_variants, table_runs_small_batches

    taken = sorted(f"{net}:{name}" for net, layers in
                   (("resnet50", resnet50()), ("vgg16", vgg16()), ("resnext50", resnext50()),
                    ("mobilenet_v2", mobilenet_v2()), ("mnasnet1_0", mnasnet1_0()))
                   for name, s in layers if table_runs_small_batches(s))
    assert taken == ["resnet50:layer4.0.conv2", "resnet50:layer4.1.conv2", "resnet50:layer4.2.conv2",
                     "vgg16:conv5_1", "vgg16:conv5_2", "vgg16:conv5_3"]
    conv5 = ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1))
    whole = default_tiling(conv5)
    assert len(batch_variants(conv5, whole)) == 2
    assert code_variants(conv5, whole) == batch_variants(conv5, whole)
    assert code_variants(conv5, whole, table_at_small_batches=True) == [batch_variants(conv5, whole)[-1]]  # fitted
    conv4 = ConvShape(512, 512, 28, 28, 3, 3, padding=(1, 1))  # 28x28: the split code wins, it stays
    assert code_variants(conv4, default_tiling(conv4), table_at_small_batches=True) == \
        batch_variants(conv4, default_tiling(conv4))
