"""The user-facing callable: compile_conv2d(...) -> Conv2dKernel; kernel(x) -> y."""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .assemble import device_target, load_kernel
from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache
from .shapes import ConvShape, IntPair, Tiling, default_tiling, shape_from_weight

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


def as_cupy_stream(stream: Any, device_id: int, what: str) -> Any:
    """A cupy.cuda.Stream for a CuPy or torch.cuda stream (same stream, no copy)."""
    import cupy

    if isinstance(stream, cupy.cuda.Stream):
        return stream
    ptr = getattr(stream, "cuda_stream", None)  # a torch.cuda.Stream
    if not isinstance(ptr, int):
        raise TypeError(f"{what}: stream must be a cupy.cuda.Stream or torch.cuda.Stream, "
                        f"got {type(stream).__name__}")
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14 prefers it
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(ptr, device_id)


class Conv2dKernel:
    """A pruned conv layer compiled to a specialised kernel on one GPU.

    kernel(x, out=None, stream=None) -> y, with x an (N, C, H, W) float32
    C-contiguous CUDA array (CuPy, or anything with __cuda_array_interface__ /
    DLPack such as a torch tensor) and y a CuPy (N, K, Ho, Wo) array. The launch
    is asynchronous on `stream` (default: CuPy's current stream)."""

    backend = "sparseconv"

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
        if stream is not None:
            stream = as_cupy_stream(stream, self.device_id, self.layer.name)
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
        return (f"{type(self).__name__}({self.layer.name}: {self.shape.describe()}, {s.get('nonzero_weights')}/"
                f"{s.get('weights')} nonzero weights, {s.get('fmas_deleted')} FMAs deleted, "
                f"backend {self.backend})")


class DenseConv2dKernel(Conv2dKernel):
    """What backend="auto" returns where cuDNN measured faster than the
    specialised kernel: the same call contract, computed by torch's conv2d in
    strict fp32 on the same stream."""

    backend = "dense"

    def __init__(self, layer: CompiledLayer, bias: Optional[np.ndarray], weight: np.ndarray) -> None:
        from .dense import dense_conv2d

        super().__init__(layer, bias)
        dense = dense_conv2d(weight, bias, layer.shape)
        if dense is None:
            raise RuntimeError(f"{layer.name}: the dense path needs torch with CUDA")
        self._dense = dense

    def _launch(self, x: Any, out: Any) -> None:
        self._dense(x, out)


def compile_conv2d(weight: Any, *, input_size: IntPair, bias: Any = None, stride: IntPair = 1,
                   padding: IntPair = 0, dilation: IntPair = 1, groups: int = 1,
                   tiling: Union[Tiling, str, None] = None, backend: str = "sparseconv",
                   tune_batch: int = 64, cache_dir: Union[str, None] = None,
                   name: str = "conv") -> Conv2dKernel:
    """Compile a pruned conv layer into a kernel specialised to its weights.

    weight: (K, C/groups, R, S) floats (NumPy, CuPy or torch), zeros where pruned.
    input_size: (H, W) of the input images. bias: (K,) or None. stride, padding,
    dilation: int or pair, as torch.nn.functional.conv2d. The batch size is free
    at call time. Builds for the current CUDA device; artifacts are cached in
    cache_dir (default: $SPARSECONV_CACHE_DIR or ptx_cache/).

    tiling: None (the default heuristic), a Tiling, or "auto": time a bounded
    set of candidate tilings at batch `tune_batch` and keep the fastest.
    backend: "sparseconv", or "auto" (opt-in): also time cuDNN strict fp32
    (needs torch) and return a DenseConv2dKernel where it was faster. Tuning
    results are cached, so a second compile does not tune again;
    kernel.stats["tuning"] holds the times and the choice."""
    if backend not in ("sparseconv", "auto"):
        raise ValueError(f"{name}: backend must be 'sparseconv' or 'auto', got {backend!r}")
    if isinstance(tiling, str) and tiling != "auto":
        raise ValueError(f"{name}: tiling must be a Tiling, None or 'auto', got {tiling!r}")
    if not isinstance(tune_batch, int) or tune_batch < 1:
        raise ValueError(f"{name}: tune_batch must be a positive int, got {tune_batch!r}")
    w = _host_array(weight, f"{name}: weight")
    shape = shape_from_weight(w, input_size, stride, padding, dilation, groups)
    b = None
    if bias is not None:
        b = _host_array(bias, f"{name}: bias")
        if b.shape != (shape.out_channels,):
            raise ValueError(f"{name}: bias must have shape ({shape.out_channels},), got {b.shape}")
    cache, target = ArtifactCache(cache_dir), device_target()
    tuning = None
    if tiling == "auto" or backend == "auto":
        from .tune import DENSE, tune_conv2d

        candidates = None if tiling == "auto" else [tiling or default_tiling(shape)]
        layer, tuning = tune_conv2d(w, shape, b, target=target, cache=cache, name=name, batch=tune_batch,
                                    tilings=candidates, consider_dense=backend == "auto")
    else:
        layer = build_conv2d(w, shape, tiling=tiling, target=target, cache=cache, name=name)
    t = time.perf_counter()
    kernel = DenseConv2dKernel(layer, b, w) if tuning and tuning.backend == DENSE else Conv2dKernel(layer, b)
    kernel.stats["seconds"] = dict(kernel.stats["seconds"], load=time.perf_counter() - t)
    if tuning is not None:
        kernel.stats["tuning"] = tuning.as_dict()
    return kernel


def compile_layers(layers: Sequence[Tuple[str, np.ndarray, Optional[np.ndarray], ConvShape]], *,
                   tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
                   cache_dir: Optional[str] = None, jobs: Optional[int] = None,
                   progress: bool = False) -> Dict[str, Conv2dKernel]:
    """Compile and load many (name, weight, bias, shape) layers on the current
    GPU; name -> kernel. Without tuning they build in parallel (a process pool);
    with tiling="auto" or backend="auto" each layer's candidates build in
    parallel, one layer after another, then are timed."""
    from .parallel import LayerJob, build_many

    kernels: Dict[str, Conv2dKernel] = {}
    if tiling == "auto" or backend == "auto":
        for name, w, b, shape in layers:
            kernels[name] = compile_conv2d(w, input_size=(shape.in_h, shape.in_w), bias=b, stride=shape.stride,
                                           padding=shape.padding, dilation=shape.dilation, groups=shape.groups,
                                           tiling=tiling, backend=backend, tune_batch=tune_batch,
                                           cache_dir=cache_dir, name=name)
        return kernels
    built = build_many([LayerJob(name, w, shape) for name, w, _, shape in layers], target=device_target(),
                       cache_dir=cache_dir, workers=jobs, progress=progress)
    for name, _, b, _ in layers:
        t = time.perf_counter()
        kernels[name] = Conv2dKernel(built[name], b)
        kernels[name].stats["seconds"] = dict(kernels[name].stats["seconds"], load=time.perf_counter() - t)
    return kernels
