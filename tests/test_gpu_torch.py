"""GPU: the PyTorch drop-in sparseconv.torch.sparsify against the float64 model,
on fresh random inputs."""
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
    fast = sct.sparsify(net, x[:1], cache_dir=str(session_cache_dir))
    kinds = {p.name: p.action for p in fast.sparseconv_plan}
    assert kinds == {"stem": "sparseconv", "down": "sparseconv", "grouped": "sparseconv", "depthwise": "sparseconv",
                     "point": "sparseconv", "reflect": "kept"}
    assert isinstance(fast.stem, sct.SparseConv2d) and isinstance(net.stem, nn.Conv2d)  # a copy was changed
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
    assert plan["stem"].action == "sparseconv" and abs(plan["stem"].sparsity - 0.9) < 0.01
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
