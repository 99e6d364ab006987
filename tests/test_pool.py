"""CPU: sparseconv.pool's max-pool kernel, compiled by nvcc as NVRTC compiles
it at run time and executed in the PTX interpreter, against torch's
F.max_pool2d (CPU) bit for bit, NaN and infinities included; its output
sizes against torch's; and the front end's swap of nn.MaxPool2d."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from sparseconv.compile import compile_to_ptx
from sparseconv.fx import IndexFreeMaxPool2d, swap_max_pools
from sparseconv.pool import MaxPoolShape, pool_source
from sparseconv.shapes import Target

from ptx_interpreter import run_kernel

POOLS = [MaxPoolShape.of(3, 2, 1),                       # ResNet's stem pool
         MaxPoolShape.of(2, 2),                          # VGG's
         MaxPoolShape.of((3, 2), (1, 2), (1, 0), (2, 1)),  # dilated, non-square
         MaxPoolShape.of(3, 2, 1, ceil_mode=True)]       # a last window past the input


def pool_ptx(kernel, stride, pad_top_left, dilation, in_size, out_size) -> str:
    """The kernel for one window and plane size (compiled in, as at run time)."""
    return compile_to_ptx(pool_source(kernel, stride, pad_top_left, dilation, in_size, out_size), Target(),
                          "the max pool")


def torch_pool(x: np.ndarray, s: MaxPoolShape) -> np.ndarray:
    return F.max_pool2d(torch.from_numpy(x), s.kernel, s.stride, s.padding, s.dilation, s.ceil_mode).numpy()


@pytest.mark.nvcc
@pytest.mark.parametrize("flat", [False, True], ids=["planes", "flat"])
@pytest.mark.parametrize("pool", POOLS, ids=str)
def test_the_kernel_gives_torchs_maxima_bit_for_bit(pool, flat):
    """Both kernels: a block per plane (sc_max_pool2d, for tensors of 2^31
    outputs or more), and one loop over every output of the tensor
    (sc_max_pool2d_flat, the default)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 9)).astype(np.float32)
    x[0, 0, 2, 3], x[1, 2, 0, 0], x[0, 1, 4, 4] = np.nan, np.inf, -np.inf  # NaN propagates, as in torch
    x[1, 1] = -np.inf                                                     # a plane of -inf: no padding wins
    oh, ow = pool.output_size(7, 9)
    y = np.full((2, 3, oh, ow), 12345.0, np.float32)
    ptx = pool_ptx(pool.kernel, pool.stride, pool.padding, pool.dilation, (7, 9), (oh, ow))
    if flat:  # fewer threads than outputs, and blocks that span planes: the grid-stride loop runs
        run_kernel(ptx, "sc_max_pool2d_flat", grid=(3, 1, 1), block=(5, 1, 1), args=[x, y, np.int32(y.size)])
    else:  # fewer blocks than planes and fewer threads than pixels: both grid-stride loops run
        run_kernel(ptx, "sc_max_pool2d", grid=(2, 4, 1), block=(4, 1, 1), args=[x, y, 6])
    want = torch_pool(x, pool)
    assert y.shape == want.shape
    assert np.array_equal(y, want, equal_nan=True)
    assert np.isnan(y).any()


@pytest.mark.parametrize("size", [1, 2, 5, 7, 8, 112, 113])
def test_output_sizes_match_torch(size):
    for k in (1, 2, 3, 5):
        for s in (1, 2, 3):
            for p in range(k // 2 + 1):
                for d in (1, 2):
                    for ceil in (False, True):
                        pool = MaxPoolShape.of(k, s, p, d, ceil)
                        try:
                            want = F.max_pool2d(torch.zeros(1, 1, size, size), k, s, p, d, ceil).shape[2:]
                        except RuntimeError:  # torch: the output would be empty
                            with pytest.raises(ValueError, match="gives no output"):
                                pool.output_size(size, size)
                            continue
                        assert pool.output_size(size, size) == tuple(want), pool


def test_windows_torch_refuses_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="padding must be at most half"):
        MaxPoolShape.of(2, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        MaxPoolShape.of(3, 0)
    with pytest.raises(TypeError, match="max pool kernel_size must be an int or a pair of ints"):
        MaxPoolShape.of(2.5, 2)
    assert MaxPoolShape.of(3, None).stride == (3, 3)  # torch's default: stride = kernel


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.block = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
        self.indexed = nn.MaxPool2d(2, return_indices=True)  # its indices are used: never swapped

    def forward(self, x):
        y, idx = self.indexed(self.block(self.pool(self.conv(x))))
        return y + idx.float()


@pytest.mark.parametrize("traced", [True, False])
def test_the_front_end_swaps_every_max_pool_without_indices(traced):
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 3, 16, 16)
    want = net(x)
    module = fx.symbolic_trace(net) if traced else net
    assert swap_max_pools(module) == ["pool", "block.1"]
    assert isinstance(module.get_submodule("pool"), IndexFreeMaxPool2d)
    assert type(module.get_submodule("indexed")) is nn.MaxPool2d
    assert torch.equal(module(x), want)  # CPU input: torch's pool, same graph
    assert "no indices" in repr(module.get_submodule("block.1"))


@pytest.mark.nvcc
@pytest.mark.parametrize("pads,ceil", [((1, 0, 0, 1), 0), ((0, 0, 0, 0), 1), ((1, 1, 1, 1), 1)])
def test_the_kernel_gives_the_onnx_runners_maxima_with_uneven_pads(pads, ceil):
    """sparseconv run pools with this kernel on the GPU (runner._pool): top and
    left pads go to the kernel, bottom, right and ceil_mode only size the output."""
    from sparseconv.runner import _pool

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 8, 7)).astype(np.float32)
    x[1, 0, 0, 0] = np.nan
    attrs = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": pads, "ceil_mode": ceil}
    want = _pool(np, x, attrs, "max")  # the NumPy path: a padded copy, then maxima of shifted views
    y = np.full(want.shape, 12345.0, np.float32)
    run_kernel(pool_ptx((3, 3), (2, 2), pads[:2], (1, 1), (8, 7), want.shape[2:]), "sc_max_pool2d",
               grid=(1, 6, 1), block=(32, 1, 1), args=[x, y, 6])
    assert np.array_equal(y, want, equal_nan=True)


@pytest.mark.nvcc
def test_the_sizes_are_compiled_in_so_no_thread_divides():
    """With the plane's sizes as kernel arguments, a pixel's row and column
    took an integer division, and the kernel was bound by its integer work
    (ncu, session 28: 121 us for ResNet-50's stem pool at batch 64; 96 with
    the sizes compiled in). Each size gets its own source and kernel."""
    ptx = pool_ptx((3, 3), (2, 2), (1, 1), (1, 1), (112, 112), (56, 56))
    assert not re.search(r"\b(div|rem)\.[su]32\b", ptx)
    assert "griddepcontrol.wait" in ptx
    assert pool_source((3, 3), (2, 2), (1, 1), (1, 1), (112, 112), (56, 56)) != \
        pool_source((3, 3), (2, 2), (1, 1), (1, 1), (56, 56), (28, 28))


class _Pools(nn.Module):
    """Pools that leave their input as it is (adaptive to its size, 1x1 at
    stride 1), one that does not and is called twice (once on a value read
    elsewhere), one whose input has another reader (then mutated in place
    after it), and one on the graph's input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.same = nn.AdaptiveAvgPool2d((8, 8))
        self.rows = nn.AdaptiveMaxPool2d((None, 8))
        self.one = nn.AvgPool2d(1, 1)
        self.halves = nn.AdaptiveAvgPool2d(4)
        self.shared = nn.AdaptiveAvgPool2d(8)
        self.on_input = nn.MaxPool2d(1)

    def forward(self, x):
        y = self.one(self.rows(self.same(self.conv(x))))
        z = torch.relu(y)
        w = self.shared(z).add_(1)  # in place on the pool's output, which would be z, read again below
        return self.halves(y) + self.halves(z + w).sum() + self.on_input(x).sum()


def test_pools_that_leave_their_input_as_it_is_are_skipped_where_nothing_writes_into_it():
    from sparseconv.fx import SkipIdentityPool, identity_pool, skip_identity_pools

    torch.manual_seed(0)
    net = _Pools().eval()
    gm = fx.symbolic_trace(net)
    assert skip_identity_pools(gm) == ["same", "rows", "one", "halves"]
    assert all(isinstance(gm.get_submodule(n), SkipIdentityPool) for n in ("same", "rows", "one"))
    for size in (8, 16):  # at 16 the adaptive pools average and take maxima again, through torch
        x = torch.randn(2, 3, size, size)
        assert torch.equal(gm(x), net(x)), size
    assert not identity_pool(nn.AvgPool2d(1, 1, divisor_override=2)) and not identity_pool(nn.MaxPool2d(3, 1, 1))
    assert not identity_pool(nn.AdaptiveMaxPool2d(2, return_indices=True))
    assert "returns its input" in repr(gm.get_submodule("same"))


def test_the_runner_returns_a_1x1_pools_input_as_it_is():
    from sparseconv.runner import _pool

    x = np.random.default_rng().standard_normal((2, 3, 5, 4)).astype(np.float32)
    for reduce in ("mean", "max"):
        assert _pool(np, x, {"kernel_shape": (1, 1), "strides": (1, 1), "ceil_mode": 1}, reduce) is x
    padded = _pool(np, x, {"kernel_shape": (1, 1), "pads": (1, 0, 0, 0), "count_include_pad": 1}, "mean")
    assert padded.shape == (2, 3, 6, 4) and np.array_equal(padded[:, :, 1:], x)  # padded: not the input


def test_the_epilogue_pool_reference_is_torchs_2x2_max_pool():
    """dense.max_pool_2x2 (the reference side of Epilogue.pool, behind
    epilogue_reference) against nn.MaxPool2d(2, 2), odd sides included."""
    from sparseconv.dense import epilogue_reference
    from sparseconv.shapes import Epilogue

    y = np.random.default_rng().standard_normal((2, 3, 7, 10))
    want = torch.nn.MaxPool2d(2, 2)(torch.relu(torch.from_numpy(y))).numpy()
    assert np.array_equal(epilogue_reference(y, Epilogue("relu", pool=True)), want)
