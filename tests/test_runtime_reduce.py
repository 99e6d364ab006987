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


def pooled_reference(ws: np.ndarray, lo, hi) -> np.ndarray:
    """NumPy's sum of ws's slices (slices, planes, H, W) in slice order, clamped, then torch's 2x2 max pool
    (floor: an odd side drops its last row or column; row order from -inf, a NaN wins and stays)."""
    v = ws[0].copy()
    for s in range(1, ws.shape[0]):
        v += ws[s]
    if lo is not None:
        v = np.where(v < np.float32(lo), np.float32(lo), v)  # np.maximum would do too; where keeps NaN the same way
    if hi is not None:
        v = np.where(v > np.float32(hi), np.float32(hi), v)
    planes, h, w = v.shape
    out = np.full((planes, h // 2, w // 2), -np.inf, np.float32)
    for r in range(2):
        for c in range(2):
            tap = v[:, r:2 * (h // 2):2, c:2 * (w // 2):2]
            out = np.where((tap > out) | np.isnan(tap), tap, out)
    return out


@pytest.mark.parametrize("slices,conv_hw,lo,hi", [(2, (6, 8), None, None), (4, (7, 5), 0.0, None),
                                                  (3, (4, 4), 0.0, 6.0)])
def test_the_pooled_reduction_sums_clamps_then_takes_each_windows_max(slices, conv_hw, lo, hi):
    """sc_reduce_slices_pool (a split variant's sum where the epilogue pools)
    gives bit for bit what the plain sum followed by sparseconv.pool's 2x2
    max gives: odd sides floored, a NaN in a window wins."""
    rng = np.random.default_rng(slices)
    planes = 5
    ws = rng.standard_normal((slices, planes) + conv_hw).astype(np.float32)
    ws[1, 2, 1, 0] = np.nan  # one window of plane 2 holds a NaN
    h, w = conv_hw
    pooled = planes * (h // 2) * (w // 2)
    y = np.full(pooled, 7.0, np.float32)
    block = 32
    run_kernel(reduce_ptx(), "sc_reduce_slices_pool", grid=(max(1, -(-pooled // block) // 2), 1, 1),
               block=(block, 1, 1),
               args=[ws, y, planes * h * w, slices, h, w, pooled, int(lo is not None), lo or 0.0,
                     int(hi is not None), hi or 0.0])
    want = pooled_reference(ws, lo, hi)
    assert np.isnan(want[2, 0, 0]) and np.isnan(y.reshape(want.shape)[2, 0, 0])
    np.testing.assert_array_equal(y.reshape(want.shape), want)  # NaN equal to NaN; half the grid: the loop covers it


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


def test_reduce_pool_values_follow_the_kernels_signature():
    """reduce_pool_values mirrors sc_reduce_slices_pool's parameters type for
    type: sizes from the planes and the conv's sides (the pooled count floors
    odd sides), then the clamp's flags."""
    import ctypes
    import re

    from sparseconv.runtime import reduce_pool_values

    params = re.search(r"sc_reduce_slices_pool\(([^)]*)\)", _REDUCE_SOURCE).group(1)
    c_types = [" ".join(p.replace("__restrict__", "").split()[:-1]) for p in params.split(",")]
    as_ctypes = {"const float*": ctypes.c_void_p, "float*": ctypes.c_void_p, "long long": ctypes.c_int64,
                 "int": ctypes.c_int32, "float": ctypes.c_float}
    values = reduce_pool_values(0x1000, 0x2000, 6, (7, 10), 4, (0.0, None))
    assert [type(v) for v in values] == [as_ctypes[t] for t in c_types], c_types
    assert [v.value for v in values] == [0x1000, 0x2000, 6 * 70, 4, 7, 10, 6 * 3 * 5, 1, 0.0, 0, 0.0]
