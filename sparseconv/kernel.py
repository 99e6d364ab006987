"""The user-facing callable: compile_conv2d(...) -> Conv2dKernel; kernel(x) -> y."""
from __future__ import annotations

import time
from typing import Any, Optional, Tuple, Union

import numpy as np

from .assemble import device_target, load_kernel
from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache
from .shapes import IntPair, Tiling, shape_from_weight

MAX_GRID_Z = 65535  # gridDim.z limit: bigger batches are launched in slices


def _host_array(a: Any, what: str) -> np.ndarray:
    """NumPy copy of a weight/bias given as NumPy, CuPy or torch."""
    if hasattr(a, "detach"):            # torch.Tensor
        a = a.detach().cpu().numpy()
    elif hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):  # cupy.ndarray
        a = a.get()
    arr = np.asarray(a)
    if arr.dtype.kind != "f":
        raise TypeError(f"{what} must be a floating-point array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


class Conv2dKernel:
    """A pruned conv layer compiled to a specialised kernel on one GPU.

    kernel(x, out=None, stream=None) -> y, with x an (N, C, H, W) float32
    C-contiguous CUDA array (CuPy, or anything with __cuda_array_interface__ /
    DLPack such as a torch tensor) and y a CuPy (N, K, Ho, Wo) array. The launch
    is asynchronous on `stream` (default: CuPy's current stream)."""

    def __init__(self, layer: CompiledLayer, bias: Optional[np.ndarray]) -> None:
        import cupy

        self.layer = layer
        self.shape = layer.shape
        self.device_id = cupy.cuda.Device().id
        self._module, self._function = load_kernel(layer.artifact, layer.artifact_suffix, layer.entry)
        k = layer.shape.out_channels
        self._bias = cupy.asarray(bias if bias is not None else np.zeros(k, np.float32), dtype=cupy.float32)
        self.stats = dict(layer.stats)

    @property
    def out_channels(self) -> int:
        return self.shape.out_channels

    def output_shape(self, batch: int) -> Tuple[int, int, int, int]:
        return (batch, self.shape.out_channels, self.shape.out_h, self.shape.out_w)

    def _check_input(self, x: Any) -> Any:
        import cupy

        if isinstance(x, np.ndarray):
            raise TypeError(f"{self.layer.name}: x is a NumPy (host) array; pass a CUDA array, "
                            "e.g. cupy.asarray(x)")
        if not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")):
            raise TypeError(f"{self.layer.name}: x must be a CUDA array (CuPy array or CUDA torch tensor), "
                            f"got {type(x).__name__}")
        if hasattr(x, "requires_grad") and getattr(x, "requires_grad"):
            raise ValueError(f"{self.layer.name}: x requires grad; sparseconv kernels are inference-only "
                             "(use torch.no_grad() or x.detach())")
        if hasattr(x, "is_cuda") and not x.is_cuda:
            raise TypeError(f"{self.layer.name}: x is a CPU tensor; move it to the GPU first (x.cuda())")
        x = x if isinstance(x, cupy.ndarray) else cupy.asarray(x)
        if x.device.id != self.device_id:
            raise ValueError(f"{self.layer.name}: x is on GPU {x.device.id}, the kernel was loaded on GPU "
                             f"{self.device_id}")
        if x.dtype != cupy.float32:
            raise TypeError(f"{self.layer.name}: x must be float32, got {x.dtype}")
        s = self.shape
        if x.ndim != 4 or tuple(x.shape[1:]) != (s.in_channels, s.in_h, s.in_w):
            raise ValueError(f"{self.layer.name}: x must have shape (N, {s.in_channels}, {s.in_h}, {s.in_w}), "
                             f"got {tuple(x.shape)}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.layer.name}: x must be C-contiguous (NCHW); use cupy.ascontiguousarray(x)")
        return x

    def _check_out(self, out: Any, x: Any) -> Any:
        import cupy

        want = self.output_shape(x.shape[0])
        if not isinstance(out, cupy.ndarray):
            raise TypeError(f"{self.layer.name}: out must be a cupy.ndarray, got {type(out).__name__}")
        if out.dtype != cupy.float32 or tuple(out.shape) != want or not out.flags.c_contiguous:
            raise ValueError(f"{self.layer.name}: out must be a C-contiguous float32 array of shape {want}, "
                             f"got {out.dtype} {tuple(out.shape)}"
                             f"{'' if out.flags.c_contiguous else ' (not contiguous)'}")
        if out.device.id != self.device_id:
            raise ValueError(f"{self.layer.name}: out is on GPU {out.device.id}, expected GPU {self.device_id}")
        x_lo, x_hi = x.data.ptr, x.data.ptr + x.nbytes
        o_lo, o_hi = out.data.ptr, out.data.ptr + out.nbytes
        if x_lo < o_hi and o_lo < x_hi:
            raise ValueError(f"{self.layer.name}: out overlaps x; the kernel cannot run in place")
        return out

    def __call__(self, x: Any, out: Any = None, stream: Any = None) -> Any:
        import cupy

        x = self._check_input(x)
        out = cupy.empty(self.output_shape(x.shape[0]), dtype=cupy.float32) if out is None \
            else self._check_out(out, x)
        if x.shape[0] == 0:
            return out
        if stream is not None and not isinstance(stream, cupy.cuda.Stream):
            ptr = getattr(stream, "cuda_stream", None)  # a torch.cuda.Stream
            if not isinstance(ptr, int):
                raise TypeError(f"{self.layer.name}: stream must be a cupy.cuda.Stream or torch.cuda.Stream, "
                                f"got {type(stream).__name__}")
            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            if from_external is not None and hasattr(stream, "__cuda_stream__"):
                stream = from_external(stream)
            else:
                stream = cupy.cuda.ExternalStream(ptr, self.device_id)
        with (stream if stream is not None else cupy.cuda.get_current_stream()):
            self._launch(x, out)
        return out

    def _launch(self, x: Any, out: Any) -> None:
        layer = self.layer
        n = x.shape[0]
        for first in range(0, n, MAX_GRID_Z):
            count = min(MAX_GRID_Z, n - first)
            self._function((layer.grid_tiles, layer.kblocks, count), (layer.tiling.threads, 1, 1),
                           (x[first:first + count], out[first:first + count], self._bias,
                            np.int32(layer.chunks)),
                           shared_mem=layer.shared_bytes)

    def __repr__(self) -> str:
        s = self.stats
        return (f"Conv2dKernel({self.layer.name}: {self.shape.describe()}, {s.get('nonzero_weights')}/"
                f"{s.get('weights')} nonzero weights, {s.get('fmas_deleted')} FMAs deleted)")


def compile_conv2d(weight: Any, *, input_size: IntPair, bias: Any = None, stride: IntPair = 1,
                   padding: IntPair = 0, dilation: IntPair = 1, groups: int = 1,
                   tiling: Optional[Tiling] = None, cache_dir: Union[str, None] = None,
                   name: str = "conv") -> Conv2dKernel:
    """Compile a pruned conv layer into a kernel specialised to its weights.

    weight: (K, C/groups, R, S) floats (NumPy, CuPy or torch), zeros where pruned.
    input_size: (H, W) of the input images. bias: (K,) or None. stride, padding,
    dilation: int or pair, as torch.nn.functional.conv2d. The batch size is free
    at call time. Builds for the current CUDA device; artifacts are cached in
    cache_dir (default: $SPARSECONV_CACHE_DIR or ptx_cache/)."""
    w = _host_array(weight, f"{name}: weight")
    shape = shape_from_weight(w, input_size, stride, padding, dilation, groups)
    b = None
    if bias is not None:
        b = _host_array(bias, f"{name}: bias")
        if b.shape != (shape.out_channels,):
            raise ValueError(f"{name}: bias must have shape ({shape.out_channels},), got {b.shape}")
    layer = build_conv2d(w, shape, tiling=tiling, target=device_target(), cache=ArtifactCache(cache_dir),
                         name=name)
    t = time.perf_counter()
    kernel = Conv2dKernel(layer, b)
    kernel.stats["seconds"] = dict(kernel.stats["seconds"], load=time.perf_counter() - t)
    return kernel
