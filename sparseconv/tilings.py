"""How each conv layer is tiled: the default tiling of each layer class,
the variants a layer is built with for small and large batches (split
reductions, blocks sized to the image or to the waves of a batch), and the
candidates `tiling="auto"` times. The rules name the measurements behind them
(docs/PERFORMANCE.md). The records these rules return, and the launch
geometry they count with, are in shapes.py."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import List, Optional, Tuple

from .shapes import (ConvShape, MAX_BODY_WEIGHTS, MAX_CLUSTER_SLICES, MAX_PATCH_BYTES, MAX_STAGE_STEPS,
                     TAP_PREDICATE_MAX_LOADS, Tiling, check_tiling, launch_grid, n_kblocks, partial_tile_bytes,
                     patch_buffer_bytes, stage_steps)


def tiling_for(shape: ConvShape, k_block: int, thread_w: int, thread_h: int = 1, threads: int = 128,
               min_blocks: int = 1) -> Tiling:
    """The tiling with this many output channels per block and outputs per
    thread: about `threads` threads, the largest c_block the body bound
    allows, shrunk until the input patches fit in shared memory and each
    thread copies at most MAX_STAGE_STEPS elements per chunk."""
    k_block = min(k_block, shape.k_per_group)
    thread_w = min(thread_w, shape.out_w)
    thread_h = min(thread_h, shape.out_h)
    threads_x = min(math.ceil(shape.out_w / thread_w), 32)
    rows = max(1, min(math.ceil(shape.out_h / thread_h), threads // threads_x))
    rs = shape.kernel_h * shape.kernel_w
    t = Tiling(k_block, max(1, min(shape.c_per_group, MAX_BODY_WEIGHTS // (k_block * rs))),
               rows * thread_h, threads_x * thread_w, thread_h, thread_w, min_blocks)
    while t.c_block > 1 and stage_steps(shape, t) > MAX_STAGE_STEPS:
        t = replace(t, c_block=max(1, min(t.c_block - 1, t.c_block * MAX_STAGE_STEPS // stage_steps(shape, t))))
    while patch_buffer_bytes(shape, t) > MAX_PATCH_BYTES:
        if t.c_block > 1:
            t = replace(t, c_block=max(1, t.c_block // 2))
        elif t.tile_h > thread_h:
            t = replace(t, tile_h=max(1, t.tile_h // thread_h // 2) * thread_h)
        else:
            raise ValueError(f"no tiling fits shared memory for {shape.describe()}")
    return t


# Below this many multiply-adds per output, default_tiling keeps 128 threads.
SHALLOW_MACS = 200


def _k_block(shape: ConvShape, k_block: int = 32) -> int:
    """k_block, halved (down to 8) while k_block * R * S exceeds the body bound."""
    rs = shape.kernel_h * shape.kernel_w
    while k_block > 8 and k_block * rs > MAX_BODY_WEIGHTS * 4:
        k_block //= 2
    return k_block


def pointwise_tiling(shape: ConvShape, k_block: int = 64, pixels: int = 1, threads: int = 128,
                     min_blocks: int = 1, slices: int = 1) -> Tiling:
    """A pointwise-family tiling: k_block output channels x `pixels` pixels
    per thread, `threads` threads. c_block is the largest the body bound
    allows, preferring one that divides the input channels (no padded chunk)."""
    k_block = min(k_block, shape.k_per_group)
    bound = max(1, min(shape.c_per_group, MAX_BODY_WEIGHTS * 4 // (k_block * shape.kernel_h * shape.kernel_w)))
    c_block = next((d for d in range(bound, bound // 2, -1) if shape.c_per_group % d == 0), bound)
    return Tiling(k_block, c_block, 1, threads * pixels, 1, pixels, min_blocks, "pointwise", slices)


# Output channels (per group) up to which a pointwise layer's default takes
# ptxas -O1, which keeps each chunk's loads ahead of its FMAs (see
# small_batch_tiling). H100, bench/split_probe.py --cold, session 11: ResNet-50
# layer1.1.conv1 (K = 64) 12.3 -> 4.5 us at batch 1, 131.5 -> 92.0 at batch
# 64; with K = 128 (layer2.x.conv1) -O1 was 5-11% slower. The same holds
# for the 3x3 layers above 28x28 (default_tiling), where -O3's choice depends
# on the weights: the sm_90 build of VGG-16 conv1_2 at -O3 had its loads a
# median ~220 instructions ahead of their use (128 registers) for some weight
# draws and 22-23 (109-111 registers) for others (4 of 7 tried, the zoo's
# among them; `bench/split_probe.py --sass`), which ran 882 and 2,020-2,070
# us at batch 64; -O1 kept them 137-147 ahead for every draw, 932 us with
# the zoo's (session 14). ResNet-50 layer1.x.conv2 (short for 1 of 7) at
# -O1: 57 -> 61 us, a small price for not depending on the draw.
POINTWISE_O1_MAX_CHANNELS = 64


def narrow_pointwise_level(shape: ConvShape) -> int:
    """ptxas level of a default pointwise tiling: -O1 up to
    POINTWISE_O1_MAX_CHANNELS output channels per group, else -O3."""
    return 1 if shape.k_per_group <= POINTWISE_O1_MAX_CHANNELS else 3


# Input channels from which a strided 1x1 takes 256 threads x 64 output
# channels capped at 2 blocks per SM (128 registers), rather than 512 threads;
# and input channels from which an unstrided 1x1 that widens (K > C) takes
# 32 output channels x 128 threads, 4 blocks per SM. Chosen on cold times at
# batch 64 (bench/split_probe.py --cold, session 13, docs/PERFORMANCE.md):
# ResNet-50's expanding conv3 layers, with their residual add, were 182 -> 142
# us (layer2), 142 -> 106 (layer3), 107 -> 89 (layer4): uncapped 64-channel
# blocks use 254 registers, 8 warps per SM, too few to hide the loads;
# layer3.0.downsample 197 -> 161, layer4.0.downsample 200 -> 193.
# Layer1's (64 input channels) and layer2.0.downsample (256) were as fast or
# faster under the old rule.
STRIDED_CAPPED_MIN_CHANNELS = 512
WIDENING_MIN_CHANNELS = 128
# Input channels from which an unstrided 1x1 conv that does not widen, with
# 14x14 outputs or more, takes blocks of 256 threads capped to 2 an SM, 32
# output channels where it has under twice this many inputs, else 32 or 64 by
# waves (NARROW_DEEP_POINTWISE_WAVE_COST; deep_pointwise_tiling).
# Before, 64 channels x 512 threads, one block an SM (chosen on the H100 in
# session 13). Cold at batch 64 on the H200 (bench/split_probe.py --cold
# --epilogue relu, seeds 0 and 1, session 46, run zz), µs, before -> after:
# ResNet-50 layer3.0.conv1 (512 -> 256, 28x28) 167-171 -> 127-129, the same
# shape as ResNeXt-50's layer2.x.conv1; ResNeXt-50 layer3.0.conv1 (512 ->
# 512, 28x28) 281-285 -> 217-218, layer4.0.conv1 (1024 -> 1024, 14x14) 271-274
# -> 216-220, layer3.1.conv1 (1024 -> 512, 14x14, as ResNet-50's
# layer4.0.conv1) 143-144 -> 141-142; ResNet-50 layer3.1.conv1 (1024 -> 256)
# 73-74 -> 72. 32 channels on the 1024-input layers: -9% on ResNeXt's
# layer3.1.conv1 and layer4.0.conv1, +16% on ResNet-50's layer3.1.conv1.
# ResNeXt-50 at batch 64, alternating trees: 7,168 -> 6,928 us a forward.
DEEP_POINTWISE_MIN_CHANNELS = 512
# From twice that many inputs, the choice between 32 and 64 channels a block
# goes by waves of two blocks an SM (TWO_WAVES) at SMALL_GRID_BATCH images: a
# wave of 32-channel blocks takes this fraction of a 64-channel wave's time.
# The same probe, both seeds (1024 inputs, 14x14, us): ResNeXt-50
# layer3.1.conv1 (K 512) 392 blocks of 64 = 2 waves, 141.3; 784 of 32 = 3
# waves, 127.8-128.1 (42.6 a wave against 70.6: 0.60). ResNet-50
# layer3.1.conv1 (K 256) 1 wave of 64, 71.7; 2 waves of 32, 84.7-85.3.
# ResNeXt-50 layer4.0.conv1 (K 1024) 3 waves of 64, 217.6-219.9; 6 of 32,
# 242.9-243.5. The 512-input layers take 32 channels by the rule above.
# Landed in session 48 on alternating trees at batch 64 (us a forward): ResNeXt-50
# 6,770 / 6,772 -> 6,722 / 6,724 (predicted -65), ResNet-50 5,703 / 5,708 -> 5,687 / 5,681 (-13).
NARROW_DEEP_POINTWISE_WAVE_COST = 0.6


# The batch at which a 7x7 1x1 conv's 32-channel blocks are counted: under
# half a wave of them there (ONE_WAVE), it takes 16-channel blocks, twice as
# many. Session 44 (H200, split_probe --cold, batch 64): MNASNet
# layers.12.1.layers.6 (1152 -> 192, 54 blocks) 42.8 -> 29.2 us,
# layers.12.0.layers.6 (576 -> 192) 24.4 -> 16.5, MobileNetV2
# features.15.conv.2 (960 -> 160, 40 blocks) 38.0 -> 23.9; with 70+ blocks
# slower (features.17.conv.2 40.3 -> 41.9, ResNet-50 layer4.1.conv1 80.6 ->
# 102.6). Session 45, alternating trees, bench --network at batch 64:
# MNASNet 1,698 -> 1,650 us, MobileNetV2 1,640 -> 1,598.
SMALL_GRID_BATCH = 64


def large_batch_blocks(shape: ConvShape, tiling: Tiling) -> int:
    """Blocks `tiling` launches at SMALL_GRID_BATCH, what the default rules
    count: the launched grid, as the blocks that its groups round up do run
    (session 49, run m)."""
    return math.prod(launch_grid(shape, tiling, SMALL_GRID_BATCH))


def large_batch_waves(shape: ConvShape, tiling: Tiling) -> int:
    """Waves (ONE_WAVE x tiling.min_blocks slots) of large_batch_blocks."""
    return -(-large_batch_blocks(shape, tiling) // (ONE_WAVE * tiling.min_blocks))


def default_pointwise_tiling(shape: ConvShape) -> Tiling:
    """The pointwise family's default, from two sweeps on the H100
    (bench/family_sweep.py, ResNet-50's 15 distinct 1x1 layers at batch 64,
    docs/PERFORMANCE.md): where one block of 128 output channels covers them
    all (K/groups <= 128), 128 channels x 1 pixel x 128 threads, so the input
    is read once; otherwise 64 channels x 1 pixel, with more threads the deeper
    the layer: 128 below 256 input channels, 256 below 512, else 512. The code
    of a deep layer's block is long straight-line code, and the more warps walk
    it together, the less each waits on instruction fetch (512 threads: 2.2x
    faster than 128 on layer3's 1024->256). Within 1.2x of the best of six
    candidates on every layer. From DEEP_POINTWISE_MIN_CHANNELS inputs on
    14x14 images or larger, the same 512 threads an SM come as two capped
    blocks of 256 (deep_pointwise_tiling); a Linear layer's one pixel keeps 512.

    Three exceptions, chosen on cold times (session 13): strided layers with
    STRIDED_CAPPED_MIN_CHANNELS+ inputs and unstrided widening layers with
    WIDENING_MIN_CHANNELS+ inputs (see there); and other layers whose images
    have fewer than MANY_THREADS_MIN_OUTPUT pixels (7x7, but not a Linear
    layer's single pixel): 32 channels x 512 threads, twice the blocks of 64
    channels, where 64-channel blocks fill under half a wave at batch 64
    (ResNet-50 layer4.1.conv1, 2048 -> 512: 122 -> 84 us cold), as for the
    deep 3x3 layers at 7x7 (default_tiling)."""
    if shape.k_per_group <= 128:
        return replace(pointwise_tiling(shape, 128, 1, 128), ptxas_level=narrow_pointwise_level(shape))
    c = shape.c_per_group
    pixels = shape.out_h * shape.out_w
    if shape.stride != (1, 1):
        if c >= STRIDED_CAPPED_MIN_CHANNELS:
            return pointwise_tiling(shape, 64, 1, 256, min_blocks=2)
    elif shape.k_per_group > c >= WIDENING_MIN_CHANNELS:
        return pointwise_tiling(shape, 32, 1, 128, min_blocks=4)
    elif 1 < pixels < MANY_THREADS_MIN_OUTPUT:
        t = pointwise_tiling(shape, 32, 1, 512)
        if large_batch_blocks(shape, t) < ONE_WAVE // 2:
            return pointwise_tiling(shape, 16, 1, 512)  # see SMALL_GRID_BATCH
        return t
    if c >= DEEP_POINTWISE_MIN_CHANNELS and pixels >= MANY_THREADS_MIN_OUTPUT:  # see there
        return deep_pointwise_tiling(shape)
    return pointwise_tiling(shape, 64, 1, 512 if c >= 512 else 256 if c >= 256 else 128)


def deep_pointwise_tiling(shape: ConvShape) -> Tiling:
    """A deep unstrided 1x1 conv on 14x14 images or larger: two capped blocks of
    256 threads an SM, 32 output channels a block below 1,024 inputs; from
    there 32 or 64, whichever takes fewer waves at SMALL_GRID_BATCH, a wave of
    32 counted at NARROW_DEEP_POINTWISE_WAVE_COST of one of 64 (see there)."""
    narrow = pointwise_tiling(shape, 32, 1, 256, min_blocks=2)
    if shape.c_per_group < 2 * DEEP_POINTWISE_MIN_CHANNELS:
        return narrow
    wide = pointwise_tiling(shape, 64, 1, 256, min_blocks=2)
    waves = {t.k_block: large_batch_waves(shape, t) for t in (narrow, wide)}
    return narrow if waves[32] * NARROW_DEEP_POINTWISE_WAVE_COST < waves[64] else wide


# Outputs per image at or below which a deep conv larger than 1x1 takes the
# pointwise family (default_tiling), and the most kernel taps it does so for
# (each tap of each pixel keeps a pointer in registers).
SMALL_OUTPUT = 28 * 28
MAX_POINTWISE_TAPS = 9
# Input channels (per group) from which a deep conv with larger outputs takes
# the pointwise family too, 64 output channels x 256 threads. Measured cold at
# batch 64 (bench/split_probe.py --cold, session 13): against the direct
# family, ResNet-50 layer1.1.conv2 (64 channels, 56x56) 152 -> 58 us, VGG-16
# conv1_2 (64, 224x224) 1,810 -> 882, conv2_2 (128, 112x112) 1,757 -> 1,514,
# conv3_2 (256, 56x56) 2,281 -> 1,756, each with its ReLU fused; conv3_1
# (128 -> 256) lost 1,000 -> 1,036. 512 threads (128 registers) tied on
# three and lost on conv2_2 (1,891); 32 channels lost on all four. Fewer
# channels than this were not measured. (conv1_2 at -O3 took 882 or 2,050 us
# by its weights: see POINTWISE_O1_MAX_CHANNELS.)
LARGE_OUTPUT_POINTWISE_MIN_CHANNELS = 64
# Input channels from which such a layer takes 32 output channels x 512
# threads and one input channel a chunk instead: 16 warps walk each block's
# code where 64 channels (254 registers) left room for 8, so each fetched
# instruction serves twice the pixels, for half the FMAs a loaded input.
# H200, bench/split_probe.py --cold --batch 64 --epilogue relu --weights zoo
# (session 55, mean of two rounds), us: VGG-16 conv2_2 (128, 112x112) 1,541
# -> 1,248, conv3_1 (128 -> 256, 56x56) 927 -> 755, conv3_2 (256, 56x56)
# 1,589 -> 1,175. With 64 input channels it did not gain: conv2_1 795 ->
# 791, conv1_2 867 -> 1,389, ResNet-50 layer1.1.conv2 59 -> 116. Two input
# channels a chunk: 1-6% slower than one; 48 or 40 channels x 512, or
# 640 threads: slower than 32 x 512 on all three. With this rule and
# MANY_THREADS_28_MIN_CHANNELS's, VGG-16 at batch 64 in alternating trees
# (bench/tree_ab.py, session 55, run zr): 13,543 / 13,560 -> 11,938 / 11,939
# us a forward.
LARGE_OUTPUT_MANY_THREADS_MIN_CHANNELS = 128
# Outputs per image at or below which a deep conv's small-batch variant is
# split on the pointwise family too; between this and SMALL_OUTPUT it is split
# on the direct family. Measured cold at batch 1 (bench/split_probe.py --cold,
# session 10): VGG-16 conv4_2 (28x28, 512 channels) 66 us split direct against
# 89-98 us split pointwise; ResNet-50's layer2 3x3 within 20% either way.
SMALL_BATCH_POINTWISE_OUTPUT = 14 * 14
# Outputs per image from which a strided or 256+-channel deep conv takes 512
# threads x 64 output channels rather than 256 threads (default_tiling);
# below it, 512 threads x 64 channels leave half a wave of blocks (ResNet-50
# layer4 at 7x7, batch 64), so those take 512 threads x 32 channels.
# Chosen on cold times, as the layers run inside a network
# (bench/split_probe.py --cold --batch 64, session 12): layer4.1.conv2
# 273 -> 169 us, layer4.0.conv2 263 -> 172, layer3.1.conv2 (256 channels)
# 194 -> 135; hot, 256 threads had looked as fast or faster.
MANY_THREADS_MIN_OUTPUT = 14 * 14
MANY_THREADS_MIN_CHANNELS = 256
# Input channels from which an unstrided deep conv with more outputs than
# MANY_THREADS_MIN_OUTPUT (up to SMALL_OUTPUT) takes 32 output channels x 640
# threads, two input channels a chunk, rather than 64 x 512: more warps on
# each block's code, as above. Session 55 (H200, split_probe --cold --batch
# 64, mean of two rounds): VGG-16 conv4_2 (512, 28x28) 1,701 -> 1,512 us;
# with 256 input channels it lost (conv4_1 741 -> 842, ResNet-50
# layer3.1.conv2 at 14x14 117 -> 141), and so did VGG-16 conv5_1 (512,
# 14x14: 359 -> 444).
MANY_THREADS_28_MIN_CHANNELS = 512


def default_direct_tiling(shape: ConvShape) -> Tiling:
    """The direct family's default (see default_tiling)."""
    if shape.c_per_group * shape.kernel_h * shape.kernel_w < SHALLOW_MACS:
        return tiling_for(shape, _k_block(shape), 1 if shape.out_w <= 16 else 2)
    return tiling_for(shape, _k_block(shape), 1, 1, 256, 2)


# Depthwise convs (one input channel a group, MobileNet's 3x3) take the
# pointwise family: one group's output channels a block (or several groups,
# DEPTHWISE_GROUPS_A_BLOCK) over DEPTHWISE_THREADS
# pixels, the batch folded into them. The direct family gave each block one
# channel of one image (49 threads at 7x7) and staged its patch in shared
# memory for ~1 FMA a thread at 90% zeros: MobileNetV2's 17 depthwise layers
# took 266-836 us at batch 64 on the H200 against cuDNN fp32's 25-333
# (session 41, `bench --network mobilenet_v2`), so routing gave every one to
# cuDNN. This rule ran them 2.2-18.6x faster at batch 64 and 1.4-3.1x at
# batch 1 (bench/split_probe.py --cold, 9 of the 17, H200); 512 threads was
# faster on the 14x14 and 7x7 ones and slower on the larger (docs/pending).
# Outputs of SMALL_OUTPUT pixels or more take 128 threads x 2 pixels: at 1
# pixel a thread each output paid its own index arithmetic and bias load for
# ~1 FMA. Session 42 (H200, MobileNetV2, split_probe --cold, batch 64): 7-23%
# faster on the six layers with 112x112 to 28x28 outputs (features.1 162 ->
# 146 us, features.5 96 -> 77, two weight draws), slower on the 14x14 and
# 7x7 ones (features.13 70 -> 77); at batch 1 within 0.5 us either way.
DEPTHWISE_THREADS = 256
DEPTHWISE_MAX_K_BLOCK = 8
DEPTHWISE_LARGE_THREADS, DEPTHWISE_LARGE_PIXELS = 128, 2
# The most taps a depthwise kernel may have to take this rule: 5x5 too (at
# 90% zeros a 5x5 channel keeps ~2.5 of its 25 taps, and with one input
# channel a group its loads stay under TAP_PREDICATE_MAX_LOADS, one pointer a
# pixel). Session 43 (H200, MNASNet 1.0's 5x5 depthwise, split_probe --cold,
# batch 64 / 1): layers.9.1.layers.3 (28x28) 245 -> 58 / 4.5 -> 2.4-3.7 us,
# layers.10.1.layers.3 (14x14) 437 -> 61 / 8.5 -> 4.3, layers.12.1.layers.3
# (7x7) 711 -> 48 / 23.4 -> 8.3; the direct family gave each block one
# channel of one image (49-126 threads).
MAX_DEPTHWISE_TAPS = 25
# Depthwise groups a block (kernel_shape), where each has one output channel:
# the most up to 4 that divides the groups. With one group a block each
# channel paid its pixels' index arithmetic and tap tests again, ~30 SASS
# instructions an output for ~1 FMA; four groups share them. Session 43:
# ptxas sm_90, MobileNetV2 features.1 3,952 -> 1,840 SASS instructions (70
# -> 86 registers), features.2 12,608 -> 5,864, features.15 75,680 ->
# 29,440; H200 (split_probe --cold, against the one-group defaults), batch
# 64: features.1 131 -> 59 us (its memory floor is ~50), features.2 155 ->
# 79, features.11 40 -> 18, features.15 39 -> 15, MNASNet layers.3 158 ->
# 59; batch 1: 3.0-6.8 -> 1.8-3.7 us. MobileNetV2 2,181 -> 1,662 us at
# batch 64.
# 5x5 takes 4 too, or else 1, at 1 pixel a thread and 2 blocks an SM: its 100
# loads a pixel take a pointer a tap (over TAP_PREDICATE_MAX_LOADS; ptxas
# gave the same code with tap tests), 124-140 registers (126 with 2 blocks).
# Session 44 (H200, MNASNet's 5x5, split_probe --cold, against one group a
# block, batch 64 / 1): layers.9.1.layers.3 (28x28) 56.1 -> 38.0 / 4.1 ->
# 3.7 us, layers.10.1.layers.3 (14x14) 58.0 -> 49.3 / 5.0 -> 4.3,
# layers.12.1.layers.3 (7x7) 52.0 -> 33.8 / 9.2 -> 6.8. At 2 groups a block
# two of the three were slower than at 1 (71.2, 88.3, 65.2 us at batch 64).
DEPTHWISE_GROUPS_A_BLOCK = 4
DEPTHWISE_WIDE_MIN_BLOCKS = 2


def is_depthwise(shape: ConvShape) -> bool:
    """One input channel a group, at most MAX_DEPTHWISE_TAPS taps."""
    return (shape.groups > 1 and shape.c_per_group == 1
            and shape.kernel_h * shape.kernel_w <= MAX_DEPTHWISE_TAPS)


def depthwise_groups_a_block(shape: ConvShape) -> int:
    """See DEPTHWISE_GROUPS_A_BLOCK: the most that divides the groups (5x5: 4 or 1).
    Unpadded layers (their taps take pointers, not tests; not measured) keep 1."""
    if shape.k_per_group != 1 or shape.padding == (0, 0):
        return 1
    g = next(g for g in range(DEPTHWISE_GROUPS_A_BLOCK, 0, -1) if shape.groups % g == 0)
    return 1 if pointer_a_tap(shape, g) and g < DEPTHWISE_GROUPS_A_BLOCK else g


def pointer_a_tap(shape: ConvShape, groups_a_block: int) -> bool:
    """Do that many depthwise groups a block load a pixel's taps through a
    pointer each, over TAP_PREDICATE_MAX_LOADS (5x5, or any kernel over 9
    taps, at 4 groups)?"""
    return groups_a_block * shape.kernel_h * shape.kernel_w > TAP_PREDICATE_MAX_LOADS


def depthwise_tiling(shape: ConvShape) -> Tiling:
    """See DEPTHWISE_THREADS and DEPTHWISE_GROUPS_A_BLOCK."""
    k_block = min(shape.k_per_group, DEPTHWISE_MAX_K_BLOCK)
    g = depthwise_groups_a_block(shape)
    if pointer_a_tap(shape, g):  # only at 4 groups a block: 1 pixel a thread, 2 blocks an SM
        t = pointwise_tiling(shape, k_block, 1, DEPTHWISE_THREADS, DEPTHWISE_WIDE_MIN_BLOCKS)
    elif shape.out_h * shape.out_w >= SMALL_OUTPUT:
        t = pointwise_tiling(shape, k_block, DEPTHWISE_LARGE_PIXELS, DEPTHWISE_LARGE_THREADS)
    else:
        t = pointwise_tiling(shape, k_block, 1, DEPTHWISE_THREADS)
    return replace(t, k_block=g * k_block, c_block=g) if g > 1 else t


# Grouped convs with a few input channels a group (ResNeXt's 32-group 3x3:
# 4-16 a group, under SHALLOW_MACS per output) take the pointwise family too,
# one group's output channels a block (up to 32), 512 threads where a group
# has 8+ output channels (ptxas then caps them at 128 registers), else 256.
# The direct family's rule for shallow layers gave each block one image's
# rows. Session 42 (H200, split_probe --cold, batch 64 / 1): ResNeXt-50
# layer1.0.conv2 (4 a group, 56x56) 391 -> 135 / 12.0 -> 5.2 us,
# layer2.1.conv2 (8, 28x28) 233 -> 64 / 10.1 -> 4.6, layer3.1.conv2 (16,
# 14x14) 104 -> 40 / 8.2 -> 7.6. (256 threads at 8 and 16 a group: 98 and 60
# at batch 64, 254 registers.) Deeper groups (ResNeXt layer4, 32 a group)
# already take the pointwise family as deep layers.
GROUPED_MAX_K_BLOCK = 32
GROUPED_MANY_THREADS_MIN_K = 8


def is_shallow_grouped(shape: ConvShape) -> bool:
    """Several groups of a few input channels each, under SHALLOW_MACS
    multiply-adds per output, a kernel the pointwise family's taps allow."""
    taps = shape.kernel_h * shape.kernel_w
    return (shape.groups > 1 and shape.c_per_group > 1 and taps <= MAX_POINTWISE_TAPS
            and shape.c_per_group * taps < SHALLOW_MACS)


def shallow_grouped_tiling(shape: ConvShape) -> Tiling:
    """See GROUPED_MAX_K_BLOCK."""
    threads = 512 if shape.k_per_group >= GROUPED_MANY_THREADS_MIN_K else 256
    return pointwise_tiling(shape, min(shape.k_per_group, GROUPED_MAX_K_BLOCK), 1, threads)


def many_warps_tiling(shape: ConvShape) -> Tiling:
    """32 output channels x 512 threads, one input channel a chunk: 16 warps
    on each block's code at 128 registers (LARGE_OUTPUT_MANY_THREADS_MIN_CHANNELS)."""
    return replace(pointwise_tiling(shape, 32, 1, 512), c_block=1)


def default_tiling(shape: ConvShape) -> Tiling:
    """1x1 convs: the pointwise family (default_pointwise_tiling). Deep convs
    with small outputs (at most SMALL_OUTPUT pixels, at most MAX_POINTWISE_TAPS
    taps): the pointwise family too, 1 pixel a thread, and 512 threads x 64
    output channels where the layer is strided or has 256+ input channels,
    512 x 32 at 7x7 outputs, else 128 x 32 at 4 blocks per SM. There the direct family's blocks
    shrink to one image's outputs (49 threads at 7x7), while the pointwise
    family folds the batch into its pixels. Measured on the H100 at batch 64
    (bench/family_sweep.py --only wide, session 10): against the direct family,
    VGG-16 conv4_2 (28x28, 512 channels) 3,631 -> 1,702 us, ResNet-50
    layer2.1.conv2 (28x28, 128) 148 -> 103, layer2.0.conv2 (strided) 260 ->
    164. The thread counts were chosen on cold times (MANY_THREADS_MIN_OUTPUT):
    inside a network each block fetches its code from DRAM, and more warps
    walking the same code wait less for it. On the unstrided layers with
    fewer channels, 512 threads lost to 256 (ResNet-50 layer2.1.conv2, hot,
    146 vs 103); there 32 output channels x 128 threads capped at 4 blocks per
    SM beat both cold (session 13: 133 -> 110 us), as for the widening 1x1
    layers (WIDENING_MIN_CHANNELS), while on every 256+-channel or strided
    layer it lost by 1.2-1.5x. Larger outputs with
    LARGE_OUTPUT_POINTWISE_MIN_CHANNELS+ input channels: the pointwise family,
    64 x 256 threads (see there; 1.3-2.6x faster than the direct family), or
    32 x 512 from LARGE_OUTPUT_MANY_THREADS_MIN_CHANNELS. Unstrided convs
    with more than 14x14 and up to 28x28 outputs and
    MANY_THREADS_28_MIN_CHANNELS+ input channels: 32 x 640.
    Other convs: the direct family (default_direct_tiling).

    Direct family: 32 output channels per block (16 or 8 when R*S is large), one output per
    thread, 256 threads, registers capped so two blocks fit on an SM. The kernel
    is straight-line code streamed from the instruction cache, so the more warps
    walk the same instructions, the less each waits for them. Chosen by
    measurement: on the H100 (bench/tiling_sweep.py --grid, 2026-11-22) this
    rule was within 1.2x (geomean) of the best of 18 tilings on the
    channel-heavy benchmark layers, and 1.5-2x faster than the previous
    32 channels x 2 outputs x 128 threads (docs/PERFORMANCE.md).

    Layers with under SHALLOW_MACS multiply-adds per output (C/groups * R * S:
    the first layers of most CNNs) are bound by memory, not by instruction
    fetch; they keep the previous rule, which measured faster on them."""
    if (shape.kernel_h, shape.kernel_w) == (1, 1):
        return default_pointwise_tiling(shape)
    if is_depthwise(shape):
        return depthwise_tiling(shape)
    if is_shallow_grouped(shape):
        return shallow_grouped_tiling(shape)
    pixels = shape.out_h * shape.out_w
    deep = shape.c_per_group * shape.kernel_h * shape.kernel_w >= SHALLOW_MACS
    if deep and shape.kernel_h * shape.kernel_w <= MAX_POINTWISE_TAPS:
        if pixels > SMALL_OUTPUT:
            if shape.c_per_group >= LARGE_OUTPUT_MANY_THREADS_MIN_CHANNELS:
                return many_warps_tiling(shape)
            if shape.c_per_group >= LARGE_OUTPUT_POINTWISE_MIN_CHANNELS:
                # One k-block of <= 64 channels: at -O3 ptxas may keep it at
                # ~110 registers by moving each load next to its first FMA
                # (POINTWISE_O1_MAX_CHANNELS; VGG-16 conv1_2 2,052 -> 932 us).
                return replace(pointwise_tiling(shape, 64, 1, 256), ptxas_level=narrow_pointwise_level(shape))
            return default_direct_tiling(shape)
        if pixels < MANY_THREADS_MIN_OUTPUT:  # 7x7: 512 threads, half the channels a block to fill a wave
            return pointwise_tiling(shape, 32, 1, 512)
        wide = shape.c_per_group >= MANY_THREADS_28_MIN_CHANNELS
        if shape.stride == (1, 1) and wide and pixels > MANY_THREADS_MIN_OUTPUT:
            return replace(pointwise_tiling(shape, 32, 1, 640), c_block=2)
        if shape.stride != (1, 1) or shape.c_per_group >= MANY_THREADS_MIN_CHANNELS:
            return pointwise_tiling(shape, 64, 1, 512)
        return pointwise_tiling(shape, 32, 1, 128, min_blocks=4)
    return default_direct_tiling(shape)


# Blocks that fill the H100 once (132 SMs) and twice: a layer that gives fewer
# than one wave at batch 1 gets a second, split variant (small_batch_tiling).
ONE_WAVE, TWO_WAVES = 132, 264
# Least work per slice of a split reduction: multiply-adds per output for the
# direct family, input channels for the pointwise one. Below it the second
# (reduction) kernel costs more than the split gains (bench/family_sweep.py).
MIN_SLICE_MACS_DIRECT = 128
MIN_SLICE_CHANNELS_POINTWISE = 128  # input channels x kernel taps, on larger kernels


def blocks_per_image(shape: ConvShape, tiling: Tiling) -> float:
    """Blocks one image gives (fractional for the pointwise family, whose
    blocks span images)."""
    kblocks = n_kblocks(shape, tiling)
    if tiling.family == "pointwise":
        return shape.out_h * shape.out_w / tiling.tile_w * kblocks
    return math.ceil(shape.out_h / tiling.tile_h) * math.ceil(shape.out_w / tiling.tile_w) * kblocks


# Inside a network a small-batch block fetches its k-block copy's code from
# DRAM: by then L2 holds other layers' code. Timed that way (L2 overwritten
# first), ResNet-50's 1x1 split variants took about 6 us + 0.42 us per KB of
# code per block, at most one block per SM (bench/split_probe.py --cold,
# docs/PERFORMANCE.md, session 8). So a small-image conv on the pointwise
# family (1x1, and the deep 3x3 layers) takes the split with the least code
# per block: one block of pixels where up to this many threads
# cover an image, this many output channels a block (the per-block stores
# and sums shrink with it), and as many slices as keep the blocks in a wave
# (two for the smallest blocks: COLD_SPLIT_TWO_WAVE_MAX_THREADS).
COLD_SPLIT_MAX_THREADS = 256
COLD_SPLIT_K_BLOCK = 32
# Up to 28x28 outputs; measured cold at batch 1 (session 9): ResNet-50's 1x1
# layers at 28x28 and below up to 3.1x faster than under the old rule (one,
# layer4.0.downsample, even), layer3's 3x3 1.4x, layer4's even. At 56x56 the
# slices' partial sums cost more than the code saved (layer1.1.conv1 6.3 ->
# 9.6 us), so larger images keep the old rule.
COLD_SPLIT_MAX_PIXELS = 1024
# Blocks of up to this many threads (7x7 images) take slices for two waves,
# which run at once, two blocks an SM: two streams of code fetched side by side.
# Measured cold at batch 1 (session 16, bench/split_probe.py --cold): ResNet-50
# layer4's 1x1 and 3x3 splits 1.1-1.3x faster (layer4.1.conv2 30.1 -> 24.9 us,
# layer4.0.downsample 26.8 -> 20.1), though 1.2-1.5x slower hot; four waves
# gained no more. Blocks of 224 threads given 2 an SM by a register cap lost
# (layer3.1.conv3 8.8 -> 11.2 us), as did two waves one after the other.
COLD_SPLIT_TWO_WAVE_MAX_THREADS = 64
# Direct-family splits of convs with at least this many input channels stage
# SPLIT_DIRECT_WIDE_C_BLOCK channels a chunk, not 2: half the chunks, each with
# its loads, barrier and switch of code. Measured cold at batch 1 (session 17,
# bench/split_probe.py --cold --weights zoo, :C4): VGG-16 conv3_2 58.5 -> 54.0
# us, conv4_2 67.6 -> 63.1, conv4_1 38.4 -> 37.8; on ResNet-50's 64- and
# 128-channel layers it lost (layer2.0.conv2 16.8 -> 20.2), and 8 channels a
# chunk gained less than 4 on every layer.
SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS = 256
SPLIT_DIRECT_WIDE_C_BLOCK = 4


def cold_pointwise_split(shape: ConvShape) -> Optional[Tiling]:
    """The small-batch variant of a pointwise-family conv with a small image
    (see COLD_SPLIT_K_BLOCK), or None where fewer than two slices fit."""
    pixels = shape.out_h * shape.out_w
    threads = min(COLD_SPLIT_MAX_THREADS, 32 * math.ceil(pixels / 32))
    t = pointwise_tiling(shape, COLD_SPLIT_K_BLOCK, 1, threads)
    blocks = math.ceil(pixels / threads) * n_kblocks(shape, t)
    chunks = math.ceil(shape.c_per_group / t.c_block)
    max_blocks = ONE_WAVE * (2 if threads <= COLD_SPLIT_TWO_WAVE_MAX_THREADS else 1)
    slices = 1
    while slices * 2 <= chunks and blocks * slices * 2 <= max_blocks:
        slices *= 2
    # ptxas -O1 for the reason small_batch_tiling gives
    return summed_in_cluster(shape, replace(t, slices=slices, ptxas_level=1)) if slices >= 2 else None


# SMs a wave of clusters of this many blocks can use on the H100: a cluster's
# blocks run in one GPC, and the GPCs' SMs are not all multiples of the
# cluster size (cuOccupancyMaxActiveClusters, bench/split_probe.py, session 15:
# 1 block an SM, 66 clusters of 2, 15 of 8, 7 of 16; 2 blocks an SM, 62 of 4).
CLUSTER_WAVE_SMS = {2: 132, 4: 124, 8: 120, 16: 112}


def summed_in_cluster(shape: ConvShape, split: Tiling) -> Tiling:
    """A split tiling with its slices summed inside a thread-block cluster
    (Tiling.slice_sum) where that measured faster: no workspace and no second
    launch (~2 us a layer at batch 1), but the blocks of a cluster wait for
    each other and read each other's partial sums. Measured at batch 1 on the
    H100 (bench/split_probe.py, docs/PERFORMANCE.md, session 15), cold and hot:
    - pointwise family, an SM holding two or more of the kernel's blocks
      (ResNet-50 layer4's 64-thread splits) or clusters of 2: 0.5-1.9 us
      faster a layer;
    - pointwise, one block of 224-256 threads an SM, 4-16 slices (layer3):
      0.5-9 us slower (that one block's warps idle at the barrier and
      through the reads);
    - direct family: cold 1-9 us faster, hot 1-10 us slower; inside the
      network, where the code is cold, faster (session 16, alternating
      runs of bench/network_ab.py at batch 1: the kernels of ResNet-50
      -12 us, VGG-16 -18 us);
    - any family, more clusters than one wave holds (CLUSTER_WAVE_SMS): up
      to 1.4x slower (VGG-16 conv4_2, 64 clusters of 4 against 62).
    At most MAX_CLUSTER_SLICES, the partial tile within shared memory."""
    if split.slices > MAX_CLUSTER_SLICES:
        return split
    fits = max(patch_buffer_bytes(shape, split), partial_tile_bytes(split)) <= MAX_PATCH_BYTES
    per_sm = register_resident_blocks(split)
    wave = CLUSTER_WAVE_SMS[1 << (split.slices - 1).bit_length()] * per_sm
    pays = (split.slices == 2 or per_sm >= 2) and math.ceil(blocks_per_image(shape, split)) <= wave
    return replace(split, slice_sum="cluster") if fits and pays else split


def register_resident_blocks(tiling: Tiling) -> int:
    """Blocks of this tiling an SM holds at once as far as registers go (its
    register cap, Tiling.max_registers, is what ptxas may use): 65536 per SM,
    allocated per warp."""
    return 65536 // (32 * math.ceil(tiling.threads / 32) * tiling.max_registers)


# Small-batch splits of deep k x k convs (256+ input channels, or 128+ where
# the image takes several blocks; stride 1) with more than SMALL_BATCH_POINTWISE_OUTPUT output pixels and at most
# WHOLE_IMAGE_SPLIT_MAX_PIXELS (VGG-16's 28x28 conv4_x and 56x56 conv3_2/3_3),
# where the layer's tiling is on the pointwise family (their default): the
# image in as few pointwise blocks as WHOLE_IMAGE_SPLIT_MAX_THREADS allow,
# WHOLE_IMAGE_SPLIT_K_BLOCK output channels and WHOLE_IMAGE_SPLIT_SLICES
# input-channel slices a block. The direct family's split tiles the image
# into 4 (28x28) or 14 (56x56) blocks, and each of them streams the same code;
# 1 or 4 blocks stream it less often. An SM keeps only ~16 KB of code
# (bench/icache_probe.py), so each block fetches all of its own.
# Measured on the H100, batch 1, cold (bench/split_probe.py): VGG-16 conv4_1
# 38.3 -> 31.5 us, conv4_2 62.9 -> 47.0 (session 18); conv3_2 / conv3_3
# 54.8 / 54.5 -> 46.3 / 46.3, hot even (session 19). With 8 slices or k_block
# 32 they lost, and so did 1024 threads at 56x56 (64 registers, loads 11
# instructions ahead of use against 41 at 800), hence the thread cap; so did
# ResNet-50's 128-channel layer2.1.conv2 (13.8 -> 14.6-16.7), hence the
# channel floor. Where the image takes several blocks (more than
# WHOLE_IMAGE_SPLIT_MAX_THREADS pixels), 128 to 255 input channels qualify
# too, in WHOLE_IMAGE_SPLIT_MID_SLICES slices: VGG-16 conv3_1 (128 channels,
# 56x56) 33.1 -> 26.9 and 33.2 -> 27.0 cold in two runs, 4 slices even
# (session 19); layer2.1.conv2 (one block) lost 13.7 -> 22.6 with 2 slices.
WHOLE_IMAGE_SPLIT_MIN_CHANNELS = 256
WHOLE_IMAGE_SPLIT_MID_CHANNELS, WHOLE_IMAGE_SPLIT_MID_SLICES = 128, 2
WHOLE_IMAGE_SPLIT_MAX_PIXELS = 56 * 56  # the largest image measured
WHOLE_IMAGE_SPLIT_MAX_THREADS = 800  # 784 pixels (28x28) a block, rounded up to whole warps
WHOLE_IMAGE_SPLIT_K_BLOCK, WHOLE_IMAGE_SPLIT_C_BLOCK, WHOLE_IMAGE_SPLIT_SLICES = 16, 4, 4


def image_block_threads(pixels: int) -> int:
    """Threads a block (one pixel each) where an image of `pixels` is cut into
    as few blocks of at most WHOLE_IMAGE_SPLIT_MAX_THREADS as cover it: the
    pixels shared evenly, in whole warps."""
    blocks = -(-pixels // WHOLE_IMAGE_SPLIT_MAX_THREADS)
    return -(-pixels // (blocks * 32)) * 32


def image_blocks_tiling(shape: ConvShape, slices: int) -> Optional[Tiling]:
    """The pointwise tiling whole_image_split and large_image_blocks build
    for a k x k conv at stride 1 without groups: image_block_threads pixels
    a block, WHOLE_IMAGE_SPLIT_K_BLOCK output channels, `slices` slices; None
    for any other conv, or where the tiling is over its bounds."""
    if (shape.kernel_h, shape.kernel_w) == (1, 1) or shape.stride != (1, 1) or shape.groups != 1:
        return None
    threads = image_block_threads(shape.out_h * shape.out_w)
    tiling = replace(pointwise_tiling(shape, WHOLE_IMAGE_SPLIT_K_BLOCK, 1, threads),
                     c_block=WHOLE_IMAGE_SPLIT_C_BLOCK, slices=slices)
    try:
        check_tiling(shape, tiling)
    except ValueError:
        return None
    return tiling


def whole_image_split(shape: ConvShape) -> Optional[Tiling]:
    """The small-batch variant described at WHOLE_IMAGE_SPLIT_MIN_CHANNELS,
    or None where the rule does not apply to `shape`."""
    pixels = shape.out_h * shape.out_w
    several_blocks = pixels > WHOLE_IMAGE_SPLIT_MAX_THREADS
    floor = WHOLE_IMAGE_SPLIT_MID_CHANNELS if several_blocks else WHOLE_IMAGE_SPLIT_MIN_CHANNELS
    if shape.c_per_group < floor or not SMALL_BATCH_POINTWISE_OUTPUT < pixels <= WHOLE_IMAGE_SPLIT_MAX_PIXELS:
        return None
    slices = (WHOLE_IMAGE_SPLIT_SLICES if shape.c_per_group >= WHOLE_IMAGE_SPLIT_MIN_CHANNELS
              else WHOLE_IMAGE_SPLIT_MID_SLICES)
    return image_blocks_tiling(shape, slices)


# Small-batch variant of k x k convs (64 to 128 input channels, stride 1) on
# images larger than WHOLE_IMAGE_SPLIT_MAX_PIXELS, up to LARGE_IMAGE_MAX_PIXELS
# (VGG-16's 112x112 conv2_1 and conv2_2), where the layer's tiling is on the
# pointwise family: blocks of WHOLE_IMAGE_SPLIT_MAX_THREADS threads and
# WHOLE_IMAGE_SPLIT_K_BLOCK output channels, not split, where they come to
# at most one wave. The default's 256-thread blocks of 64 channels each
# stream a 64-channel k-block's code (~118 KB for conv2_2) at the ~3.8 GB/s an
# SM fetches code (bench/icache_probe.py): ~31 us. A 16-channel block streams
# a quarter of that, and the image's ~800 pixels a block keep the block count
# at one wave (VGG-16 conv2_x: 16 x 8 = 128 blocks). Measured on the H100,
# batch 1 (bench/split_probe.py, session 19), us hot / cold: conv2_1 16.5 /
# 35.5 -> 16.2 / 21.6, conv2_2 30.9 / 64.4 -> 26.7 / 34.2; the same blocks
# with 2 or 4 slices lost (reducing a 112x112 image's slices costs 5-8 us),
# and so did ResNet-50's 64-channel 56x56 layer1.x.conv2 (cold 12.8 -> 16.4),
# which the pixel floor leaves out. Deeper convs on such images were not
# measured; 256+ channels keep the direct split, staged 4 channels a chunk
# (SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS).
LARGE_IMAGE_MIN_CHANNELS, LARGE_IMAGE_MAX_CHANNELS = 64, 128
LARGE_IMAGE_MAX_PIXELS = 112 * 112  # the largest image measured


def large_image_blocks(shape: ConvShape) -> Optional[Tiling]:
    """The small-batch variant described at LARGE_IMAGE_MIN_CHANNELS, or None
    where the rule does not apply to `shape`."""
    pixels = shape.out_h * shape.out_w
    if (not LARGE_IMAGE_MIN_CHANNELS <= shape.c_per_group <= LARGE_IMAGE_MAX_CHANNELS
            or not WHOLE_IMAGE_SPLIT_MAX_PIXELS < pixels <= LARGE_IMAGE_MAX_PIXELS):
        return None
    tiling = image_blocks_tiling(shape, slices=1)
    return tiling if tiling is not None and math.prod(launch_grid(shape, tiling, 1)) <= ONE_WAVE else None


# Small-batch variant of a network's image layer (at most
# IMAGE_LAYER_MAX_CHANNELS input channels, no groups), when it has the direct
# family's default tiling: 16 output channels x one output a thread x 256
# threads instead of 32 x 2 x 128. In the network the layer runs cold, and its
# time is every SM fetching its block's code from DRAM; smaller k-blocks, in
# more blocks an SM, fetch less code a block and several streams at once.
# Measured on the H100 (bench/split_probe.py --cold --epilogue relu --weights
# zoo, session 25, runs an and ao), us hot / cold, default -> this:
# - batch 1: ResNet-50 conv1 (7x7 s2) 4.8 / 16.4 -> 5.2 / 9.7, VGG-16 conv1_1
#   6.1 / 9.6 -> 5.9 / 7.2; k8 blocks were slower, cold, on both;
# - batch 8: 21.3 / 32.0 -> 33.8 / 35.1 (ResNet-50), batch 64: 148.6 -> 277.8.
# So batch 1 only (BATCH1_VARIANT_MAX_BATCH), whatever the image size: on small
# images, where split_batch_limit would allow more, nothing was measured.
IMAGE_LAYER_MAX_CHANNELS = 4
IMAGE_LAYER_K_BLOCK, IMAGE_LAYER_THREADS = 16, 256


def image_layer_blocks(shape: ConvShape, tiling: Tiling) -> Optional[Tiling]:
    """The small-batch variant described at IMAGE_LAYER_MAX_CHANNELS, or None
    where the rule does not apply to `shape` with `tiling`."""
    if (shape.in_channels > IMAGE_LAYER_MAX_CHANNELS or shape.groups != 1 or tiling.family != "direct"
            or tiling != default_direct_tiling(shape)):
        return None
    return tiling_for(shape, _k_block(shape, IMAGE_LAYER_K_BLOCK), 1, 1, IMAGE_LAYER_THREADS)


# Small-batch variant of an expanding 1x1 conv (stride 1, no groups, at least
# EXPANDING_MIN_RATIO times as many output channels as input channels; ResNet's
# conv3 and its first downsample) on an image of EXPANDING_MIN_PIXELS to
# EXPANDING_MAX_PIXELS pixels, when it has the pointwise default: blocks of
# EXPANDING_K_BLOCK output channels, not split, each the fewest threads (of
# EXPANDING_THREADS) that keep the grid within one wave. Cold, each block
# streams its k-block's code from DRAM; the default's 64-channel blocks (or
# the cold split's 32) stream 2-4x as much each. Measured on the H100, batch
# 1, cold (bench/split_probe.py --cold --weights zoo, session 26, runs as and
# at), us, default -> this, with the residual add and ReLU:
# - ResNet-50 layer1.0.conv3 (64 -> 256, 56x56): 11.3 / 10.9 -> 6.4 / 6.3
#   (512 threads; 256 threads, two waves: 9.3-10.3); no epilogue 6.0 -> 4.9;
# - layer2.0.conv3 (128 -> 512, 28x28, default: the cold split in a cluster):
#   11.5 / 11.6 -> 7.2 / 6.7 (256 threads);
# - layer1.0.downsample (64 -> 256, 56x56, no epilogue): 6.1 -> 4.6.
# Hot they gained too (4.4 -> 3.6-3.8 us). Where they did not gain: the
# strided downsamples of layer2 and layer3 (9.9 -> 9.6, 12.6 -> 14.5),
# layer3.0.conv3 at 14x14 (9.3 -> 9.6; the table takes it anyway),
# layer4.0.conv3 at 7x7 (14.6 -> 18.7), and the narrowing layer1.1.conv1
# (256 -> 64: 5.9 -> 5.5-6.9), hence the ratio, stride and pixel bounds.
# Batch 1 only, as measured (BATCH1_VARIANT_MAX_BATCH).
EXPANDING_MIN_RATIO = 2
EXPANDING_MIN_PIXELS, EXPANDING_MAX_PIXELS = 28 * 28, 56 * 56
EXPANDING_K_BLOCK = 16
EXPANDING_THREADS = (128, 256, 512)


def expanding_pointwise_blocks(shape: ConvShape, tiling: Tiling) -> Optional[Tiling]:
    """The small-batch variant described at EXPANDING_MIN_RATIO, or None
    where the rule does not apply to `shape` with `tiling`."""
    pixels = shape.out_h * shape.out_w
    if ((shape.kernel_h, shape.kernel_w) != (1, 1) or shape.stride != (1, 1) or shape.groups != 1
            or shape.out_channels < EXPANDING_MIN_RATIO * shape.in_channels
            or not EXPANDING_MIN_PIXELS <= pixels <= EXPANDING_MAX_PIXELS
            or tiling != default_pointwise_tiling(shape)):
        return None
    for threads in EXPANDING_THREADS:
        blocks = pointwise_tiling(shape, EXPANDING_K_BLOCK, 1, threads)
        if math.prod(launch_grid(shape, blocks, 1)) <= ONE_WAVE:
            return blocks
    return None


# The variants above measured at batch 1 only serve no larger batch.
BATCH1_VARIANT_MAX_BATCH = 1


def batch1_blocks(shape: ConvShape, tiling: Tiling) -> Optional[Tiling]:
    """The batch-1 variant of `shape` with `tiling` (image_layer_blocks or
    expanding_pointwise_blocks; at most one applies), or None."""
    return image_layer_blocks(shape, tiling) or expanding_pointwise_blocks(shape, tiling)


def small_batch_tiling(shape: ConvShape, tiling: Tiling) -> Optional[Tiling]:
    """The variant of `tiling` that small batches run, or None where one image
    already fills the GPU or the input-channel reduction is too short to
    split. The first case that applies:
    - a pointwise `tiling` of whole_image_split's class: as few split blocks
      as cover the image; of large_image_blocks' class: smaller blocks, not
      split (a direct `tiling` skips both and keeps the direct split below,
      for comparisons);
    - batch1_blocks (the image layer, expanding 1x1 convs): smaller blocks,
      not split;
    - a conv larger than 1x1 with more than SMALL_BATCH_POINTWISE_OUTPUT
      pixels is split on the direct family, whatever family `tiling` is;
    - a pointwise conv with an image of 2 to COLD_SPLIT_MAX_PIXELS pixels
      (not a Linear layer, whose image is one pixel): cold_pointwise_split;
    - otherwise the reduction split into slices: the largest power of two
      that keeps blocks within two waves and each slice at least the
      minimum work (measured on the H100: batch 1, ResNet-50 and VGG-16
      layers, 1.2-6x faster where it applies; bench/family_sweep.py)."""
    if tiling.slices != 1:
        return None
    whole = (whole_image_split(shape) or large_image_blocks(shape)) if tiling.family == "pointwise" else None
    if whole is not None:
        return whole
    smaller = batch1_blocks(shape, tiling)
    if smaller is not None:
        return smaller
    if (tiling.family == "pointwise" and (shape.kernel_h, shape.kernel_w) != (1, 1)
            and shape.out_h * shape.out_w > SMALL_BATCH_POINTWISE_OUTPUT):
        tiling = default_direct_tiling(shape)  # measured faster split (SMALL_BATCH_POINTWISE_OUTPUT)
    if tiling.family == "pointwise" and tiling.threads > 128:
        # a small batch has few pixels: big blocks would idle most threads
        tiling = pointwise_tiling(shape, tiling.k_block, tiling.thread_w, 128, tiling.min_blocks)
    blocks = math.ceil(blocks_per_image(shape, tiling))
    if blocks >= ONE_WAVE:
        return None
    if tiling.family == "pointwise" and 1 < shape.out_h * shape.out_w <= COLD_SPLIT_MAX_PIXELS:
        return cold_pointwise_split(shape)
    chunks = math.ceil(shape.c_per_group / tiling.c_block)
    if tiling.family == "pointwise":
        most = shape.c_per_group * shape.kernel_h * shape.kernel_w // MIN_SLICE_CHANNELS_POINTWISE
        least = 4  # 2 slices do not pay for the reduction kernel
    else:
        most = shape.c_per_group * shape.kernel_h * shape.kernel_w // MIN_SLICE_MACS_DIRECT
        least = 2
    slices = 1
    while slices * 2 <= min(most, chunks) and blocks * slices * 2 <= TWO_WAVES:
        slices *= 2
    if slices < least:
        return None
    # A split block has few warps to hide load latency with: keep the chunk's
    # loads together (ptxas -O1; Tiling.ptxas_level). Measured on the H100 at
    # batch 1 (bench/split_probe.py): 1x1 layers 1.6-2.4x faster; deep 3x3
    # even, and at batch 64 (many warps) -O1 is 0-15% slower.
    level = 1 if tiling.family == "pointwise" and (shape.kernel_h, shape.kernel_w) == (1, 1) else tiling.ptxas_level
    split = replace(tiling, slices=slices, ptxas_level=level)
    if tiling.family == "direct" and shape.c_per_group >= SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS:
        split = widest_fitting_chunk(shape, split, SPLIT_DIRECT_WIDE_C_BLOCK)
    return summed_in_cluster(shape, split)


def widest_fitting_chunk(shape: ConvShape, tiling: Tiling, c_block: int) -> Tiling:
    """`tiling` with c_block raised to `c_block` where check_tiling and the
    staging bound of tiling_for (MAX_STAGE_STEPS) allow it, halving it until
    they do; unchanged where no wider chunk fits."""
    while c_block > tiling.c_block:
        wider = replace(tiling, c_block=min(c_block, shape.c_per_group))
        try:
            check_tiling(shape, wider)
            if stage_steps(shape, wider) <= MAX_STAGE_STEPS:
                return wider
        except ValueError:
            pass
        c_block //= 2
    return tiling


# The split variant serves at most this batch size: measured better at batch
# 1 and worse at 64 (its workspace grows with the batch); the crossover in
# between is not measured, so this is a guess to revisit with measurements.
MAX_SPLIT_BATCH = 16


def split_batch_limit(shape: ConvShape, split: Tiling) -> int:
    """Largest batch the split variant serves: while the same tiling unsplit
    would still give less than one wave of blocks, at most MAX_SPLIT_BATCH."""
    unsplit = replace(split, slices=1, slice_sum="kernel")
    return max(1, min(MAX_SPLIT_BATCH, math.ceil(ONE_WAVE / blocks_per_image(shape, unsplit)) - 1))


# A variant serves batches up to this size; the last one serves any batch.
ANY_BATCH = 1 << 62


# Deep convs at batch 64 wait on instruction fetch (session 16): a block
# streams its k-block's code, so a wave of blocks takes about as long as one
# block's code, and blocks beyond a whole number of waves start another. A
# default that leaves SMs idle in its last wave can take fewer output channels
# a block (a k_block need not be a power of two) and, at one block an SM, up
# to WAVE_FIT_MAX_THREADS threads, so that more blocks of less code fill the
# waves it had. Cost of a tiling: waves at SMALL_GRID_BATCH x (this many
# channels + k_block), the fixed part fitted to the cold probe below (a
# block's loads and epilogue do not shrink with its channels). Taken where
# the cost falls by WAVE_FIT_MIN_GAIN and the last wave fills by
# WAVE_FIT_MIN_FILL_GAIN more: ResNet-50 layer4.0.conv2, whose 128 blocks
# already fill a wave, lost 5% with 24 x 544 (cost -8%, fill +3%).
# H200, bench/split_probe.py --cold --batch 64 --epilogue relu --seed 0
# (session 49, runs p and q), us before -> after:
#   ResNet-50 layer3.1/3.2.conv2 (64 x 512, 104 blocks -> 52 x 512, 130):
#     129.4 -> 119.7, 130.5 -> 118.5
#   layer4.1/4.2.conv2 (32 x 512, 112 -> 20 x 640, 130): 162.4 -> 134.9,
#     166.1 -> 135.8
#   layer3.1/3.2.conv1 (1x1, 64 x 256 x 2 an SM, 196 -> 52, 245):
#     68.3 -> 63.8, 69.5 -> 67.4
#   VGG-16 conv5_1/5_2 (64 x 512, 224 -> 40 x 640, 260): 491.8 -> 361.1,
#     492.1 -> 358.2
# Whole networks, alternating trees at batch 64 (session 50, runs v):
# ResNet-50 5,821 -> 5,661 us, VGG-16 14,418 / 14,397 -> 13,994 / 14,009.
# Small batches keep the variants of the default before the fit.
WAVE_FIT_FIXED_CHANNELS = 64
WAVE_FIT_MIN_GAIN = 0.05
WAVE_FIT_MIN_FILL_GAIN = 0.1
WAVE_FIT_MAX_THREADS = 640
WAVE_FIT_MIN_K_BLOCK = 16
# Registers a thread needs beside its k_block accumulators (pointers, the
# loaded inputs); at 640 threads (96 registers) k_block 40 at most.
WAVE_FIT_OTHER_REGISTERS = 56


def wave_fitted_tiling(shape: ConvShape, tiling: Tiling) -> Tiling:
    """`tiling` (a default of a deep pointwise-family conv: 512 threads, one
    block an SM, on a kernel larger than 1x1, or 256 threads two an SM)
    refitted to the waves of SMALL_GRID_BATCH images (see
    WAVE_FIT_FIXED_CHANNELS); unchanged where it is of neither kind or no
    candidate gains enough."""
    # Not 128 threads four an SM: ResNet-50's layer4.x.conv3 at 25 channels in
    # place of 32 fills its last wave but runs 19% slower, its blocks bound by
    # reading their input, not their code (docs/PERFORMANCE.md, session 51).
    fits = (tiling.family == "pointwise" and shape.groups == 1 and tiling.slices == 1 and tiling.thread_w == 1
            and ((tiling.threads, tiling.min_blocks) == (512, 1) and (shape.kernel_h, shape.kernel_w) != (1, 1)
                 or (tiling.threads, tiling.min_blocks) == (256, 2)))
    if not fits:
        return tiling

    def cost_and_fill(t: Tiling) -> Tuple[int, float]:
        waves, blocks = large_batch_waves(shape, t), large_batch_blocks(shape, t)
        return waves * (WAVE_FIT_FIXED_CHANNELS + t.k_block), blocks / (waves * ONE_WAVE * t.min_blocks)

    base_cost, base_fill = cost_and_fill(tiling)
    best, best_cost, best_fill = tiling, base_cost, base_fill
    threads = range(tiling.threads, WAVE_FIT_MAX_THREADS + 1, 32) if tiling.min_blocks == 1 else [tiling.threads]
    for n in threads:
        for k in range(WAVE_FIT_MIN_K_BLOCK, tiling.k_block + 1):
            t = replace(pointwise_tiling(shape, k, 1, n, tiling.min_blocks), ptxas_level=tiling.ptxas_level)
            if k + WAVE_FIT_OTHER_REGISTERS > t.max_registers:
                continue
            cost, fill = cost_and_fill(t)
            if cost < best_cost:
                best, best_cost, best_fill = t, cost, fill
    if best_cost <= (1 - WAVE_FIT_MIN_GAIN) * base_cost and best_fill >= base_fill + WAVE_FIT_MIN_FILL_GAIN:
        return best
    return tiling


def any_batch_tiling(shape: ConvShape, tiling: Tiling) -> Tiling:
    """The tiling a build of `tiling` runs large batches with: a default
    refitted to the waves of a large batch (wave_fitted_tiling); a tiling the
    caller named, as named."""
    return wave_fitted_tiling(shape, tiling) if tiling == default_tiling(shape) else tiling


def batch_variants(shape: ConvShape, tiling: Tiling) -> List[Tuple[int, Tiling]]:
    """The tilings a layer is built with, each for batches up to a size:
    `tiling` for any batch, preceded by a variant for small batches where
    there is one: batch1_blocks' for batch 1 (measured there only), else
    small_batch_tiling's up to split_batch_limit. The default's any-batch
    tiling is refitted to the waves of a large batch (wave_fitted_tiling);
    the small-batch variants come from the default as it was."""
    large = any_batch_tiling(shape, tiling)
    smaller = batch1_blocks(shape, tiling)
    if smaller is not None:  # measured at batch 1 only
        return [(BATCH1_VARIANT_MAX_BATCH, smaller), (ANY_BATCH, large)]
    split = small_batch_tiling(shape, tiling)
    if split is None:
        return [(ANY_BATCH, large)]
    return [(split_batch_limit(shape, split), split), (ANY_BATCH, large)]


# Convs larger than 1x1, in one group, with TABLE_SMALL_BATCH_MIN_CHANNELS+
# input channels and outputs of TABLE_SMALL_BATCH_MAX_OUTPUT pixels or fewer
# (VGG-16's conv5_x, ResNet-50's layer4.x.conv2). At batch 1 the weight table
# (sparseconv.table) beat their split code in every network run since session
# 22; in session 46 (H200, routing's cold times, runs zx and zy) conv5_x 26.7-
# 27.0 us against 31.4-31.6, layer4.x.conv2 9.6-12.8 against 23.9-24.1. So
# where the table is timed for small batches (sparsify, table=True), their
# split variant is not built: VGG-16's three take ~68 s of the ~415 s of CPU
# its cold build took on 2 cores (bench/results/compile_vgg16_2026-11-28x).
# The split variant served up to 9-10 images, the table serves up to 8: at 9
# or 10 images these layers run their unsplit code.
TABLE_SMALL_BATCH_MIN_CHANNELS = 512
TABLE_SMALL_BATCH_MAX_OUTPUT = 14 * 14


def table_runs_small_batches(shape: ConvShape) -> bool:
    """Whether the weight table, where it is timed, makes a split code
    variant of this layer not worth building (TABLE_SMALL_BATCH_MIN_CHANNELS)."""
    return (shape.kernel_h * shape.kernel_w > 1 and shape.groups == 1
            and shape.in_channels >= TABLE_SMALL_BATCH_MIN_CHANNELS
            and shape.out_h * shape.out_w <= TABLE_SMALL_BATCH_MAX_OUTPUT)


def code_variants(shape: ConvShape, tiling: Tiling, table_at_small_batches: bool = False) -> List[Tuple[int, Tiling]]:
    """batch_variants, less the small-batch variant where the weight table
    will run small batches (table_at_small_batches: the caller times it) and
    table_runs_small_batches says it beats that variant; the any-batch
    tiling is the same either way (any_batch_tiling)."""
    if table_at_small_batches and table_runs_small_batches(shape):
        return [(ANY_BATCH, any_batch_tiling(shape, tiling))]
    return batch_variants(shape, tiling)


def variant_for_batch(shape: ConvShape, batch: int, tiling: Optional[Tiling] = None) -> Tiling:
    """The tiling a build runs `batch` images with: batch_variants of
    `tiling`, default_tiling where none is given."""
    whole = default_tiling(shape) if tiling is None else tiling
    return next(t for up_to, t in batch_variants(shape, whole) if batch <= up_to)


# (k_block, outputs per thread along W, threads, min_blocks), best first: the
# default, then the runners-up of the same sweep, then the previous default.
_CANDIDATES = ((32, 1, 256, 2), (32, 1, 512, 1), (64, 1, 256, 2), (32, 1, 256, 1), (32, 2, 256, 2),
               (32, 2, 256, 1), (16, 1, 256, 2), (64, 1, 128, 2), (32, 2, 128, 1))


# (k_block, pixels per thread, threads, min_blocks) of the pointwise family
# worth timing (bench/family_sweep.py, H100, 2026-11-23, and the capped
# 32- and 64-channel blocks of session 13); the default comes first.
_POINTWISE_CANDIDATES = ((64, 1, 512, 1), (32, 1, 128, 4), (64, 1, 256, 2), (32, 1, 512, 1), (64, 1, 256, 1),
                         (64, 1, 128, 1), (128, 1, 128, 1), (128, 1, 64, 1), (64, 2, 128, 1))


def candidate_tilings(shape: ConvShape, limit: int = 9) -> list:
    """A bounded set of tilings worth measuring (see _CANDIDATES), k_block
    shrunk as in the default for large kernels, at most 64 accumulators per
    thread. 1x1 convs: pointwise-family tilings (_POINTWISE_CANDIDATES).
    Larger kernels: the default first, then _CANDIDATES of the direct family,
    then three of the pointwise family where its tap count allows."""
    out = []
    if (shape.kernel_h, shape.kernel_w) == (1, 1):
        out.append(default_pointwise_tiling(shape))
        for k_block, pixels, threads, min_blocks in _POINTWISE_CANDIDATES:
            t = pointwise_tiling(shape, k_block, pixels, threads, min_blocks)
            if t not in out:
                out.append(t)
        return out[:limit]
    out.append(default_tiling(shape))
    # 512 threads: more warps share each fetched instruction, which is what a
    # deep layer's cold code needs (docs/PERFORMANCE.md, session 11); and
    # many_warps_tiling (session 55: 16-26% faster on VGG-16's 56x56 and
    # 112x112 convs of 128+ channels, slower on most others)
    wide = [pointwise_tiling(shape, 64, 1, threads) for threads in (128, 256, 512)] + [many_warps_tiling(shape)] \
        if shape.kernel_h * shape.kernel_w <= MAX_POINTWISE_TAPS else []
    for k_block, thread_w, threads, min_blocks in _CANDIDATES:
        k_block = _k_block(shape, k_block)
        if min(k_block, shape.k_per_group) * min(thread_w, shape.out_w) > 64:
            continue
        try:
            t = tiling_for(shape, k_block, thread_w, 1, threads, min_blocks)
            check_tiling(shape, t)
        except ValueError:
            continue
        if t not in out:
            out.append(t)
    out = out[:max(1, limit - len(wide))]
    out += [t for t in wide if t not in out]
    return out[:limit]


def pools_in_kernel(shape: ConvShape, tiling: Tiling) -> bool:
    """Whether a kernel of this tiling takes an epilogue's 2x2 max pool among
    its own threads: pointwise, unsplit (a split's slices are summed after the
    kernel), its pixels walked by 2x2 windows, and whole warps (the four
    lanes of a window exchange their values by shuffles). Other variants of a
    pooled layer are pooled by the runtime (runtime.Conv2dKernel): a split
    one as its slices are summed, the rest from a scratch buffer after."""
    return (tiling.family == "pointwise" and tiling.slices == 1 and tiling.pixel_order == "quads"
            and tiling.threads % 32 == 0 and shape.out_h % 2 == 0 and shape.out_w % 2 == 0)


def pooled_tiling(shape: ConvShape, tiling: Tiling) -> Tiling:
    """The tiling a layer whose epilogue pools is built with: `tiling` with
    its pixels walked by 2x2 windows where that lets the kernel take the pool
    (pools_in_kernel), else `tiling` unchanged. On VGG-16's five pooled convs
    at batch 64 the window order alone cost 2.1% (+126 us of 5,891;
    docs/PERFORMANCE.md, session 52), less than the pools it removes."""
    quads = replace(tiling, pixel_order="quads") if tiling.family == "pointwise" else tiling
    return quads if pools_in_kernel(shape, quads) else tiling
