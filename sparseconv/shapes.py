"""The small frozen records every stage passes around (layer shape, tiling,
epilogue, target), and what follows from a shape and a tiling alone: the
launch grid, shared memory, chunks and k-blocks, the template's switches.
Which tiling a layer gets is tilings.py."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional, Tuple, Union

import numpy as np

IntPair = Union[int, Tuple[int, int]]

# Kernel families: one template each (templates/conv2d_<family>.cu.j2).
FAMILIES = ("direct", "pointwise")
# Activations the epilogue applies at the store (Epilogue.activation).
ACTIVATIONS = ("none", "relu", "relu6", "clip")
# How a split reduction's slices are added (Tiling.slice_sum): "kernel", a
# second launch over a workspace of partial sums; "cluster", the slices of an
# output block form one thread-block cluster (sm_90+) and add each other's
# partial sums through distributed shared memory before the store.
SLICE_SUMS = ("kernel", "cluster")
# The order a pointwise block's threads walk an image's output pixels
# (Tiling.pixel_order): "rows", row-major; "quads", 2x2 windows in row-major
# order of windows, four adjacent threads a window, so that a 2x2 max pool
# after the conv is taken among them (Epilogue.pool, tilings.pools_in_kernel).
PIXEL_ORDERS = ("rows", "quads")
# Where a pointwise block's chunk input goes on its way to the FMAs
# (Tiling.input_loads): "registers", loaded straight into them, a whole
# chunk's loads before its FMAs; "staged", copied by each thread with
# cp.async into its own slots of dynamic shared memory INPUT_STAGES - 1
# chunks ahead and read back from there, so loads are in flight without
# registers holding them (no barrier: a thread reads only what it copied);
# "prefetched", loaded as "registers" does, each value asked for in L1
# (prefetch.L1) PREFETCH_AHEAD chunks ahead, a hint that holds no register.
# No default tiling uses the last two yet: experiments (docs/pending, session 57).
INPUT_LOADS = ("registers", "staged", "prefetched")
# Chunks of input a staged block holds: the one read now and two in flight.
INPUT_STAGES = 3
# How many chunks ahead a prefetched block asks for its input.
PREFETCH_AHEAD = 2
# Blocks in one cluster: 8 is portable; the H100 allows 16 once the kernel
# opts in (runtime: the non-portable cluster size attribute).
MAX_CLUSTER_SLICES = 16

# Bound on the weights of one template body (K_BLOCK * C_BLOCK * R * S). nvcc and
# ptxas time grow faster than linearly with straight-line code, so the template
# never holds more than this; bigger layers are built from copies of its PTX.
MAX_BODY_WEIGHTS = 576
# Shared memory of one block without opting in: the input patches of two chunks
# of channels (double buffered: one is read while the next is copied in).
MAX_PATCH_BYTES = 48 * 1024
# Shared memory an SM's staged pointwise blocks may take (Tiling.input_loads):
# the most an sm_90 block may opt in to; build_conv2d checks its target's.
MAX_STAGED_BYTES = 227 * 1024
# Patch elements one thread copies per chunk, at most. The source offset of each
# is kept in a register for the whole kernel (see the template), so this bounds
# the registers staging takes.
MAX_STAGE_STEPS = 24


def pair(value: IntPair, name: str) -> Tuple[int, int]:
    """Accept an int or a pair of ints, like torch.nn.functional.conv2d."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    try:
        a, b = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return (int(a), int(b))


@dataclass(frozen=True)
class ConvShape:
    """One conv layer, batch size excluded (it is free at call time). NCHW."""

    in_channels: int
    out_channels: int
    in_h: int
    in_w: int
    kernel_h: int
    kernel_w: int
    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (0, 0)
    dilation: Tuple[int, int] = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        for name in ("in_channels", "out_channels", "in_h", "in_w", "kernel_h", "kernel_w", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("stride", "dilation"):
            if min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.padding) < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(
                f"in_channels ({self.in_channels}) and out_channels ({self.out_channels}) "
                f"must both be divisible by groups ({self.groups})")
        if self.out_h < 1 or self.out_w < 1:
            raise ValueError(
                f"the output would be empty: input {self.in_h}x{self.in_w}, kernel "
                f"{self.kernel_h}x{self.kernel_w}, stride {self.stride}, padding {self.padding}, "
                f"dilation {self.dilation} give {self.out_h}x{self.out_w}")

    @property
    def c_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def k_per_group(self) -> int:
        return self.out_channels // self.groups

    @property
    def out_h(self) -> int:
        return (self.in_h + 2 * self.padding[0] - self.dilation[0] * (self.kernel_h - 1) - 1) // self.stride[0] + 1

    @property
    def out_w(self) -> int:
        return (self.in_w + 2 * self.padding[1] - self.dilation[1] * (self.kernel_w - 1) - 1) // self.stride[1] + 1

    @property
    def weight_shape(self) -> Tuple[int, int, int, int]:
        return (self.out_channels, self.c_per_group, self.kernel_h, self.kernel_w)

    def describe(self) -> str:
        return (f"C={self.in_channels} K={self.out_channels} {self.in_h}x{self.in_w} "
                f"kernel {self.kernel_h}x{self.kernel_w} stride {self.stride} pad {self.padding} "
                f"dilation {self.dilation} groups {self.groups}")

    def as_dict(self) -> dict:
        return asdict(self)


def shape_from_weight(weight: np.ndarray, input_size: IntPair, stride: IntPair = 1, padding: IntPair = 0,
                      dilation: IntPair = 1, groups: int = 1) -> ConvShape:
    """The ConvShape of a (K, C/groups, R, S) weight applied to (H, W) inputs."""
    if weight.ndim != 4:
        raise ValueError(f"weight must be 4-D (K, C/groups, R, S), got shape {weight.shape}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    k, cpg, r, s = weight.shape
    h, w = pair(input_size, "input_size")
    return ConvShape(cpg * groups, k, h, w, r, s, pair(stride, "stride"), pair(padding, "padding"),
                     pair(dilation, "dilation"), groups)


@dataclass(frozen=True)
class Tiling:
    """How work is split. Each block computes tile_h x tile_w outputs of k_block
    output channels for one image; each thread thread_h x thread_w of them per
    channel; input channels are staged c_block at a time."""

    k_block: int
    c_block: int
    tile_h: int
    tile_w: int
    thread_h: int = 1
    thread_w: int = 1
    # Blocks that must fit on one SM at once. Sets the register cap (max_registers):
    # the kernel's code is streamed, not looped, so what keeps the SM busy is many
    # warps walking the same instructions (see docs/PERFORMANCE.md).
    min_blocks: int = 1
    # The kernel family (FAMILIES): "direct" stages input patches in shared
    # memory; "pointwise" reads its inputs straight from global memory, one
    # load per (input channel, kernel tap) feeding all the block's output
    # channels, the batch folded into the pixels (tile_w = pixels per block,
    # thread_w = pixels per thread). Named for the 1x1 convs it was built for,
    # it also serves larger kernels on small outputs (default_tiling).
    family: str = "direct"
    # The input-channel reduction split over this many blocks (split-K): each
    # writes partial sums to a workspace, and a second kernel adds them in a
    # fixed order (deterministic). 1 = no split.
    slices: int = 1
    # ptxas optimisation level (-O1..-O3) for the specialised kernel. -O3
    # sinks each global load of the pointwise body next to its first FMA,
    # leaving one or two loads in flight per warp; -O1 keeps the template's
    # order (a chunk's loads first), which is what a block with few warps needs.
    # Without ptxas (PTX artifact, driver JIT) the driver's default applies.
    ptxas_level: int = 3
    # How the slices' partial sums are added (SLICE_SUMS); "cluster" needs
    # sm_90 (build_conv2d falls back to "kernel" for older targets).
    slice_sum: str = "kernel"
    # PIXEL_ORDERS; "quads" needs the pointwise family and an even output
    # height and width (render checks the shape).
    pixel_order: str = "rows"
    # INPUT_LOADS; "staged" and "prefetched" need the pointwise family, and
    # "staged" not a cluster sum (its partial sums would share the dynamic
    # shared memory).
    input_loads: str = "registers"

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if name == "family":
                if v not in FAMILIES:
                    raise ValueError(f"tiling.family must be one of {FAMILIES}, got {v!r}")
            elif name == "slice_sum":
                if v not in SLICE_SUMS:
                    raise ValueError(f"tiling.slice_sum must be one of {SLICE_SUMS}, got {v!r}")
            elif name == "pixel_order":
                if v not in PIXEL_ORDERS:
                    raise ValueError(f"tiling.pixel_order must be one of {PIXEL_ORDERS}, got {v!r}")
            elif name == "input_loads":
                if v not in INPUT_LOADS:
                    raise ValueError(f"tiling.input_loads must be one of {INPUT_LOADS}, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"tiling.{name} must be a positive int, got {v!r}")
        if self.ptxas_level not in (1, 2, 3):
            raise ValueError(f"tiling.ptxas_level must be 1, 2 or 3, got {self.ptxas_level!r}")
        if self.slice_sum == "cluster" and not 2 <= self.slices <= MAX_CLUSTER_SLICES:
            raise ValueError(f"a cluster sum takes 2 to {MAX_CLUSTER_SLICES} slices (one cluster of blocks), "
                             f"got {self.slices}")
        if self.pixel_order == "quads" and self.family != "pointwise":
            raise ValueError("pixel_order 'quads' is a pointwise-family order; the direct family tiles its pixels")
        if self.input_loads != "registers" and self.family != "pointwise":
            raise ValueError(f"input_loads {self.input_loads!r} is a pointwise-family path "
                             "(the direct family stages its patches anyway)")
        if self.input_loads == "staged" and self.slice_sum == "cluster":
            raise ValueError("input_loads 'staged' cannot take a cluster sum: its partial tile would share the "
                             "staged input's dynamic shared memory")
        if self.family == "pointwise" and self.tile_h != 1:
            raise ValueError("a pointwise tiling has tile_h 1 (its pixels run along tile_w)")
        if self.tile_h % self.thread_h or self.tile_w % self.thread_w:
            raise ValueError(f"tile {self.tile_h}x{self.tile_w} is not a multiple of the "
                             f"per-thread {self.thread_h}x{self.thread_w}")
        if self.threads > 1024:
            raise ValueError(f"tiling gives {self.threads} threads per block; at most 1024")
        if self.threads * self.min_blocks > 2048 or self.max_registers < 32:
            raise ValueError(f"{self.min_blocks} blocks of {self.threads} threads do not fit on one SM "
                             f"(at most 2048 threads and 65536 registers, 32 or more per thread)")

    @property
    def threads_x(self) -> int:
        return self.tile_w // self.thread_w

    @property
    def threads(self) -> int:
        return (self.tile_h // self.thread_h) * self.threads_x

    @property
    def max_registers(self) -> int:
        """ptxas register cap per thread so that min_blocks blocks fit on an SM.
        An SM is 4 sub-partitions of 16K registers, and a block's warps are dealt
        out over them, so the busiest one holds ceil(warps / 4) of each block
        (ptxas derives the same cap from __launch_bounds__: 128 for 2 x 7 warps)."""
        warps = math.ceil(self.threads / 32)
        warps_per_partition = math.ceil(warps / 4) * self.min_blocks
        return min(255, 16384 // (32 * warps_per_partition) // 8 * 8)

    @property
    def fmas_per_weight(self) -> int:
        """Outputs of one thread per output channel: FMAs each weight feeds in the body."""
        return self.thread_h * self.thread_w

    def describe(self) -> str:
        blocks = f", {self.min_blocks} blocks/SM" if self.min_blocks > 1 else ""
        fam = "" if self.family == "direct" else f"{self.family} "
        sl = f", {self.slices} slices" if self.slices > 1 else ""
        sl += " summed in a cluster" if self.slice_sum == "cluster" else ""
        sl += f", ptxas -O{self.ptxas_level}" if self.ptxas_level != 3 else ""
        sl += ", 2x2 pixel quads" if self.pixel_order == "quads" else ""
        sl += {"registers": "", "staged": ", input staged by cp.async",
               "prefetched": ", input prefetched into L1"}[self.input_loads]
        if self.family == "pointwise":
            return (f"{fam}k_block={self.k_block} c_block={self.c_block} pixels={self.thread_w}/thread "
                    f"({self.threads} threads{blocks}{sl})")
        return (f"{fam}k_block={self.k_block} c_block={self.c_block} tile={self.tile_h}x{self.tile_w} "
                f"thread={self.thread_h}x{self.thread_w} ({self.threads} threads{blocks}{sl})")


def pooled_hw(h: int, w: int) -> Tuple[int, int]:
    """The output size of Epilogue.pool's 2x2 max pool of stride 2 on an h x w
    conv output: torch's floor mode, an odd side drops its last row or column."""
    return h // 2, w // 2


@dataclass(frozen=True)
class Epilogue:
    """What a kernel does to each output at the store, after the bias: add a
    residual tensor of the output's shape (a ResNet shortcut), then an
    activation, then (pool) a 2x2 max pool of stride 2 (VGG's Conv -> ReLU ->
    MaxPool). Fusing these saves a pass over memory each. Exact fp32:
    y = pool(act(conv(x) + bias + residual)), each sum started at bias +
    residual (a split reduction adds the residual after the slices instead).
    With pool the output is (out_h // 2, out_w // 2), torch's floor mode."""

    activation: str = "none"                       # one of ACTIVATIONS
    clip: Optional[Tuple[float, float]] = None     # (lo, hi), for activation "clip" only
    residual: bool = False
    pool: bool = False                             # a 2x2 max pool, stride 2, after the activation

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if (self.activation == "clip") != (self.clip is not None):
            raise ValueError("clip=(lo, hi) is given with activation='clip', and only then")
        if self.clip is not None:
            lo, hi = self.clip
            if not (float(lo) <= float(hi)):
                raise ValueError(f"clip bounds must satisfy lo <= hi, got {self.clip}")
            object.__setattr__(self, "clip", (float(lo), float(hi)))
        if not isinstance(self.residual, bool):
            raise TypeError(f"residual must be a bool, got {self.residual!r}")
        if not isinstance(self.pool, bool):
            raise TypeError(f"pool must be a bool, got {self.pool!r}")
        if self.pool and self.residual:
            # the residual would be shaped as the conv's output, the kernel's output as the pool's
            raise ValueError("pool=True with residual=True is not fused: add the residual before a separate pool")

    @property
    def bounds(self) -> Tuple[Optional[float], Optional[float]]:
        """(lo, hi) of the clamp the activation is; None where unbounded."""
        if self.activation == "relu":
            return 0.0, None
        if self.activation == "relu6":
            return 0.0, 6.0
        if self.activation == "clip":
            lo, hi = self.clip  # type: ignore[misc]
            return (None if lo == -math.inf else lo), (None if hi == math.inf else hi)
        return None, None

    def describe(self) -> str:
        parts = ["bias"] + (["+ residual"] if self.residual else [])
        if self.activation != "none":
            parts.append(f"-> {self.activation}" + (f"{self.clip}" if self.clip else ""))
        if self.pool:
            parts.append("-> max pool 2x2")
        return " ".join(parts)

    def output_hw(self, shape: ConvShape) -> Tuple[int, int]:
        """(height, width) of what the kernel writes: the conv's output, or the pool's."""
        return pooled_hw(shape.out_h, shape.out_w) if self.pool else (shape.out_h, shape.out_w)


@dataclass(frozen=True)
class Target:
    """What the PTX is compiled for. arch as nvcc spells it (sm_90 for H100)."""

    arch: str = "sm_90"

    def __post_init__(self) -> None:
        if not (self.arch.startswith("sm_") and self.arch[3:].rstrip("af").isdigit()):
            raise ValueError(f"target arch must look like 'sm_90', got {self.arch!r}")
        if int(self.arch[3:].rstrip("af")) < MIN_COMPUTE_CAPABILITY:
            # refused here, not by ptxas after minutes of building ("Feature 'cp.async' requires sm_80")
            raise ValueError(f"sparseconv builds for sm_{MIN_COMPUTE_CAPABILITY} and newer GPUs (A100, RTX 30xx and "
                             f"later: its direct kernels stage their input with cp.async); {self.arch} is older. "
                             f"On such a GPU run the model in PyTorch (cuDNN) instead")

    @property
    def has_clusters(self) -> bool:
        """Thread-block clusters and distributed shared memory: sm_90 and later."""
        return int(self.arch[3:].rstrip("af")) >= 90

    @property
    def max_shared_bytes(self) -> int:
        """Shared memory one block may opt in to (cudaFuncAttributeMaxDynamicSharedMemorySize),
        from the CUDA C++ Programming Guide's table of compute capabilities;
        48 KB, what needs no opt-in, for an arch not listed."""
        cc = int(self.arch[3:].rstrip("af"))
        return _OPT_IN_SHARED_KB.get(cc, MAX_PATCH_BYTES // 1024) * 1024


# The oldest GPU the kernels build for: the direct family's cp.async staging needs sm_80.
MIN_COMPUTE_CAPABILITY = 80
_OPT_IN_SHARED_KB = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227,
                     110: 227, 120: 99, 121: 99}


# The pointwise family reads its input once per k-block. Blocks start in
# grid order, x fastest, so with the pixel blocks along x each k-block would
# stream the whole input from DRAM again once it is larger than L2. Its grid
# is (group, k-blocks, groups) instead: one group's pixel blocks go through
# every k-block while their input is still in L2. A group holds as many pixel
# blocks as keep its input within this budget (the H100's L2 is 50 MB; the
# outputs and the residual stream through it too).
L2_GROUP_BYTES = 8 << 20
MAX_GRID_Z = 65535


def kernel_shape(shape: ConvShape, tiling: Tiling) -> ConvShape:
    """The shape the kernel is built for. A depthwise layer (one input
    channel a group) whose pointwise tiling takes c_block = G > 1 input
    channels a chunk runs as groups / G groups of G input channels each
    (DEPTHWISE_GROUPS_A_BLOCK): its weights become block-diagonal
    (specialise.weights.arrange_weights), and the specialiser deletes the
    zeros between the groups like any other zero weight. The layer's tensors
    are the same either way. Every function here of a shape and a tiling
    sees this shape; it is idempotent."""
    if not (tiling.family == "pointwise" and shape.c_per_group == 1 and shape.groups > 1 and tiling.c_block > 1):
        return shape
    if shape.groups % tiling.c_block:
        raise ValueError(f"tiling {tiling.describe()}: {tiling.c_block} depthwise groups a block must divide "
                         f"the {shape.groups} groups")
    return replace(shape, groups=shape.groups // tiling.c_block)


def pixel_blocks(shape: ConvShape, tiling: Tiling, batch: int) -> int:
    """Pointwise family: blocks of pixels the whole batch gives."""
    return -(-batch * shape.out_h * shape.out_w // tiling.tile_w)


def pixel_group(shape: ConvShape, tiling: Tiling) -> int:
    """Pointwise family: pixel blocks per group (before capping at the batch's)."""
    input_bytes = tiling.tile_w * shape.c_per_group * shape.stride[1] * 4  # a stride-2 row is read whole
    return max(1, L2_GROUP_BYTES // input_bytes)


def launch_grid(shape: ConvShape, tiling: Tiling, batch: int) -> Tuple[int, int, int]:
    """The grid for `batch` images: blockIdx.y picks the k-block copy (output-
    channel block x slice). The direct family tiles each image's outputs (x)
    per image (z). The pointwise family splits the pixel blocks of the whole
    batch into groups of gridDim.x (z: the group; see L2_GROUP_BYTES) where
    it has more than one k-block; the last group's extra blocks store nothing.
    Extra blocks are kept few: one more block than fits a wave adds a wave
    (ResNet-50's layer2.1.conv1 at batch 64: 58 -> 93 us with 24 extra)."""
    shape = kernel_shape(shape, tiling)
    if tiling.family == "pointwise":
        blocks, kblocks = pixel_blocks(shape, tiling, batch), n_kblocks(shape, tiling)
        if kblocks == 1:  # the input is read once in any order: no groups, no extra blocks
            return (blocks, 1, 1)
        groups = -(-blocks // pixel_group(shape, tiling))
        group = -(-blocks // groups)  # groups of nearly equal size: fewer than `groups` extra blocks
        return (group, kblocks, -(-blocks // group))
    tiles = -(-shape.out_h // tiling.tile_h) * -(-shape.out_w // tiling.tile_w)
    return (tiles, n_kblocks(shape, tiling), batch)


def max_batch_per_launch(shape: ConvShape, tiling: Tiling) -> int:
    """Images one launch may take (the run time splits larger batches):
    gridDim.z for the direct family; for the pointwise family, gridDim.z
    groups of pixel blocks, and the batch's pixels, the last group's extra
    blocks included (fewer than gridDim.z), must index as a 32-bit int."""
    shape = kernel_shape(shape, tiling)
    if tiling.family == "pointwise":
        group_pixels = pixel_group(shape, tiling) * tiling.tile_w
        pixels = min(2**31 - 1 - MAX_GRID_Z * tiling.tile_w, MAX_GRID_Z * group_pixels)
        return max(1, pixels // (shape.out_h * shape.out_w))
    return MAX_GRID_Z


def patch_size(shape: ConvShape, tiling: Tiling) -> Tuple[int, int]:
    """Input rows and columns a block needs for its tile of outputs."""
    ph = (tiling.tile_h - 1) * shape.stride[0] + (shape.kernel_h - 1) * shape.dilation[0] + 1
    pw = (tiling.tile_w - 1) * shape.stride[1] + (shape.kernel_w - 1) * shape.dilation[1] + 1
    return ph, pw


def patch_buffer_bytes(shape: ConvShape, tiling: Tiling) -> int:
    """Dynamic shared memory of one block: two buffers of c_block input patches
    (the direct family; the pointwise family stages nothing)."""
    if tiling.family == "pointwise":
        return 0
    ph, pw = patch_size(shape, tiling)
    return 2 * tiling.c_block * ph * pw * 4


def partial_tile_bytes(tiling: Tiling) -> int:
    """A block's partial sums, k_block x outputs per thread x threads floats:
    what a cluster sum (Tiling.slice_sum) leaves in shared memory for the
    other slices of its cluster to read."""
    return tiling.k_block * tiling.fmas_per_weight * tiling.threads * 4


def staged_input_bytes(shape: ConvShape, tiling: Tiling) -> int:
    """A staged pointwise block's input slots (Tiling.input_loads): INPUT_STAGES
    chunks of c_block x taps values for each pixel of each thread; 0 otherwise."""
    if tiling.input_loads != "staged":
        return 0
    shape = kernel_shape(shape, tiling)
    return INPUT_STAGES * tiling.c_block * shape.kernel_h * shape.kernel_w * tiling.thread_w * tiling.threads * 4


def dynamic_shared_bytes(shape: ConvShape, tiling: Tiling) -> int:
    """Dynamic shared memory a block is launched with: the input patches
    (patch_buffer_bytes), which a cluster sum reuses for its partial tile
    once the chunk loop is done, or a staged block's input slots."""
    partial = partial_tile_bytes(tiling) if tiling.slice_sum == "cluster" else 0
    return max(patch_buffer_bytes(shape, tiling), partial, staged_input_bytes(shape, tiling))


def stage_steps(shape: ConvShape, tiling: Tiling) -> int:
    """Patch elements each thread copies per chunk."""
    ph, pw = patch_size(shape, tiling)
    return -(-tiling.c_block * ph * pw // tiling.threads)


def n_chunks(shape: ConvShape, tiling: Tiling) -> int:
    """Chunks of c_block input channels one block runs: all of a group's, or
    one slice's share of them when the reduction is split."""
    shape = kernel_shape(shape, tiling)
    return math.ceil(math.ceil(shape.c_per_group / tiling.c_block) / tiling.slices)


def n_kblocks(shape: ConvShape, tiling: Tiling) -> int:
    """Copies of the k-block function, blockIdx.y's range: output-channel
    blocks over all groups, times the slices of the reduction."""
    shape = kernel_shape(shape, tiling)
    return shape.groups * math.ceil(shape.k_per_group / tiling.k_block) * tiling.slices


def padded_channels(shape: ConvShape, tiling: Tiling) -> bool:
    """Do the chunks (of every slice) run past the group's last input channel?"""
    shape = kernel_shape(shape, tiling)
    return n_chunks(shape, tiling) * tiling.slices * tiling.c_block != shape.c_per_group


# Loads a pixel needs from one group's input (its input channels x taps) up
# to which a padded pointwise-family layer loads each tap behind a predicate
# (in the image or not) at a constant offset from one pointer a pixel; above
# it each tap keeps its own pointer, set once, and padding taps read a zero
# buffer (the template, "TAP_PREDICATES"). Counted over the group, not a
# chunk: a deep layer at 4 channels a chunk has 36 loads a chunk but many
# chunks, each of whose loads would take its test.
# Session 42, ptxas sm_90 (split_probe --sass): a depthwise 3x3 (9 loads)
# went from 83 to 70 registers and ResNeXt-50 layer1.0.conv2 (36) from 92
# to 78, with fewer instructions; at 144 loads (ResNeXt-50 layer3.1.conv2)
# and on the deep 3x3 layers (ResNet-50 layer4.1.conv2) the predicates took
# 50% more instructions and spilled. Timed (H200, split_probe --cold, old
# template against new, batch 64): MobileNetV2's depthwise layers -4 to -13%
# on five of six (+2% on features.2), ResNeXt-50 layer1.0.conv2 -30%. The
# pointer a pixel may point outside x where a pixel's first tap is padding;
# it is only dereferenced at taps inside the image.
TAP_PREDICATE_MAX_LOADS = 36


def tap_predicates(shape: ConvShape, tiling: Tiling) -> bool:
    """See TAP_PREDICATE_MAX_LOADS (the direct family stages its patches, padding included, in shared memory)."""
    shape = kernel_shape(shape, tiling)
    padded = shape.padding != (0, 0)
    return (tiling.family == "pointwise" and padded
            and shape.c_per_group * shape.kernel_h * shape.kernel_w <= TAP_PREDICATE_MAX_LOADS)


# Where a pointwise-family block adds the residual (an epilogue with an add):
# to start each sum (before the chunk loop), or after the loop, all its loads
# issued before the first store. Before the loop it made ptxas -O3 issue the
# chunk's loads ~22 instructions ahead of their use instead of ~250 where one
# block holds a group's every output channel (MNASNet layers.10.1.layers.6,
# 480 -> 80 at 14x14). Session 45 (H200, split_probe --cold, batch 64,
# add+relu, the two places in alternating runs): MNASNet layers.10.1.layers.6
# 52.9 -> 16.9 us, layers.11.1.layers.6 (k_block 96) 34.5 -> 31.5; where
# blocks hold 32 or 64 of many channels after the loop lost 17-44% (ResNet-50
# layer1-4 conv3: spills, more instructions), and features.15.conv.2 of
# MobileNetV2 (32 of 160) was within 1 us. So: after the loop only for 1x1
# convs without groups (what was measured), at -O3 (-O1 keeps the loads'
# order anyway), where one k-block holds every output channel, at most
# RESIDUAL_AFTER_LOOP_MAX_OUTPUTS sums a thread (k_block 96 took 255
# registers).
RESIDUAL_AFTER_LOOP_MAX_OUTPUTS = 96


def residual_after_loop(shape: ConvShape, tiling: Tiling) -> bool:
    """Does this tiling add a residual after its chunk loop? See RESIDUAL_AFTER_LOOP_MAX_OUTPUTS."""
    # one k-block in all: no groups, no split, k_block covering every output channel
    return (tiling.family == "pointwise" and tiling.ptxas_level == 3 and (shape.kernel_h, shape.kernel_w) == (1, 1)
            and n_kblocks(shape, tiling) == 1 and tiling.k_block * tiling.thread_w <= RESIDUAL_AFTER_LOOP_MAX_OUTPUTS)


def check_tiling(shape: ConvShape, tiling: Tiling) -> None:
    """Raise ValueError when a tiling cannot serve this layer."""
    shape = kernel_shape(shape, tiling)
    if tiling.family == "pointwise" and shape.kernel_h * shape.kernel_w > 64:
        raise ValueError(f"the pointwise family serves kernels of at most 64 taps, "
                         f"not {shape.kernel_h}x{shape.kernel_w}")
    if tiling.slices > math.ceil(shape.c_per_group / tiling.c_block):
        raise ValueError(f"tiling {tiling.describe()}: {tiling.slices} slices but only "
                         f"{math.ceil(shape.c_per_group / tiling.c_block)} chunks of input channels")
    body = tiling.k_block * tiling.c_block * shape.kernel_h * shape.kernel_w
    if body > MAX_BODY_WEIGHTS * 4:
        raise ValueError(f"tiling {tiling.describe()} puts {body} weights in one template body; "
                         f"keep k_block*c_block*R*S <= {MAX_BODY_WEIGHTS * 4} or compile time explodes")
    partial = partial_tile_bytes(tiling) if tiling.slice_sum == "cluster" else 0
    unstaged = max(patch_buffer_bytes(shape, tiling), partial)
    if unstaged > MAX_PATCH_BYTES:
        raise ValueError(f"tiling {tiling.describe()} needs {unstaged} bytes of "
                         f"shared memory per block; at most {MAX_PATCH_BYTES}: lower c_block, the tile "
                         "or (with a cluster sum) k_block x threads")
    staged = staged_input_bytes(shape, tiling) * tiling.min_blocks
    if staged > MAX_STAGED_BYTES:
        raise ValueError(f"tiling {tiling.describe()} stages {staged} bytes of input an SM "
                         f"({tiling.min_blocks} block(s)); at most {MAX_STAGED_BYTES}: lower c_block, the pixels "
                         "a thread, the threads or min_blocks, or use input_loads 'registers'")
    if tiling.input_loads != "registers" and tap_predicates(shape, tiling):
        raise ValueError(f"tiling {tiling.describe()}: a layer whose padded taps sit behind tests "
                         "(shapes.tap_predicates: few loads a pixel) is neither staged nor prefetched; "
                         "use input_loads 'registers'")
    if tiling.k_block > shape.k_per_group:
        raise ValueError(f"k_block={tiling.k_block} exceeds the {shape.k_per_group} output channels per group")
    if tiling.c_block > shape.c_per_group:
        raise ValueError(f"c_block={tiling.c_block} exceeds the {shape.c_per_group} input channels per group")
    if tiling.pixel_order == "quads" and (shape.out_h % 2 or shape.out_w % 2):
        raise ValueError(f"pixel_order 'quads' walks 2x2 windows of the output, which is {shape.out_h}x{shape.out_w}: "
                         "an odd side has no whole windows; use pixel_order 'rows'")
