"""The weight-table family: a layer's nonzero weights as a table in GPU
memory instead of immediates in the instruction stream, for small batches.

Why: at batch 1 a deep layer's straight-line code is fetched at ~1.4 GB/s
an SM from DRAM and ~3.8 GB/s from L2 (16 bytes an FFMA; docs/PERFORMANCE.md,
sessions 17-18), while the data path reads at ~20 GB/s an SM. Where few
pixels share each fetched instruction (7x7 and 14x14 outputs of one image)
the table is faster: ResNet-50's layer4 convs ran 1.6-2.1x faster cold on
this kernel, its layer3 convs 1.2-1.6x (bench/weight_table_probe.py, H100,
session 21). Where many pixels share it (VGG-16's 28x28 layers, or batch
64) the code is faster, so a layer takes the table only at the batch sizes
where it measured faster (routing: sparseconv.torch.route_by_batch and the
runner's route_kernels, each timing the table that `routable_table` builds).

The table is the specialisation: `weight_table` keeps each nonzero weight
once, as an 8-byte entry (where its input sits from an output pixel's
receptive field, with its tap; its value), sorted by (output channel, input
channel, tap); zero weights have no entry. The kernel is compiled per layer
shape and epilogue (NVRTC, cached by CuPy), never per weight set.

Each block computes 32 * J pixels of one output channel of one image. It
first copies the channel's entries into shared memory, before it waits on
the kernel before (TableTiling.staged_entries; the weights are not that
kernel's output). Its WS warps split the entries; a warp reads an entry
once (one address for all lanes) and applies it to J pixels a lane, each lane testing
the entry's tap against a bit mask of its pixels' taps inside the image. The warps' partial sums
are added in warp order in shared memory: a fixed summation order, so
results are the same run to run. Bias, residual and the clamp are applied
at the store, as in the other families; where the epilogue pools, the block
walks whole 2x2 windows and stores each one's maximum (no second launch).
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .launch import GRID_DEPENDENCY_CUDA, PreparedLaunch
from .pool import POOL_MAX_CUDA, QUAD_WALK_CUDA
from .runtime import CallContract
from .shapes import MAX_PATCH_BYTES, ConvShape, Epilogue, pooled_hw
from .weight_loads import weight_loads_cuda

# An entry's first word (unsigned): the byte offset of its weight's input
# (channel and tap) shifted up by TAP_BITS, the tap in the bits below (the
# bounds test).
TAP_BITS = 6
MAX_TAPS = 1 << TAP_BITS
# Batches the table is timed at by routing: beyond a few images the code
# family shares each fetched instruction among enough pixels to win.
MAX_TABLE_BATCH = 8
# The rule for the warps a block (table_tiling), from the probe
# (bench/weight_table_probe.py, H100, session 21, run y): 8 warps where a
# warp would otherwise walk more than LONG_SHARE entries of its channel
# (VGG-16 conv5_2, 461 a channel: 29 us against 35 with 4 warps) or the grid
# has at most FEW_BLOCKS blocks (ResNet-50 layer3.1.conv1: 6.0 against 7.6);
# else 4 (layer4.0.downsample, 2,048 blocks of 102 entries: 12.4 against 14.2).
# 16 warps where the grid has at most VERY_FEW_BLOCKS (session 23, run i:
# ResNet-50 layer4.1.conv2, 512 blocks, 8.8 against 10.5 us cold, and
# layer4.1.conv1 4.9 against 6.2; 8 warps filled 45% of the SMs' warp slots).
# 4 pixels a lane and 16 warps where a channel has more than VERY_LONG_CHANNEL
# entries and the image at least 128 output pixels, so that a block of 128
# pixels is mostly full (session 24, run u: VGG-16 conv5_2, 14x14, 461 entries
# a channel, 27.3 against 30.7 us cold; ResNet-50's 14x14 layers have at most
# 230 and stayed within the spread).
FEW_BLOCKS = 1024
VERY_FEW_BLOCKS = 512
LONG_SHARE = 64
VERY_LONG_CHANNEL = 256
# The rule stages a block's entries in shared memory (TableTiling.staged_entries)
# wherever they fit (TableConv2d). Measured on the H100, batch 1
# (bench/weight_table_probe.py --cands rule-u,rule-s,rule-u,rule-s, session 26,
# run aw), us cold / hot, unstaged -> staged: ResNet-50 layer4.1.conv2 10.3 /
# 10.2 -> 9.2 / 7.3, layer3.1.conv2 11.5 / 10.5 -> 10.9 / 8.0, layer2.1.conv1
# 6.0 / 5.4 -> 5.3 / 4.5, VGG-16 conv5_2 27.4 / 26.0 -> 26.1 / 23.3; of eleven
# layers, cold 0.2-1.3 faster on nine, even on layer4.0.conv2, 0.4 slower on
# layer2.1.conv2 (hot 2.3 faster); hot 1.0-2.9 faster on ten.
STAGE_ENTRIES = True


@dataclass(frozen=True)
class TableTiling:
    """pixels_per_lane (J): a block covers 32 * J pixels of one output channel;
    warps (WS): the warps of a block, which split each tap's entries;
    staged_entries: the block copies its channel's entries into shared
    memory before it waits on the kernel before (the weights are not that
    kernel's output), and its warps read them there."""

    pixels_per_lane: int = 2
    warps: int = 4
    staged_entries: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.pixels_per_lane <= 16:
            raise ValueError(f"pixels_per_lane must be 1..16, got {self.pixels_per_lane}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if not isinstance(self.staged_entries, bool):
            raise ValueError(f"staged_entries must be True or False, got {self.staged_entries!r}")

    def describe(self) -> str:
        staged = ", entries staged in shared memory" if self.staged_entries else ""
        return f"weight table, {self.pixels_per_lane} pixels/lane, {self.warps} warps{staged}"

    def staged_bytes(self, longest_channel: int) -> int:
        """The dynamic shared memory a block is launched with: its channel's
        entries, 8 bytes each, where they are staged (0 where not)."""
        return 8 * longest_channel if self.staged_entries else 0

    def shared_bytes(self, longest_channel: int) -> int:
        """All the shared memory a block takes: the warps' partial sums
        (static) and staged_bytes."""
        return 4 * self.warps * 32 * self.pixels_per_lane + self.staged_bytes(longest_channel)


# Shared memory a block may take without opting in (cudaFuncSetAttribute):
# the same 48 KB that bounds the code families' input patches.
MAX_SHARED_BYTES = MAX_PATCH_BYTES


def fitting_tiling(tiling: TableTiling, longest_channel: int) -> TableTiling:
    """`tiling` as a layer whose longest output channel has `longest_channel`
    entries can run it: unstaged where its staged entries and the warps' sums
    would pass MAX_SHARED_BYTES (the warps then read the entries from global
    memory)."""
    if tiling.shared_bytes(longest_channel) > MAX_SHARED_BYTES:
        return replace(tiling, staged_entries=False)
    return tiling


def table_supported(shape: ConvShape) -> Optional[str]:
    """None if the table family takes this layer, else why not."""
    if shape.groups != 1:
        return "grouped convs are not supported by the table family"
    if shape.kernel_h * shape.kernel_w > MAX_TAPS:
        return f"more than {MAX_TAPS} taps (an entry's tap field has {TAP_BITS} bits)"
    if shape.in_channels * shape.in_h * shape.in_w * 4 >= 1 << (32 - TAP_BITS):
        return (f"an image's input exceeds 2^{32 - TAP_BITS} bytes (an entry holds its byte offset and its tap "
                "in 32 bits)")
    return None


def table_tiling(shape: ConvShape, batch: int = 1, nonzeros: Optional[int] = None) -> TableTiling:
    """The rule (see LONG_SHARE and VERY_LONG_CHANNEL): 4 pixels a lane and
    16 warps on very long channels of images of 128+ pixels; else 2 pixels a
    lane, and 16 warps a block where the grid is very small, 8 where 4 would
    each walk more than LONG_SHARE of a channel's entries or the grid is
    small, else 4. Entries staged in shared memory (STAGE_ENTRIES).
    nonzeros: the layer's nonzero weights (None: 10%)."""
    if nonzeros is None:
        nonzeros = shape.out_channels * shape.in_channels * shape.kernel_h * shape.kernel_w // 10
    blocks = -(-shape.out_h * shape.out_w // 64) * shape.out_channels * batch
    long_share = nonzeros / shape.out_channels / 4 > LONG_SHARE
    if nonzeros / shape.out_channels > VERY_LONG_CHANNEL and shape.out_h * shape.out_w >= 128:
        return TableTiling(4, 16, STAGE_ENTRIES)
    if blocks <= VERY_FEW_BLOCKS:
        return TableTiling(2, 16, STAGE_ENTRIES)
    return TableTiling(2, 8 if long_share or blocks <= FEW_BLOCKS else 4, STAGE_ENTRIES)


def weight_table(weight: np.ndarray, shape: ConvShape) -> Tuple[np.ndarray, np.ndarray]:
    """(entries, starts) of a (K, C, R, S) weight: entries int32 (E, 2), one
    per nonzero weight, sorted by (k, c, tap r * S + s); starts int32 (K + 1,):
    output channel k's entries are entries[starts[k]:starts[k + 1]]. An
    entry is (4 * offset << TAP_BITS | tap as uint32 bits, the weight's
    float32 bits), offset = c * H * W + r * dilation_h * W + s * dilation_w:
    where tap (r, s) of channel c sits from the top-left of an output
    pixel's receptive field."""
    why = table_supported(shape)  # first: a grouped layer's weight has another shape too
    if why:
        raise ValueError(f"weight_table: {shape.describe()}: {why}")
    want = (shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w)
    if tuple(weight.shape) != want:
        raise ValueError(f"weight_table: the weight must have shape {want} for {shape.describe()}, "
                         f"got {tuple(weight.shape)}")
    w = np.ascontiguousarray(weight, dtype=np.float32)
    kk, cc, rr, ss = np.nonzero(w)  # in (k, c, r, s) order; NaN and inf are nonzero: they propagate as in torch
    offset = (cc * shape.in_h + rr * shape.dilation[0]) * shape.in_w + ss * shape.dilation[1]
    entries = np.empty((len(kk), 2), np.int32)
    entries[:, 0] = (((4 * offset) << TAP_BITS) | (rr * shape.kernel_w + ss)).astype(np.uint32).view(np.int32)
    entries[:, 1] = w[kk, cc, rr, ss].view(np.int32)
    starts = np.zeros(shape.out_channels + 1, np.int64)
    starts[1:] = np.cumsum(np.bincount(kk, minlength=shape.out_channels))
    return entries, starts.astype(np.int32)


_SOURCE = r"""
// The constants above come from table_source: the layer's shape, the tiling
// (J pixels a lane, WS warps a block) and the epilogue.
//
// Which output pixel index i of an image's walk stands for. Row-major; or,
// where the epilogue pools (POOL: Epilogue.pool, a 2x2 max pool of stride
// 2), the pooled output's windows (sc_quad_row / sc_quad_col,
// pool.QUAD_WALK_CUDA), so a block holds whole windows. An odd side's last
// row or column is in no window: torch's floor mode drops it, and it is
// never computed.
#if POOL
#define NPIX (4 * POOL_H * POOL_W)
#define PIXEL_ROW(i) sc_quad_row((i), POOL_W)
#define PIXEL_COL(i) sc_quad_col((i), POOL_W)
#else
#define NPIX (OH * OW)
#define PIXEL_ROW(i) ((i) / OW)
#define PIXEL_COL(i) ((i) % OW)
#endif
extern "C" __global__ void __launch_bounds__(32 * WS)
sc_table_conv(const float* __restrict__ x, const int2* __restrict__ entries, const int* __restrict__ starts,
              const float* __restrict__ bias, const float* __restrict__ residual, float* __restrict__ out)
{
    const int k = blockIdx.y, n = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int pix0 = blockIdx.x * 32 * J;
    const char* xn = (const char*)(x + (long long)n * C * H * W);
    float acc[J];
    const char* field[J];  // the top-left of each of the lane's pixels' receptive field (may lie outside x)
    MASK_T taps_in[J];     // bit t: tap t of that pixel lies inside the image
#pragma unroll
    for (int j = 0; j < J; ++j) {
        acc[j] = 0.0f;
        const int p = pix0 + lane + 32 * j;
        const int oy = PIXEL_ROW(p), ox = PIXEL_COL(p);
        const int y0 = oy * SH - PH, x0 = ox * SW - PW;
        field[j] = xn + 4LL * (y0 * W + x0);
        MASK_T m = 0;
#pragma unroll
        for (int t = 0; t < KH * KW; ++t) {
            const int iy = y0 + (t / KW) * DH, ix = x0 + (t % KW) * DW;
            if (iy >= 0 && iy < H && ix >= 0 && ix < W) m |= (MASK_T)1 << t;
        }
        taps_in[j] = p < NPIX ? m : 0;
    }
    // This warp's share of output channel k's entries, in one flat loop: the
    // entry loads do not wait on the taps before them.
    const int b = starts[k], len = starts[k + 1] - b;
    const int lo = (len * w) / WS, hi = (len * (w + 1)) / WS;
#if STAGE_ENTRIES
    // The channel's entries, copied by the whole block at once (dynamic shared
    // memory: TableTiling.staged_bytes), before the wait: cold, their DRAM
    // round trip overlaps the kernel before, and the loop below reads them at
    // shared-memory latency instead of waiting on each warp's chain of loads.
    extern __shared__ int2 staged[];
    for (int i = threadIdx.x; i < len; i += 32 * WS) staged[i] = sc_load_entry2_l1(entries + b + i);
    __syncthreads();
#define SC_ENTRY(i) staged[i]
#else
#define SC_ENTRY(i) sc_load_entry2_l1(entries + b + (i))
#endif
    // The bias is a weight too: read before the wait, not on the block's way out.
    const float bias_k = bias[k];
    // Only the table, the bias and the masks above; the input is the kernel before's output (sparseconv/launch.py).
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
#pragma unroll 4
    for (int i = lo; i < hi; ++i) {
        const int2 e = SC_ENTRY(i);  // one address for the whole warp
        const float v = __int_as_float(e.y);
        const unsigned byte = (unsigned)e.x >> TAP_BITS;  // unsigned: one 64-bit add to the pointer
        const unsigned tap = (unsigned)e.x & (MAX_TAPS - 1);
#pragma unroll
        for (int j = 0; j < J; ++j) {
#if UNPADDED
            // no padding: every tap of a pixel inside the output lies inside the image
            if (taps_in[j]) acc[j] = fmaf(v, __ldg((const float*)(field[j] + byte)), acc[j]);
#else
            if ((taps_in[j] >> tap) & 1) acc[j] = fmaf(v, __ldg((const float*)(field[j] + byte)), acc[j]);
#endif
        }
    }
    __shared__ float part[WS][32 * J];
#pragma unroll
    for (int j = 0; j < J; ++j) part[w][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int q = threadIdx.x; q < 32 * J; q += 32 * WS) {
        const int p = pix0 + q;
        if (p >= NPIX) continue;
        float sum = part[0][q];  // the warps' shares in warp order: a fixed order
#pragma unroll
        for (int u = 1; u < WS; ++u) sum += part[u][q];
        sum += bias_k;
#if HAS_RESIDUAL
        // read here, not before the loop: read early, it cost 0.1-0.3 us a layer (run bk). Never with POOL.
        sum += residual[((long long)n * K + k) * (OH * OW) + p];
#endif
#ifdef LO
        sum = sum < LO ? LO : sum;  // comparisons keep NaN, as torch's clamp does
#endif
#ifdef HI
        sum = sum > HI ? HI : sum;
#endif
#if POOL
        part[0][q] = sum;  // q is this thread's alone: pooled below, once every window is whole
#else
        out[((long long)n * K + k) * (OH * OW) + p] = sum;
#endif
    }
#if POOL
    // Each window's maximum, top-left first, by sparseconv.pool's rule
    // (sc_pool_max: a NaN wins and stays, as in torch); pooled pixel = window.
    __syncthreads();
    for (int q = threadIdx.x; q < 8 * J; q += 32 * WS) {
        const int window = pix0 / 4 + q;
        if (window >= POOL_H * POOL_W) continue;
        float m = part[0][4 * q];
#pragma unroll
        for (int t = 1; t < 4; ++t) m = sc_pool_max(m, part[0][4 * q + t]);
        out[((long long)n * K + k) * (POOL_H * POOL_W) + window] = m;
    }
#endif
}
"""


def _float_literal(v: float) -> str:
    return f"__int_as_float({int(np.float32(v).view(np.int32))})"


def table_source(shape: ConvShape, tiling: TableTiling, epilogue: Epilogue = Epilogue()) -> str:
    """The kernel's CUDA source for one layer shape, tiling and epilogue."""
    why = table_supported(shape)
    if why:
        raise ValueError(f"table: {shape.describe()}: {why}")
    pool_h, pool_w = pooled_hw(shape.out_h, shape.out_w)
    consts = dict(C=shape.in_channels, H=shape.in_h, W=shape.in_w, K=shape.out_channels, OH=shape.out_h,
                  OW=shape.out_w, KH=shape.kernel_h, KW=shape.kernel_w, SH=shape.stride[0], SW=shape.stride[1],
                  PH=shape.padding[0], PW=shape.padding[1], DH=shape.dilation[0], DW=shape.dilation[1],
                  J=tiling.pixels_per_lane, WS=tiling.warps, STAGE_ENTRIES=int(tiling.staged_entries),
                  HAS_RESIDUAL=int(epilogue.residual), POOL=int(epilogue.pool),
                  POOL_H=pool_h, POOL_W=pool_w,
                  TAP_BITS=TAP_BITS, MAX_TAPS=MAX_TAPS, UNPADDED=int(shape.padding == (0, 0)),
                  MASK_T="unsigned" if shape.kernel_h * shape.kernel_w <= 32 else "unsigned long long")
    lo, hi = epilogue.bounds
    if lo is not None:
        consts["LO"] = _float_literal(lo)
    if hi is not None:
        consts["HI"] = _float_literal(hi)
    return ("".join(f"#define {k} {v}\n" for k, v in consts.items()) + GRID_DEPENDENCY_CUDA + weight_loads_cuda()
            + (POOL_MAX_CUDA + QUAD_WALK_CUDA if epilogue.pool else "") + _SOURCE)


def table_grid(shape: ConvShape, tiling: TableTiling, batch: int, pool: bool = False) -> Tuple[int, int, int]:
    """(pixel blocks, output channels, images). pool: the epilogue pools, so
    the kernel computes only the pixels of whole 2x2 windows (table_source)."""
    pixels = 4 * math.prod(pooled_hw(shape.out_h, shape.out_w)) if pool else shape.out_h * shape.out_w
    return (-(-pixels // (32 * tiling.pixels_per_lane)), shape.out_channels, batch)


_functions: Dict[Tuple[int, str], Any] = {}  # (device, source) -> compiled function


class TableConv2d:
    """A conv layer through the table family on the current GPU, with the call
    of runtime.Conv2dKernel (runtime.CallContract: the same checks):
    kernel(x, out=None, stream=None, residual=None) -> y, asynchronous on
    `stream` (default: CuPy's current stream). `tiling` None: table_tiling's
    rule at batch 1 for the weight's nonzeros. An epilogue that pools
    (Epilogue.pool) makes y the 2x2 max pool of the conv's output, as the
    code families do."""

    backend = "table"
    launches_pointers = True

    def __init__(self, weight: np.ndarray, bias: Optional[np.ndarray], shape: ConvShape,
                 epilogue: Epilogue = Epilogue(), tiling: Optional[TableTiling] = None, name: str = "conv") -> None:
        import cupy

        self.shape, self.epilogue, self.name = shape, epilogue, name
        try:
            entries, starts = weight_table(weight, shape)  # raises for a layer the family does not take
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        longest_channel = int(np.diff(starts).max())
        self.tiling = fitting_tiling(tiling or table_tiling(shape, 1, len(entries)), longest_channel)
        self._staged_bytes = self.tiling.staged_bytes(longest_channel)
        source = table_source(shape, self.tiling, epilogue)
        self.device_id = cupy.cuda.Device().id
        self.contract = CallContract(name, shape, epilogue.residual, self.device_id, epilogue.pool)
        self._entries = cupy.asarray(entries if len(entries) else np.zeros((1, 2), np.int32))
        self._starts = cupy.asarray(starts)
        self._bias = cupy.asarray(np.zeros(shape.out_channels, np.float32) if bias is None
                                  else np.asarray(bias, np.float32).reshape(shape.out_channels))
        key = (self.device_id, source)
        if key not in _functions:
            _functions[key] = cupy.RawKernel(source, "sc_table_conv")
        self._fn = _functions[key]
        self._launches: Dict[int, PreparedLaunch] = {}  # batch -> launch_pointers' launch
        self.stats = {"backend": "table", "tiling": self.tiling.describe(), "nonzero_weights": int(len(entries)),
                      "weights": int(np.prod(weight.shape)), "table_bytes": int(entries.nbytes + starts.nbytes),
                      # reading the attributes compiles and loads the kernel now, not at a first
                      # launch that may lie inside a CUDA graph capture
                      "registers": int(self._fn.attributes["num_regs"])}
        # Copied in on the current stream; the kernel may run on another.
        cupy.cuda.get_current_stream().synchronize()

    def output_shape(self, batch: int) -> Tuple[int, int, int, int]:
        return self.contract.output_shape(batch)

    def __call__(self, x: Any, out: Any = None, stream: Any = None, residual: Any = None) -> Any:
        with self.contract.launching(stream) as s:
            x, out, residual = self.contract.arrays(x, out, residual)  # the checks of every family
            if x.shape[0]:
                self.launch_pointers(x.data.ptr, out.data.ptr, 0 if residual is None else residual.data.ptr,
                                     x.shape[0], s.ptr)
        return out

    def launch_pointers(self, x: int, out: int, residual: int, batch: int, stream: int) -> None:
        """The launch on raw device pointers and stream handle, with no checks:
        what __call__ runs once the contract has checked its arrays
        (runtime.Conv2dKernel.launch_pointers says who else calls it)."""
        prepared = self._launches.get(batch)
        if prepared is None:
            null = ctypes.c_void_p
            grid = table_grid(self.shape, self.tiling, batch, self.epilogue.pool)
            if not grid[0]:  # pooled to nothing (a side of 1): no output to write
                return
            prepared = self._launches[batch] = PreparedLaunch(
                self._fn, grid, (32 * self.tiling.warps,), self._staged_bytes,
                (null(), null(self._entries.data.ptr), null(self._starts.data.ptr), null(self._bias.data.ptr),
                 null(), null()), self.device_id)
        prepared(stream, x, None, None, None, residual, out)  # None: the table and bias stay

    def __repr__(self) -> str:
        return (f"TableConv2d({self.name}: {self.shape.describe()}, {self.stats['nonzero_weights']}/"
                f"{self.stats['weights']} nonzero weights, {self.tiling.describe()})")


def routable_table(weight: np.ndarray, bias: Optional[np.ndarray], shape: ConvShape, epilogue: Epilogue,
                   batches: Sequence[int], name: str) -> Optional[TableConv2d]:
    """The TableConv2d that routing (sparsify, sparseconv run) times for a
    conv layer, on the current GPU; None where the table is not timed: the
    family does not take the shape, or no batch size is at most
    MAX_TABLE_BATCH."""
    if not table_timed(shape, batches):
        return None
    return TableConv2d(weight, bias, shape, epilogue, name=name)


def table_timed(shape: ConvShape, batches: Sequence[int]) -> bool:
    """Whether routing times this conv through the table at some of these
    batch sizes: the family takes the shape and one is at most MAX_TABLE_BATCH."""
    return table_supported(shape) is None and bool(batches) and min(batches) <= MAX_TABLE_BATCH
