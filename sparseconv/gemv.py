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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .launch import GRID_DEPENDENCY_CUDA, launch

# Images a launch serves: each keeps one partial sum a lane and reads x once
# per weight load; beyond a few images a GEMM reuses the weights better.
MAX_GEMV_BATCH = 8
WARPS_PER_BLOCK = 8   # GemvVariant.split of them share an output feature
# A dense layer takes this kernel when it has at least this many output
# features: it won on 1,000 and 4,096 (VGG-16's and ResNet-50's classifiers,
# bench/gemv_probe.py, H100, session 20). With few features its warps are too
# few to stream the weights; cuBLAS splits the rows.
MIN_GEMV_FEATURES = 1000


@dataclass(frozen=True)
class GemvVariant:
    """How the kernel reads a weight row: `split` warps a feature, `unroll`
    16-byte weight loads a lane a step. The default won on VGG-16's and
    ResNet-50's classifiers (bench/gemv_probe.py, H100, session 20)."""

    split: int = 4
    unroll: int = 8


_GEMV_SOURCE = r"""
// BATCH, UNROLL and SPLIT are compiled in (gemv_source). SPLIT warps share an
// output feature `row`: lane l of warp part p reads float4 number p * 32 + l,
// then SPLIT * 32 further on, and so on, all UNROLL loads of a step before
// their FMAs. ptxas keeps only ~2 of them in flight a lane (--sass), so the
// bytes in flight come from warps: SPLIT > 1 gives a 4,096-feature layer
// enough warps to fill every SM.
// Weights are read once: not kept in L1, which x (read by every row) uses.
__device__ __forceinline__ float4 load_weights(const float4* p) {
    float4 v;
    asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

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
        for (int u = 0; u < UNROLL; ++u) wv[u] = load_weights(wr + j + STEP * u);
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
        const float4 wv = load_weights(wr + j);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const float4 xv = __ldg(x4 + (long long)b * n4 + j);
            acc[b] = fmaf(wv.x, xv.x, acc[b]);
            acc[b] = fmaf(wv.y, xv.y, acc[b]);
            acc[b] = fmaf(wv.z, xv.z, acc[b]);
            acc[b] = fmaf(wv.w, xv.w, acc[b]);
        }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], offset);
    }
#if SPLIT > 1
    // The row's parts add up in part order: a fixed order, run to run.
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
        for (int b = 0; b < BATCH; ++b) y[(long long)b * out_features + row] = acc[b] + b0;
    }
}
"""


def gemv_source(batch: int, variant: GemvVariant = GemvVariant()) -> str:
    """The kernel's CUDA source for `batch` images a launch."""
    if not 1 <= batch <= MAX_GEMV_BATCH:
        raise ValueError(f"gemv: batch must be 1..{MAX_GEMV_BATCH}, got {batch}")
    if variant.split not in (1, 2, 4, 8) or variant.unroll < 1:
        raise ValueError(f"gemv: split must be 1, 2, 4 or 8 warps a feature and unroll >= 1, got {variant}")
    return (f"#define BATCH {batch}\n#define UNROLL {variant.unroll}\n#define WARPS {WARPS_PER_BLOCK}\n"
            f"#define SPLIT {variant.split}\n" + GRID_DEPENDENCY_CUDA + _GEMV_SOURCE)


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
    import cupy
    import numpy as np

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
    key = (device_id, n, variant)
    if key not in _kernels:
        _kernels[key] = cupy.RawKernel(gemv_source(n, variant), "sc_gemv")
    if y.size == 0:
        return
    blocks = -(-out_features // (WARPS_PER_BLOCK // variant.split))
    launch(_kernels[key], (blocks,), (WARPS_PER_BLOCK * 32,),
           (x, w, bias, y, np.int32(in_features), np.int32(out_features)))
