"""The user-facing callable: compile_conv2d(...) -> Conv2dKernel; kernel(x) -> y."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .assemble import device_target, load_kernel
from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache
from .shapes import ANY_BATCH, ConvShape, Epilogue, IntPair, Tiling, batch_variants, default_tiling, shape_from_weight



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


# Adds the partial sums of a split reduction (Tiling.slices) in slice order,
# so results are the same run to run, then applies the epilogue. Plain fp32,
# compiled once per process by NVRTC (no weights in it).
_REDUCE_SOURCE = r"""
extern "C" __global__ void sc_reduce_slices(const float* __restrict__ ws, float* __restrict__ y,
        const float* __restrict__ residual, long long total, int slices, int has_residual,
        int has_lo, float lo, int has_hi, float hi)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ws[i];
        for (int s = 1; s < slices; ++s) v += ws[s * total + i];
        if (has_residual) v += residual[i];
        if (has_lo) v = v < lo ? lo : v;
        if (has_hi) v = v > hi ? hi : v;
        y[i] = v;
    }
}
"""
_reduce_kernels: Dict[int, Any] = {}


def _reduce_kernel(device_id: int) -> Any:
    import cupy

    if device_id not in _reduce_kernels:
        _reduce_kernels[device_id] = cupy.RawKernel(_REDUCE_SOURCE, "sc_reduce_slices")
    return _reduce_kernels[device_id]


class Conv2dKernel:
    """A pruned conv layer compiled to a specialised kernel on one GPU.

    kernel(x, out=None, stream=None, residual=None) -> y, with x an (N, C, H, W)
    float32 C-contiguous CUDA array (CuPy, or anything with
    __cuda_array_interface__ / DLPack such as a torch tensor) and y a CuPy
    (N, K, Ho, Wo) array: y = act(conv(x) + bias + residual), the epilogue
    the layer was compiled with. The launch is asynchronous on `stream`
    (default: CuPy's current stream).

    A kernel may hold several compiled variants of the layer, each for batches
    up to a size (e.g. the reduction split over blocks for batch 1, where one
    image gives too few blocks to fill the GPU, unsplit for larger batches);
    the call picks by the batch size."""

    backend = "sparseconv"

    def __init__(self, layer: Union[CompiledLayer, Sequence[Tuple[int, CompiledLayer]]],
                 bias: Optional[np.ndarray]) -> None:
        import cupy

        variants = [(ANY_BATCH, layer)] if isinstance(layer, CompiledLayer) else sorted(layer, key=lambda v: v[0])
        if not variants or variants[-1][0] < ANY_BATCH:
            raise ValueError("the last variant must serve any batch size (ANY_BATCH)")
        self.layer = variants[-1][1]
        self.shape = self.layer.shape
        self.epilogue = self.layer.epilogue
        if any(v.shape != self.shape or v.epilogue != self.epilogue for _, v in variants):
            raise ValueError("variants of a kernel must share the layer shape and epilogue")
        self.device_id = cupy.cuda.Device().id
        # (up_to_batch, layer, function); the module is kept alive beside its function
        loaded = [(up_to, v, load_kernel(v.artifact, v.artifact_suffix, v.entry)) for up_to, v in variants]
        self._variants = [(up_to, v, fn) for up_to, v, (_, fn) in loaded]
        self._modules = [mod for _, _, (mod, _) in loaded]
        k = self.shape.out_channels
        self._bias = cupy.asarray(bias if bias is not None else np.zeros(k, np.float32), dtype=cupy.float32)
        self._workspace: Dict[Tuple[int, int], Any] = {}  # (variant, batch) -> partial sums of the slices
        self.stats = dict(self.layer.stats)
        if len(variants) > 1:
            self.stats["variants"] = [{"up_to_batch": None if up_to == ANY_BATCH else up_to,
                                       "tiling": v.tiling.describe()} for up_to, v in variants]

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

    def _check_residual(self, residual: Any, x: Any, out: Any) -> Any:
        import cupy

        name = self.layer.name
        if not self.epilogue.residual:
            if residual is not None:
                raise ValueError(f"{name}: got a residual, but the kernel was compiled without one "
                                 "(compile with residual=True)")
            return None
        if residual is None:
            raise ValueError(f"{name}: the kernel adds a residual; pass residual=<(N, K, Ho, Wo) array>")
        if hasattr(residual, "requires_grad") and residual.requires_grad:
            raise ValueError(f"{name}: residual requires grad; sparseconv kernels are inference-only")
        r = residual if isinstance(residual, cupy.ndarray) else cupy.asarray(residual)
        want = self.output_shape(x.shape[0])
        if r.dtype != cupy.float32 or tuple(r.shape) != want or not r.flags.c_contiguous:
            raise ValueError(f"{name}: residual must be a C-contiguous float32 array of shape {want}, "
                             f"got {r.dtype} {tuple(r.shape)}")
        if r.device.id != self.device_id:
            raise ValueError(f"{name}: residual is on GPU {r.device.id}, expected GPU {self.device_id}")
        if r.data.ptr < out.data.ptr + out.nbytes and out.data.ptr < r.data.ptr + r.nbytes \
                and r.data.ptr != out.data.ptr:
            raise ValueError(f"{name}: residual partly overlaps out (it may be out itself, or apart from it)")
        return r

    def __call__(self, x: Any, out: Any = None, stream: Any = None, residual: Any = None) -> Any:
        import cupy

        x = self._check_input(x)
        out = cupy.empty(self.output_shape(x.shape[0]), dtype=cupy.float32) if out is None \
            else self._check_out(out, x)
        residual = self._check_residual(residual, x, out)
        if x.shape[0] == 0:
            return out
        if stream is not None:
            stream = as_cupy_stream(stream, self.device_id, self.layer.name)
        with (stream if stream is not None else cupy.cuda.get_current_stream()):
            self._launch(x, out, residual)
        return out

    def variant(self, batch: int) -> Tuple[int, CompiledLayer, Any]:
        """(index, compiled layer, function) of the variant serving this batch size."""
        for i, (up_to, layer, fn) in enumerate(self._variants):
            if batch <= up_to:
                return i, layer, fn
        raise AssertionError("the last variant serves any batch")

    def _launch(self, x: Any, out: Any, residual: Any = None) -> None:
        import cupy

        n = x.shape[0]
        index, layer, fn = self.variant(n)
        step = layer.max_batch_per_launch
        slices = layer.tiling.slices
        for first in range(0, n, step):
            count = min(step, n - first)
            y = out[first:first + count]
            res = residual[first:first + count] if residual is not None else None
            if slices > 1:  # partial sums into the workspace, then the ordered reduction
                ws = self._workspace.get((index, count))
                if ws is None:
                    ws = self._workspace[(index, count)] = cupy.empty((slices,) + y.shape, cupy.float32)
                target = ws
            else:
                target = y
            fn(layer.grid(count), (layer.tiling.threads, 1, 1),
               (x[first:first + count], target, self._bias, res if res is not None else np.uint64(0),
                np.int32(count), np.int32(layer.chunks)),
               shared_mem=layer.shared_bytes)
            if slices > 1:
                lo, hi = self.epilogue.bounds
                total = y.size
                _reduce_kernel(self.device_id)(
                    (min(-(-total // 256), 4096),), (256,),
                    (target, y, res if res is not None else np.uint64(0), np.int64(total), np.int32(slices),
                     np.int32(res is not None), np.int32(lo is not None), np.float32(lo or 0.0),
                     np.int32(hi is not None), np.float32(hi or 0.0)))

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

    def _launch(self, x: Any, out: Any, residual: Any = None) -> None:
        import cupy

        self._dense(x, out)
        if residual is not None:
            cupy.add(out, residual, out=out)
        lo, hi = self.epilogue.bounds
        if lo is not None or hi is not None:  # a clamp that keeps NaN, like the kernels
            lo_v = np.float32(-np.inf if lo is None else lo)
            hi_v = np.float32(np.inf if hi is None else hi)
            cupy.copyto(out, cupy.where(out < lo_v, lo_v, cupy.where(out > hi_v, hi_v, out)))


def compile_conv2d(weight: Any, *, input_size: IntPair, bias: Any = None, stride: IntPair = 1,
                   padding: IntPair = 0, dilation: IntPair = 1, groups: int = 1,
                   activation: str = "none", clip: Optional[Tuple[float, float]] = None, residual: bool = False,
                   tiling: Union[Tiling, str, None] = None, backend: str = "sparseconv",
                   tune_batch: int = 64, cache_dir: Union[str, None] = None,
                   name: str = "conv") -> Conv2dKernel:
    """Compile a pruned conv layer into a kernel specialised to its weights.

    weight: (K, C/groups, R, S) floats (NumPy, CuPy or torch), zeros where pruned.
    input_size: (H, W) of the input images. bias: (K,) or None. stride, padding,
    dilation: int or pair, as torch.nn.functional.conv2d. The batch size is free
    at call time. Builds for the current CUDA device; artifacts are cached in
    cache_dir (default: $SPARSECONV_CACHE_DIR or ptx_cache/).

    The epilogue is fused into the store: y = act(conv(x) + bias + residual),
    with activation "none", "relu", "relu6" or "clip" (clip=(lo, hi)), and
    residual=True for a kernel called as kernel(x, residual=r).

    With the default tiling, a layer that gives too few blocks at small
    batches to fill the GPU also gets a variant with the input-channel
    reduction split over blocks (deterministic), used up to a batch size
    (kernel.stats["variants"]).

    tiling: None (the default heuristic), a Tiling, or "auto": time a bounded
    set of candidate tilings at batch `tune_batch` and keep the fastest.
    backend: "sparseconv", or "auto" (opt-in): also time cuDNN strict fp32
    (needs torch) and return a DenseConv2dKernel where it was faster. Tuning
    results are cached, so a second compile does not tune again;
    kernel.stats["tuning"] holds the times and the choice."""
    if backend not in ("sparseconv", "auto"):
        raise ValueError(f"{name}: backend must be 'sparseconv' or 'auto', got {backend!r}")
    try:
        epilogue = Epilogue(activation, clip, residual)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
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
                                    tilings=candidates, consider_dense=backend == "auto", epilogue=epilogue)
        variants = [(ANY_BATCH, layer)]
    else:
        chosen = [(ANY_BATCH, tiling)] if isinstance(tiling, Tiling) else batch_variants(shape, default_tiling(shape))
        variants = [(up_to, build_conv2d(w, shape, tiling=t, target=target, cache=cache, name=name,
                                         epilogue=epilogue)) for up_to, t in chosen]
    t = time.perf_counter()
    kernel = DenseConv2dKernel(variants[-1][1], b, w) if tuning and tuning.backend == DENSE \
        else Conv2dKernel(variants, b)
    kernel.stats["seconds"] = dict(kernel.stats["seconds"], load=time.perf_counter() - t)
    if tuning is not None:
        kernel.stats["tuning"] = tuning.as_dict()
    return kernel


def compile_layers(layers: Sequence[Tuple[str, np.ndarray, Optional[np.ndarray], ConvShape]], *,
                   tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
                   cache_dir: Optional[str] = None, jobs: Optional[int] = None,
                   progress: bool = False,
                   epilogues: Optional[Dict[str, Epilogue]] = None) -> Dict[str, Conv2dKernel]:
    """Compile and load many (name, weight, bias, shape) layers on the current
    GPU; name -> kernel. Without tuning they build in parallel (a process pool),
    every batch variant of every layer (shapes.batch_variants); with
    tiling="auto" or backend="auto" each layer's candidates build in parallel,
    one layer after another, then are timed. `epilogues`: name -> the
    epilogue fused into that layer (default: bias only)."""
    epilogues = epilogues or {}
    from .parallel import LayerJob, build_many

    kernels: Dict[str, Conv2dKernel] = {}
    if tiling == "auto" or backend == "auto":
        for name, w, b, shape in layers:
            ep = epilogues.get(name, Epilogue())
            kernels[name] = compile_conv2d(w, input_size=(shape.in_h, shape.in_w), bias=b, stride=shape.stride,
                                           padding=shape.padding, dilation=shape.dilation, groups=shape.groups,
                                           activation=ep.activation, clip=ep.clip, residual=ep.residual,
                                           tiling=tiling, backend=backend, tune_batch=tune_batch,
                                           cache_dir=cache_dir, name=name)
        return kernels
    jobs_by_layer = {name: [(up_to, LayerJob(f"{name}#{i}" if i else name, w, shape, t,
                                             epilogues.get(name, Epilogue())))
                            for i, (up_to, t) in enumerate(reversed(batch_variants(shape, default_tiling(shape))))]
                     for name, w, _, shape in layers}
    built = build_many([job for variants in jobs_by_layer.values() for _, job in variants], target=device_target(),
                       cache_dir=cache_dir, workers=jobs, progress=progress)
    for name, _, b, _ in layers:
        t = time.perf_counter()
        kernels[name] = Conv2dKernel([(up_to, replace(built[job.name], name=name))
                                      for up_to, job in jobs_by_layer[name]], b)
        kernels[name].stats["seconds"] = dict(kernels[name].stats["seconds"], load=time.perf_counter() - t)
    return kernels
