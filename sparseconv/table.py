"""The weight-table family: a layer's nonzero weights as a table in GPU
memory instead of immediates in the instruction stream, for small batches.

Why: at batch 1 a deep layer's straight-line code is fetched at ~1.4 GB/s
an SM from DRAM and ~3.8 GB/s from L2 (16 bytes an FFMA; docs/PERFORMANCE.md,
sessions 17-18), while the data path reads at ~20 GB/s an SM. Where few
pixels share each fetched instruction (7x7 and 14x14 outputs of one image)
the table is faster: ResNet-50's layer4 convs ran 1.5-1.9x faster cold on a
probe of this kernel (bench/weight_table_probe.py, H100, session 21). Where
many pixels share it (28x28 and up, or batch 64) the code is faster, so a
layer takes the table only at the batch sizes where it measured faster
(sparseconv.torch.route_by_batch).

The table is the specialisation: `weight_table` keeps each nonzero weight
once, as an 8-byte entry (byte offset of its input channel, value), sorted by
(output channel, tap, input channel); zero weights have no entry. The kernel
is compiled per layer shape and epilogue (NVRTC, cached by CuPy), never per
weight set.

Each block computes 32 * J pixels of one output channel of one image. Its
WS warps split each tap's entries; a warp loads an entry once (one address
for all lanes) and applies it to J pixels a lane. The warps' partial sums
are added in warp order in shared memory: a fixed summation order, so
results are the same run to run. Bias, residual and the clamp are applied
at the store, as in the other families.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .shapes import ConvShape, Epilogue

# Batches the table is timed at by routing: beyond a few images the code
# family shares each fetched instruction among enough pixels to win.
MAX_TABLE_BATCH = 8
# Below this many blocks a layer gets 8 warps a block, else 4: ~4-8 thousand
# warps won on the probe (layer4.1.conv1: 512 blocks, 8 warps 8.1 us cold vs
# 4 warps 11.1; layer4.0.downsample: 2,048 blocks, 4 warps 12.2 vs 8 warps 14.1).
FEW_BLOCKS = 1024


@dataclass(frozen=True)
class TableTiling:
    """pixels_per_lane (J): a block covers 32 * J pixels of one output channel;
    warps (WS): the warps of a block, which split each tap's entries."""

    pixels_per_lane: int = 2
    warps: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.pixels_per_lane <= 16:
            raise ValueError(f"pixels_per_lane must be 1..16, got {self.pixels_per_lane}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {self.warps}")

    def describe(self) -> str:
        return f"weight table, {self.pixels_per_lane} pixels/lane, {self.warps} warps"


def table_supported(shape: ConvShape) -> Optional[str]:
    """None if the table family takes this layer, else why not."""
    if shape.groups != 1:
        return "grouped convs are not supported by the table family"
    if shape.in_channels * shape.in_h * shape.in_w * 4 >= 2 ** 31:
        return "an image's input exceeds 2 GiB (entries hold 32-bit byte offsets)"
    return None


def table_tiling(shape: ConvShape, batch: int = 1) -> TableTiling:
    """The rule (probe: bench/weight_table_probe.py, H100, session 21): 2
    pixels a lane; 8 warps a block where the grid has few blocks, else 4."""
    blocks = -(-shape.out_h * shape.out_w // 64) * shape.out_channels * batch
    return TableTiling(2, 8 if blocks <= FEW_BLOCKS else 4)


def weight_table(weight: np.ndarray, shape: ConvShape) -> Tuple[np.ndarray, np.ndarray]:
    """(entries, starts) of a (K, C, R, S) weight: entries int32 (E, 2), each
    (4 * c * H * W, the weight's float32 bits), one per nonzero weight, sorted
    by (k, tap r * S + s, c); starts int32 (K, R * S + 1): the entries of
    output channel k and tap t are entries[starts[k, t]:starts[k, t + 1]]."""
    want = (shape.out_channels, shape.in_channels, shape.kernel_h, shape.kernel_w)
    if tuple(weight.shape) != want:
        raise ValueError(f"weight_table: the weight must have shape {want} for {shape.describe()}, "
                         f"got {tuple(weight.shape)}")
    w = np.ascontiguousarray(weight, dtype=np.float32)
    taps = shape.kernel_h * shape.kernel_w
    kk, cc, rr, ss = np.nonzero(w)  # NaN and inf are nonzero: they propagate as in torch
    tap = rr * shape.kernel_w + ss
    order = np.lexsort((cc, tap, kk))
    values = w[kk, cc, rr, ss][order]
    entries = np.empty((len(order), 2), np.int32)
    entries[:, 0] = cc[order] * (shape.in_h * shape.in_w * 4)
    entries[:, 1] = values.view(np.int32)
    counts = np.zeros((shape.out_channels, taps), np.int64)
    np.add.at(counts, (kk, tap), 1)
    starts = np.zeros((shape.out_channels, taps + 1), np.int64)
    starts[:, 1:] = np.cumsum(counts, axis=1)
    starts += np.concatenate([[0], np.cumsum(counts.sum(axis=1))[:-1]])[:, None]
    return entries, starts.astype(np.int32)


_SOURCE = r"""
// The constants above come from table_source: the layer's shape, the tiling
// (J pixels a lane, WS warps a block) and the epilogue.
extern "C" __global__ void __launch_bounds__(32 * WS)
sc_table_conv(const float* __restrict__ x, const int2* __restrict__ entries, const int* __restrict__ starts,
              const float* __restrict__ bias, const float* __restrict__ residual, float* __restrict__ out)
{
    const int k = blockIdx.y, n = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int pix0 = blockIdx.x * 32 * J;
    const float* xn = x + (long long)n * C * H * W;
    float acc[J];
    int oy[J], ox[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        acc[j] = 0.0f;
        const int p = pix0 + lane + 32 * j;
        oy[j] = p < OH * OW ? p / OW : -(1 << 20);  // a pixel past the end reads nothing
        ox[j] = p % OW;
    }
    const int* st = starts + k * (KH * KW + 1);
    for (int t = 0; t < KH * KW; ++t) {
        const int r = t / KW, s = t % KW;
        const char* xp[J];  // this tap's input pixel of each of the lane's outputs, in channel 0
        bool ok[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int iy = oy[j] * SH - PH + r * DH, ix = ox[j] * SW - PW + s * DW;
            ok[j] = iy >= 0 && iy < H && ix >= 0 && ix < W;
            xp[j] = (const char*)(xn + (ok[j] ? iy * W + ix : 0));
        }
        const int b = st[t], len = st[t + 1] - b;
        const int lo = b + (len * w) / WS, hi = b + (len * (w + 1)) / WS;
#pragma unroll 4
        for (int i = lo; i < hi; ++i) {
            const int2 e = __ldg(entries + i);  // one address for the whole warp
            const float v = __int_as_float(e.y);
            // unsigned: keeps the 64-bit pointer plus 32-bit offset one add
#pragma unroll
            for (int j = 0; j < J; ++j)
                if (ok[j]) acc[j] = fmaf(v, __ldg((const float*)(xp[j] + (unsigned)e.x)), acc[j]);
        }
    }
    __shared__ float part[WS][32 * J];
#pragma unroll
    for (int j = 0; j < J; ++j) part[w][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int q = threadIdx.x; q < 32 * J; q += 32 * WS) {
        const int p = pix0 + q;
        if (p >= OH * OW) continue;
        float sum = part[0][q];  // the warps' shares in warp order: a fixed order
#pragma unroll
        for (int u = 1; u < WS; ++u) sum += part[u][q];
        sum += bias[k];
        const long long o = ((long long)n * K + k) * (OH * OW) + p;
#if HAS_RESIDUAL
        sum += residual[o];
#endif
#ifdef LO
        sum = sum < LO ? LO : sum;  // comparisons keep NaN, as torch's clamp does
#endif
#ifdef HI
        sum = sum > HI ? HI : sum;
#endif
        out[o] = sum;
    }
}
"""


def _float_literal(v: float) -> str:
    return f"__int_as_float({int(np.float32(v).view(np.int32))})"


def table_source(shape: ConvShape, tiling: TableTiling, epilogue: Epilogue = Epilogue()) -> str:
    """The kernel's CUDA source for one layer shape, tiling and epilogue."""
    why = table_supported(shape)
    if why:
        raise ValueError(f"table: {shape.describe()}: {why}")
    consts = dict(C=shape.in_channels, H=shape.in_h, W=shape.in_w, K=shape.out_channels, OH=shape.out_h,
                  OW=shape.out_w, KH=shape.kernel_h, KW=shape.kernel_w, SH=shape.stride[0], SW=shape.stride[1],
                  PH=shape.padding[0], PW=shape.padding[1], DH=shape.dilation[0], DW=shape.dilation[1],
                  J=tiling.pixels_per_lane, WS=tiling.warps, HAS_RESIDUAL=int(epilogue.residual))
    lo, hi = epilogue.bounds
    if lo is not None:
        consts["LO"] = _float_literal(lo)
    if hi is not None:
        consts["HI"] = _float_literal(hi)
    return "".join(f"#define {k} {v}\n" for k, v in consts.items()) + _SOURCE


def table_grid(shape: ConvShape, tiling: TableTiling, batch: int) -> Tuple[int, int, int]:
    return (-(-shape.out_h * shape.out_w // (32 * tiling.pixels_per_lane)), shape.out_channels, batch)


_functions: Dict[Tuple[int, str], Any] = {}  # (device, source) -> compiled function


class TableConv2d:
    """A conv layer through the table family on the current GPU, with the call
    contract of runtime.Conv2dKernel: kernel(x, out=None, residual=None) -> y,
    on CuPy's current stream. `tiling` None: table_tiling's rule at batch 1."""

    backend = "table"

    def __init__(self, weight: np.ndarray, bias: Optional[np.ndarray], shape: ConvShape,
                 epilogue: Epilogue = Epilogue(), tiling: Optional[TableTiling] = None, name: str = "conv") -> None:
        import cupy

        self.shape, self.epilogue, self.name = shape, epilogue, name
        self.tiling = tiling or table_tiling(shape)
        source = table_source(shape, self.tiling, epilogue)  # raises for a layer the family does not take
        entries, starts = weight_table(weight, shape)
        self.device_id = cupy.cuda.Device().id
        self._entries = cupy.asarray(entries if len(entries) else np.zeros((1, 2), np.int32))
        self._starts = cupy.asarray(starts)
        self._bias = cupy.asarray(np.zeros(shape.out_channels, np.float32) if bias is None
                                  else np.asarray(bias, np.float32).reshape(shape.out_channels))
        key = (self.device_id, source)
        if key not in _functions:
            _functions[key] = cupy.RawKernel(source, "sc_table_conv")
        self._fn = _functions[key]
        self.stats = {"backend": "table", "tiling": self.tiling.describe(), "nonzero_weights": int(len(entries)),
                      "weights": int(np.prod(weight.shape)), "table_bytes": int(entries.nbytes + starts.nbytes)}
        # Copied in on the current stream; the kernel may run on another.
        cupy.cuda.get_current_stream().synchronize()

    def output_shape(self, batch: int) -> Tuple[int, int, int, int]:
        return (batch, self.shape.out_channels, self.shape.out_h, self.shape.out_w)

    def __call__(self, x: Any, out: Any = None, residual: Any = None) -> Any:
        import cupy

        s = self.shape
        if not isinstance(x, cupy.ndarray) or x.dtype != np.float32 or x.ndim != 4 \
                or tuple(x.shape[1:]) != (s.in_channels, s.in_h, s.in_w) or not x.flags.c_contiguous:
            raise ValueError(f"{self.name}: x must be a C-contiguous float32 CuPy array of shape "
                             f"(N, {s.in_channels}, {s.in_h}, {s.in_w}), got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        want = self.output_shape(x.shape[0])
        if out is None:
            out = cupy.empty(want, np.float32)
        for what, arr in (("out", out), ("residual", residual)):
            if arr is not None and (not isinstance(arr, cupy.ndarray) or arr.dtype != np.float32
                                    or tuple(arr.shape) != want or not arr.flags.c_contiguous):
                raise ValueError(f"{self.name}: {what} must be a C-contiguous float32 CuPy array of shape {want}")
        if self.epilogue.residual != (residual is not None):
            raise ValueError(f"{self.name}: this kernel {'adds' if self.epilogue.residual else 'takes no'} "
                             "residual")
        if x.shape[0] == 0:
            return out
        self._fn(table_grid(s, self.tiling, x.shape[0]), (32 * self.tiling.warps,),
                 (x, self._entries, self._starts, self._bias,
                  residual if residual is not None else np.uint64(0), out))
        return out

    def __repr__(self) -> str:
        return (f"TableConv2d({self.name}: {self.shape.describe()}, {self.stats['nonzero_weights']}/"
                f"{self.stats['weights']} nonzero weights, {self.tiling.describe()})")
