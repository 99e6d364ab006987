"""GPU: the weight-table family (sparseconv.table) against float64 on fresh
random inputs, run to run identical, refusing bad input; and sparsify's
routing through it (every conv forced onto the table, and table=False)."""
from dataclasses import replace

import numpy as np
import pytest

from sparseconv.dense import epilogue_reference
from sparseconv.shapes import ConvShape, Epilogue
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

LAYERS = {
    "layer4-3x3": (ConvShape(512, 512, 7, 7, 3, 3, padding=(1, 1)), Epilogue("relu")),
    "layer3-1x1": (ConvShape(1024, 256, 14, 14, 1, 1), Epilogue("relu")),
    "layer4-downsample": (ConvShape(1024, 2048, 14, 14, 1, 1, stride=(2, 2)), Epilogue()),
    "layer4-1x1-add-relu": (ConvShape(512, 2048, 7, 7, 1, 1), Epilogue("relu", residual=True)),
    "dilated-relu6": (ConvShape(24, 40, 13, 11, 3, 3, padding=(2, 2), dilation=(2, 2)), Epilogue("relu6")),
    "5x5-stride2-clip": (ConvShape(16, 8, 17, 17, 5, 5, stride=(2, 2), padding=(2, 2)),
                         Epilogue("clip", clip=(-0.3, 0.4))),
    # VGG-16's conv5_3 with its max pool fused (the table pools as it stores), and an odd side that pool drops
    "conv5_3-relu-pool": (ConvShape(512, 512, 14, 14, 3, 3, padding=(1, 1)), Epilogue("relu", pool=True)),
    "odd-7x9-pool": (ConvShape(64, 48, 7, 9, 3, 3, padding=(1, 1)), Epilogue(pool=True)),
}


def _reference(x, w, bias, shape, epilogue, res):
    return epilogue_reference(conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation), epilogue, res)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("staged", [False, True], ids=["entries-in-global", "entries-staged"])
def test_table_conv_matches_float64(name, batch, staged):
    import cupy as cp

    from sparseconv.table import TableConv2d, table_tiling

    shape, epilogue = LAYERS[name]
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, 0.9)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    res = rng.standard_normal((batch, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32) \
        if epilogue.residual else None
    tiling = replace(table_tiling(shape, 1, int(np.count_nonzero(w))), staged_entries=staged)
    k = TableConv2d(w, bias, shape, epilogue, tiling, name=name)
    assert k.tiling.staged_entries == staged
    kwargs = {} if res is None else {"residual": cp.asarray(res)}
    y1 = k(cp.asarray(x), **kwargs).get()
    y2 = k(cp.asarray(x), **kwargs).get()
    assert np.array_equal(y1, y2)  # a fixed summation order
    assert relative_l2(y1, _reference(x, w, bias, shape, epilogue, res)) <= 1e-5


def test_a_channel_too_long_to_stage_reads_its_entries_from_global_memory():
    import cupy as cp

    from sparseconv.table import MAX_SHARED_BYTES, TableConv2d, TableTiling

    shape = ConvShape(1024, 4, 5, 5, 3, 3, padding=(1, 1))  # ~6,500 entries a channel: 52 KB
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, 0.3)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    k = TableConv2d(w, bias, shape, Epilogue(), TableTiling(1, 4, staged_entries=True), name="long")
    assert TableTiling(1, 4, True).shared_bytes(int(np.count_nonzero(w[0]))) > MAX_SHARED_BYTES
    assert not k.tiling.staged_entries
    x = rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    y = k(cp.asarray(x)).get()
    assert relative_l2(y, _reference(x, w, bias, shape, Epilogue(), None)) <= 1e-5


def test_table_conv_refuses_bad_input():
    import cupy as cp

    from sparseconv.table import TableConv2d

    shape = ConvShape(8, 4, 6, 6, 3, 3, padding=(1, 1))
    k = TableConv2d(np.ones(shape.weight_shape, np.float32), None, shape, name="conv7")
    with pytest.raises(ValueError, match=r"conv7: x must have shape \(N, 8, 6, 6\)"):
        k(cp.zeros((1, 8, 5, 6), cp.float32))
    with pytest.raises(TypeError, match="conv7: x must be float32"):
        k(cp.zeros((1, 8, 6, 6), cp.float64))
    with pytest.raises(ValueError, match="conv7: out must"):
        k(cp.zeros((1, 8, 6, 6), cp.float32), out=cp.zeros((1, 4, 6, 5), cp.float32))
    with pytest.raises(ValueError, match="conv7: got a residual, but the kernel was compiled without one"):
        k(cp.zeros((1, 8, 6, 6), cp.float32), residual=cp.zeros((1, 4, 6, 6), cp.float32))
    x = cp.zeros((1, 8, 6, 6), cp.float32)
    with pytest.raises(ValueError, match="conv7: out overlaps x"):
        k(x, out=x.reshape(-1)[:4 * 36].reshape(1, 4, 6, 6))
    with pytest.raises(TypeError, match="conv7: x is a NumPy"):
        k(np.zeros((1, 8, 6, 6), np.float32))
    assert k(cp.zeros((0, 8, 6, 6), cp.float32)).shape == (0, 4, 6, 6)
    pooling = TableConv2d(np.ones(shape.weight_shape, np.float32), None, shape, Epilogue(pool=True), name="conv8")
    with pytest.raises(ValueError, match="conv8: out must"):  # the pooled shape, not the conv's
        pooling(x, out=cp.zeros((1, 4, 6, 6), cp.float32))
    assert pooling(cp.zeros((0, 8, 6, 6), cp.float32)).shape == (0, 4, 3, 3)


def test_table_conv_takes_torch_tensors_on_a_torch_stream():
    """The call of every family (runtime.CallContract): torch tensors in, a
    torch stream to launch on, grad refused."""
    import cupy as cp

    from sparseconv.table import TableConv2d

    shape = ConvShape(8, 4, 6, 6, 3, 3, padding=(1, 1))
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, 0.8)
    k = TableConv2d(w, None, shape, Epilogue(residual=True), name="conv8")
    x = torch.randn(2, 8, 6, 6, device="cuda")
    res = torch.randn(2, 4, 6, 6, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    y = k(x, stream=stream, residual=res)
    stream.synchronize()
    ref = _reference(x.cpu().numpy(), w, np.zeros(4, np.float32), shape, Epilogue(residual=True), res.cpu().numpy())
    assert isinstance(y, cp.ndarray) and relative_l2(y.get(), ref) <= 1e-5
    with pytest.raises(ValueError, match="conv8: x requires grad"):
        k(x.clone().requires_grad_(), residual=res)


class Block(nn.Module):
    """A ResNet bottleneck's shapes, small: 1x1, 3x3, 1x1 + add, a strided 1x1 shortcut."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(64, 32, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 128, 1, bias=False)
        self.down = nn.Conv2d(64, 128, 1, stride=2, bias=False)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.conv3(y) + self.down(x))


def _pruned_block():
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    net = Block()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((torch.rand_like(m.weight) >= 0.9).float())
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return net.cuda().eval()


def test_sparsify_runs_convs_through_the_table_where_routed(session_cache_dir):
    import copy

    import sparseconv.torch as sct
    from sparseconv.fx import FusedConv2d
    from sparseconv.tilings import ANY_BATCH
    from sparseconv.table import TableConv2d

    net = _pruned_block()
    x = torch.randn(2, 64, 14, 14, device="cuda")
    fast = sct.sparsify(net, x[:1], cache_dir=str(session_cache_dir), route_batches=(1,), progress=False)
    convs = [m for m in fast.modules() if isinstance(m, FusedConv2d)]
    assert len(convs) == 4
    plan = {p.name: p.reason for p in fast.sparseconv_plan}
    assert all("table" in plan[m.layer_name] for m in convs)  # timed at batch 1
    for m in convs:  # the table where routing chose it; forced onto it elsewhere
        assert (m.table is not None) == any(path == "table" for _, path in m.route)
        if m.table is None:
            m.table = TableConv2d(m.weight.cpu().numpy(), None if m.bias is None else m.bias.cpu().numpy(),
                                  m.kernel.shape, m.kernel.epilogue, name=m.layer_name)
        m.route = [(ANY_BATCH, "table")]
    with torch.no_grad():
        y = fast(x)
        ref = copy.deepcopy(net).double()(x.double())
    assert relative_l2(y.cpu().numpy(), ref.cpu().numpy()) <= 1e-5


def test_sparsify_without_the_table_never_times_it(session_cache_dir):
    import sparseconv.torch as sct
    from sparseconv.fx import FusedConv2d

    net = _pruned_block()
    x = torch.randn(1, 64, 14, 14, device="cuda")
    fast = sct.sparsify(net, x, cache_dir=str(session_cache_dir), route_batches=(1,), progress=False, table=False)
    convs = [m for m in fast.modules() if isinstance(m, FusedConv2d)]
    assert convs and all(m.table is None and all(p != "table" for _, p in m.route) for m in convs)
    assert not any("table" in p.reason for p in fast.sparseconv_plan)
