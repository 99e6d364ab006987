"""Max pooling without indices: the pooling stage of the torch front end.

torch's CUDA max_pool2d writes each output's argmax too, as int64 (twice the
bytes of the float output) even when nobody asks for it, and at inference
nobody does. In ResNet-50 at batch 64 that pool took 204 us of a 7.5 ms
forward (bench/network_profile.py, H100, session 12); the indices are ~30%
of its traffic, and more of VGG-16's five pools. This kernel reads the input
once and writes only the maxima. The result is exact (a max is), with
torch's semantics: windows in row order, starting from -inf, a NaN in a
window propagates, padding never wins.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .launch import GRID_DEPENDENCY_CUDA, PreparedLaunch, c_args, launch, launch_raw
from .shapes import pair

IntPair = Tuple[int, int]

# The max pool's order and NaN rule, written once for every kernel that pools
# (this module's, the split sum's sc_reduce_slices_pool, the pointwise
# template's window shuffles, the weight table's store): the maximum so far m
# takes v if v is larger or v is NaN, so a NaN wins and stays, as in torch;
# each kernel starts from -inf (or the window's first value) and walks the
# window top-left first.
POOL_MAX_CUDA = r"""
static __device__ __forceinline__ float sc_pool_max(float m, float v) { return v > m || v != v ? v : m; }
"""

# The walk by 2x2 windows, written once for the two kernels that take it (the
# pointwise template's pixel_order "quads", shapes.PIXEL_ORDERS, and the
# weight table where it pools): index i of an image's walk stands for the
# output pixel at (sc_quad_row, sc_quad_col), four consecutive i a window
# (top-left, top-right, bottom-left, bottom-right), the windows row-major,
# windows_w of them a row. A block of a multiple of 4 pixels then holds whole
# windows, and a window's four values lie in adjacent lanes for the pool.
QUAD_WALK_CUDA = r"""
static __device__ __forceinline__ int sc_quad_row(int i, int windows_w)
{
    return (i >> 2) / windows_w * 2 + ((i >> 1) & 1);
}
static __device__ __forceinline__ int sc_quad_col(int i, int windows_w)
{
    return (i >> 2) % windows_w * 2 + (i & 1);
}
"""

_MAX_POOL_SOURCE = r"""
// The window and the sizes are compiled in (pool_source). With the window
// loops unrolled a thread issues all of its window's loads before the first
// compare (with run-time bounds each load waited for the one before, which
// held the kernel at ~2x its floor). With the sizes constant, a pixel's row
// and column cost a multiply and a shift, not a division: with them as
// arguments the kernel was bound by its integer work (ncu: SM throughput 81%,
// DRAM 60%, 126 us for ResNet-50's stem pool at batch 64; session 28).

// One output: the maximum over its window of plane src (p: row * OUT_W + column).
__device__ __forceinline__ float window_max(const float* __restrict__ src, int p)
{
    const float neg_inf = -__int_as_float(0x7f800000);
    const int h0 = (p / OUT_W) * STRIDE_H - PAD_H, w0 = (p % OUT_W) * STRIDE_W - PAD_W;
    float v[KERNEL_H][KERNEL_W];
#pragma unroll
    for (int r = 0; r < KERNEL_H; ++r)
#pragma unroll
        for (int s = 0; s < KERNEL_W; ++s) {
            const int h = h0 + r * DIL_H, w = w0 + s * DIL_W;
            // padding reads as -inf: it never wins a compare below
            v[r][s] = h >= 0 && h < IN_H && w >= 0 && w < IN_W ? __ldg(src + h * IN_W + w) : neg_inf;
        }
    float m = neg_inf;                       // as torch starts
#pragma unroll
    for (int r = 0; r < KERNEL_H; ++r)
#pragma unroll
        for (int s = 0; s < KERNEL_W; ++s)
            m = sc_pool_max(m, v[r][s]);
    return m;
}

// A block a plane, for tensors of 2^31 outputs or more (sc_max_pool2d_flat
// takes the rest). grid: (pixel blocks, planes), each a grid-stride loop;
// blockIdx.y picks the (n, c) plane, so no thread divides a 64-bit index.
extern "C" __global__ void sc_max_pool2d(const float* __restrict__ x, float* __restrict__ y, long long planes)
{
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
    const int out_hw = OUT_H * OUT_W;
    for (long long plane = blockIdx.y; plane < planes; plane += gridDim.y) {
        const float* src = x + plane * (IN_H * IN_W);
        float* dst = y + plane * out_hw;
        for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < out_hw; p += gridDim.x * blockDim.x)
            dst[p] = window_max(src, p);
    }
}

// One grid-stride loop over every output of the tensor: a block spans planes,
// so small planes (VGG-16's pool5: 49 outputs) leave no thread idle (a block
// a plane ran 40 us there at batch 64, this 8.5; and 91.7 against 96.4 us on
// ResNet-50's stem pool; bench/pool_bench.py, session 33). The caller keeps
// planes * OUT_H * OUT_W < 2^31; the plane is a 32-bit division by a constant.
extern "C" __global__ void sc_max_pool2d_flat(const float* __restrict__ x, float* __restrict__ y, int outputs)
{
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
    // unsigned: i + the grid's stride stays below 2^32 without overflow
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned int)outputs;
         i += gridDim.x * blockDim.x) {
        const unsigned int plane = i / (OUT_H * OUT_W);
        y[i] = window_max(x + (long long)plane * (IN_H * IN_W), (int)(i - plane * (OUT_H * OUT_W)));
    }
}
"""


def pool_source(kernel: IntPair, stride: IntPair, pad_top_left: IntPair, dilation: IntPair, in_size: IntPair,
                out_size: IntPair) -> str:
    """The max-pool kernel's CUDA source for one window and one plane size
    (input and output height, width), all compiled in."""
    values = dict(KERNEL=kernel, STRIDE=stride, PAD=pad_top_left, DIL=dilation, IN=in_size, OUT=out_size)
    defines = "".join(f"#define {name}_H {int(v[0])}\n#define {name}_W {int(v[1])}\n" for name, v in values.items())
    return defines + GRID_DEPENDENCY_CUDA + POOL_MAX_CUDA + _MAX_POOL_SOURCE


@dataclass(frozen=True)
class MaxPoolShape:
    """A 2-D max pool's window, as torch.nn.MaxPool2d takes it (stride
    defaults to the kernel size there; here it is always given)."""

    kernel: IntPair
    stride: IntPair
    padding: IntPair = (0, 0)
    dilation: IntPair = (1, 1)
    ceil_mode: bool = False

    @staticmethod
    def of(kernel_size: Any, stride: Any, padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False
           ) -> "MaxPoolShape":
        kernel = pair(kernel_size, "max pool kernel_size")
        stride = kernel if stride is None or stride == () or stride == [] else stride  # torch's default
        shape = MaxPoolShape(kernel, pair(stride, "max pool stride"), pair(padding, "max pool padding"),
                             pair(dilation, "max pool dilation"), bool(ceil_mode))
        if min(shape.kernel + shape.stride + shape.dilation) < 1 or min(shape.padding) < 0:
            raise ValueError(f"max pool: kernel, stride and dilation must be >= 1 and padding >= 0, got {shape}")
        if any(2 * p > k for p, k in zip(shape.padding, shape.kernel)):
            raise ValueError(f"max pool: padding must be at most half the kernel size, got {shape}")
        return shape

    def output_size(self, in_h: int, in_w: int) -> IntPair:
        """torch's output size (pooling_output_shape), ceil_mode included."""
        def one(size: int, k: int, s: int, p: int, d: int) -> int:
            span = size + 2 * p - d * (k - 1) - 1
            out = (span + (s - 1 if self.ceil_mode else 0)) // s + 1
            if self.ceil_mode and (out - 1) * s >= size + p:  # the last window would start in the padding
                out -= 1
            return out
        h = one(in_h, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0])
        w = one(in_w, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1])
        if h < 1 or w < 1:
            raise ValueError(f"max pool {self}: an input of {in_h}x{in_w} gives no output")
        return h, w


# The pool an Epilogue fuses into a conv (Epilogue.pool): VGG's MaxPool2d(2, 2).
FUSED_POOL = MaxPoolShape((2, 2), (2, 2))

_kernels: Dict[Tuple[object, ...], Any] = {}  # (device, kernel name, pool_source's arguments) -> kernel


def max_pool2d(device_id: int, x: Any, y: Any, pool: MaxPoolShape) -> None:
    """y = max pool of x (CuPy float32 arrays, C-contiguous, (N, C, H, W) and
    (N, C) + pool.output_size(H, W)) on the current stream."""
    n, c, in_h, in_w = x.shape
    out_h, out_w = pool.output_size(in_h, in_w)
    if tuple(y.shape) != (n, c, out_h, out_w):
        raise ValueError(f"max pool {pool}: y must have shape {(n, c, out_h, out_w)}, got {tuple(y.shape)}")
    launch_max_pool(device_id, x, y, pool.kernel, pool.stride, pool.padding, pool.dilation)


def launch_max_pool(device_id: int, x: Any, y: Any, kernel: IntPair, stride: IntPair, pad_top_left: IntPair,
                    dilation: IntPair, flat: Optional[bool] = None) -> None:
    """The kernel launch behind max_pool2d, for callers that size y
    themselves (ONNX's pads may differ at the bottom and right, and its
    ceil_mode adds a partial window: the kernel skips whatever falls outside
    x). Window (i, j) starts at (i * stride - top, j * stride - left).
    `flat` picks the kernel: one loop over the tensor's outputs
    (sc_max_pool2d_flat, the default below 2^31 outputs) or a block a plane
    (sc_max_pool2d); bench/pool_bench.py times both."""
    if y.size == 0:
        return
    fn, grid, block, size = _pool_launch(device_id, tuple(x.shape), tuple(y.shape[2:]), kernel, stride,
                                         pad_top_left, dilation, flat)
    launch(fn, grid, block, (x, y, size))


def max_pool2d_pointers(device_id: int, x: int, y: int, x_shape: Tuple[int, int, int, int], pool: MaxPoolShape,
                        stream: int) -> None:
    """max_pool2d on raw device pointers (x of x_shape, y sized by
    pool.output_size) and a raw stream handle, unchecked: for a caller that
    made y itself (fx.IndexFreeMaxPool2d's eager calls; sparseconv.launch's doc
    says why), on the current device."""
    out_hw = pool.output_size(x_shape[2], x_shape[3])
    if x_shape[0] * x_shape[1] == 0:
        return
    fn, grid, block, size = _pool_launch(device_id, x_shape, out_hw, pool.kernel, pool.stride, pool.padding,
                                         pool.dilation, None)
    launch_raw(fn, grid, block, c_args((ctypes.c_void_p(x), ctypes.c_void_p(y), size)), 0, stream, device_id)


def prepared_max_pool(device_id: int, x: int, x_shape: Tuple[int, int, int, int], pool: MaxPoolShape
                      ) -> PreparedLaunch:
    """The launch of max_pool2d_pointers prepared once (its arguments: x, y,
    size; a call passes y): what runtime.Conv2dKernel runs after a variant
    whose kernel does not take its epilogue's pool."""
    fn, grid, block, size = _pool_launch(device_id, x_shape, pool.output_size(x_shape[2], x_shape[3]), pool.kernel,
                                         pool.stride, pool.padding, pool.dilation, None)
    c_size = ctypes.c_int32(int(size)) if size.dtype.itemsize == 4 else ctypes.c_int64(int(size))
    return PreparedLaunch(fn, grid, block, 0, (ctypes.c_void_p(x), ctypes.c_void_p(0), c_size), device_id)


def _pool_launch(device_id: int, x_shape: Tuple[int, ...], out_hw: Tuple[int, ...], kernel: IntPair,
                 stride: IntPair, pad_top_left: IntPair, dilation: IntPair,
                 flat: Optional[bool]) -> Tuple[Any, Tuple[int, ...], Tuple[int, ...], Any]:
    """(kernel, grid, block, its size argument) of one pool launch (launch_max_pool says which kernel)."""
    import cupy
    import numpy as np

    n, c, in_h, in_w = x_shape
    out_h, out_w = out_hw
    sizes = tuple(kernel), tuple(stride), tuple(pad_top_left), tuple(dilation), (in_h, in_w), (out_h, out_w)
    outputs = n * c * out_h * out_w
    if flat and outputs >= 2**31:
        raise ValueError(f"max pool: sc_max_pool2d_flat indexes outputs in 32 bits, got {outputs}")
    flat = outputs < 2**31 if flat is None else flat
    name = "sc_max_pool2d_flat" if flat else "sc_max_pool2d"
    key = (device_id, name, *sizes)
    if key not in _kernels:
        _kernels[key] = cupy.RawKernel(pool_source(*sizes), name)
    if flat:
        return _kernels[key], (-(-outputs // 256),), (256,), np.int32(outputs)
    # Up to 256 threads per plane, fewer for smaller planes.
    threads = min(256, 32 * -(-(out_h * out_w) // 32))
    return (_kernels[key], (min(-(-(out_h * out_w) // threads), 1024), min(n * c, 65535)), (threads,),
            np.int64(n * c))
