"""Markers (gpu, nvcc) that skip themselves where the tool is missing, and a
session-wide artifact cache. tests/ptx_interpreter.py is importable as a
top-level module through pytest's `pythonpath = ["tests"]` (pyproject.toml)."""
import functools
import shutil

import pytest


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA device found")
    skip_nvcc = pytest.mark.skip(reason="nvcc not on PATH")
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and shutil.which("nvcc") is None:
            item.add_marker(skip_nvcc)


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory):
    """One cold cache per test session: compiles are real, shared across tests."""
    return tmp_path_factory.mktemp("sparseconv-cache")
