"""Run time: load a built layer on the GPU and launch it.

Everything here needs CuPy and a CUDA device (imported lazily, so importing
this module does not); the build side (sparseconv.build) never imports it.

    load_kernel(artifact, suffix, entry)   cubin or PTX -> cupy.RawModule + function
    CallContract(name, shape, residual, device_id)
                                           the checks of a conv kernel's call, shared by every family
    Conv2dKernel(layer, bias)              the callable: kernel(x, out=None, stream=None) -> y;
                                           kernel.launch_pointers(...) the same launches, unchecked, on raw pointers
    LinearKernel(conv)                     a fully connected layer through a Conv2dKernel: (N, in) -> (N, out)
    DenseConv2dKernel(layer, bias, weight) the same contract through cuDNN (backend="auto")

Every kernel goes out through sparseconv.launch (cuLaunchKernelEx), which on
sm_90 lets it start while the kernel before it finishes (programmatic
dependent launch) in a CUDA graph.

A cubin from a CUDA 13.x ptxas loads on a 13.0 driver, whereas PTX is
JIT-compiled by the driver only if its .version is one the driver knows; the
build prefers ptxas, and a PTX artifact is checked against the driver here
(check_ptx_loadable) with advice when it is too new.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import numpy as np

from .build import CompiledLayer
from .dense import dense_conv2d
from .launch import GRID_DEPENDENCY_CUDA, PreparedLaunch, launch_raw
from .ptx import ptx_version
from .pool import FUSED_POOL, POOL_MAX_CUDA, max_pool2d, prepared_max_pool
from .shapes import MAX_PATCH_BYTES, ConvShape, Target, pooled_hw
from .tilings import ANY_BATCH, pools_in_kernel



class DriverTooOldError(RuntimeError):
    pass


def max_ptx_version(driver_version: int) -> Tuple[int, int]:
    """Newest PTX ISA a driver can JIT, from cudaDriverGetVersion (e.g. 13000).
    CUDA 11.x -> 7.x, 12.x -> 8.x, 13.x -> 9.x (PTX major = CUDA major - 4)."""
    major, minor = driver_version // 1000, (driver_version % 1000) // 10
    return (major - 4, minor)


def check_ptx_loadable(ptx: str, driver_version: int) -> None:
    have = ptx_version(ptx)
    limit = max_ptx_version(driver_version)
    if have > limit:
        raise DriverTooOldError(
            f"the PTX is .version {have[0]}.{have[1]} but this driver (CUDA {driver_version // 1000}."
            f"{(driver_version % 1000) // 10}) JIT-compiles at most PTX {limit[0]}.{limit[1]}. Put a ptxas "
            f"on PATH (SPARSECONV_PTXAS) so a cubin is built instead, use an nvcc no newer than the driver, "
            f"or upgrade the driver.")


def device_target(device_id: Optional[int] = None) -> Target:
    """The Target of a CUDA device (the current one by default)."""
    import cupy

    dev = cupy.cuda.Device(device_id)
    return Target(f"sm_{dev.compute_capability}")


def load_kernel(artifact: bytes, suffix: str, entry: str) -> Tuple[Any, Any]:
    """Load cubin (suffix '.cubin') or PTX ('.ptx') bytes with cupy.RawModule on
    the current device; returns (module, kernel function). get_function forces
    the load while the temporary file still exists (RawModule may be lazy)."""
    import cupy

    if suffix == ".ptx":
        check_ptx_loadable(artifact.decode(), cupy.cuda.runtime.driverGetVersion())
    fd, path = tempfile.mkstemp(prefix="sparseconv-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(artifact)
        module = cupy.RawModule(path=path)
        return module, module.get_function(entry)
    finally:
        os.unlink(path)


# Thread-block clusters of more than 8 blocks run only on GPUs that allow them
# (the H100 allows 16) and only for kernels that opt in.
PORTABLE_CLUSTER_SIZE = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


# Dynamic shared memory above this needs the kernel's opt-in (CUDA's default limit).
OPT_IN_SHARED_BYTES = MAX_PATCH_BYTES
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


def allow_shared_bytes(fn: Any, nbytes: int) -> None:
    """Let a loaded kernel launch with `nbytes` of dynamic shared memory,
    above the 48 KB it gets without asking (a split k-block's loop state in
    dynamic shared memory: specialise.pieces.PieceState)."""
    import cupy

    function = getattr(fn, "kernel", fn)
    cupy.cuda.driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


def allow_large_clusters(fn: Any) -> None:
    """Let a loaded kernel launch with its compiled-in cluster of up to 16
    blocks (Tiling.slice_sum "cluster" with more than 8 slices)."""
    import cupy

    function = getattr(fn, "kernel", fn)  # RawModule.get_function gives a RawKernel around a Function
    cupy.cuda.driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)


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
# compiled once per process by NVRTC (no weights in it). Compiling the slice
# count in (every slice's load before the first add) was measured no faster:
# the kernel is ~1.4 us of fixed cost (docs/PERFORMANCE.md, session 11).
_REDUCE_SOURCE = GRID_DEPENDENCY_CUDA + POOL_MAX_CUDA + r"""
extern "C" __global__ void sc_reduce_slices(const float* __restrict__ ws, float* __restrict__ y,
        const float* __restrict__ residual, long long total, int slices, int has_residual,
        int has_lo, float lo, int has_hi, float hi)
{
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
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

// The same sum where the epilogue pools (Epilogue.pool) and the split
// variant's kernel cannot: a thread sums the slices of one 2x2 window's four
// pixels, clamps each, and stores their max (row order from -inf, a NaN
// wins: sparseconv.pool's window_max), so the unpooled output is never
// written or read back and no pool launch follows. Odd sides drop their last
// row or column, as torch's floor does. No residual: a pool never takes one.
extern "C" __global__ void sc_reduce_slices_pool(const float* __restrict__ ws, float* __restrict__ y,
        long long total, int slices, int conv_h, int conv_w, long long pooled,
        int has_lo, float lo, int has_hi, float hi)
{
    SC_WAIT_FOR_PREVIOUS_KERNEL();
    SC_LET_NEXT_KERNEL_START();
    const int out_h = conv_h / 2, out_w = conv_w / 2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pooled;
         i += (long long)gridDim.x * blockDim.x) {
        const long long plane = i / (out_h * out_w);
        const int p = (int)(i - plane * (out_h * out_w));
        const long long corner = plane * conv_h * conv_w + 2LL * (p / out_w) * conv_w + 2 * (p % out_w);
        float m = -__int_as_float(0x7f800000);
        for (int r = 0; r < 2; ++r)
            for (int c = 0; c < 2; ++c) {
                const long long j = corner + r * conv_w + c;
                float v = ws[j];
                for (int s = 1; s < slices; ++s) v += ws[s * total + j];
                if (has_lo) v = v < lo ? lo : v;
                if (has_hi) v = v > hi ? hi : v;
                m = sc_pool_max(m, v);
            }
        y[i] = m;
    }
}
"""
_reduce_kernels: Dict[Tuple[int, str], Any] = {}


def reduce_kernel(device_id: int, name: str = "sc_reduce_slices") -> Any:
    """sc_reduce_slices (or sc_reduce_slices_pool) on this GPU, compiled on first use."""
    import cupy

    if (device_id, name) not in _reduce_kernels:
        _reduce_kernels[device_id, name] = cupy.RawKernel(_REDUCE_SOURCE, name)
    return _reduce_kernels[device_id, name]


def reduce_grid(total: int) -> Tuple[int]:
    return (min(-(-total // 256), 4096),)


def reduce_values(ws: int, y: int, residual: int, total: int, slices: int,
                  bounds: Tuple[Optional[float], Optional[float]]) -> Tuple[Any, ...]:
    """sc_reduce_slices' arguments in its order, as ctypes values: device
    pointers (residual 0 for none), then the sizes and the clamp. The one
    place that mirrors the kernel's signature (reduce_slices and
    Conv2dKernel's prepared launches both take it)."""
    lo, hi = bounds
    return (ctypes.c_void_p(ws), ctypes.c_void_p(y), ctypes.c_void_p(residual), ctypes.c_int64(total),
            ctypes.c_int32(slices), ctypes.c_int32(residual != 0), ctypes.c_int32(lo is not None),
            ctypes.c_float(lo or 0.0), ctypes.c_int32(hi is not None), ctypes.c_float(hi or 0.0))


def reduce_pool_values(ws: int, y: int, planes: int, conv_hw: Tuple[int, int], slices: int,
                       bounds: Tuple[Optional[float], Optional[float]]) -> Tuple[Any, ...]:
    """sc_reduce_slices_pool's arguments in its order, as ctypes values, for
    `planes` (images x channels) conv outputs of conv_hw pooled 2x2 into y."""
    lo, hi = bounds
    conv_h, conv_w = conv_hw
    return (ctypes.c_void_p(ws), ctypes.c_void_p(y), ctypes.c_int64(planes * conv_h * conv_w), ctypes.c_int32(slices),
            ctypes.c_int32(conv_h), ctypes.c_int32(conv_w), ctypes.c_int64(planes * math.prod(pooled_hw(*conv_hw))),
            ctypes.c_int32(lo is not None), ctypes.c_float(lo or 0.0), ctypes.c_int32(hi is not None),
            ctypes.c_float(hi or 0.0))


def reduce_slices(device_id: int, ws: Any, y: Any, residual: Any = None,
                  bounds: Tuple[Optional[float], Optional[float]] = (None, None)) -> None:
    """y = the sum of ws's slices (ws: (slices,) + y.shape) in slice order, plus
    residual, clamped to bounds (lo, hi; None for no bound), on the current stream."""
    import cupy

    launch_raw(reduce_kernel(device_id), reduce_grid(y.size), (256,),
               reduce_values(ws.data.ptr, y.data.ptr, 0 if residual is None else residual.data.ptr, y.size,
                             ws.shape[0], bounds), 0, cupy.cuda.get_current_stream().ptr, device_id)


@dataclass(frozen=True)
class CallContract:
    """What a conv kernel's call accepts, checked the same way for every
    family (Conv2dKernel, table.TableConv2d): x an (N, C, H, W) float32
    C-contiguous CUDA array on the kernel's GPU (CuPy, or a torch tensor
    through __cuda_array_interface__ / DLPack, without grad); out a CuPy
    array of the output shape, apart from x; a residual exactly where the
    kernel was compiled with one; `stream` CuPy's or torch's."""

    name: str              # the layer, for the messages
    shape: ConvShape
    residual: bool         # whether the kernel adds a residual
    device_id: int
    pool: bool = False     # whether its output is the 2x2 max pool of the conv's (Epilogue.pool)

    def output_shape(self, batch: int) -> Tuple[int, int, int, int]:
        s = self.shape
        return (batch, s.out_channels) + (pooled_hw(s.out_h, s.out_w) if self.pool else (s.out_h, s.out_w))

    def arrays(self, x: Any, out: Any, residual: Any) -> Tuple[Any, Any, Any]:
        """(x, out, residual) as CuPy arrays, checked; out allocated when None."""
        import cupy

        x = self.input(x)
        out = cupy.empty(self.output_shape(x.shape[0]), dtype=cupy.float32) if out is None else self.out(out, x)
        return x, out, self.residual_of(residual, x, out)

    @contextlib.contextmanager
    def launching(self, stream: Any) -> Iterator[Any]:
        """A context with the kernel's GPU current (the output is allocated and
        the kernel launched there, whichever GPU the caller has current) and
        the stream to launch on made current: `stream`, or that GPU's current
        one. Yields the stream."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            s = cupy.cuda.get_current_stream() if stream is None else as_cupy_stream(stream, self.device_id,
                                                                                      self.name)
            with s:
                yield s

    def as_cupy(self, x: Any) -> Any:
        """x as a CuPy array on this kernel's GPU (no copy), float32, or an error saying what to pass."""
        import cupy

        if isinstance(x, np.ndarray):
            raise TypeError(f"{self.name}: x is a NumPy (host) array; pass a CUDA array, "
                            "e.g. cupy.asarray(x)")
        # before the interface test: torch raises RuntimeError for a grad tensor's __cuda_array_interface__
        if getattr(x, "requires_grad", False):
            raise ValueError(f"{self.name}: x requires grad; sparseconv kernels are inference-only "
                             "(use torch.no_grad() or x.detach())")
        if not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")):
            raise TypeError(f"{self.name}: x must be a CUDA array (CuPy array or CUDA torch tensor), "
                            f"got {type(x).__name__}")
        if hasattr(x, "is_cuda") and not x.is_cuda:
            raise TypeError(f"{self.name}: x is a CPU tensor; move it to the GPU first (x.cuda())")
        x = x if isinstance(x, cupy.ndarray) else cupy.asarray(x)
        if x.device.id != self.device_id:
            raise ValueError(f"{self.name}: x is on GPU {x.device.id}, the kernel was loaded on GPU "
                             f"{self.device_id}")
        if x.dtype != cupy.float32:
            raise TypeError(f"{self.name}: x must be float32, got {x.dtype}")
        return x

    def input(self, x: Any) -> Any:
        x = self.as_cupy(x)
        s = self.shape
        if x.ndim != 4 or tuple(x.shape[1:]) != (s.in_channels, s.in_h, s.in_w):
            raise ValueError(f"{self.name}: x must have shape (N, {s.in_channels}, {s.in_h}, {s.in_w}), "
                             f"got {tuple(x.shape)}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.name}: x must be C-contiguous (NCHW); use cupy.ascontiguousarray(x)")
        return x

    def out(self, out: Any, x: Any) -> Any:
        import cupy

        want = self.output_shape(x.shape[0])
        if not isinstance(out, cupy.ndarray):
            raise TypeError(f"{self.name}: out must be a cupy.ndarray, got {type(out).__name__}")
        if out.dtype != cupy.float32 or tuple(out.shape) != want or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out must be a C-contiguous float32 array of shape {want}, "
                             f"got {out.dtype} {tuple(out.shape)}"
                             f"{'' if out.flags.c_contiguous else ' (not contiguous)'}")
        if out.device.id != self.device_id:
            raise ValueError(f"{self.name}: out is on GPU {out.device.id}, expected GPU {self.device_id}")
        x_lo, x_hi = x.data.ptr, x.data.ptr + x.nbytes
        o_lo, o_hi = out.data.ptr, out.data.ptr + out.nbytes
        if x_lo < o_hi and o_lo < x_hi:
            raise ValueError(f"{self.name}: out overlaps x; the kernel cannot run in place")
        return out

    def residual_of(self, residual: Any, x: Any, out: Any) -> Any:
        import cupy

        name = self.name
        if not self.residual:
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


@dataclass(frozen=True)
class BatchStep:
    """The launches of a code-family conv for `count` images of a call
    (Conv2dKernel.launch_pointers), prepared once: the conv kernel from byte
    offsets into x and out (and the residual, shaped as out), then, where
    the reduction is split into a workspace, the ordered sum of its slices
    with the epilogue (sc_reduce_slices)."""

    conv: PreparedLaunch            # arguments (x, target, bias, residual, count, chunks)
    reduce: Optional[PreparedLaunch]  # (workspace, y, residual, total, slices, has_residual, bounds...)
    x_offset: int
    out_offset: int
    workspace: int                  # device pointer of the partial sums; 0: the kernel writes out
    # Where the epilogue pools and this variant's kernel does not
    # (tilings.pools_in_kernel): the conv's output goes to `scratch`, and
    # `pool` (sparseconv.pool's kernel: scratch, y, size) writes y from it.
    pool: Optional[PreparedLaunch] = None
    scratch: int = 0
    # Where a split variant's sum pools as it stores (sc_reduce_slices_pool:
    # workspace, y, ...): no scratch and no pool launch.
    reduce_pools: bool = False

    def run(self, x: int, out: int, residual: int, stream: int) -> None:
        y = out + self.out_offset
        res = residual + self.out_offset if residual else 0  # no residual goes with a pool (Epilogue)
        conv_out = self.scratch or y
        self.conv(stream, x + self.x_offset, self.workspace or conv_out, None, res)  # None: the bias stays
        if self.reduce_pools:
            self.reduce(stream, None, y)  # type: ignore[misc]  # None: the workspace stays
        elif self.reduce is not None:
            self.reduce(stream, None, conv_out, res, None, None, int(res != 0))  # None: workspace, total, slices
        if self.pool is not None:
            self.pool(stream, None, y)  # None: the scratch stays


class Conv2dKernel:
    """A pruned conv layer compiled to a specialised kernel on one GPU.

    kernel(x, out=None, stream=None, residual=None) -> y, with x an (N, C, H, W)
    float32 C-contiguous CUDA array (CuPy, or anything with
    __cuda_array_interface__ / DLPack such as a torch tensor) and y a CuPy
    (N, K, Ho, Wo) array: y = act(conv(x) + bias + residual), the epilogue
    the layer was compiled with (with its pool, the (N, K, Ho // 2, Wo // 2)
    max pool of that). The launch is asynchronous on `stream`
    (default: CuPy's current stream).

    A kernel may hold several compiled variants of the layer, each for batches
    up to a size (e.g. the reduction split over blocks for batch 1, where one
    image gives too few blocks to fill the GPU, unsplit for larger batches);
    the call picks by the batch size. A split variant whose slices are not
    summed in a cluster (Tiling.slice_sum) keeps its partial sums in a
    workspace of the kernel's own (one per batch size, allocated on first use),
    and where the epilogue pools (Epilogue.pool) a variant whose kernel
    cannot take the pool writes the conv's output to a scratch buffer of the
    same kind, pooled into y by a second launch (a split variant's sum pools
    as it stores instead): calls of one kernel must not run concurrently on
    different streams."""

    backend = "sparseconv"
    launches_pointers = True  # launch_pointers serves it (not DenseConv2dKernel's cuDNN call)

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
        self.contract = CallContract(self.layer.name, self.shape, self.epilogue.residual, self.device_id,
                                     self.epilogue.pool)
        # (up_to_batch, layer, function); the module is kept alive beside its function
        loaded = [(up_to, v, load_kernel(v.artifact, v.artifact_suffix, v.entry)) for up_to, v in variants]
        for _, v, (_, fn) in loaded:
            if v.tiling.slice_sum == "cluster" and v.tiling.slices > PORTABLE_CLUSTER_SIZE:
                allow_large_clusters(fn)
            if v.shared_bytes > OPT_IN_SHARED_BYTES:
                allow_shared_bytes(fn, v.shared_bytes)
        self._variants = [(up_to, v, fn) for up_to, v, (_, fn) in loaded]
        self._modules = [mod for _, _, (mod, _) in loaded]
        k = self.shape.out_channels
        self._bias = cupy.asarray(bias if bias is not None else np.zeros(k, np.float32), dtype=cupy.float32)
        # Copied in on the current stream; the kernel may be called on another,
        # non-blocking one, which would not wait for the copy.
        cupy.cuda.get_current_stream().synchronize()
        self._workspace: Dict[Tuple[int, int], Any] = {}  # (variant, batch) -> partial sums of the slices
        self._scratch: Dict[Tuple[int, int], Any] = {}  # (variant, batch) -> the conv's output, to be pooled
        self._plans: Dict[int, Tuple[BatchStep, ...]] = {}  # batch -> launch_pointers' steps
        self.stats = dict(self.layer.stats)
        if len(variants) > 1:
            self.stats["variants"] = [{"up_to_batch": None if up_to == ANY_BATCH else up_to,
                                       "tiling": v.tiling.describe()} for up_to, v in variants]

    @property
    def out_channels(self) -> int:
        return self.shape.out_channels

    def output_shape(self, batch: int) -> Tuple[int, int, int, int]:
        return self.contract.output_shape(batch)

    def __call__(self, x: Any, out: Any = None, stream: Any = None, residual: Any = None) -> Any:
        with self.contract.launching(stream):
            x, out, residual = self.contract.arrays(x, out, residual)
            if x.shape[0]:
                self._launch(x, out, residual)
        return out

    def launch_pointers(self, x: int, out: int, residual: int, batch: int, stream: int) -> None:
        """The launches for `batch` images on raw device pointers (residual 0
        where the kernel adds none) and a raw stream handle, with no checks:
        what __call__ runs once the contract has checked its arrays, and what
        a caller that checked its own tensors against output_shape calls
        directly (fx.FusedConv2d: CuPy's views and the contract's checks cost
        ~100 us of host time a call, more than the kernels of a batch-1
        forward; bench/eager_forward.py, session 34). On the current device."""
        plan = self._plans.get(batch)
        if plan is None:
            plan = self._plans[batch] = self._plan(batch)
        for step in plan:
            step.run(x, out, residual, stream)

    def _plan(self, batch: int) -> Tuple[BatchStep, ...]:
        """The launches for `batch` images, a BatchStep per max_batch_per_launch
        images with the variant's workspace: what does not change from call
        to call, made once."""
        import cupy

        index, layer, fn = self.variant(batch)
        s = self.shape
        in_bytes, out_bytes = 4 * s.in_channels * s.in_h * s.in_w, 4 * math.prod(self.output_shape(1))
        conv_shape = (s.out_channels, s.out_h, s.out_w)  # of one image, before any pool
        step = layer.max_batch_per_launch
        # partial sums through a workspace and a second launch, unless the
        # kernel's clusters add them (Tiling.slice_sum)
        workspace = layer.tiling.slices > 1 and layer.tiling.slice_sum == "kernel"
        pool_after = self.epilogue.pool and not pools_in_kernel(s, layer.tiling)
        null = ctypes.c_void_p
        steps = []
        for first in range(0, batch, step):
            count = min(step, batch - first)
            conv = PreparedLaunch(fn, tuple(int(g) for g in layer.grid(count)), (layer.tiling.threads, 1, 1),
                                  layer.shared_bytes, (null(), null(), null(self._bias.data.ptr), null(),
                                                       ctypes.c_int32(count), ctypes.c_int32(layer.chunks)),
                                  self.device_id)
            ws, reduce = 0, None
            if workspace:
                key = (index, count)
                if key not in self._workspace:
                    self._workspace[key] = cupy.empty((layer.tiling.slices, count) + conv_shape, cupy.float32)
                ws = self._workspace[key].data.ptr
                if pool_after:  # the sum pools as it stores
                    pooled = count * math.prod(self.output_shape(1))
                    reduce = PreparedLaunch(reduce_kernel(self.device_id, "sc_reduce_slices_pool"),
                                            reduce_grid(pooled), (256,), 0,
                                            reduce_pool_values(ws, 0, count * s.out_channels, (s.out_h, s.out_w),
                                                               layer.tiling.slices, self.epilogue.bounds),
                                            self.device_id)
                else:
                    total = count * math.prod(conv_shape)
                    reduce = PreparedLaunch(reduce_kernel(self.device_id), reduce_grid(total), (256,), 0,
                                            reduce_values(ws, 0, 0, total, layer.tiling.slices, self.epilogue.bounds),
                                            self.device_id)
            scratch, pool = 0, None
            if pool_after and not workspace:
                key = (index, count)
                if key not in self._scratch:
                    self._scratch[key] = cupy.empty((count,) + conv_shape, cupy.float32)
                scratch = self._scratch[key].data.ptr
                pool = prepared_max_pool(self.device_id, scratch, (count,) + conv_shape, FUSED_POOL)
            steps.append(BatchStep(conv, reduce, first * in_bytes, first * out_bytes, ws, pool, scratch,
                                   reduce_pools=pool_after and workspace))
        return tuple(steps)

    def variant(self, batch: int) -> Tuple[int, CompiledLayer, Any]:
        """(index, compiled layer, function) of the variant serving this batch size."""
        for i, (up_to, layer, fn) in enumerate(self._variants):
            if batch <= up_to:
                return i, layer, fn
        raise AssertionError("the last variant serves any batch")

    def _launch(self, x: Any, out: Any, residual: Any = None) -> None:
        """__call__'s launches, its arrays checked: launch_pointers on their pointers and CuPy's current stream."""
        import cupy

        self.launch_pointers(x.data.ptr, out.data.ptr, 0 if residual is None else residual.data.ptr, x.shape[0],
                             cupy.cuda.get_current_stream().ptr)

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
    launches_pointers = False  # torch's conv2d takes tensors: callers go through __call__

    def __init__(self, layer: CompiledLayer, bias: Optional[np.ndarray], weight: np.ndarray) -> None:
        super().__init__(layer, bias)
        dense = dense_conv2d(weight, bias, layer.shape)
        if dense is None:
            raise RuntimeError(f"{layer.name}: the dense path needs torch with CUDA")
        self._dense = dense

    def _launch(self, x: Any, out: Any, residual: Any = None) -> None:
        import cupy

        s = self.shape
        conv_out = cupy.empty((x.shape[0], s.out_channels, s.out_h, s.out_w), cupy.float32) \
            if self.epilogue.pool else out
        self._dense(x, conv_out)
        if residual is not None:
            cupy.add(conv_out, residual, out=conv_out)
        lo, hi = self.epilogue.bounds
        if lo is not None or hi is not None:  # a clamp that keeps NaN, like the kernels
            lo_v = np.float32(-np.inf if lo is None else lo)
            hi_v = np.float32(np.inf if hi is None else hi)
            cupy.copyto(conv_out, cupy.where(conv_out < lo_v, lo_v, cupy.where(conv_out > hi_v, hi_v, conv_out)))
        if self.epilogue.pool:
            max_pool2d(self.device_id, conv_out, out, FUSED_POOL)


class LinearKernel:
    """A pruned fully connected layer, y = act(x @ W.T + b), run as the
    Conv2dKernel of its 1x1 conv on a 1x1 input (the batch as pixels;
    sparseconv.api.compile_linear builds it).

    kernel(x, out=None, stream=None) -> y, with x an (N, in_features) float32
    C-contiguous CUDA array (CuPy, or a torch tensor through
    __cuda_array_interface__ / DLPack) and y a CuPy (N, out_features) array.
    The (N, C) and (N, C, 1, 1) layouts are the same memory, so the conv
    kernel runs on views: no copy. Asynchronous on `stream`, as Conv2dKernel."""

    def __init__(self, conv: Conv2dKernel) -> None:
        s = conv.shape
        if (s.in_h, s.in_w, s.kernel_h, s.kernel_w, s.groups) != (1, 1, 1, 1, 1) or s.padding != (0, 0):
            raise ValueError(f"{conv.layer.name}: a Linear layer is a 1x1 conv on a 1x1 input without groups "
                             f"or padding, got {s.describe()}")
        if conv.epilogue.residual:
            raise ValueError(f"{conv.layer.name}: a LinearKernel takes no residual")
        self.conv = conv
        self.name = conv.layer.name
        self.in_features, self.out_features = s.in_channels, s.out_channels

    @property
    def backend(self) -> str:
        return self.conv.backend

    @property
    def shape(self) -> Any:
        return self.conv.shape

    @property
    def stats(self) -> Dict[str, Any]:
        return self.conv.stats

    @property
    def device_id(self) -> int:
        return self.conv.device_id

    def output_shape(self, batch: int) -> Tuple[int, int]:
        return (batch, self.out_features)

    def __call__(self, x: Any, out: Any = None, stream: Any = None) -> Any:
        import cupy

        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 2:
            raise ValueError(f"{self.name}: x must be 2-D (N, {self.in_features}), got shape {shape}"
                             + ("; flatten it first, e.g. x.reshape(len(x), -1)" if len(shape) > 2 else ""))
        if shape[1] != self.in_features:
            raise ValueError(f"{self.name}: x has {shape[1]} features, this layer takes {self.in_features}: "
                             f"expected shape (N, {self.in_features}), got {shape}")
        x = self.conv.contract.as_cupy(x)
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.name}: x must be C-contiguous; use cupy.ascontiguousarray(x)")
        n = x.shape[0]
        out4 = None
        if out is not None:
            want = self.output_shape(n)
            if not isinstance(out, cupy.ndarray):
                raise TypeError(f"{self.name}: out must be a cupy.ndarray, got {type(out).__name__}")
            if out.dtype != cupy.float32 or tuple(out.shape) != want or not out.flags.c_contiguous:
                raise ValueError(f"{self.name}: out must be a C-contiguous float32 array of shape {want}, "
                                 f"got {out.dtype} {tuple(out.shape)}")
            out4 = out.reshape(n, self.out_features, 1, 1)  # a view: contiguous
        y = self.conv(x.reshape(n, self.in_features, 1, 1), out=out4, stream=stream)
        return out if out is not None else y.reshape(n, self.out_features)

    def __repr__(self) -> str:
        s = self.stats
        return (f"LinearKernel({self.name}: {self.in_features} -> {self.out_features}, "
                f"{s.get('nonzero_weights')}/{s.get('weights')} nonzero weights, "
                f"{s.get('fmas_deleted')} FMAs deleted, backend {self.backend})")
