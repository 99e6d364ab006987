"""Dense fp32 matrix-vector products for small batches: the dense classifier
of a pruned network at batch 1 to MAX_GEMV_BATCH.

A network's dense classifier stays dense (the benchmark prunes only the
convs, and a user may prune only those too), and at batch 1 it only streams
its weights: VGG-16's 494 MB take ~180 us of a ~660 us forward. cuBLAS's
gemv reads fc6 at the HBM's ~2.7 TB/s already, but fc7 (4096 x 4096) at
1.7 TB/s and every layer at batch 8 at 0.3-1.5 TB/s (bench/gemv_probe.py,
H100, session 20, docs/PERFORMANCE.md). Here GemvVariant.split warps share an
output feature; their lanes stream the weight row in 16-byte loads and keep
one partial sum per image. The sum runs in a fixed order (each lane's share
in column order, a butterfly over the lanes, then the warps in order), so
results are identical run to run; they are exact fp32 sums in another order
than cuBLAS's, so they may differ from F.linear in the last bits.

A pruned layer (most weights zero) takes the sparse kernel instead
(sparse_rows, linear_sparse_gemv): its nonzero weights as 8-byte entries
(input column, value) row by row, so it streams ~2 x nnz x 4 bytes in place
of out x in x 4 and gathers x by column. The weights are data here, not
instructions: a layer of 100 M weights (VGG-16's fc6) is read in tens of
microseconds and costs no build, where the code family could not build it.
Its summation order is fixed too (each lane's entries in column order, the
butterfly, the warps of a row in order).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .launch import GRID_DEPENDENCY_CUDA, launch, launch_raw
from .weight_loads import weight_loads_cuda

# Images a launch serves: each keeps one partial sum a lane and reads x once
# per weight load; beyond a few images a GEMM reuses the weights better.
MAX_GEMV_BATCH = 8
WARPS_PER_BLOCK = 8   # GemvVariant.split of them share an output feature
# A dense layer takes this kernel when it has at least this many output
# features: it won on 1,000 and 4,096 (VGG-16's and ResNet-50's classifiers,
# bench/gemv_probe.py, H100, session 20). With few features its warps are too
# few to stream the weights; cuBLAS splits the rows.
MIN_GEMV_FEATURES = 1000
# A Linear left uncompiled takes the sparse kernel when at least this
# fraction of its weights is zero: an entry is 8 bytes against 4 a dense
# weight, and each one gathers its x. At 60% zeros the sparse kernel won on
# VGG-16's fc6 and fc7 but tied or lost on the 1,000-output layers (fc8,
# ResNet-50's fc) at batch 8; at 70% it won or tied on all four, and at 90%
# it is 1.2-4x faster than the dense kernel (bench/gemv_probe.py --sparsity,
# H100, session 30, docs/PERFORMANCE.md).
MIN_SPARSE_GEMV_SPARSITY = 0.7


@dataclass(frozen=True)
class GemvVariant:
    """How the kernel reads a weight row: `split` warps a feature, `unroll`
    16-byte weight loads a lane a step. The default won on VGG-16's and
    ResNet-50's classifiers (bench/gemv_probe.py, H100, session 20)."""

    split: int = 4
    unroll: int = 8


# Both kernels end the same way: a row's sum over its lanes and warps, in a
# fixed order, plus the bias, stored by the row's first lane.
_ROW_SUM_CUDA = r"""
// Each lane's partial sums, a butterfly over the lanes, then the SPLIT warps
// of the row in part order: a fixed order, so results are identical run to run.
__device__ __forceinline__ void sum_and_store_row(float (&acc)[BATCH], int lane, int warp, int part, int row,
                                                  bool live, const float* __restrict__ bias,
                                                  float* __restrict__ y, int out_features)
{
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], offset);
    }
#if SPLIT > 1
    __shared__ float partial[WARPS][BATCH];
    if (lane == 0) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) partial[warp][b] = acc[b];
    }
    __syncthreads();
    if (part == 0 && lane == 0) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            float s = partial[warp][b];
#pragma unroll
            for (int q = 1; q < SPLIT; ++q) s += partial[warp + q][b];
            acc[b] = s;
        }
    }
#endif
    if (live && part == 0 && lane == 0) {
        const float b0 = bias[row];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) y[(long long)b * out_features + row] = ACTIVATE(acc[b] + b0);
    }
}
"""


_GEMV_SOURCE = r"""
// BATCH, UNROLL and SPLIT are compiled in (gemv_source). SPLIT warps share an
// output feature `row`: lane l of warp part p reads float4 number p * 32 + l,
// then SPLIT * 32 further on, and so on, all UNROLL loads of a step before
// their FMAs. ptxas keeps only ~2 of them in flight a lane (--sass), so the
// bytes in flight come from warps: SPLIT > 1 gives a 4,096-feature layer
// enough warps to fill every SM.
// Weights are read once: not kept in L1, which x (read by every row) uses
// (sc_load_weights4, sparseconv/weight_loads.py).

extern "C" __global__ void __launch_bounds__(WARPS * 32) sc_gemv(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ y, int in_features, int out_features)
{
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = warp % SPLIT;
    const int row = blockIdx.x * (WARPS / SPLIT) + warp / SPLIT;
    const bool live = row < out_features;
    const int n4 = live ? in_features >> 2 : 0;  // in_features % 4 == 0, checked by the caller
    const float4* wr = reinterpret_cast<const float4*>(w + (long long)(live ? row : 0) * in_features);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    constexpr int STEP = 32 * SPLIT;
    float acc[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) acc[b] = 0.0f;
    int j = part * 32 + lane;
    for (; j + STEP * (UNROLL - 1) < n4; j += STEP * UNROLL) {
        float4 wv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wv[u] = sc_load_weights4(wr + j + STEP * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                const float4 xv = __ldg(x4 + (long long)b * n4 + j + STEP * u);
                acc[b] = fmaf(wv[u].x, xv.x, acc[b]);
                acc[b] = fmaf(wv[u].y, xv.y, acc[b]);
                acc[b] = fmaf(wv[u].z, xv.z, acc[b]);
                acc[b] = fmaf(wv[u].w, xv.w, acc[b]);
            }
    }
    for (; j < n4; j += STEP) {  // the row's last, partial step
        const float4 wv = sc_load_weights4(wr + j);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const float4 xv = __ldg(x4 + (long long)b * n4 + j);
            acc[b] = fmaf(wv.x, xv.x, acc[b]);
            acc[b] = fmaf(wv.y, xv.y, acc[b]);
            acc[b] = fmaf(wv.z, xv.z, acc[b]);
            acc[b] = fmaf(wv.w, xv.w, acc[b]);
        }
    }
    sum_and_store_row(acc, lane, warp, part, row, live, bias, y, out_features);
}
"""


def activation_macro(activation: str = "none", clip: Optional[Tuple[float, float]] = None) -> str:
    """ACTIVATE(v), applied at the store: the epilogue of a fused Linear
    (shapes.Epilogue's activations; clip bounds as exact float32 literals)."""
    if activation == "none":
        return "#define ACTIVATE(v) (v)\n"
    if activation == "relu":
        return "#define ACTIVATE(v) fmaxf((v), 0.0f)\n"
    if activation == "relu6":
        return "#define ACTIVATE(v) fminf(fmaxf((v), 0.0f), 6.0f)\n"
    if activation == "clip" and clip is not None:
        lo, hi = (float(np.float32(c)) for c in clip)
        return f"#define ACTIVATE(v) fminf(fmaxf((v), {lo!r}f), {hi!r}f)\n"
    raise ValueError(f"gemv: activation must be none, relu, relu6 or clip with (lo, hi), got {activation!r}, {clip}")


def _source(kernel: str, body: str, batch: int, variant: GemvVariant, activation: str = "none",
            clip: Optional[Tuple[float, float]] = None) -> str:
    """body (a kernel's CUDA text) with its sizes and epilogue defined and the shared parts before it."""
    if not 1 <= batch <= MAX_GEMV_BATCH:
        raise ValueError(f"{kernel}: batch must be 1..{MAX_GEMV_BATCH}, got {batch}")
    if variant.split not in (1, 2, 4, 8) or variant.unroll < 1:
        raise ValueError(f"{kernel}: split must be 1, 2, 4 or 8 warps a feature and unroll >= 1, got {variant}")
    return (f"#define BATCH {batch}\n#define UNROLL {variant.unroll}\n#define WARPS {WARPS_PER_BLOCK}\n"
            f"#define SPLIT {variant.split}\n" + activation_macro(activation, clip) + GRID_DEPENDENCY_CUDA
            + weight_loads_cuda() + _ROW_SUM_CUDA + body)


def gemv_source(batch: int, variant: GemvVariant = GemvVariant()) -> str:
    """The kernel's CUDA source for `batch` images a launch."""
    return _source("gemv", _GEMV_SOURCE, batch, variant)


_kernels: Dict[Tuple[int, int, GemvVariant], Any] = {}  # (device, batch, variant) -> kernel


def gemv_takes(out_features: int, in_features: int) -> bool:
    """Whether a dense layer of this size runs this kernel at small batches
    (both front ends ask: fx.swap_dense_linears and the ONNX runner)."""
    return out_features >= MIN_GEMV_FEATURES and in_features % 4 == 0


def gemv_supported(batch: int, in_features: int, x_ptr: int, w_ptr: int) -> bool:
    """Whether linear_gemv takes this call: 1..MAX_GEMV_BATCH images, rows of
    a multiple of 4 floats, x and w 16-byte aligned (they are read as float4)."""
    return 1 <= batch <= MAX_GEMV_BATCH and in_features % 4 == 0 and x_ptr % 16 == 0 and w_ptr % 16 == 0


def linear_gemv(device_id: int, x: Any, w: Any, bias: Any, y: Any, variant: GemvVariant = GemvVariant()) -> None:
    """y = x @ w.T + bias on the current stream, CuPy float32 C-contiguous
    arrays: x (N, in), w (out, in), bias (out,), y (N, out), N <= MAX_GEMV_BATCH."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"gemv: x and w must be 2-D, (N, in_features) and (out_features, in_features); got "
                         f"shapes {tuple(x.shape)} and {tuple(w.shape)}")
    n, in_features = x.shape
    out_features = w.shape[0]
    expected = {"w": (out_features, in_features), "bias": (out_features,), "y": (n, out_features)}
    for name, arr in (("w", w), ("bias", bias), ("y", y)):
        if tuple(arr.shape) != expected[name]:
            raise ValueError(f"gemv: {name} must have shape {expected[name]}, got {tuple(arr.shape)}")
    if not all(a.dtype == np.float32 and a.flags.c_contiguous for a in (x, w, bias, y)):
        raise ValueError("gemv: x, w, bias and y must be C-contiguous float32 arrays")
    if not gemv_supported(n, in_features, x.data.ptr, w.data.ptr):
        raise ValueError(f"gemv: needs 1..{MAX_GEMV_BATCH} images, in_features % 4 == 0 and 16-byte aligned "
                         f"arrays; got {n} images, {in_features} features")
    if y.size == 0:
        return
    import cupy

    linear_gemv_pointers(device_id, x.data.ptr, w.data.ptr, bias.data.ptr, y.data.ptr, n, in_features, out_features,
                         cupy.cuda.get_current_stream().ptr, variant)


def linear_gemv_pointers(device_id: int, x: int, w: int, bias: int, y: int, batch: int, in_features: int,
                         out_features: int, stream: int, variant: GemvVariant = GemvVariant()) -> None:
    """The launch on raw device pointers and a raw stream handle, unchecked:
    what linear_gemv runs once it has checked its arrays, and what a caller
    that checked its tensors and gemv_supported calls directly
    (fx.GemvLinear's eager calls; sparseconv.launch's doc says why), on the
    current device."""
    launch_raw(_gemv_kernel(device_id, batch, variant), _gemv_grid(out_features, variant), (WARPS_PER_BLOCK * 32,),
               (ctypes.c_void_p(x), ctypes.c_void_p(w), ctypes.c_void_p(bias), ctypes.c_void_p(y),
                ctypes.c_int32(in_features), ctypes.c_int32(out_features)), 0, stream, device_id)


def _gemv_kernel(device_id: int, batch: int, variant: GemvVariant) -> Any:
    import cupy

    key = (device_id, batch, variant)
    if key not in _kernels:
        _kernels[key] = cupy.RawKernel(gemv_source(batch, variant), "sc_gemv")
    return _kernels[key]


def _gemv_grid(out_features: int, variant: GemvVariant) -> Tuple[int]:
    return (-(-out_features // (WARPS_PER_BLOCK // variant.split)),)


# -- pruned layers: the nonzero weights as (column, value) entries -------------------------------------------------

@dataclass(frozen=True)
class SparseRows:
    """A weight matrix's nonzeros, row by row (CSR): row r's entries are
    entries[row_start[r]:row_start[r + 1]], each (input column, the value's
    float32 bits) as two uint32, in column order."""

    out_features: int
    in_features: int
    row_start: np.ndarray   # int32, out_features + 1
    entries: np.ndarray     # uint32, (nnz, 2)

    @property
    def nnz(self) -> int:
        return int(self.entries.shape[0])

    def to_dense(self) -> np.ndarray:
        """The float32 matrix back (zeros where there is no entry)."""
        w = np.zeros((self.out_features, self.in_features), np.float32)
        rows = np.repeat(np.arange(self.out_features), np.diff(self.row_start))
        w[rows, self.entries[:, 0]] = self.entries[:, 1].view(np.float32)
        return w


def sparse_rows(weight: Any) -> SparseRows:
    """The nonzero weights of a 2-D float32 matrix (out_features, in_features)
    as SparseRows. Negative zeros count as zeros (they add nothing)."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"sparse gemv: the weight must be 2-D (out_features, in_features), got shape {w.shape}")
    if w.shape[0] >= 2 ** 31 or w.size >= 2 ** 31:
        raise ValueError(f"sparse gemv: {w.shape} is too large for 32-bit entry offsets")
    rows, cols = np.nonzero(w)      # row-major: rows ascending, columns ascending within a row
    entries = np.empty((rows.size, 2), np.uint32)
    entries[:, 0] = cols
    entries[:, 1] = w[rows, cols].view(np.uint32)
    row_start = np.zeros(w.shape[0] + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=w.shape[0]), out=row_start[1:])
    return SparseRows(int(w.shape[0]), int(w.shape[1]), row_start, entries)


def sparse_gemv_takes(out_features: int, sparsity: float) -> bool:
    """Whether a Linear of this many outputs and this fraction of zero weights
    runs the sparse kernel at small batches (both front ends ask)."""
    return out_features >= MIN_GEMV_FEATURES and sparsity >= MIN_SPARSE_GEMV_SPARSITY


_SPARSE_GEMV_SOURCE = r"""
// BATCH, UNROLL and SPLIT as in sc_gemv. SPLIT warps share output feature
// `row`; lane l of warp part p takes entry begin + p * 32 + l, then SPLIT * 32
// further on, UNROLL entry loads a step before their FMAs. An entry is
// (input column, weight bits); x is gathered by column (every row reads the
// same x, so it stays in L1/L2), the entries are read once (sc_load_entry2,
// sparseconv/weight_loads.py).

extern "C" __global__ void __launch_bounds__(WARPS * 32) sc_sparse_gemv(
    const float* __restrict__ x, const uint2* __restrict__ entries, const int* __restrict__ row_start,
    const float* __restrict__ bias, float* __restrict__ y, int in_features, int out_features)
{
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = warp % SPLIT;
    const int row = blockIdx.x * (WARPS / SPLIT) + warp / SPLIT;
    const bool live = row < out_features;
    // the row's bounds are weights, not the previous kernel's output: read before the wait
    const int begin = live ? row_start[row] : 0;
    const int end = live ? row_start[row + 1] : 0;
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
    constexpr int STEP = 32 * SPLIT;
    float acc[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) acc[b] = 0.0f;
    int j = begin + part * 32 + lane;
    for (; j + STEP * (UNROLL - 1) < end; j += STEP * UNROLL) {
        uint2 e[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) e[u] = sc_load_entry2(entries + j + STEP * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int b = 0; b < BATCH; ++b)
                acc[b] = fmaf(__uint_as_float(e[u].y), __ldg(x + (long long)b * in_features + e[u].x), acc[b]);
    }
    for (; j < end; j += STEP) {  // the row's last, partial step
        const uint2 e = sc_load_entry2(entries + j);
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
            acc[b] = fmaf(__uint_as_float(e.y), __ldg(x + (long long)b * in_features + e.x), acc[b]);
    }
    sum_and_store_row(acc, lane, warp, part, row, live, bias, y, out_features);
}
"""

# The sparse kernel's variant by layer (sparse_gemv_variant), from the probe
# (bench/gemv_probe.py --sparsity, H100, session 30): one warp a row where
# there are enough rows (VGG-16's 4,096-output fc6 and fc7: at batch 8 four
# warps a row took fc6 from 57 to 77 us), four where there are few (the
# 1,000-output layers: 8.3 -> 7.6 us at batch 1, 13.4 -> 10.5 at batch 8);
# 8 entry loads a step at batch <= 4, 4 above (the FMAs of a step grow with
# the batch).
SPARSE_GEMV_VARIANT = GemvVariant(split=1, unroll=8)
FEW_ROWS = 2048


def sparse_gemv_variant(out_features: int, batch: int) -> GemvVariant:
    """The sparse kernel's variant for a layer of out_features rows at batch."""
    split = 4 if out_features < FEW_ROWS else 1
    return GemvVariant(split=split, unroll=8 if split == 1 and batch <= 4 else 4)


def sparse_gemv_source(batch: int, variant: GemvVariant = SPARSE_GEMV_VARIANT, activation: str = "none",
                       clip: Optional[Tuple[float, float]] = None) -> str:
    """The sparse kernel's CUDA source for `batch` images a launch, with its
    epilogue (activation_macro)."""
    return _source("sparse gemv", _SPARSE_GEMV_SOURCE, batch, variant, activation, clip)


# (device, batch, variant, activation, clip) -> kernel
_sparse_kernels: Dict[Tuple[int, int, GemvVariant, str, Optional[Tuple[float, float]]], Any] = {}


def linear_sparse_gemv(device_id: int, x: Any, entries: Any, row_start: Any, bias: Any, y: Any,
                       variant: Optional[GemvVariant] = None, activation: str = "none",
                       clip: Optional[Tuple[float, float]] = None) -> None:
    """y = act(x @ W.T + bias) on the current stream for W given as
    SparseRows' arrays on the GPU (CuPy: entries uint32 (nnz, 2), row_start
    int32 (out + 1,)); x (N, in), bias (out,), y (N, out) C-contiguous float32
    CuPy arrays, N <= MAX_GEMV_BATCH. variant None: sparse_gemv_variant's."""
    import cupy

    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"sparse gemv: x and y must be 2-D, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    n, in_features = x.shape
    out_features = row_start.shape[0] - 1
    if tuple(bias.shape) != (out_features,) or tuple(y.shape) != (n, out_features):
        raise ValueError(f"sparse gemv: bias must have shape ({out_features},) and y ({n}, {out_features}); "
                         f"got {tuple(bias.shape)} and {tuple(y.shape)}")
    if entries.dtype != np.uint32 or entries.ndim != 2 or entries.shape[1] != 2 or row_start.dtype != np.int32:
        raise ValueError("sparse gemv: entries must be uint32 (nnz, 2) and row_start int32 (sparse_rows' arrays)")
    if not all(a.dtype == np.float32 and a.flags.c_contiguous for a in (x, bias, y)) \
            or not (entries.flags.c_contiguous and row_start.flags.c_contiguous):
        raise ValueError("sparse gemv: x, bias and y must be C-contiguous float32, entries and row_start contiguous")
    if not 1 <= n <= MAX_GEMV_BATCH:
        raise ValueError(f"sparse gemv: needs 1..{MAX_GEMV_BATCH} images, got {n}")
    variant = variant or sparse_gemv_variant(out_features, n)
    key = (device_id, n, variant, activation, clip)
    if key not in _sparse_kernels:
        _sparse_kernels[key] = cupy.RawKernel(sparse_gemv_source(n, variant, activation, clip), "sc_sparse_gemv")
    if y.size == 0:
        return
    blocks = -(-out_features // (WARPS_PER_BLOCK // variant.split))
    launch(_sparse_kernels[key], (blocks,), (WARPS_PER_BLOCK * 32,),
           (x, entries, row_start, bias, y, np.int32(in_features), np.int32(out_features)))


class SparseLinearTable:
    """A compiled Linear layer's weights as the sparse gemv's entries on the
    GPU, with its bias and activation: FusedLinear's "table" path at batch <=
    MAX_GEMV_BATCH, where routing timed it faster than its code and cuBLAS."""

    def __init__(self, weight: np.ndarray, bias: Optional[np.ndarray], activation: str = "none",
                 clip: Optional[Tuple[float, float]] = None) -> None:
        import cupy

        rows = sparse_rows(weight)
        self.out_features, self.in_features, self.nnz = rows.out_features, rows.in_features, rows.nnz
        self.entries, self.row_start = cupy.asarray(rows.entries), cupy.asarray(rows.row_start)
        self.bias = cupy.asarray(np.zeros(rows.out_features, np.float32) if bias is None else bias, cupy.float32)
        self.activation, self.clip = activation, clip
        activation_macro(activation, clip)  # refused now, not at the first call
        self.device_id = cupy.cuda.Device().id

    def __call__(self, x: Any, out: Any) -> None:
        """out = act(x @ W.T + bias) on the current stream (CuPy arrays on this device)."""
        linear_sparse_gemv(self.device_id, x, self.entries, self.row_start, self.bias, out,
                           activation=self.activation, clip=self.clip)
