"""GPU: the 2x2 max pool fused into a conv's epilogue (Epilogue.pool), taken
among a pointwise kernel's lanes or run after a variant that cannot take it,
against float64 on fresh random inputs; and VGG's Conv -> ReLU -> MaxPool
chains through sparsify, every route (kernel, table, cuDNN)."""
import numpy as np
import pytest

from sparseconv.testing import pruned_weight, relative_l2

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def _reference(x, w, b, padding):
    """pool(relu(conv(x) + b)) in float64, on the GPU."""
    y = F.conv2d(torch.as_tensor(x, device="cuda").double(), torch.as_tensor(w, device="cuda").double(),
                 torch.as_tensor(b, device="cuda").double(), padding=padding)
    return F.max_pool2d(torch.relu(y), 2, 2).cpu().numpy()


# (channels, size): variants in-kernel at large batches, pooled after at small
# ones (tilings.code_variants): a split over slices summed by a second kernel
# that pools as it stores (14x14), a direct kernel summed in clusters (28x28); and an odd side (15x15),
# pooled after at every batch, floor mode.
LAYERS = [(64, 14), (64, 28), (32, 15)]


@pytest.mark.parametrize("channels,size", LAYERS, ids=str)
def test_a_pooled_conv_matches_float64_through_every_variant(channels, size, session_cache_dir):
    import cupy

    from sparseconv import compile_conv2d
    from sparseconv.tilings import pools_in_kernel

    rng = np.random.default_rng()
    w = pruned_weight(rng, (channels, channels, 3, 3), 0.8)
    b = rng.standard_normal(channels).astype(np.float32)
    kernel = compile_conv2d(w, input_size=(size, size), bias=b, padding=1, activation="relu", pool=True,
                            cache_dir=str(session_cache_dir), progress=False)
    in_kernel = [pools_in_kernel(kernel.shape, layer.tiling) for _, layer, _ in kernel._variants]
    assert in_kernel[-1] == (size % 2 == 0) and not in_kernel[0]
    small = kernel._variants[0][1].tiling
    summed_in_a_kernel = small.slices > 1 and small.slice_sum == "kernel"
    assert summed_in_a_kernel == (size == 14), small.describe()
    for step in kernel._plan(1):  # a split sum pools as it stores: no scratch, no pool launch
        assert step.reduce_pools == summed_in_a_kernel and (step.pool is None) == summed_in_a_kernel
    for batch in (1, 3, 20):  # the small-batch variant, then the large one
        x = rng.standard_normal((batch, channels, size, size)).astype(np.float32)
        y = cupy.asnumpy(kernel(cupy.asarray(x)))
        ref = _reference(x, w, b, 1)
        assert y.shape == (batch, channels, size // 2, size // 2) == ref.shape
        assert relative_l2(y, ref) <= 1e-5, batch


def test_the_dense_route_pools_after_cudnn(session_cache_dir):
    """DenseConv2dKernel (what backend="auto" returns where cuDNN wins) on a
    pooled layer: cuDNN's conv, the clamp, then the pool, against float64;
    an odd side floors."""
    import cupy

    from sparseconv import compile_conv2d
    from sparseconv.runtime import DenseConv2dKernel

    rng = np.random.default_rng()
    for size in (12, 13):
        w = pruned_weight(rng, (16, 8, 3, 3), 0.8)
        b = rng.standard_normal(16).astype(np.float32)
        code = compile_conv2d(w, input_size=(size, size), bias=b, padding=1, activation="relu", pool=True,
                              cache_dir=str(session_cache_dir), progress=False)
        dense = DenseConv2dKernel(code.layer, b, w)
        assert dense.output_shape(2) == code.output_shape(2) == (2, 16, size // 2, size // 2)
        x = rng.standard_normal((2, 8, size, size)).astype(np.float32)
        ref = _reference(x, w, b, 1)
        assert relative_l2(cupy.asnumpy(dense(cupy.asarray(x))), ref) <= 1e-5, size


class Vgg(nn.Module):
    """VGG's blocks, shrunk: Conv -> (BN) -> ReLU -> MaxPool2d(2, 2)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2))
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def test_sparsify_fuses_vgg_pools_and_every_route_is_exact(session_cache_dir):
    import copy

    import sparseconv.torch as sct
    from sparseconv.fx import FusedConv2d
    from sparseconv.shapes import Epilogue
    from sparseconv.table import TableConv2d, table_supported
    from sparseconv.tilings import ANY_BATCH

    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    net = Vgg()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((torch.rand_like(m.weight) >= 0.8).float())
        bn = net.features[6]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
    net = net.cuda().eval()
    fast = sct.sparsify(net, torch.randn(1, 3, 32, 32, device="cuda"), cache_dir=str(session_cache_dir),
                        progress=False)
    plan = {p.name: p.fused for p in fast.sparseconv_plan if p.kind != "linear"}
    assert plan == {"features.0": ("relu",), "features.2": ("relu", "maxpool"),
                    "features.5": ("bn", "relu", "maxpool"), "features.9": ("relu", "maxpool")}
    convs = [m for m in fast.modules() if isinstance(m, FusedConv2d)]
    assert sum(m.pool for m in convs) == 3 and all(m.kernel.epilogue.pool == m.pool for m in convs)
    for m in convs:  # a weight table for each that the family takes, pooling where the layer does
        if m.table is None and table_supported(m.kernel.shape) is None:
            bias = None if m.bias is None else m.bias.cpu().numpy()
            m.table = TableConv2d(m.weight.cpu().numpy(), bias, m.kernel.shape,
                                  Epilogue(m.activation, m.clip, pool=m.pool), name=m.layer_name)
    with torch.no_grad():
        reference = copy.deepcopy(net).double()
        for batch in (1, 40):
            x = torch.randn(batch, 3, 32, 32, device="cuda")
            ref = reference(x.double()).cpu().numpy()
            assert relative_l2(fast(x).cpu().numpy(), ref) <= 1e-5, batch
            for path in ("sparseconv", "table", "dense"):
                for m in convs:
                    m.route = [(ANY_BATCH, path)]
                assert relative_l2(fast(x).cpu().numpy(), ref) <= 1e-5, (batch, path)
