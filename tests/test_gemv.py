"""sparseconv.gemv: the dense small-batch Linear kernel, compiled by nvcc as
NVRTC compiles it at run time and executed in the PTX interpreter (CPU)
against float64; the front end's swap of dense nn.Linear layers (CPU); and on
the GPU, the kernel and sparsify's GemvLinear against float64 on fresh random
inputs, and what it refuses."""

import numpy as np
import pytest
import torch
from torch import fx, nn

from sparseconv.compile import compile_to_ptx
from sparseconv.fx import GemvLinear, swap_dense_linears
from sparseconv.gemv import MAX_GEMV_BATCH, MIN_GEMV_FEATURES, WARPS_PER_BLOCK, GemvVariant, gemv_source
from sparseconv.shapes import Target

from ptx_interpreter import run_kernel


def rel_l2(a, ref) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.nvcc
@pytest.mark.parametrize("batch,variant", [(1, GemvVariant()), (3, GemvVariant()), (2, GemvVariant(1, 2))],
                         ids=["b1-default", "b3-default", "b2-one-warp-a-feature"])
def test_the_kernel_sums_every_weight_once(batch, variant):
    """in_features 4,000: the default's lanes run one unrolled step and the
    tail, or the tail alone; 7 features leave the last block's last warps
    without a row (nothing may be written past y)."""
    rng = np.random.default_rng(batch)
    n_in, n_out = 4000, 7
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    y = np.full((batch, n_out), 12345.0, np.float32)
    ptx = compile_to_ptx(gemv_source(batch, variant), Target(), "the gemv kernel")
    rows_per_block = WARPS_PER_BLOCK // variant.split
    run_kernel(ptx, "sc_gemv", grid=(-(-n_out // rows_per_block), 1, 1), block=(WARPS_PER_BLOCK * 32, 1, 1),
               args=[x, w, bias, y, n_in, n_out])
    ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    assert rel_l2(y, ref) < 1e-6


def test_linear_gemv_refuses_an_x_or_w_that_is_not_2d_before_touching_a_gpu():
    from sparseconv.gemv import linear_gemv

    for x, w in ((np.zeros((1, 2, 4), np.float32), np.zeros((3, 4), np.float32)),
                 (np.zeros((1, 4), np.float32), np.zeros((3, 4, 1), np.float32))):
        with pytest.raises(ValueError, match=r"gemv: x and w must be 2-D.*got shapes"):
            linear_gemv(0, x, w, np.zeros(3, np.float32), np.zeros((1, 3), np.float32))


def test_gemv_source_refuses_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match=f"batch must be 1..{MAX_GEMV_BATCH}"):
        gemv_source(MAX_GEMV_BATCH + 1)
    with pytest.raises(ValueError, match="split must be 1, 2, 4 or 8"):
        gemv_source(1, GemvVariant(split=3))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2048, MIN_GEMV_FEATURES)                  # ResNet-50's: swapped
        self.small = nn.Linear(MIN_GEMV_FEATURES, 10)                 # too few features for the kernel
        self.odd = nn.Sequential(nn.Linear(10, 1002), nn.ReLU(), nn.Linear(1002, 1000, bias=False))  # 1002 % 4

    def forward(self, x):
        return self.small(self.fc(x)) + self.odd(x[:, :10]).sum(1, keepdim=True)


@pytest.mark.parametrize("traced", [True, False])
def test_the_front_end_swaps_only_wide_dense_linears(traced):
    torch.manual_seed(0)
    net = _Head().eval()
    x = torch.randn(3, 2048)
    want = net(x)
    weight = net.fc.weight
    module = fx.symbolic_trace(net) if traced else net
    assert swap_dense_linears(module) == ["fc"]
    swapped = module.get_submodule("fc")
    assert isinstance(swapped, GemvLinear) and swapped.weight is weight
    assert type(module.get_submodule("small")) is nn.Linear and type(module.get_submodule("odd.2")) is nn.Linear
    assert set(dict(module.named_parameters())) >= {"fc.weight", "fc.bias"}  # same parameters, same names
    assert torch.equal(module(x), want)  # CPU input: F.linear, the same numbers
    assert "sparseconv.gemv at batch <= 8" in repr(swapped)


def test_a_gemv_linear_keeps_autograd_on_the_cpu_and_through_f_linear():
    lin = nn.Linear(8, MIN_GEMV_FEATURES)
    g = GemvLinear(lin, "head")
    x = torch.randn(2, 8, requires_grad=True)
    g(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    # without a bias: the kernel's zeros are a buffer that is not saved
    no_bias = GemvLinear(nn.Linear(8, MIN_GEMV_FEATURES, bias=False), "head")
    assert set(no_bias.state_dict()) == {"weight"} and not no_bias.zero_bias.any()


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out", [(4096, 1000), (2048, 1000), (36, 1001), (25088, 64)])
def test_linear_gemv_matches_float64_on_the_gpu(n_in, n_out):
    import cupy as cp

    from sparseconv.gemv import linear_gemv

    rng = np.random.default_rng(n_in + n_out)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    for batch in range(1, MAX_GEMV_BATCH + 1):
        x = rng.standard_normal((batch, n_in)).astype(np.float32)
        y = cp.full((batch, n_out), np.nan, np.float32)
        linear_gemv(0, cp.asarray(x), cp.asarray(w), cp.asarray(bias), y)
        again = cp.empty_like(y)
        linear_gemv(0, cp.asarray(x), cp.asarray(w), cp.asarray(bias), again)
        ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
        assert rel_l2(cp.asnumpy(y), ref) < 1e-6, batch
        assert cp.array_equal(y, again)  # a fixed summation order: identical run to run


@pytest.mark.gpu
def test_linear_gemv_refuses_bad_input_before_launching():
    import cupy as cp

    from sparseconv.gemv import linear_gemv

    x, w = cp.ones((1, 64), cp.float32), cp.ones((1000, 64), cp.float32)
    bias, y = cp.zeros(1000, cp.float32), cp.empty((1, 1000), cp.float32)
    with pytest.raises(ValueError, match=r"y must have shape \(1, 1000\)"):
        linear_gemv(0, x, w, bias, cp.empty((2, 1000), cp.float32))
    with pytest.raises(ValueError, match="C-contiguous float32"):
        linear_gemv(0, x.astype(cp.float64), w, bias, y)
    with pytest.raises(ValueError, match="16-byte aligned"):
        linear_gemv(0, cp.ones(65, cp.float32)[1:].reshape(1, 64), w, bias, y)  # 4 bytes past an allocation
    with pytest.raises(ValueError, match=f"1..{MAX_GEMV_BATCH} images"):
        linear_gemv(0, cp.ones((MAX_GEMV_BATCH + 1, 64), cp.float32), w, bias,
                    cp.empty((MAX_GEMV_BATCH + 1, 1000), cp.float32))


class _Classifier(nn.Module):
    """A pruned conv and a dense VGG-style head: two wide Linears, one without bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        with torch.no_grad():
            self.conv.weight.mul_((torch.rand_like(self.conv.weight) > 0.8).float())
        self.fc1 = nn.Linear(8 * 6 * 6, 1024)
        self.fc2 = nn.Linear(1024, 1000, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


@pytest.mark.gpu
def test_sparsify_runs_dense_heads_through_the_gemv_kernel(tmp_path):
    import sparseconv.torch as sct

    torch.manual_seed(0)
    net = _Classifier().cuda().eval()
    fast = sct.sparsify(net, torch.randn(1, 3, 6, 6, device="cuda"), cache_dir=str(tmp_path), progress=False,
                        route_batches=None, cuda_graph=True)
    assert fast.sparseconv_gemv == ["fc1", "fc2"]
    ref_net = _Classifier().double().cuda().eval()
    ref_net.load_state_dict(net.state_dict())
    with torch.no_grad():
        for batch in (1, 5, MAX_GEMV_BATCH + 1):  # the last: F.linear
            x = torch.randn(batch, 3, 6, 6, device="cuda")
            got = fast(x)
            ref = ref_net(x.double())
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-5, batch
    off = sct.sparsify(net, torch.randn(1, 3, 6, 6, device="cuda"), cache_dir=str(tmp_path), progress=False,
                       route_batches=None, gemv=False)
    assert off.sparseconv_gemv == [] and type(off.get_submodule("fc1")) is nn.Linear
