"""The larger non-conv ONNX operators of `sparseconv run`: Resize,
ConvTranspose, Slice, ReduceMean/Sum/Max, Cast, Pad, LayerNormalization,
InstanceNormalization, Erf, Split, DepthToSpace/SpaceToDepth.

Each is written once for an array module `xp` (CuPy for the GPU run, NumPy
for the float64 reference), like the small ones in runner.OPS. Index and
weight tables (Resize) and slice bounds are computed on the host in NumPy,
so both runs use the same coordinates. Shape values (int64 NumPy
arrays from Shape/Gather/...) stay on the host.

`check(op, attrs)` says why a node's attributes are beyond what these
implement; the runner calls it when the model is loaded, before any compile.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .dense import torch_matmul_into, torch_with_cuda


def host(a: Any) -> np.ndarray:
    """An array on the host (CuPy arrays are copied back)."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


# fp32 matrix product for a CUDA-graph capture without torch (CuPy refuses cuBLAS there):
# 16x16 output tiles per block, the K axis staged through shared memory,
# batch on blockIdx.z. Each output sums its K products in order with fmaf.
_MATMUL_SOURCE = r"""
extern "C" __global__ void sc_matmul(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                                     int m, int n, int k) {
    __shared__ float ta[16][17], tb[16][17];
    const int bz = blockIdx.z, row = blockIdx.y * 16 + threadIdx.y, col = blockIdx.x * 16 + threadIdx.x;
    a += (long long)bz * m * k; b += (long long)bz * k * n; c += (long long)bz * m * n;
    float acc = 0.0f;
    for (int k0 = 0; k0 < k; k0 += 16) {
        const int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        ta[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? a[(long long)row * k + ka] : 0.0f;
        tb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? b[(long long)kb * n + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 16; ++j) acc = fmaf(ta[threadIdx.y][j], tb[j][threadIdx.x], acc);
        __syncthreads();
    }
    if (row < m && col < n) c[(long long)row * n + col] = acc;
}
"""
_matmul_kernel: Any = None


def matmul(xp: Any, a: Any, b: Any) -> Any:
    """a @ b with NumPy semantics. On the GPU, float32 operands go through
    torch's cuBLAS in strict fp32 where torch has CUDA (dense.torch_matmul_into;
    eagerly too, so that its cuBLAS handle exists before any capture); else
    through xp's matmul (cuBLAS) or, while a CUDA graph is being captured
    (CuPy does not allow cuBLAS then), a small kernel of our own."""
    global _matmul_kernel
    if xp is np or not hasattr(xp, "cuda") or a.dtype != np.float32 or b.dtype != np.float32:
        return xp.matmul(a, b)
    through_torch = torch_with_cuda() is not None
    if not through_torch and not xp.cuda.get_current_stream().is_capturing():
        if _matmul_kernel is None:  # compiled and loaded on the first (eager) GPU call, never inside a capture
            _matmul_kernel = xp.RawKernel(_MATMUL_SOURCE, "sc_matmul")
            _matmul_kernel.compile()
        return xp.matmul(a, b)
    a2 = a.reshape(1, -1) if a.ndim == 1 else a
    b2 = b.reshape(-1, 1) if b.ndim == 1 else b
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    m, k, n = a2.shape[-2], a2.shape[-1], b2.shape[-1]
    if b2.shape[-2] != k:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    out = xp.empty(batch + (m, n), dtype=xp.float32)
    if through_torch:
        torch_matmul_into(a2, b2, out)
    else:
        count = int(np.prod(batch, dtype=np.int64))
        aa = xp.ascontiguousarray(xp.broadcast_to(a2, batch + (m, k))).reshape(count, m, k)
        bb = xp.ascontiguousarray(xp.broadcast_to(b2, batch + (k, n))).reshape(count, k, n)
        _matmul_kernel(((n + 15) // 16, (m + 15) // 16, count), (16, 16, 1),
                       (aa, bb, out.reshape(count, m, n), np.int32(m), np.int32(n), np.int32(k)))
    if a.ndim == 1:
        out = out[..., 0, :]
    if b.ndim == 1:
        out = out[..., 0]
    return out


def is_host_int(a: Any) -> bool:
    """Shape arithmetic: int64 NumPy arrays, kept on the host."""
    return isinstance(a, np.ndarray) and a.dtype.kind in "iub"


def text(v: Any, default: str) -> str:
    v = default if v is None else v
    return v.decode() if isinstance(v, bytes) else str(v)


_RESIZE_COORDS = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
                  "half_pixel_symmetric")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def check(op: str, attrs: Dict[str, Any]) -> Optional[str]:
    """Why this node cannot run (None when it can)."""
    if op == "Resize":
        mode = text(attrs.get("mode"), "nearest")
        coord = text(attrs.get("coordinate_transformation_mode"), "half_pixel")
        if mode not in ("nearest", "linear"):
            return f"Resize mode {mode!r} is not supported (nearest and linear are)"
        if coord not in _RESIZE_COORDS:
            return f"Resize coordinate_transformation_mode {coord!r} is not supported ({', '.join(_RESIZE_COORDS)} are)"
        if text(attrs.get("nearest_mode"), "round_prefer_floor") not in _NEAREST:
            return f"Resize nearest_mode {text(attrs['nearest_mode'], '')!r} is not supported"
        if int(attrs.get("antialias", 0)):
            return "Resize antialias=1 is not supported"
        if text(attrs.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
            return "Resize keep_aspect_ratio_policy other than 'stretch' is not supported"
    if op == "ConvTranspose":
        if text(attrs.get("auto_pad"), "NOTSET") not in ("NOTSET", ""):
            return "ConvTranspose auto_pad is not supported; export with explicit pads"
        if "output_shape" in attrs:
            return "ConvTranspose output_shape is not supported; export with explicit pads and output_padding"
    if op in ("DepthToSpace", "SpaceToDepth") and text(attrs.get("mode"), "DCR") not in ("DCR", "CRD"):
        return f"{op} mode {text(attrs['mode'], '')!r} is not an ONNX value"
    if op == "Upsample" and text(attrs.get("mode"), "nearest") not in ("nearest", "linear"):
        return f"Upsample mode {text(attrs['mode'], '')!r} is not supported (nearest and linear are)"
    if op == "Pad" and text(attrs.get("mode"), "constant") != "constant":
        return f"Pad mode {text(attrs['mode'], '')!r} is not supported (constant is)"
    return None


# --------------------------------------------------------------------------- Resize

def _source_coords(coord: str, out_len: int, in_len: int, scale: float) -> np.ndarray:
    """ONNX Resize: the input coordinate of each output position, in float64
    as onnx's reference implementation computes it. (Where a coordinate
    lands exactly on a pixel boundary, floor/ceil rounding depends on the
    last bit; onnxruntime's float32 arithmetic can pick the neighbour there.)"""
    x = np.arange(out_len, dtype=np.float64)
    if coord == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if coord == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros_like(x)
    if coord == "align_corners":
        return x * (in_len - 1) / (out_len - 1) if out_len > 1 else np.zeros_like(x)
    if coord == "asymmetric":
        return x / scale
    if coord == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    # half_pixel_symmetric (opset 19)
    adjustment = out_len / (scale * in_len)
    return in_len / 2 * (1 - adjustment) + (x + 0.5) / scale - 0.5


def _nearest(src: np.ndarray, mode: str) -> np.ndarray:
    if mode == "floor":
        return np.floor(src)
    if mode == "ceil":
        return np.ceil(src)
    half = src - np.floor(src) == 0.5
    if mode == "round_prefer_ceil":
        return np.where(half, np.ceil(src), np.round(src))
    return np.where(half, np.floor(src), np.round(src))


def resize(xp: Any, x: Any, roi: Any, scales: Any, sizes: Any, attrs: Dict[str, Any]) -> Any:
    """ONNX Resize (opset 11-19), nearest or (multi)linear, one axis at a time
    (both modes are separable)."""
    mode = text(attrs.get("mode"), "nearest")
    coord = text(attrs.get("coordinate_transformation_mode"), "half_pixel")
    nearest_mode = text(attrs.get("nearest_mode"), "round_prefer_floor")
    axes = [int(a) % x.ndim for a in attrs.get("axes", range(x.ndim))]
    in_shape = [int(d) for d in x.shape]
    scale_of = {a: 1.0 for a in range(x.ndim)}
    out_of = dict(enumerate(in_shape))
    if sizes is not None and host(sizes).size:
        for a, n in zip(axes, host(sizes).astype(np.int64).tolist()):
            out_of[a], scale_of[a] = int(n), n / in_shape[a]
    else:
        for a, s in zip(axes, host(scales).astype(np.float64).tolist()):
            scale_of[a], out_of[a] = float(s), int(np.floor(in_shape[a] * s))
    for a in range(x.ndim):
        if out_of[a] == in_shape[a] and scale_of[a] == 1.0:
            continue
        src = _source_coords(coord, out_of[a], in_shape[a], scale_of[a])
        shape = [1] * x.ndim
        shape[a] = out_of[a]
        if mode == "nearest":
            idx = np.clip(_nearest(src, nearest_mode), 0, in_shape[a] - 1).astype(np.int64)
            x = xp.take(x, xp.asarray(idx), axis=a)
        else:
            lo = np.floor(src)
            frac = (src - lo).reshape(shape)
            i0 = np.clip(lo, 0, in_shape[a] - 1).astype(np.int64)
            i1 = np.clip(lo + 1, 0, in_shape[a] - 1).astype(np.int64)
            w = xp.asarray(frac, dtype=x.dtype)
            x = xp.take(x, xp.asarray(i0), axis=a) * (1 - w) + xp.take(x, xp.asarray(i1), axis=a) * w
    return x


# --------------------------------------------------------------------------- ConvTranspose

def conv_transpose(xp: Any, x: Any, w: Any, b: Any, attrs: Dict[str, Any]) -> Any:
    """ONNX ConvTranspose (2-D), dense: one batched matmul per kernel tap,
    scattered into the strided output. Not a sparseconv kernel."""
    n, c, h, wd = x.shape
    g = int(attrs.get("group", 1))
    cg, kg, kh, kw = w.shape[0] // g, w.shape[1], w.shape[2], w.shape[3]
    sh, sw = (int(v) for v in attrs.get("strides", (1, 1)))
    dh, dw = (int(v) for v in attrs.get("dilations", (1, 1)))
    top, left, bottom, right = (int(v) for v in attrs.get("pads", (0, 0, 0, 0)))
    oph, opw = (int(v) for v in attrs.get("output_padding", (0, 0)))
    full_h, full_w = (h - 1) * sh + dh * (kh - 1) + 1 + oph, (wd - 1) * sw + dw * (kw - 1) + 1 + opw
    out = xp.zeros((n, g * kg, full_h, full_w), dtype=x.dtype)
    xg = x.reshape(n, g, cg, h * wd)
    wg = w.reshape(g, cg, kg, kh, kw)
    for r in range(kh):
        for s in range(kw):
            tap = matmul(xp, wg[:, :, :, r, s].transpose(0, 2, 1), xg)  # (n, g, kg, h*w)
            out[:, :, r * dh:r * dh + (h - 1) * sh + 1:sh, s * dw:s * dw + (wd - 1) * sw + 1:sw] += \
                tap.reshape(n, g * kg, h, wd)
    out = out[:, :, top:full_h - bottom, left:full_w - right]
    return out if b is None else out + b.reshape(1, -1, 1, 1)


# --------------------------------------------------------------------------- shape and reductions

def slice_(xp: Any, x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> Any:
    """ONNX Slice (opset 10+): bounds on the host, clamped as Python slices are."""
    starts, ends = host(starts).astype(np.int64).tolist(), host(ends).astype(np.int64).tolist()
    axes_l = list(range(len(starts))) if axes is None else host(axes).astype(np.int64).tolist()
    steps_l = [1] * len(starts) if steps is None else host(steps).astype(np.int64).tolist()
    index: List[Any] = [slice(None)] * x.ndim
    big = 2 ** 62  # INT64_MAX / INT64_MIN style "to the end" bounds
    for a, s, e, st in zip(axes_l, starts, ends, steps_l):
        s = max(min(s, big), -big)
        e = max(min(e, big), -big)
        index[int(a) % x.ndim] = slice(s, e, st)
    return x[tuple(index)]


def axes_of(attrs: Dict[str, Any], axes: Any) -> Optional[List[int]]:
    """Axes from the input (newer opsets) or the attribute (older ones)."""
    if axes is not None:
        return host(axes).astype(np.int64).tolist()
    return None if "axes" not in attrs else [int(a) for a in attrs["axes"]]


def reduce(xp: Any, fn: str, x: Any, attrs: Dict[str, Any], axes: Any = None) -> Any:
    ax = axes_of(attrs, axes)
    keep = bool(int(attrs.get("keepdims", 1)))
    if not ax:
        if int(attrs.get("noop_with_empty_axes", 0)):
            return x
        ax = list(range(x.ndim))
    mod = np if is_host_int(x) else xp
    return getattr(mod, fn)(x, axis=tuple(int(a) % x.ndim for a in ax), keepdims=keep)


def squeeze(x: Any, axes: Optional[Sequence[int]]) -> Any:
    if axes is None:
        return x.reshape(tuple(d for d in x.shape if d != 1))
    drop = {int(a) % x.ndim for a in axes}
    return x.reshape(tuple(d for i, d in enumerate(x.shape) if i not in drop))


def cast(xp: Any, x: Any, to: int) -> Any:
    """Cast. Float tensors keep the run's float type (float32 on the GPU,
    float64 in the reference); shape values stay host NumPy."""
    from onnx import helper

    target = np.dtype(helper.tensor_dtype_to_np_dtype(to))
    if isinstance(x, np.ndarray) and (is_host_int(x) or target.kind in "iub"):
        return x.astype(target)
    if target.kind == "f":
        return x if x.dtype.kind == "f" else x.astype(xp.float64 if xp is np else xp.float32)
    return x.astype(target)


def pad(xp: Any, x: Any, pads: Any, value: Any = None, axes: Any = None) -> Any:
    """ONNX Pad, constant mode; negative pads crop."""
    p = host(pads).astype(np.int64).tolist()
    ax = list(range(x.ndim)) if axes is None else [int(a) % x.ndim for a in host(axes).tolist()]
    k = len(ax)
    fill = 0.0 if value is None or host(value).size == 0 else float(host(value).reshape(-1)[0])
    before, after = [0] * x.ndim, [0] * x.ndim
    for i, a in enumerate(ax):
        before[a], after[a] = p[i], p[i + k]
    crop = tuple(slice(-b if b < 0 else 0, d + a if a < 0 else d) for b, a, d in zip(before, after, x.shape))
    x = x[crop]
    out = xp.full(tuple(d + max(b, 0) + max(a, 0) for d, b, a in zip(x.shape, before, after)), fill, dtype=x.dtype)
    out[tuple(slice(max(b, 0), max(b, 0) + d) for b, d in zip(before, x.shape))] = x
    return out


def layer_norm(xp: Any, x: Any, scale: Any, bias: Any, attrs: Dict[str, Any]) -> Any:
    """ONNX LayerNormalization (opset 17): over the axes from `axis` on."""
    axes = tuple(range(int(attrs.get("axis", -1)) % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / xp.sqrt(var + float(attrs.get("epsilon", 1e-5))) * scale
    return y if bias is None else y + bias


def erf(xp: Any, x: Any) -> Any:
    """The error function: cupyx.scipy.special on the GPU; on the CPU SciPy's
    when installed, else math.erf element by element (the reference only)."""
    if xp is np:
        try:
            from scipy.special import erf as scipy_erf
        except ImportError:
            import math

            return np.vectorize(math.erf, otypes=[x.dtype])(x)
        return scipy_erf(x)
    from cupyx.scipy.special import erf as cupy_erf

    return cupy_erf(x)


def gelu(xp: Any, x: Any, approximate: str) -> Any:
    """ONNX Gelu (opset 20): exact (erf) or the tanh approximation."""
    if approximate == "tanh":
        return 0.5 * x * (1 + xp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + erf(xp, x / np.sqrt(2)))


def instance_norm(xp: Any, x: Any, scale: Any, bias: Any, eps: float) -> Any:
    """ONNX InstanceNormalization: per image and channel over the spatial axes."""
    axes = tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / xp.sqrt(var + eps) * scale.reshape(shape) + bias.reshape(shape)


def split(xp: Any, x: Any, split_sizes: Any, attrs: Dict[str, Any], n_out: int) -> tuple:
    """ONNX Split: sizes from the input (opset 13+) or attribute, else equal
    parts (the last one smaller, as opset 18 allows)."""
    axis = int(attrs.get("axis", 0)) % x.ndim
    if split_sizes is not None:
        sizes = host(split_sizes).astype(np.int64).tolist()
    elif "split" in attrs:
        sizes = [int(v) for v in attrs["split"]]
    else:
        part = -(-x.shape[axis] // n_out)
        sizes = [min(part, x.shape[axis] - i * part) for i in range(n_out)]
    bounds = np.cumsum([0] + sizes)
    index: List[Any] = [slice(None)] * x.ndim
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        index[axis] = slice(int(lo), int(hi))
        outs.append(x[tuple(index)])
    return tuple(outs)


def depth_to_space(x: Any, bs: int, mode: str) -> Any:
    b, c, h, w = x.shape
    if mode == "CRD":
        y = x.reshape(b, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:  # DCR
        y = x.reshape(b, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    return y.reshape(b, c // (bs * bs), h * bs, w * bs)


def space_to_depth(x: Any, bs: int) -> Any:
    b, c, h, w = x.shape
    y = x.reshape(b, c, h // bs, bs, w // bs, bs).transpose(0, 3, 5, 1, 2, 4)
    return y.reshape(b, c * bs * bs, h // bs, w // bs)
