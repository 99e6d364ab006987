"""sparseconv.gemv: the dense and the sparse small-batch Linear kernels,
compiled by nvcc as NVRTC compiles them at run time and executed in the PTX
interpreter (CPU) against float64; the sparse entries (SparseRows); the front
end's swap of uncompiled nn.Linear layers (CPU); and on the GPU, the kernels
and sparsify's GemvLinear / SparseGemvLinear against float64 on fresh random
inputs, and what they refuse."""

import numpy as np
import pytest
import torch
from torch import fx, nn

from sparseconv.compile import compile_to_ptx
from sparseconv.fx import GemvLinear, SparseGemvLinear, swap_dense_linears
from sparseconv.gemv import (MAX_GEMV_BATCH, MIN_GEMV_FEATURES, MIN_SPARSE_GEMV_SPARSITY, SPARSE_GEMV_VARIANT,
                             WARPS_PER_BLOCK, GemvVariant, gemv_source, sparse_gemv_source, sparse_rows)
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


@pytest.mark.gpu
def test_a_gemv_linear_launches_on_pointers_as_the_checked_call():
    """GemvLinear's eager call (raw pointers and torch's stream, unchecked)
    equals linear_gemv on the same tensors as CuPy arrays (checked) bit for
    bit, with and without a bias, at every batch the kernel takes, within
    1e-6 of float64; an input of the wrong width goes to torch, which
    refuses it."""
    import cupy as cp

    from sparseconv.gemv import linear_gemv

    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    for lin in (nn.Linear(2048, 1000), nn.Linear(36, MIN_GEMV_FEATURES + 1, bias=False)):
        g = GemvLinear(lin.cuda(), "head")
        w = lin.weight.detach()
        bias = torch.zeros(lin.out_features, device="cuda") if lin.bias is None else lin.bias.detach()
        for batch in (1, 3, MAX_GEMV_BATCH):
            x = torch.randn(batch, lin.in_features, device="cuda")
            with torch.no_grad():
                got = g(x)
            checked = torch.full_like(got, float("nan"))
            torch.cuda.synchronize()
            linear_gemv(0, cp.from_dlpack(x), cp.from_dlpack(w), cp.from_dlpack(bias), cp.from_dlpack(checked))
            cp.cuda.get_current_stream().synchronize()
            ref = x.double() @ w.double().T + bias.double()
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-6, batch
            assert torch.equal(got, checked), batch
        with pytest.raises(RuntimeError), torch.no_grad():
            g(torch.randn(1, lin.in_features + 4, device="cuda"))


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


# -- the sparse kernel ------------------------------------------------------------------------------------------------

def _pruned(rng, shape, sparsity):
    w = rng.standard_normal(shape).astype(np.float32)
    w[rng.random(shape) < sparsity] = 0.0
    return w


def test_sparse_rows_keep_every_nonzero_once_in_row_and_column_order():
    rng = np.random.default_rng(1)
    w = _pruned(rng, (7, 300), 0.9)
    w[2] = 0.0                       # a row without entries
    w[4, :] = rng.standard_normal(300).astype(np.float32)  # a full row
    w[5, 17] = -0.0                  # a negative zero adds nothing: no entry
    rows = sparse_rows(w)
    assert rows.nnz == np.count_nonzero(w) and rows.row_start[0] == 0 and rows.row_start[-1] == rows.nnz
    assert rows.row_start[3] == rows.row_start[2] and rows.row_start[5] - rows.row_start[4] == 300
    assert np.array_equal(rows.to_dense(), w)
    for r in range(7):
        cols = rows.entries[rows.row_start[r]:rows.row_start[r + 1], 0]
        assert np.all(np.diff(cols.astype(np.int64)) > 0)   # column order within a row
    assert 17 not in rows.entries[rows.row_start[5]:rows.row_start[6], 0]
    empty = sparse_rows(np.zeros((3, 4), np.float32))
    assert empty.nnz == 0 and list(empty.row_start) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"must be 2-D \(out_features, in_features\), got shape \(2, 3, 4\)"):
        sparse_rows(np.zeros((2, 3, 4), np.float32))


@pytest.mark.nvcc
@pytest.mark.parametrize("batch,variant", [(1, SPARSE_GEMV_VARIANT), (3, SPARSE_GEMV_VARIANT), (8, GemvVariant(1, 2)),
                                           (2, GemvVariant(4, 2))],
                         ids=["b1-default", "b3-default", "b8-unroll2", "b2-four-warps-a-feature"])
def test_the_sparse_kernel_sums_every_nonzero_weight_once(batch, variant):
    """Rows with no entry, fewer entries than a warp, and more than one
    unrolled step (the loop and the tail); 11 features leave the last
    block's last warps without a row (nothing may be written past y); 1,002
    inputs, not a multiple of 4 (the sparse kernel gathers x by column)."""
    rng = np.random.default_rng(batch)
    n_in, n_out = 1002, 11
    w = _pruned(rng, (n_out, n_in), 0.7)
    w[0] = 0.0
    w[1, 20:] = 0.0                  # 20 columns or fewer: under one entry a lane
    rows = sparse_rows(w)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    y = np.full((batch, n_out), 12345.0, np.float32)
    ptx = compile_to_ptx(sparse_gemv_source(batch, variant), Target(), "the sparse gemv kernel")
    rows_per_block = WARPS_PER_BLOCK // variant.split
    run_kernel(ptx, "sc_sparse_gemv", grid=(-(-n_out // rows_per_block), 1, 1), block=(WARPS_PER_BLOCK * 32, 1, 1),
               args=[x, rows.entries, rows.row_start, bias, y, n_in, n_out])
    ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    assert rel_l2(y, ref) < 1e-6
    assert np.array_equal(y[:, 0], np.broadcast_to(bias[0], (batch,)))   # no entries: the bias alone


def test_the_sparse_kernel_takes_one_warp_a_row_where_rows_are_many_and_four_where_few():
    from sparseconv.gemv import sparse_gemv_variant

    assert sparse_gemv_variant(4096, 1) == GemvVariant(1, 8)   # VGG-16's fc6 / fc7 at batch 1
    assert sparse_gemv_variant(4096, 8) == GemvVariant(1, 4)
    assert sparse_gemv_variant(1000, 1) == sparse_gemv_variant(1000, 8) == GemvVariant(4, 4)   # fc8, ResNet-50's fc


def test_sparse_gemv_source_refuses_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match=f"sparse gemv: batch must be 1..{MAX_GEMV_BATCH}"):
        sparse_gemv_source(0)
    with pytest.raises(ValueError, match="split must be 1, 2, 4 or 8"):
        sparse_gemv_source(1, GemvVariant(split=16))


class _PrunedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc6 = nn.Linear(1002, MIN_GEMV_FEATURES)     # pruned, 1,002 inputs: the sparse kernel takes it
        self.fc7 = nn.Linear(MIN_GEMV_FEATURES, 1024)     # dense: the dense kernel
        self.mid = nn.Linear(1024, 1024, bias=False)      # under MIN_SPARSE_GEMV_SPARSITY zeros: dense kernel
        self.small = nn.Linear(1024, 10)                  # pruned but too few features: left alone
        with torch.no_grad():
            self.fc6.weight.mul_((torch.rand_like(self.fc6.weight) > 0.9).float())
            self.mid.weight.mul_((torch.rand_like(self.mid.weight) > MIN_SPARSE_GEMV_SPARSITY - 0.2).float())
            self.small.weight.mul_((torch.rand_like(self.small.weight) > 0.9).float())

    def forward(self, x):
        return self.small(self.mid(torch.relu(self.fc7(torch.relu(self.fc6(x))))))


@pytest.mark.parametrize("traced", [True, False])
def test_the_front_end_takes_pruned_wide_linears_to_the_sparse_kernel(traced):
    torch.manual_seed(0)
    net = _PrunedHead().eval()
    x = torch.randn(3, 1002)
    want = net(x)
    weight = net.fc6.weight
    module = fx.symbolic_trace(net) if traced else net
    assert swap_dense_linears(module) == ["fc6", "fc7", "mid"]
    sparse = module.get_submodule("fc6")
    assert isinstance(sparse, SparseGemvLinear) and sparse.weight is weight
    assert sparse.nnz == int((weight != 0).sum())
    assert np.array_equal(sparse_rows(weight.detach().numpy()).entries.view(np.int32), sparse.entries.numpy())
    assert isinstance(module.get_submodule("fc7"), GemvLinear) and isinstance(module.get_submodule("mid"), GemvLinear)
    assert type(module.get_submodule("small")) is nn.Linear
    assert set(sparse.state_dict()) == {"weight", "bias"}     # the entries are derived, not saved
    assert torch.equal(module(x), want)  # CPU input: F.linear, the same numbers
    assert f"{sparse.nnz:,} nonzero weights, sparseconv's sparse gemv at batch <= 8" in repr(sparse)


def test_a_sparse_gemv_linear_keeps_autograd_and_bias_free_layers_on_the_cpu():
    lin = nn.Linear(8, MIN_GEMV_FEATURES, bias=False)
    with torch.no_grad():
        lin.weight[:, 1:] = 0.0
    g = SparseGemvLinear(lin, "head")
    x = torch.randn(2, 8, requires_grad=True)
    g(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert set(g.state_dict()) == {"weight"} and not g.zero_bias.any() and g.nnz == MIN_GEMV_FEATURES


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out,sparsity", [(25088, 512, 0.9), (4096, 1000, 0.95), (1002, 1001, 0.6)])
def test_linear_sparse_gemv_matches_float64_on_the_gpu(n_in, n_out, sparsity):
    import cupy as cp

    from sparseconv.gemv import linear_sparse_gemv

    rng = np.random.default_rng(n_in + n_out)
    w = _pruned(rng, (n_out, n_in), sparsity)
    w[3] = 0.0
    rows = sparse_rows(w)
    entries, row_start = cp.asarray(rows.entries), cp.asarray(rows.row_start)
    bias = rng.standard_normal(n_out).astype(np.float32)
    for batch in range(1, MAX_GEMV_BATCH + 1):
        x = rng.standard_normal((batch, n_in)).astype(np.float32)
        y = cp.full((batch, n_out), np.nan, np.float32)
        linear_sparse_gemv(0, cp.asarray(x), entries, row_start, cp.asarray(bias), y)
        again = cp.empty_like(y)
        linear_sparse_gemv(0, cp.asarray(x), entries, row_start, cp.asarray(bias), again)
        ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
        assert rel_l2(cp.asnumpy(y), ref) < 1e-6, batch
        assert cp.array_equal(y, again)  # a fixed summation order: identical run to run


@pytest.mark.gpu
def test_linear_sparse_gemv_refuses_bad_input_before_launching():
    import cupy as cp

    from sparseconv.gemv import linear_sparse_gemv

    rows = sparse_rows(_pruned(np.random.default_rng(0), (1000, 64), 0.9))
    entries, row_start = cp.asarray(rows.entries), cp.asarray(rows.row_start)
    x, bias, y = cp.ones((1, 64), cp.float32), cp.zeros(1000, cp.float32), cp.empty((1, 1000), cp.float32)
    with pytest.raises(ValueError, match=r"y \(1, 1000\); got \(1000,\) and \(2, 1000\)"):
        linear_sparse_gemv(0, x, entries, row_start, bias, cp.empty((2, 1000), cp.float32))
    with pytest.raises(ValueError, match="entries must be uint32"):
        linear_sparse_gemv(0, x, entries.view(cp.int32), row_start, bias, y)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        linear_sparse_gemv(0, x.astype(cp.float64), entries, row_start, bias, y)
    with pytest.raises(ValueError, match=f"1..{MAX_GEMV_BATCH} images"):
        linear_sparse_gemv(0, cp.ones((MAX_GEMV_BATCH + 1, 64), cp.float32), entries, row_start, bias,
                           cp.empty((MAX_GEMV_BATCH + 1, 1000), cp.float32))


class _PrunedClassifier(_Classifier):
    """_Classifier with its head pruned (fc1 90% zeros, fc2 without a bias
    95%), too large to compile under max_linear_weights=1000."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            for m, keep in ((self.fc1, 0.1), (self.fc2, 0.05)):
                m.weight.mul_((torch.rand_like(m.weight) < keep).float())


@pytest.mark.gpu
def test_sparsify_runs_pruned_heads_it_does_not_compile_through_the_sparse_kernel(tmp_path):
    import sparseconv.torch as sct

    torch.manual_seed(1)
    net = _PrunedClassifier().cuda().eval()
    fast = sct.sparsify(net, torch.randn(1, 3, 6, 6, device="cuda"), cache_dir=str(tmp_path), progress=False,
                        route_batches=None, cuda_graph=True, max_linear_weights=1000)
    assert fast.sparseconv_gemv == ["fc1", "fc2"]
    plans = {p.name: p for p in fast.sparseconv_plan}
    for name in ("fc1", "fc2"):
        assert plans[name].action == "kept" and "runs sparseconv's sparse gemv at batch <= 8" in plans[name].reason
    ref_net = _PrunedClassifier().double().cuda().eval()
    ref_net.load_state_dict(net.state_dict())
    with torch.no_grad():
        for batch in (1, 5, MAX_GEMV_BATCH + 1, 1):  # MAX_GEMV_BATCH + 1: F.linear; then the graph of batch 1 again
            x = torch.randn(batch, 3, 6, 6, device="cuda")
            got = fast(x)
            ref = ref_net(x.double())
            assert float((got.double() - ref).norm() / ref.norm()) < 1e-5, batch


@pytest.mark.nvcc
@pytest.mark.parametrize("activation,clip", [("relu", None), ("relu6", None), ("clip", (-0.5, 0.25))])
def test_the_sparse_kernel_applies_a_fused_activation_at_the_store(activation, clip):
    rng = np.random.default_rng(4)
    n_in, n_out, batch = 300, 9, 2
    w = _pruned(rng, (n_out, n_in), 0.8) * 3
    rows = sparse_rows(w)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    y = np.full((batch, n_out), np.nan, np.float32)
    ptx = compile_to_ptx(sparse_gemv_source(batch, GemvVariant(1, 4), activation, clip), Target(), "sparse gemv")
    run_kernel(ptx, "sc_sparse_gemv", grid=(2, 1, 1), block=(WARPS_PER_BLOCK * 32, 1, 1),
               args=[x, rows.entries, rows.row_start, bias, y, n_in, n_out])
    lo, hi = clip or ((0.0, 6.0) if activation == "relu6" else (0.0, np.inf))
    ref = np.clip(x.astype(np.float64) @ w.astype(np.float64).T + bias, lo, hi)
    assert np.abs(ref).max() > 0 and rel_l2(y, ref) < 1e-6
    assert (y >= lo).all() and (y <= hi).all()


def test_activation_macro_refuses_what_the_epilogue_does_not_have():
    from sparseconv.gemv import activation_macro

    assert activation_macro("clip", (0.1, 0.2)) == "#define ACTIVATE(v) fminf(fmaxf((v), 0.10000000149011612f), " \
        "0.20000000298023224f)\n"   # the float32 bounds exactly
    with pytest.raises(ValueError, match="activation must be none, relu, relu6 or clip"):
        activation_macro("gelu")
    with pytest.raises(ValueError, match="activation must be none, relu, relu6 or clip"):
        activation_macro("clip")


@pytest.mark.gpu
def test_sparsify_times_the_sparse_gemv_for_compiled_linears_at_small_batches(tmp_path):
    """A pruned Linear that compiles (under max_linear_weights) is timed at
    batch <= 8 through the sparse gemv too, with its ReLU fused; whichever
    path each batch takes, the output matches float64."""
    import sparseconv.torch as sct

    torch.manual_seed(2)
    net = _PrunedClassifier().cuda().eval()
    fast = sct.sparsify(net, torch.randn(1, 3, 6, 6, device="cuda"), cache_dir=str(tmp_path), progress=False,
                        route_batches=(1, 16), cuda_graph=True)
    plans = {p.name: p for p in fast.sparseconv_plan}
    assert plans["fc1"].fused == ("relu",) and "batch 1: sparseconv" in plans["fc1"].reason
    assert "sparse gemv" in plans["fc1"].reason.split(";")[0] and "sparse gemv" not in plans["fc1"].reason.split(";")[1]
    ref_net = _PrunedClassifier().double().cuda().eval()
    ref_net.load_state_dict(net.state_dict())
    with torch.no_grad():
        for batch in (1, 3, 16):
            x = torch.randn(batch, 3, 6, 6, device="cuda")
            ref = ref_net(x.double())
            assert float((fast(x).double() - ref).norm() / ref.norm()) < 1e-5, batch
