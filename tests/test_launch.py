"""sparseconv.launch on the CPU: the ctypes mirror of cuda.h's launch
structs (checked against cuda.h itself, compiled by nvcc), the kernel
arguments, and that every kernel source launched through launch() waits for
the kernel before it (on sm_90, not below)."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from sparseconv.compile import compile_to_ptx
from sparseconv.gemv import GemvVariant, gemv_source
from sparseconv.launch import (GRID_DEPENDENCY_CUDA, LaunchAttribute, LaunchConfig, PROGRAMMATIC_STREAM_SERIALIZATION,
                               c_args, launch_config, programmatic_attribute)
from sparseconv.pool import pool_source
from sparseconv.render import render
from sparseconv.runtime import _REDUCE_SOURCE
from sparseconv.shapes import ConvShape, Epilogue, Target, default_tiling
from sparseconv.table import TableTiling, table_source

LAYOUT_PROBE = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main() {
    printf("%zu %zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttributeValue),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


@pytest.mark.nvcc
def test_the_launch_structs_match_cuda_h(tmp_path):
    src = tmp_path / "layout.cu"
    src.write_text(LAYOUT_PROBE)
    exe = tmp_path / "layout"
    subprocess.run([shutil.which("nvcc"), str(src), "-o", str(exe)], check=True, capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    ours = [ctypes.sizeof(LaunchAttribute), LaunchAttribute.value.offset, ctypes.sizeof(LaunchConfig),
            LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset, LaunchAttribute.value.size, PROGRAMMATIC_STREAM_SERIALIZATION]
    assert got == ours


def test_the_attribute_asks_for_programmatic_serialization():
    a = programmatic_attribute()
    assert a.id == PROGRAMMATIC_STREAM_SERIALIZATION
    value = ctypes.c_int.from_address(ctypes.addressof(a) + LaunchAttribute.value.offset)
    assert value.value == 1


def test_launch_config_pads_grid_and_block_to_three_dimensions():
    attr = programmatic_attribute()
    cfg = launch_config((7, 3), (256,), 1024, 0xABC0, attr)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (7, 3, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (256, 1, 1)
    assert cfg.sharedMemBytes == 1024 and cfg.hStream == 0xABC0 and cfg.numAttrs == 1
    assert ctypes.addressof(cfg.attrs.contents) == ctypes.addressof(attr)


class _FakeArray:
    """What c_args reads of a CuPy array: .data.ptr (no GPU here)."""

    class data:
        ptr = 0x7F00_0000_1000


def test_c_args_passes_arrays_as_pointers_and_numpy_scalars_as_their_type():
    raw = ctypes.c_void_p(0x7F00_0000_2000)  # a raw pointer (the drop-in's eager launches): passed as it is
    vals = c_args([_FakeArray(), np.int32(-3), np.int64(1 << 40), np.uint64(0), np.float32(0.5), raw])
    assert [type(v) for v in vals] == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64,
                                       ctypes.c_float, ctypes.c_void_p]
    assert [v.value for v in vals] == [0x7F00_0000_1000, -3, 1 << 40, 0, 0.5, 0x7F00_0000_2000]
    assert vals[-1] is raw


@pytest.mark.parametrize("bad", [3, 0.5, np.float64(1.0), None])
def test_c_args_refuses_what_cupy_would_pass_differently(bad):
    with pytest.raises(TypeError, match="a kernel argument must be a CuPy array, a NumPy int32"):
        c_args([bad])


def _sources():
    """Every kernel source that runtime, table, pool and gemv launch through launch()."""
    shape = ConvShape(16, 32, 9, 9, 3, 3, padding=(1, 1))
    return {
        "code": render(shape, default_tiling(shape), Epilogue("relu")).source,
        "reduce": _REDUCE_SOURCE,
        "table": table_source(shape, TableTiling(2, 4), Epilogue("relu")),
        "pool": pool_source((3, 3), (2, 2), (1, 1), (1, 1), (9, 9), (5, 5)),
        "gemv": gemv_source(2, GemvVariant()),
    }


@pytest.mark.nvcc
@pytest.mark.parametrize("family", ["code", "reduce", "table", "pool", "gemv"])
def test_every_launched_kernel_waits_for_the_kernel_before_it_on_sm_90(family):
    source = _sources()[family]
    assert GRID_DEPENDENCY_CUDA in source
    ptx = compile_to_ptx(source, Target("sm_90"), family)
    entries = ptx.split(".entry ")[1:]  # the pool source holds two kernels (a block a plane, and flat)
    assert len(entries) == (2 if family == "pool" else 1)
    for body in entries:
        assert body.count("griddepcontrol.wait") == 1
        assert body.count("griddepcontrol.launch_dependents") == 1
        assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")
    # before sm_90 there is no such instruction: the macros are empty
    assert "griddepcontrol" not in compile_to_ptx(source, Target("sm_80"), family)


@pytest.mark.nvcc
@pytest.mark.parametrize("residual", [False, True])
def test_the_table_kernel_reads_its_table_before_the_wait_and_its_input_after(residual):
    source = table_source(ConvShape(16, 32, 9, 9, 1, 1), TableTiling(2, 4, True), Epilogue(residual=residual))
    ptx = compile_to_ptx(source, Target("sm_90"), "t")
    body = ptx[ptx.index(".entry sc_table_conv"):]
    wait = body.index("griddepcontrol.wait")
    assert "ld.global.nc.u32" in body[:wait] or "ld.global.nc.b32" in body[:wait]  # starts[k], starts[k + 1]
    # the one float read before it is bias[k]: no input (x) and no residual, which the kernel before may write
    assert body[:wait].count("ld.global.nc.f32") == 1
    assert "st.global" not in body[:wait]

