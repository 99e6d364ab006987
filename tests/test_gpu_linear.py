"""GPU: pruned fully connected layers against float64 on fresh random inputs:
compile_linear at batch 1, 7 and 64 (the split variant and the whole one),
sparsify of a small CNN with pruned Linear layers, and the ONNX runner on a
model with Gemm and MatMul layers. Outputs are poisoned with NaN first, so an
element never written fails."""
import copy

import numpy as np
import pytest

import sparseconv
from sparseconv.testing import pruned_weight, relative_l2

pytestmark = pytest.mark.gpu
TOL = 1e-5


def _ref(x, w, b, relu):
    y = x.astype(np.float64) @ w.astype(np.float64).T + (0.0 if b is None else b.astype(np.float64))
    return np.maximum(y, 0.0) if relu else y


@pytest.mark.parametrize("cin, cout", [(1024, 300), (40, 24), (4096, 1000)])
def test_compile_linear_matches_float64_at_batch_1_7_64(session_cache_dir, cin, cout):
    import cupy as cp

    rng = np.random.default_rng()
    w = pruned_weight(rng, (cout, cin), 0.9, zero_channels=1)
    b = rng.standard_normal(cout).astype(np.float32)
    fc = sparseconv.compile_linear(w, bias=b, activation="relu", cache_dir=str(session_cache_dir), name="fc")
    assert isinstance(fc, sparseconv.LinearKernel) and fc.backend == "sparseconv"
    assert (fc.in_features, fc.out_features) == (cin, cout)
    for batch in (1, 7, 64):
        x = rng.standard_normal((batch, cin)).astype(np.float32)
        out = cp.full((batch, cout), np.nan, cp.float32)
        assert fc(cp.asarray(x), out=out) is out
        y = out.get()
        assert not np.isnan(y).any(), f"batch {batch}: outputs never written"
        assert relative_l2(y, _ref(x, w, b, True)) <= TOL, batch
        y2 = fc(cp.asarray(x)).get()  # no out: a fresh (N, out) array
        np.testing.assert_array_equal(y2, y)
    if cin >= 1024:  # the split variant serves small batches
        assert fc.stats["variants"][0]["up_to_batch"] == 16


def test_linear_kernel_takes_torch_tensors_and_refuses_bad_inputs(session_cache_dir):
    import cupy as cp
    import torch

    rng = np.random.default_rng(1)
    w = pruned_weight(rng, (8, 20), 0.8)
    fc = sparseconv.compile_linear(w, cache_dir=str(session_cache_dir), name="head.fc")
    x = torch.randn(3, 20, device="cuda")
    y = cp.asnumpy(fc(x))
    assert relative_l2(y, _ref(x.cpu().numpy(), w, None, False)) <= TOL
    with pytest.raises(ValueError, match=r"head.fc: x has 21 features, this layer takes 20"):
        fc(cp.zeros((3, 21), cp.float32))
    with pytest.raises(ValueError, match=r"head.fc: x must be 2-D \(N, 20\), got shape \(3, 20, 1, 1\); flatten"):
        fc(cp.zeros((3, 20, 1, 1), cp.float32))
    with pytest.raises(TypeError, match="head.fc: x is a NumPy"):
        fc(np.zeros((3, 20), np.float32))
    with pytest.raises(TypeError, match="head.fc: x must be float32"):
        fc(cp.zeros((3, 20), cp.float64))
    with pytest.raises(ValueError, match="head.fc: x must be C-contiguous"):
        fc(cp.zeros((20, 3), cp.float32).T)
    with pytest.raises(ValueError, match=r"head.fc: out must be .* shape \(3, 8\)"):
        fc(cp.zeros((3, 20), cp.float32), out=cp.zeros((3, 9), cp.float32))


def test_sparsify_compiles_pruned_linears_and_routes_them(session_cache_dir):
    import torch
    from torch import nn

    import sparseconv.torch as sct

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, padding=1)
            self.fc1, self.fc2, self.head = nn.Linear(16 * 8 * 8, 256), nn.Linear(256, 128), nn.Linear(128, 10)

        def forward(self, x):
            x = torch.relu(self.conv(x)).flatten(1)
            return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for m in (net.conv, net.fc1, net.fc2):
            m.weight.mul_((torch.rand_like(m.weight) >= 0.9).float())
    net = net.cuda().eval()
    fast = sct.sparsify(net, torch.randn(1, 3, 8, 8, device="cuda"), cache_dir=str(session_cache_dir),
                        progress=False)
    plan = {p.name: p for p in fast.sparseconv_plan}
    assert set(plan) == {"conv", "fc1", "fc2"}  # the dense head is left alone
    assert plan["fc1"].kind == plan["fc2"].kind == "linear" and plan["fc1"].fused == ("relu",)
    assert all(p.action in ("sparseconv", "dense", "mixed") for p in plan.values())
    assert "cuBLAS fp32" in plan["fc1"].reason and "batch 64" in plan["fc1"].reason
    for batch in (1, 7, 64):
        x = torch.randn(batch, 3, 8, 8, device="cuda")
        with torch.no_grad():
            y = fast(x)
            ref = copy.deepcopy(net).double()(x.double())
        assert relative_l2(y.cpu().numpy(), ref.cpu().numpy()) <= TOL, batch
    # every path, whatever the routing chose: force the kernel
    for m in (fast.fc1, fast.fc2):
        m.route = []
    with torch.no_grad():
        x = torch.randn(5, 3, 8, 8, device="cuda")
        ref = copy.deepcopy(net).double()(x.double())
        assert relative_l2(fast(x).cpu().numpy(), ref.cpu().numpy()) <= TOL


def test_runner_runs_gemm_and_matmul_as_kernels(tmp_path):
    from onnx import helper
    from onnx_models import save_model

    from sparseconv.runner import compile_model, run_reference

    rng = np.random.default_rng(3)
    inits = {"wc": pruned_weight(rng, (4, 3, 3, 3), 0.5),
             "w1": pruned_weight(rng, (64, 4 * 6 * 6), 0.9), "b1": rng.standard_normal(64).astype(np.float32),
             "w2": pruned_weight(rng, (64, 10), 0.9)}
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Gemm", ["f", "w1", "b1"], ["g"], name="fc1", transB=1),
             helper.make_node("Relu", ["g"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["out"], name="fc2")]
    path = save_model(tmp_path / "m.onnx", nodes, inits, ["N", 3, 6, 6])
    sparse = compile_model(path, cache_dir=str(tmp_path / "cache"))
    assert isinstance(sparse.kernels["fc1"], sparseconv.LinearKernel)
    assert "fc1: Gemm as Linear 144->64, sparseconv" in sparse.plan
    assert "fc2: MatMul as Linear 64->10, sparseconv" in sparse.plan
    for batch in (1, 7, 64):
        x = rng.standard_normal((batch, 3, 6, 6)).astype(np.float32)
        y = sparse(x).get()
        assert relative_l2(y, run_reference(sparse.program, x)[0]) <= TOL, batch


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_runner_streams_dense_heads_through_gemv(tmp_path, cuda_graph):
    """`sparseconv run`'s dense Gemm (transB=1: its constant serves as is) and
    MatMul (a transposed copy) of 1,000 outputs run sparseconv.gemv at batch
    <= 8 and the operator above; float64 reference on fresh inputs."""
    from onnx_models import dense_head

    from sparseconv.gemv import MAX_GEMV_BATCH
    from sparseconv.runner import compile_model, run_reference

    rng = np.random.default_rng()
    path, _ = dense_head(tmp_path, rng)
    sparse = compile_model(path, cache_dir=str(tmp_path / "cache"), cuda_graph=cuda_graph, route_batches=None)
    assert any(line.startswith("head2: MatMul, dense (sparseconv.gemv") for line in sparse.plan)
    for batch in (1, 3, MAX_GEMV_BATCH, MAX_GEMV_BATCH + 1, 3):
        x = rng.standard_normal((batch, 3, 4, 4)).astype(np.float32)
        y = sparse(x).get()
        assert relative_l2(y, run_reference(sparse.program, x)[0]) <= TOL, batch
    if cuda_graph:  # above 8 images the products run torch's cuBLAS, inside the capture too
        assert set(sparse.graph_notes.values()) == {"captured"}, sparse.graph_notes
    assert sorted(sparse._gemv_arrays) == ["head1", "head2"]
    assert sparse._gemv_arrays["head1"][0] is sparse._constants["w1"]  # the constant itself, not a copy


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_runner_streams_pruned_heads_it_does_not_compile_through_the_sparse_gemv(tmp_path, monkeypatch, cuda_graph):
    """Pruned Gemm / MatMul heads over MAX_LINEAR_WEIGHTS (lowered so the
    model stays small) run the sparse kernel at batch <= 8 and the operator
    above; float64 reference on fresh inputs."""
    import sparseconv.runner as runner
    from onnx_models import pruned_head

    from sparseconv.gemv import MAX_GEMV_BATCH

    monkeypatch.setattr(runner, "MAX_LINEAR_WEIGHTS", 1000)
    rng = np.random.default_rng()
    path, _ = pruned_head(tmp_path, rng)
    sparse = runner.compile_model(path, cache_dir=str(tmp_path / "cache"), cuda_graph=cuda_graph, route_batches=None)
    assert any(line.startswith("head2: MatMul, not compiled (sparseconv's sparse gemv") for line in sparse.plan)
    for batch in (1, 3, MAX_GEMV_BATCH, MAX_GEMV_BATCH + 1, 3):
        x = rng.standard_normal((batch, 3, 4, 4)).astype(np.float32)
        y = sparse(x).get()
        assert relative_l2(y, runner.run_reference(sparse.program, x)[0]) <= TOL, batch
    if cuda_graph:
        assert set(sparse.graph_notes.values()) == {"captured"}, sparse.graph_notes
    assert sorted(sparse._gemv_arrays) == ["head1", "head2", "head3"]
    assert all(len(arrays) == 3 for arrays in sparse._gemv_arrays.values())  # entries, row starts, bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_gemm_computes_f_linear_on_the_gpu_and_the_cpu(with_bias):
    """fx.linear_gemm (a plain GEMM and the bias added after it: the dense
    path of Linear layers above the gemv's batch sizes) against float64, at
    a batch the gemv does not take, TF32 off."""
    torch = pytest.importorskip("torch")
    from sparseconv.dense import torch_flags
    from sparseconv.fx import linear_gemm

    rng = np.random.default_rng()
    x = rng.standard_normal((24, 300)).astype(np.float32)
    w = rng.standard_normal((1000, 300)).astype(np.float32)
    b = rng.standard_normal(1000).astype(np.float32) if with_bias else None
    ref = _ref(x, w, b, relu=False)
    with torch_flags(torch, tf32=False, cudnn_benchmark=False):
        for device in ("cuda", "cpu"):
            tb = None if b is None else torch.from_numpy(b).to(device)
            y = linear_gemm(torch.from_numpy(x).to(device), torch.from_numpy(w).to(device), tb)
            assert y.shape == (24, 1000) and relative_l2(y.cpu().numpy(), ref) <= 1e-6, device
