"""Kernel launches that overlap the kernel before them (programmatic
dependent launch, sm_90 and later).

A kernel boundary inside a CUDA graph costs ~0.9 us on the H100, and a
batch-1 forward has ~60 of them (docs/PERFORMANCE.md, sessions 12, 17, 23).
Launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, a kernel
may be scheduled while the kernel before it on the stream still runs, as soon
as that one's blocks have all run `griddepcontrol.launch_dependents`. So
every kernel launched here must begin its dependent work with
`griddepcontrol.wait`, which returns once the kernel before it has finished
and its writes are visible. Each of our kernel sources does, through
GRID_DEPENDENCY_CUDA's two macros:

    SC_WAIT_FOR_PREVIOUS_KERNEL()   before the first read of an activation and the first write
    SC_LET_NEXT_KERNEL_START()      right after it: the next kernel may be scheduled now

Before the wait a kernel may read only what no kernel writes: its weights,
its table, its bias. Where the attribute is not set, both are no-ops: the
switch off, a GPU older than sm_90, or a stream that is not capturing a CUDA
graph (only a graph runs kernels back to back without the host in between).

Every launch goes through cuLaunchKernelEx (the attribute only when
capturing), called through ctypes: one path for the checked calls on CuPy
arrays and for the drop-in's eager calls on raw pointers, which skip CuPy's
arrays because at batch 1 they cost more host time than the kernels
(session 35).

    launch(function, grid, block, args, shared_mem=0)   on CuPy's current stream, CuPy arrays
                                                        and NumPy scalars as arguments
    launch_raw(function, grid, block, values, shared_mem, stream, device_id)
                                  ctypes argument values on a raw stream handle
    PreparedLaunch(function, grid, block, shared_mem, values, device_id)(stream, *new_values)
                                  the same, made once and called at each forward
                                  (the kernels' launch_pointers: the drop-in's eager calls)

The switch: OVERLAP_LAUNCHES (environment SPARSECONV_OVERLAP_LAUNCHES=0 turns
it off, read at import), checked at each launch.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Pasted at the top of every kernel source launched through launch(). The
# templates get it as a variable (render.py), the NVRTC sources by
# concatenation: one text for every family.
GRID_DEPENDENCY_CUDA = r"""
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// programmatic dependent launch (sparseconv/launch.py): no-ops unless launched with it
#define SC_WAIT_FOR_PREVIOUS_KERNEL() asm volatile("griddepcontrol.wait;" ::: "memory")
#define SC_LET_NEXT_KERNEL_START() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define SC_WAIT_FOR_PREVIOUS_KERNEL() do {} while (0)
#define SC_LET_NEXT_KERNEL_START() do {} while (0)
#endif
"""


def overlap_from_environment(value: Optional[str]) -> bool:
    """SPARSECONV_OVERLAP_LAUNCHES: unset, 1/true/yes/on -> True; 0/false/no/off -> False
    (any case); anything else is refused, so a typo does not silently leave it on."""
    if value is None or value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"SPARSECONV_OVERLAP_LAUNCHES must be 1 or 0 (true/false, yes/no, on/off), got {value!r}; "
                     f"unset it or set it to 0 to launch our kernels one after another")


OVERLAP_LAUNCHES: bool = overlap_from_environment(os.environ.get("SPARSECONV_OVERLAP_LAUNCHES"))

# cuda.h (CUDA 12.0 and later, unchanged in 13.0): CUlaunchAttribute is
# {id; 4 bytes of padding; a 64-byte value union}, CUlaunchConfig
# {grid x/y/z, block x/y/z, sharedMemBytes, hStream, attrs, numAttrs}.
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32), ("gridDimZ", ctypes.c_uint32),
                ("blockDimX", ctypes.c_uint32), ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint32)]


def programmatic_attribute() -> LaunchAttribute:
    """The attribute that lets a kernel start before the one before it ends."""
    a = LaunchAttribute()
    a.id = PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(a) + LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    return a


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}


def c_args(args: Sequence[Any]) -> List[Any]:
    """ctypes values for kernel arguments, as CuPy passes them: a CUDA array
    as its device pointer, a NumPy scalar as its own type; a ctypes value
    (a raw pointer as c_void_p) as it is."""
    out: List[Any] = []
    for a in args:
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if isinstance(a, ctypes._SimpleCData):
            out.append(a)
        elif isinstance(ptr, int):
            out.append(ctypes.c_void_p(ptr))
        elif isinstance(a, np.generic) and a.dtype in _SCALARS:
            out.append(_SCALARS[a.dtype](a.item()))
        else:
            raise TypeError(f"launch: a kernel argument must be a CuPy array, a NumPy int32, int64, uint64 "
                            f"or float32 scalar, or a ctypes value, got {type(a).__name__}")
    return out


def launch_config(grid: Tuple[int, ...], block: Tuple[int, ...], shared_mem: int, stream_ptr: int,
                  attribute: LaunchAttribute) -> LaunchConfig:
    """cuLaunchKernelEx's config; grid and block as CuPy takes them (1 to 3 numbers)."""
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    return LaunchConfig(*g, *b, shared_mem, ctypes.c_void_p(stream_ptr), ctypes.pointer(attribute), 1)


class _Driver:
    """libcuda's cuLaunchKernelEx and cuStreamIsCapturing, or why they cannot be had."""

    def __init__(self) -> None:
        self.launch_ex: Any = None
        self.why_not: Optional[str] = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn, self.is_capturing = lib.cuLaunchKernelEx, lib.cuStreamIsCapturing
        except (OSError, AttributeError) as e:
            self.why_not = f"no cuLaunchKernelEx or cuStreamIsCapturing in libcuda.so.1 ({e})"
            return
        fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self.launch_ex = fn
        self.error_string = lib.cuGetErrorString
        self.is_capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self.is_capturing.restype = ctypes.c_int
        self.attribute = programmatic_attribute()

    def capturing(self, stream_ptr: int) -> bool:
        """Whether the stream is capturing a CUDA graph (CU_STREAM_CAPTURE_STATUS_ACTIVE);
        False where the driver cannot say (the legacy stream beside a capture)."""
        status = ctypes.c_int(0)
        return self.is_capturing(ctypes.c_void_p(stream_ptr), ctypes.byref(status)) == 0 and status.value == 1


_driver: Optional[_Driver] = None
_overlap_on_device: Dict[int, bool] = {}  # device id -> sm_90 or later


def _overlaps(device_id: int) -> bool:
    global _driver
    if not OVERLAP_LAUNCHES:
        return False
    if device_id not in _overlap_on_device:
        import cupy

        major = cupy.cuda.Device(device_id).compute_capability[:-1] or "0"
        if _driver is None:
            _driver = _Driver()
        _overlap_on_device[device_id] = int(major) >= 9 and _driver.launch_ex is not None
    return _overlap_on_device[device_id]


def launch(function: Any, grid: Tuple[int, ...], block: Tuple[int, ...], args: Sequence[Any],
           shared_mem: int = 0) -> None:
    """Launch a CuPy RawKernel or module Function on CuPy's current stream and
    device, `args` as c_args takes them, overlapping the kernel before it
    where the GPU can and a CUDA graph is being captured (see the module
    doc). Its source must use GRID_DEPENDENCY_CUDA's macros."""
    import cupy

    launch_raw(function, grid, block, c_args(args), shared_mem, cupy.cuda.get_current_stream().ptr,
               cupy.cuda.Device().id)


def launch_raw(function: Any, grid: Tuple[int, ...], block: Tuple[int, ...], values: Sequence[Any],
               shared_mem: int, stream: int, device_id: int) -> None:
    """Launch on the raw stream handle `stream` with `values` already ctypes
    scalars (c_void_p for pointers), overlapping the kernel before it where
    the GPU can and the stream is capturing. `device_id` must be the current
    device (the function belongs to its context)."""
    PreparedLaunch(function, grid, block, shared_mem, values, device_id)(stream)


class PreparedLaunch:
    """A kernel's launch with its function, grid, block, shared memory and
    argument types fixed: a call sets the argument values and the stream,
    and nothing else is made. The drop-in's eager calls launch the same
    kernel with the same grid at every forward, and making the config, the
    parameter array and the ctypes values anew costs ~4 us of Python a
    launch (session 36). The values are reused, so one PreparedLaunch must
    not be called from two threads at once (the kernels' workspaces already
    ask that); the driver copies them at the launch, so a call may follow
    the last one at once."""

    def __init__(self, function: Any, grid: Tuple[int, ...], block: Tuple[int, ...], shared_mem: int,
                 values: Sequence[Any], device_id: int) -> None:
        driver = _the_driver()
        self.function = function  # kept alive: _fn is its loaded code
        self.device_id = device_id
        self._fn = ctypes.c_void_p(getattr(function, "kernel", function).ptr)  # a RawKernel's compiled Function
        self._values = tuple(values)
        self._params = (ctypes.c_void_p * max(1, len(self._values)))(*[ctypes.addressof(v) for v in self._values])
        self._config = launch_config(grid, block, shared_mem, 0, driver.attribute)

    def __call__(self, stream: int, *values: Any) -> None:
        """Launch on the raw stream handle `stream`; `values` (Python numbers)
        replace the first len(values) argument values, except where None:
        that one and those after the last stay as they were."""
        for v, new in zip(self._values, values):
            if new is not None:
                v.value = new
        config = self._config
        config.hStream = stream
        overlap = _overlaps(self.device_id) and _driver.capturing(stream)  # type: ignore[union-attr]
        config.numAttrs = 1 if overlap else 0
        err = _driver.launch_ex(ctypes.byref(config), self._fn, self._params, None)  # type: ignore[union-attr]
        if err != 0:
            msg = ctypes.c_char_p()
            _driver.error_string(err, ctypes.byref(msg))  # type: ignore[union-attr]
            text = msg.value.decode() if msg.value else "unknown error"
            hint = "; set SPARSECONV_OVERLAP_LAUNCHES=0 to launch without overlap" if overlap else ""
            c = config
            grid, block = (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ)
            raise RuntimeError(f"cuLaunchKernelEx failed for kernel {getattr(self.function, 'name', '?')} (grid "
                               f"{grid}, block {block}, {c.sharedMemBytes} bytes of shared memory): CUresult {err} "
                               f"({text}){hint}")


def _the_driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    if _driver.launch_ex is None:
        raise RuntimeError(f"sparseconv launches its kernels through the CUDA driver's cuLaunchKernelEx (CUDA 12.0 "
                           f"and later), but: {_driver.why_not}. Install a newer NVIDIA driver.")
    return _driver
