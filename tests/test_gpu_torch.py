"""GPU: the PyTorch drop-in sparseconv.torch.sparsify (fx front end, BN folded,
epilogues fused) against the float64 evaluation of the original model, on fresh
random inputs; the CUDA-graph option against eager results."""
import numpy as np
import pytest

from sparseconv.testing import relative_l2

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402


class Net(nn.Module):
    """Strided, grouped, dilated, depthwise, 'same', 1x1 and reflect-padded convs,
    BN, a residual add, pooling and a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=4)
        self.depthwise = nn.Conv2d(32, 32, 3, padding="same", groups=32)
        self.point = nn.Conv2d(32, 24, 1)
        self.reflect = nn.Conv2d(24, 24, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = torch.relu(self.down(x))
        x = x + torch.relu(self.grouped(x))
        x = self.point(torch.relu(self.depthwise(x)))
        x = self.reflect(x)
        return self.head(x.mean((2, 3)))


def _pruned_net(sparsity=0.8):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    net = Net()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((torch.rand_like(m.weight) >= sparsity).float())
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 1.5)
    return net.cuda().eval()


def _float64_output(net, x):
    import copy

    with torch.no_grad():
        return copy.deepcopy(net).double()(x.double())


def test_sparsify_matches_the_original_model(session_cache_dir):
    import sparseconv.torch as sct

    net = _pruned_net()
    x = torch.randn(5, 3, 20, 18, device="cuda")
    fast = sct.sparsify(net, x[:1], cache_dir=str(session_cache_dir), route_batches=None)  # every conv a kernel
    kinds = {p.name: (p.action, p.fused) for p in fast.sparseconv_plan}
    assert kinds == {"stem": ("sparseconv", ("bn", "relu")), "down": ("sparseconv", ("relu",)),
                     "grouped": ("sparseconv", ("relu",)), "depthwise": ("sparseconv", ("relu",)),
                     "point": ("sparseconv", ()), "reflect": ("kept", ())}
    assert isinstance(fast.stem, sct.FusedConv2d) and isinstance(net.stem, nn.Conv2d)  # the model is unchanged
    assert fast.stem.kernel is not None
    with torch.no_grad():
        y = fast(x)
    assert y.dtype == torch.float32
    assert relative_l2(y.cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5


def test_sparsify_runs_on_the_current_torch_stream_and_any_batch(session_cache_dir):
    import sparseconv.torch as sct

    net = _pruned_net(0.9)
    fast = sct.sparsify(net, torch.randn(1, 3, 16, 16, device="cuda"), cache_dir=str(session_cache_dir))
    stream = torch.cuda.Stream()
    x = torch.randn(33, 3, 16, 16, device="cuda")
    with torch.no_grad(), torch.cuda.stream(stream):
        x_s = x * 1.0  # produced on `stream`: the kernels must follow it there
        y = fast(x_s)
    stream.synchronize()
    assert relative_l2(y.cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5


def test_cupy_view_shares_the_tensors_memory():
    """fx.cupy_view: the kernels' zero-copy view of a torch tensor, built from
    the pointer (contiguous float32 / int32 / int64), or through DLPack
    (strided, empty, other dtypes): same memory, shape and values either way."""
    import cupy as cp

    from sparseconv.fx import cupy_view

    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    base = torch.randn(4, 6, 5, device="cuda", generator=gen)
    for t in (base, base.to(torch.int32), base.to(torch.int64), base.transpose(1, 2), base[:, :0],
              base.to(torch.float16)):
        v = cupy_view(t)
        assert isinstance(v, cp.ndarray) and tuple(v.shape) == tuple(t.shape) and v.dtype.itemsize == t.element_size()
        if t.numel():
            assert v.data.ptr == t.data_ptr()
            np.testing.assert_array_equal(cp.asnumpy(v), t.cpu().numpy())
    v = cupy_view(base)
    v[1, 2, 3] = 1234.5  # a write through the view is the tensor's
    torch.cuda.synchronize()
    assert base[1, 2, 3].item() == 1234.5


def test_sparsify_prune_reparametrised_convs(session_cache_dir):
    import torch.nn.utils.prune as prune

    import sparseconv.torch as sct

    net = _pruned_net(0.0)
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            prune.l1_unstructured(m, "weight", amount=0.9)
    x = torch.randn(2, 3, 12, 12, device="cuda")
    fast = sct.sparsify(net, x, cache_dir=str(session_cache_dir), min_sparsity=0.5)
    plan = {p.name: p for p in fast.sparseconv_plan}
    # Compiled from the pruned weight (weight_orig * weight_mask); routing may
    # send batch 1 to the table and batch 64 to the code ("mixed").
    assert plan["stem"].action in ("sparseconv", "table", "mixed"), plan["stem"]
    assert abs(plan["stem"].sparsity - 0.9) < 0.01
    with torch.no_grad():
        assert relative_l2(fast(x).cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5


def test_sparse_conv_refuses_gradients_and_wrong_sizes(session_cache_dir):
    import sparseconv.torch as sct

    net = _pruned_net()
    fast = sct.sparsify(net, torch.randn(1, 3, 16, 16, device="cuda"), cache_dir=str(session_cache_dir))
    x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only.*no_grad"):
        fast(x)
    with torch.no_grad():
        fast(x)  # fine under no_grad
        with pytest.raises(ValueError, match="compiled for inputs"):
            fast(torch.randn(2, 3, 17, 16, device="cuda"))
        with pytest.raises(TypeError, match="float32 CUDA"):
            fast.stem(torch.randn(2, 3, 16, 16, device="cuda").double())


class ResidualNet(nn.Module):
    """Residual adds before ReLU / ReLU6 / clamp, a BN'd projection shortcut
    computed after the main branch (as torchvision's Bottleneck does)."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.a, self.bna = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.b, self.bnb = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32)
        self.proj, self.bnp = nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32)
        self.c = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        x = nn.functional.relu6(self.bna(self.a(x)) + x)
        y = self.bnb(self.b(x))
        y += self.bnp(self.proj(x))
        y = torch.relu(y)
        y = torch.clamp(self.c(y) + y, -1.0, 3.0)
        return self.head(y.mean((2, 3)))


def _pruned(net, sparsity=0.8):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((torch.rand_like(m.weight) >= sparsity).float())
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return net.cuda().eval()


def test_fused_residual_epilogues_match_the_original_model(session_cache_dir):
    import sparseconv.torch as sct

    net = _pruned(ResidualNet())
    x = torch.randn(7, 3, 18, 20, device="cuda")
    fast = sct.sparsify(net, x[:1], cache_dir=str(session_cache_dir), progress=False, route_batches=None)
    fused = {p.name: p.fused for p in fast.sparseconv_plan}
    assert fused == {"stem": ("bn", "relu"), "a": ("bn", "add", "relu6"), "b": ("bn", "add", "relu"),
                     "proj": ("bn",), "c": ("add", "clip")}
    assert all(p.action == "sparseconv" for p in fast.sparseconv_plan)
    with torch.no_grad():
        y = fast(x)
    assert relative_l2(y.cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5


def test_cuda_graph_replays_equal_eager_results_on_fresh_inputs(session_cache_dir):
    import sparseconv.torch as sct

    net = _pruned(ResidualNet())
    example = torch.randn(1, 3, 16, 16, device="cuda")
    eager = sct.sparsify(net, example, cache_dir=str(session_cache_dir), progress=False, route_batches=None)
    graphed = sct.sparsify(net, example, cache_dir=str(session_cache_dir), progress=False, cuda_graph=True,
                           route_batches=None)
    assert isinstance(graphed, sct.CudaGraphModule) and graphed.sparseconv_plan == eager.sparseconv_plan
    with torch.no_grad():
        outputs = []
        for batch in (4, 4, 9, 4):  # the second call of a shape replays; a new shape captures again
            x = torch.randn(batch, 3, 16, 16, device="cuda")
            y = graphed(x)
            # cuBLAS may pick another algorithm in a graph
            torch.testing.assert_close(y, eager(x), rtol=1e-6, atol=1e-6)
            assert relative_l2(y.cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5
            outputs.append((x, y))
        assert sorted(graphed.captured_shapes()) == [(4, 3, 16, 16), (9, 3, 16, 16)]
        # The result is a copy: an earlier output is not overwritten by later replays.
        x0, y0 = outputs[0]
        torch.testing.assert_close(y0, eager(x0), rtol=1e-6, atol=1e-6)


class _TwoOutputs(nn.Module):
    def forward(self, x):
        return x * 2.0, {"mean": x.mean(dim=(2, 3)), "label": "not a tensor"}


def test_cuda_graph_module_clones_every_tensor_of_a_nested_output():
    from sparseconv.torch import CudaGraphModule

    graphed = CudaGraphModule(_TwoOutputs())
    with torch.no_grad():
        results = []
        for _ in range(3):  # the first call captures, the others replay
            x = torch.randn(2, 3, 8, 8, device="cuda")
            doubled, extra = graphed(x)
            results.append((x, doubled, extra))
    for x, doubled, extra in results:  # no result overwritten by a later replay
        torch.testing.assert_close(doubled, x * 2.0, rtol=0, atol=0)
        torch.testing.assert_close(extra["mean"], x.mean(dim=(2, 3)), rtol=1e-6, atol=1e-6)
        assert extra["label"] == "not a tensor"
    assert graphed.captured_shapes() == [(2, 3, 8, 8)]


class _SyncsOnLargeBatches(nn.Module):
    """On batches over 4, a host sync (.item()) that no capture can hold."""

    def forward(self, x):
        y = x * 2.0
        if x.shape[0] > 4:
            y = y + float(x.amax().item() > 1e30)  # adds 0.0
        return y


def test_cuda_graph_module_runs_a_shape_it_cannot_capture_eagerly_and_says_why():
    from sparseconv.torch import CudaGraphModule

    graphed = CudaGraphModule(_SyncsOnLargeBatches())
    default = torch.cuda.current_stream()
    with torch.no_grad():
        for batch in (2, 8, 2, 8, 3):  # captured, not captured, replays, eager again, a new shape captures
            x = torch.randn(batch, 3, 8, 8, device="cuda")
            torch.testing.assert_close(graphed(x), x * 2.0, rtol=0, atol=0)
            assert torch.cuda.current_stream() == default
    assert graphed.captured_shapes() == [(2, 3, 8, 8), (3, 3, 8, 8)]
    notes = graphed.graph_notes
    assert notes[(2, 3, 8, 8)] == notes[(3, 3, 8, 8)] == "captured"
    note = notes[(8, 3, 8, 8)]
    assert note.startswith("not captured, runs eagerly: it synchronizes with the host (") and "\n" not in note, note
    assert torch.cuda.get_sync_debug_mode() == 0  # the check is off again


def test_full_resnet50_batch2_matches_float64(session_cache_dir):
    import sparseconv.torch as sct
    from sparseconv.zoo_torch import build_network

    net = build_network("resnet50", sparsity=0.9, seed=int(np.random.default_rng().integers(1000))).cuda()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    fast = sct.sparsify(net, x[:1], cache_dir=str(session_cache_dir), cuda_graph=True)
    kinds = {}
    for p in fast.sparseconv_plan:
        kinds[p.fused] = kinds.get(p.fused, 0) + 1
        # routed by measurement at batch 1 and 64 (the default), the times in the plan
        assert p.action in ("sparseconv", "dense", "mixed") and "cuDNN fp32" in p.reason, p
    assert kinds == {("bn", "relu"): 33, ("bn", "add", "relu"): 16, ("bn",): 4}
    assert fast.sparseconv_pools == ["maxpool"]  # the stem's pool, without indices, inside the graph
    with torch.no_grad():
        y = fast(x)
    ref = _float64_output(net, x)
    assert relative_l2(y.cpu().numpy(), ref.cpu().numpy()) <= 1e-5
    assert torch.equal(y.argmax(1).cpu(), ref.argmax(1).cpu())


def test_routing_by_batch_size_runs_each_path_exactly(session_cache_dir):
    """sparsify's default routing: each conv measured at batch 1 and 64 against
    cuDNN strict fp32; whichever path a batch size takes, the result is exact,
    and forcing either path gives the same numbers within fp32 rounding."""
    import sparseconv.torch as sct
    from sparseconv.fx import FusedConv2d
    from sparseconv.tilings import ANY_BATCH

    net = _pruned(ResidualNet())
    example = torch.randn(1, 3, 16, 16, device="cuda")
    fast = sct.sparsify(net, example, cache_dir=str(session_cache_dir), progress=False)
    convs = [m for m in fast.modules() if isinstance(m, FusedConv2d)]
    assert convs and all(m.route for m in convs)
    plan = {p.name: p for p in fast.sparseconv_plan}
    for m in convs:
        assert plan[m.layer_name].action == ({p for _, p in m.route}.pop() if len(m.route) == 1 else "mixed")
    with torch.no_grad():
        for batch in (1, 5, 64):
            x = torch.randn(batch, 3, 16, 16, device="cuda")
            ref = _float64_output(net, x).cpu().numpy()
            assert relative_l2(fast(x).cpu().numpy(), ref) <= 1e-5
            for path in ("sparseconv", "dense"):
                for m in convs:
                    m.route = [(ANY_BATCH, path)]
                assert relative_l2(fast(x).cpu().numpy(), ref) <= 1e-5, path


@pytest.mark.parametrize("pool", [(3, 2, 1, 1, False), (2, 2, 0, 1, False), ((3, 2), (1, 2), (1, 0), (2, 1), False),
                                  (3, 2, 1, 1, True)], ids=str)
def test_index_free_max_pool_equals_torchs_bit_for_bit(pool):
    from sparseconv.fx import IndexFreeMaxPool2d

    k, s, p, d, ceil = pool
    torch_pool = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil)
    ours = IndexFreeMaxPool2d(torch_pool, "pool")
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    x = torch.randn(3, 5, 57, 30, device="cuda", generator=gen)
    x[0, 0, 3, 3], x[2, 4, 10, 7], x[1, 1] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        y = ours(x)
    want = torch_pool(x)
    assert y.shape == want.shape and torch.equal(y.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(want))
    assert torch.equal(ours(x[:0]), torch_pool(x[:0]))  # an empty batch
    small = x[:, :, :12, :12]  # small planes (VGG-16's pool5 has 49 outputs a plane): sparseconv's pool too
    assert torch.equal(torch.nan_to_num(ours(small)), torch.nan_to_num(torch_pool(small)))


@pytest.mark.parametrize("flat", [False, True], ids=["planes", "flat"])
def test_both_pool_kernels_equal_torchs_bit_for_bit(flat):
    """sparseconv.pool's two kernels, each forced on the same inputs: VGG-16's
    pool5 at batch 64 (49 outputs a plane, 32,768 planes: more blocks than one
    wave for sc_max_pool2d_flat), an uneven window and NaN / inf values."""
    import cupy as cp

    from sparseconv.pool import launch_max_pool
    from sparseconv.runtime import as_cupy_stream

    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    for shape, (k, s, p) in (((64, 512, 14, 14), (2, 2, 0)), ((3, 5, 13, 10), ((3, 2), (2, 1), (1, 0)))):
        x = torch.randn(*shape, device="cuda", generator=gen)
        x[0, 0, 3, 3], x[2, 4, 1, 7], x[1, 1] = float("nan"), float("inf"), float("-inf")
        want = torch.nn.functional.max_pool2d(x, k, s, p)
        y = torch.full_like(want, 12345.0)
        kp = (k, k) if isinstance(k, int) else k
        sp = (s, s) if isinstance(s, int) else s
        pp = (p, p) if isinstance(p, int) else p
        with cp.cuda.Device(0), as_cupy_stream(torch.cuda.current_stream(), 0, "test"):
            launch_max_pool(0, cp.from_dlpack(x), cp.from_dlpack(y), kp, sp, pp, (1, 1), flat=flat)
        torch.cuda.synchronize()
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(y), torch.nan_to_num(want))


def test_sparsify_skips_an_adaptive_pool_to_its_input_size(session_cache_dir):
    """VGG's AdaptiveAvgPool2d after features of its output size returns its
    input (sparseconv_skipped_pools), against float64, replayed in CUDA
    graphs. (Other sizes run the pool: tests/test_pool.py, on the CPU; here
    the compiled conv takes only its own size.)"""
    import sparseconv.torch as sct

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 3, padding=1)
            self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
            self.fc = nn.Linear(16 * 36, 10)

        def forward(self, x):
            return self.fc(torch.flatten(self.avgpool(torch.relu(self.conv(x))), 1))

    net = _pruned(Head())
    fast = sct.sparsify(net, torch.randn(2, 8, 6, 6, device="cuda"), cache_dir=str(session_cache_dir),
                        progress=False, cuda_graph=True, route_batches=None)
    assert fast.sparseconv_skipped_pools == ["avgpool"]
    with torch.no_grad():
        for batch in (3, 1, 3):
            x = torch.randn(batch, 8, 6, 6, device="cuda")
            assert relative_l2(fast(x).cpu().numpy(), _float64_output(net, x).cpu().numpy()) <= 1e-5
