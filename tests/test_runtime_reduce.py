"""CPU: the split-reduction kernel of sparseconv.runtime (sc_reduce_slices),
compiled by nvcc as NVRTC compiles it at run time, and executed in the PTX
interpreter against NumPy: the slices are added in slice order (bit for bit
what a float32 loop in that order gives), then the residual, then the clamps."""
import numpy as np
import pytest

from sparseconv.compile import compile_to_ptx
from sparseconv.runtime import _REDUCE_SOURCE
from sparseconv.shapes import Target

from ptx_interpreter import run_kernel

pytestmark = pytest.mark.nvcc


def reduce_ptx() -> str:
    return compile_to_ptx(_REDUCE_SOURCE, Target(), "the split reduction")


@pytest.mark.parametrize("slices,residual,lo,hi", [(2, False, None, None), (5, True, 0.0, None),
                                                   (16, True, -0.5, 0.5)])
def test_the_reduction_adds_slices_in_order_then_the_epilogue(slices, residual, lo, hi):
    rng = np.random.default_rng(slices)
    total = 1000  # not a multiple of the block: the last threads do nothing
    ws = rng.standard_normal((slices, total)).astype(np.float32)
    res = rng.standard_normal(total).astype(np.float32)
    y = np.full(total, np.nan, np.float32)
    block = 128
    run_kernel(reduce_ptx(), "sc_reduce_slices", grid=(-(-total // block) // 2, 1, 1), block=(block, 1, 1),
               args=[ws, y, res if residual else np.zeros(1, np.float32), total, slices, int(residual),
                     int(lo is not None), lo or 0.0, int(hi is not None), hi or 0.0])
    want = ws[0].copy()
    for s in range(1, slices):
        want += ws[s]  # float32, slice order
    if residual:
        want += res
    if lo is not None:
        want = np.maximum(want, np.float32(lo))
    if hi is not None:
        want = np.minimum(want, np.float32(hi))
    assert np.array_equal(y, want)  # half the blocks: the grid-stride loop covers the rest



def test_reduce_values_follow_the_kernels_signature():
    """reduce_values, the one mirror of sc_reduce_slices' parameters in
    Python (the checked reduce_slices and Conv2dKernel's prepared launches
    take it), matches the source's parameter list type for type, with the
    flags the kernel tests."""
    import ctypes
    import re

    from sparseconv.runtime import reduce_values

    params = re.search(r"sc_reduce_slices\(([^)]*)\)", _REDUCE_SOURCE).group(1)
    c_types = [" ".join(p.replace("__restrict__", "").split()[:-1]) for p in params.split(",")]
    as_ctypes = {"const float*": ctypes.c_void_p, "float*": ctypes.c_void_p, "long long": ctypes.c_int64,
                 "int": ctypes.c_int32, "float": ctypes.c_float}
    values = reduce_values(0x1000, 0x2000, 0x3000, 640, 4, (0.0, None))
    assert [type(v) for v in values] == [as_ctypes[t] for t in c_types], c_types
    assert [v.value for v in values] == [0x1000, 0x2000, 0x3000, 640, 4, 1, 1, 0.0, 0, 0.0]
    no_residual = reduce_values(0x1000, 0x2000, 0, 640, 4, (None, 6.0))
    assert [v.value for v in no_residual][2:] == [None, 640, 4, 0, 0, 0.0, 1, 6.0]
