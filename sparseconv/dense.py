"""The dense paths, shared by the runner, the tuner and the benchmark.

* im2col / conv2d_im2col: a float64 convolution by im2col + GEMM for NumPy or
  CuPy (`xp`): the dense reference of `sparseconv run --check` and of the
  benchmark's baselines.
* dense_conv2d: cuDNN through torch in strict fp32 (TF32 off), the path
  backend="auto" falls back to; torch_matmul_into: cuBLAS through torch in
  strict fp32, the ONNX runner's matrix products.
* fold_batchnorm / epilogue_reference: the numbers of BN folding and of a
  fused epilogue, shared by the torch.fx and the ONNX front ends.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from .shapes import ConvShape, Epilogue


def im2col(x: Any, shape: ConvShape, xp: Any = np) -> Any:
    """(N, C, H, W) -> (C*R*S, N*Ho*Wo) columns, rows ordered (c, r, s) as the
    weight's flattening, columns (n, ho, wo). Works with NumPy or CuPy (`xp`);
    the benchmark's timed im2col is the one-launch GPU kernel below, checked
    against this one through the float64 reference."""
    s = shape
    n = x.shape[0]
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    xpad = xp.zeros((n, s.in_channels, s.in_h + 2 * ph, s.in_w + 2 * pw), dtype=x.dtype)
    xpad[:, :, ph:ph + s.in_h, pw:pw + s.in_w] = x
    cols = xp.empty((s.in_channels, s.kernel_h, s.kernel_w, n, s.out_h, s.out_w), dtype=x.dtype)
    for r in range(s.kernel_h):
        for q in range(s.kernel_w):
            rows = slice(r * dh, r * dh + sh * (s.out_h - 1) + 1, sh)
            colz = slice(q * dw, q * dw + sw * (s.out_w - 1) + 1, sw)
            cols[:, r, q] = xpad[:, :, rows, colz].transpose(1, 0, 2, 3)
    return cols.reshape(s.in_channels * s.kernel_h * s.kernel_w, n * s.out_h * s.out_w)


def columns_to_nchw(y: Any, batch: int, shape: ConvShape) -> Any:
    """(K, N*Ho*Wo) GEMM output (either memory order) -> logical (N, K, Ho, Wo)."""
    return y.reshape(shape.out_channels, batch, shape.out_h, shape.out_w).transpose(1, 0, 2, 3)


def conv2d_im2col(x: Any, w: Any, shape: ConvShape, bias: Any = None, xp: Any = np) -> Any:
    """float64 convolution by im2col + GEMM, one GEMM per group: the reference
    for the baselines (and for sparseconv when torch is missing)."""
    x64 = xp.asarray(x, dtype=xp.float64)
    cols = im2col(x64, shape, xp)
    g = shape.groups
    w64 = xp.asarray(w, dtype=xp.float64).reshape(g, shape.k_per_group, -1)
    y = xp.matmul(w64, cols.reshape(g, -1, cols.shape[1])).reshape(shape.out_channels, -1)
    y = columns_to_nchw(y, x.shape[0], shape)
    if bias is not None:
        y = y + xp.asarray(bias, dtype=xp.float64)[None, :, None, None]
    return y


def fold_batchnorm(weight: np.ndarray, bias: Optional[np.ndarray], gamma: np.ndarray, beta: np.ndarray,
                   mean: np.ndarray, var: np.ndarray, eps: float) -> Tuple[np.ndarray, np.ndarray]:
    """A conv's weight (K, ...) and bias (K,) or None with an eval-mode
    BatchNorm after it folded in, in float64: w' = w * s per output channel,
    b' = (b - mean) * s + beta, s = gamma / sqrt(var + eps). A zero weight
    stays zero (the sparsity is unchanged) unless s is not finite: callers
    check the result is finite."""
    var64 = np.asarray(var, np.float64)
    scale = np.asarray(gamma, np.float64) / np.sqrt(var64 + float(eps))
    w = np.asarray(weight, np.float64) * scale.reshape((-1,) + (1,) * (np.ndim(weight) - 1))
    b = np.zeros_like(var64) if bias is None else np.asarray(bias, np.float64)
    return w, (b - np.asarray(mean, np.float64)) * scale + np.asarray(beta, np.float64)


def epilogue_reference(y: Any, epilogue: Epilogue, residual: Any = None) -> Any:
    """What a kernel's fused epilogue does after conv + bias, in y's dtype:
    add the residual, then clamp (ReLU, ReLU6, clip), then the 2x2 max pool
    (Epilogue.pool, floor mode). y: (N, K, H, W), NumPy or CuPy."""
    if residual is not None:
        y = y + residual
    lo, hi = epilogue.bounds
    y = y if lo is None and hi is None else np.clip(y, lo, hi)
    return max_pool_2x2(y) if epilogue.pool else y


def max_pool_2x2(y: Any) -> Any:
    """The 2x2 max pool of stride 2 of y (N, K, H, W), floor mode, as
    nn.MaxPool2d(2, 2): the reference side of Epilogue.pool."""
    n, k, h, w = y.shape
    return y[:, :, :h // 2 * 2, :w // 2 * 2].reshape(n, k, h // 2, 2, w // 2, 2).max(axis=(3, 5))


@contextlib.contextmanager
def torch_flags(torch: Any, tf32: bool, cudnn_benchmark: bool) -> Iterator[None]:
    """Set TF32 (cuDNN and cuBLAS) and cudnn.benchmark; restore them afterwards."""
    import warnings

    flags = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (flags[0].allow_tf32, flags[1].allow_tf32, flags[0].benchmark)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer torch nudges towards fp32_precision; the legacy flags still rule
        flags[0].allow_tf32, flags[1].allow_tf32, flags[0].benchmark = tf32, tf32, cudnn_benchmark
        try:
            yield
        finally:
            flags[0].allow_tf32, flags[1].allow_tf32, flags[0].benchmark = saved


def torch_with_cuda() -> Any:
    """torch, where it is installed with CUDA; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_stream(torch: Any, dev: Any) -> Any:
    """torch's view of CuPy's current stream (a capture's stream included)."""
    import cupy

    ptr = cupy.cuda.get_current_stream().ptr
    return torch.cuda.default_stream(dev) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=dev)


def dense_conv2d(weight: np.ndarray, bias: Optional[np.ndarray], shape: ConvShape) -> Optional[Callable[..., Any]]:
    """f(x_cupy, out_cupy): cuDNN strict fp32 through torch on CuPy's current
    stream, or None when torch (with CUDA) is not installed."""
    torch = torch_with_cuda()
    if torch is None:
        return None
    import cupy

    dev = torch.device("cuda", cupy.cuda.Device().id)
    # Copies: torch refuses to share read-only NumPy memory.
    w = torch.from_numpy(np.array(weight, np.float32)).to(dev)
    b = None if bias is None else torch.from_numpy(np.array(bias, np.float32)).to(dev)

    def run(x: Any, out: Any) -> None:
        # TF32 off: exact fp32, like the sparse kernel.
        with torch_flags(torch, tf32=False, cudnn_benchmark=torch.backends.cudnn.benchmark), \
                torch.cuda.stream(_torch_stream(torch, dev)), torch.no_grad():
            y = torch.nn.functional.conv2d(torch.from_dlpack(x), w, b, shape.stride, shape.padding,
                                           shape.dilation, shape.groups)
            torch.from_dlpack(out).copy_(y)
    return run


def torch_matmul_into(a: Any, b: Any, out: Any) -> bool:
    """out = a @ b for CuPy float32 arrays (a (..., m, k), b (..., k, n), out
    of their broadcast shape (..., m, n)) through torch's cuBLAS in strict
    fp32 on CuPy's current stream; False, with nothing done, where torch with
    CUDA is missing. Inside a CUDA-graph capture CuPy refuses cuBLAS, and the
    runner's own small kernel (onnx_ops.matmul) took VGG-16's dense
    classifier at batch 64 ~3.4 ms more than cuBLAS (docs/PERFORMANCE.md,
    session 32). Whatever torch allocates in a capture (cuBLAS's workspace)
    must go to a pool of the graph's own (runner.SparseModel._torch_pool)."""
    torch = torch_with_cuda()
    if torch is None:
        return False
    dev = torch.device("cuda", out.device.id)
    with torch_flags(torch, tf32=False, cudnn_benchmark=torch.backends.cudnn.benchmark), \
            torch.cuda.stream(_torch_stream(torch, dev)), torch.no_grad():
        torch.matmul(torch.from_dlpack(a), torch.from_dlpack(b), out=torch.from_dlpack(out))
    return True
