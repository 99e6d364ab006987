"""Run time: load a built layer on the GPU and launch it.

Everything here needs CuPy and a CUDA device (imported lazily, so importing
this module does not); the build side (sparseconv.build) never imports it.

    load_kernel(artifact, suffix, entry)   cubin or PTX -> cupy.RawModule + function
    Conv2dKernel(layer, bias)              the callable: kernel(x, out=None, stream=None) -> y
    DenseConv2dKernel(layer, bias, weight) the same contract through cuDNN (backend="auto")

A cubin from a CUDA 13.x ptxas loads on a 13.0 driver, whereas PTX is
JIT-compiled by the driver only if its .version is one the driver knows; the
build prefers ptxas, and a PTX artifact is checked against the driver here
(check_ptx_loadable) with advice when it is too new.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional, Tuple

import numpy as np

from .build import CompiledLayer
from .dense import dense_conv2d
from .ptx import ptx_version
from .shapes import Target

MAX_GRID_Z = 65535  # gridDim.z limit: bigger batches are launched in slices


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
        super().__init__(layer, bias)
        dense = dense_conv2d(weight, bias, layer.shape)
        if dense is None:
            raise RuntimeError(f"{layer.name}: the dense path needs torch with CUDA")
        self._dense = dense

    def _launch(self, x: Any, out: Any) -> None:
        self._dense(x, out)
