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
from sparseconv.shapes import ConvShape, Epilogue, Target
from sparseconv.tilings import default_tiling
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
    # the pool source holds two kernels (a block a plane, and flat), the reduce source two (plain, pooling)
    entries = ptx.split(".entry ")[1:]
    assert len(entries) == (2 if family in ("pool", "reduce") else 1)
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



class _FakeDriver:
    """launch._Driver's surface, recording what each launch would hand to cuLaunchKernelEx."""

    def __init__(self, capturing=False, error=0):
        self.attribute = programmatic_attribute()
        self.launches = []
        self.is_capturing_now = capturing
        self.error = error
        self.why_not = None

    def launch_ex(self, config_ref, fn, params, extra):
        config = config_ref._obj
        n = len(params)
        # the low 4 bytes of each value (every value in these tests fits; a c_int32 has no more)
        values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint32)).contents.value for i in range(n)]
        self.launches.append({"fn": fn.value, "grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
                              "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
                              "shared": config.sharedMemBytes, "stream": config.hStream,
                              "attrs": config.numAttrs, "values": values})
        return self.error

    def capturing(self, stream_ptr):
        return self.is_capturing_now

    def error_string(self, err, msg_ref):
        msg_ref._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0


class _FakeFunction:
    """What PreparedLaunch reads of a RawKernel (its .kernel, a Function with .ptr, is optional)."""
    ptr = 0xF00D
    name = "sc_fake"


@pytest.fixture
def fake_driver(monkeypatch):
    import sparseconv.launch as launch_mod

    driver = _FakeDriver()
    monkeypatch.setattr(launch_mod, "_driver", driver)
    monkeypatch.setattr(launch_mod, "_overlap_on_device", {0: True})  # an sm_90 GPU 0, no CuPy asked
    return driver


def test_a_prepared_launch_sets_only_the_values_and_stream_it_is_given(fake_driver):
    from sparseconv.launch import PreparedLaunch

    p = PreparedLaunch(_FakeFunction(), (7, 2), (128,), 512,
                       (ctypes.c_void_p(), ctypes.c_void_p(0xB1A5), ctypes.c_uint64(5)), 0)
    p(0x51, 0xA000, None, 9)        # None: the second value stays
    p(0x52, 0xA400)                 # values after the last given stay too
    first, second = fake_driver.launches
    assert first == {"fn": 0xF00D, "grid": (7, 2, 1), "block": (128, 1, 1), "shared": 512, "stream": 0x51,
                     "attrs": 0, "values": [0xA000, 0xB1A5, 9]}
    assert second["stream"] == 0x52 and second["values"] == [0xA400, 0xB1A5, 9]


def test_a_launch_overlaps_only_while_its_stream_is_capturing_and_the_switch_is_on(fake_driver, monkeypatch):
    import sparseconv.launch as launch_mod

    p = launch_mod.PreparedLaunch(_FakeFunction(), (1,), (32,), 0, (ctypes.c_int32(1),), 0)
    p(0x51)
    fake_driver.is_capturing_now = True
    p(0x51)
    monkeypatch.setattr(launch_mod, "OVERLAP_LAUNCHES", False)
    p(0x51)
    launch_mod.launch_raw(_FakeFunction(), (1,), (32,), (ctypes.c_int32(3),), 0, 0x51, 0)  # the same path, made once
    assert [launch["attrs"] for launch in fake_driver.launches] == [0, 1, 0, 0]
    assert fake_driver.launches[-1]["values"] == [3]


def test_a_failed_launch_says_the_driver_error_and_a_missing_driver_function_what_to_do(fake_driver, monkeypatch):
    import sparseconv.launch as launch_mod

    fake_driver.error = 1
    fake_driver.is_capturing_now = True
    p = launch_mod.PreparedLaunch(_FakeFunction(), (1,), (32,), 0, (ctypes.c_int32(1),), 0)
    with pytest.raises(RuntimeError, match=r"failed for kernel sc_fake \(grid \(1, 1, 1\), block \(32, 1, 1\), 0 "
                                           r"bytes of shared memory\): CUresult 1 \(CUDA_ERROR_INVALID_VALUE\); set "
                                           r"SPARSECONV_OVERLAP_LAUNCHES=0"):
        p(0x51)
    fake_driver.launch_ex = None
    fake_driver.why_not = "no cuLaunchKernelEx in libcuda.so.1 (undefined symbol)"
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx \(CUDA 12.0 and later\), but: no cuLaunchKernelEx "
                                           r"in libcuda.so.1 \(undefined symbol\)\. Install a newer NVIDIA driver"):
        launch_mod.PreparedLaunch(_FakeFunction(), (1,), (32,), 0, (ctypes.c_int32(1),), 0)
