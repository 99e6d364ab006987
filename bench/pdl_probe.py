"""Does programmatic dependent launch (PDL) hide the boundaries between the
kernels of a batch-1 forward? A probe (written in session 11, first run in
session 12: 0.31 us saved per kernel on six ResNet-50 layer3 layers, see
docs/PERFORMANCE.md, "Programmatic dependent launch").

For a chain of layers (their batch-1 variants; a split variant is its main
kernel then sc_reduce_slices), each run one after another on its own buffers,
it times with CUDA-graph replays:
  - plain: every kernel launched as today;
  - pdl: every kernel launched through cuLaunchKernelEx with
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, its code edited to
    begin with `griddepcontrol.wait` (no load before the kernel before it has
    finished and its stores are visible) and then
    `griddepcontrol.launch_dependents` (the next kernel may be scheduled now
    and wait on its SMs). What this can save is the launch and ramp of each
    kernel, up to ~1-2 us per boundary; ResNet-50's batch-1 forward has ~100.
It checks that both give the same outputs, bit for bit.

    python bench/pdl_probe.py --layers resnet50:layer3.1.conv1,resnet50:layer3.1.conv2,resnet50:layer3.1.conv3
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import tempfile
import time
from typing import Any, List, Sequence, Tuple

import numpy as np

from sparseconv.assemble import assemble_cubin
from sparseconv.cache import ArtifactCache
from sparseconv.parallel import LayerJob, build_many
from sparseconv.render import ENTRY_NAME
from sparseconv.runtime import _REDUCE_SOURCE, load_kernel
from sparseconv.shapes import Target, variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.timing import cupy_graph, time_gpu
from sparseconv.zoo import resnet50, vgg16

GRID_DEPENDENCY = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n"


def with_grid_dependency(ptx: str, entry: str) -> str:
    """`ptx` with the two griddepcontrol instructions as the first
    instructions of `entry`: after its opening brace and its declarations."""
    m = re.search(rf"\.entry\s+{re.escape(entry)}\s*\(", ptx)
    if m is None:
        raise ValueError(f"no .entry {entry} in the PTX")
    brace = ptx.index("{", ptx.index(")", m.end()))
    lines = ptx[brace + 1:].split("\n")
    i = 0
    while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith((".reg", ".shared", ".local",
                                                                                   "//"))):
        i += 1
    return ptx[:brace + 1] + "\n".join(lines[:i]) + "\n" + GRID_DEPENDENCY + "\n".join(lines[i:])


# CUDA 13.0 cuda.h: CUlaunchAttribute is {id; pad to 8; 64-byte value union},
# CUlaunchConfig {grid x/y/z, block x/y/z, sharedMemBytes, hStream, attrs, numAttrs}.
class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32), ("gridDimZ", ctypes.c_uint32),
                ("blockDimX", ctypes.c_uint32), ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint32)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6


def programmatic_attribute() -> LaunchAttribute:
    a = LaunchAttribute()
    a.id = PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(a) + LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    return a


def c_args(args: Sequence[Any]) -> List[Any]:
    """ctypes values for kernel arguments: CuPy arrays as pointers, numpy scalars as themselves."""
    out: List[Any] = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):
            out.append(ctypes.c_void_p(a.data.ptr))
        elif isinstance(a, np.uint64):
            out.append(ctypes.c_uint64(int(a)))
        elif isinstance(a, np.int64):
            out.append(ctypes.c_int64(int(a)))
        elif isinstance(a, np.int32):
            out.append(ctypes.c_int32(int(a)))
        elif isinstance(a, np.float32):
            out.append(ctypes.c_float(float(a)))
        else:
            raise TypeError(f"unsupported kernel argument {type(a).__name__}")
    return out


class PdlLauncher:
    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.attr = programmatic_attribute()

    def __call__(self, fn: Any, grid: Tuple[int, int, int], block: Tuple[int, int, int], args: Sequence[Any],
                 shared: int = 0) -> None:
        import cupy

        values = c_args(args)
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        cfg = LaunchConfig(*grid, *block, shared, ctypes.c_void_p(cupy.cuda.get_current_stream().ptr),
                           ctypes.pointer(self.attr), 1)
        err = self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.ptr), params, None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err}")


def main() -> None:
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", required=True, help="comma-separated, run in this order, e.g. resnet50:layer3.1.conv1")
    ap.add_argument("--out", default="pdl_probe.json")
    args = ap.parse_args()
    nets = {"resnet50": dict(resnet50()), "vgg16": dict(vgg16())}
    names = args.layers.split(",")
    rng = np.random.default_rng(0)
    cache_dir = tempfile.mkdtemp(prefix="pdl-probe-")
    jobs = []
    for i, lname in enumerate(names):
        net, layer = lname.split(":")
        shape = nets[net][layer]
        jobs.append(LayerJob(f"{i}:{lname}", pruned_weight(rng, shape.weight_shape, 0.9), shape,
                             variant_for_batch(shape, 1)))
    built = build_many(jobs, target=Target(), cache_dir=cache_dir)
    cache = ArtifactCache(cache_dir)
    device = cupy.cuda.Device().id
    plain_reduce = cupy.RawKernel(_REDUCE_SOURCE, "sc_reduce_slices")
    head = "{\n    for (long long i"
    if head not in _REDUCE_SOURCE:
        raise SystemExit("sc_reduce_slices changed: update the probe's edit of it")
    pdl_reduce = cupy.RawKernel(_REDUCE_SOURCE.replace(head, "{\n    asm volatile(\"griddepcontrol.wait;\\n\\t"
                                                             "griddepcontrol.launch_dependents;\" ::: \"memory\");\n"
                                                             "    for (long long i", 1), "sc_reduce_slices")
    pdl = PdlLauncher()
    steps = []  # per layer: its launches, plain and PDL, on buffers of its own
    for job in jobs:
        layer = built[job.name]
        ptx = cache.get_text("kernel", layer.ptx_sha256, ".ptx")
        edited = assemble_cubin(with_grid_dependency(ptx, ENTRY_NAME), Target(), job.name,
                                max_registers=layer.tiling.max_registers, opt_level=layer.tiling.ptxas_level)
        _, fn_plain = load_kernel(layer.artifact, layer.artifact_suffix, ENTRY_NAME)
        _, fn_pdl = load_kernel(edited, ".cubin", ENTRY_NAME)
        s = layer.shape
        x = cupy.asarray(rng.standard_normal((1, s.in_channels, s.in_h, s.in_w), dtype=np.float32))
        y = cupy.zeros((1, s.out_channels, s.out_h, s.out_w), cupy.float32)
        bias = cupy.asarray(rng.standard_normal(s.out_channels, dtype=np.float32))
        ws = cupy.zeros((layer.tiling.slices,) + y.shape, cupy.float32)
        main_args = (x, ws if layer.tiling.slices > 1 else y, bias, np.uint64(0), np.int32(1), np.int32(layer.chunks))
        total = y.size
        red_args = (ws, y, np.uint64(0), np.int64(total), np.int32(layer.tiling.slices), np.int32(0), np.int32(0),
                    np.float32(0), np.int32(0), np.float32(0))
        steps.append(dict(name=job.name, layer=layer, fn_plain=fn_plain, fn_pdl=fn_pdl, main_args=main_args,
                          red_args=red_args, y=y, red_grid=(min(-(-total // 256), 4096), 1, 1)))

    def run(use_pdl: bool) -> None:
        for st in steps:
            layer = st["layer"]
            grid, block = layer.grid(1), (layer.tiling.threads, 1, 1)
            if use_pdl:
                pdl(st["fn_pdl"].kernel, grid, block, st["main_args"], layer.shared_bytes)
            else:
                st["fn_plain"](grid, block, st["main_args"], shared_mem=layer.shared_bytes)
            if layer.tiling.slices > 1:
                if use_pdl:
                    pdl(pdl_reduce.kernel, st["red_grid"], (256, 1, 1), st["red_args"])
                else:
                    plain_reduce(st["red_grid"], (256, 1, 1), st["red_args"])

    run(False)
    cupy.cuda.Device().synchronize()
    want = [st["y"].copy() for st in steps]
    for st in steps:
        st["y"].fill(0)
    run(True)
    cupy.cuda.Device().synchronize()
    same = all(bool((st["y"] == w).all()) for st, w in zip(steps, want))
    kernels = sum(1 + (st["layer"].tiling.slices > 1) for st in steps)
    t_plain = time_gpu(lambda: run(False), repeat=30, max_seconds=0.5, capture=cupy_graph).us
    t_pdl = time_gpu(lambda: run(True), repeat=30, max_seconds=0.5, capture=cupy_graph).us
    print(f"{len(steps)} layers, {kernels} kernels: plain {t_plain:.1f} us, PDL {t_pdl:.1f} us "
          f"({(t_plain - t_pdl) / max(kernels, 1):+.2f} us per kernel saved); outputs equal: {same}")
    with open(args.out, "w") as f:
        json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(device)["name"].decode(),
                       date=time.strftime("%Y-%m-%d"), layers=names, kernels=kernels, plain_us=t_plain,
                       pdl_us=t_pdl, outputs_equal=same,
                       tilings=[st["layer"].tiling.describe() for st in steps]), f, indent=1)


if __name__ == "__main__":
    main()
