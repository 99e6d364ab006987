"""CPU: the torch.fx front end (sparseconv/fx.py). Every pass is checked against
the original, unfolded module: in float64 to 1e-10, in float32 to 1e-5."""
import copy
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sparseconv.fx import FusedConv2d, fold_batchnorm, prepare  # noqa: E402

F64 = (torch.float64,)


def rel(a, b):
    """Relative L2 error; the absolute one when b is all zero (a ReLU chain on
    an unlucky random input can zero the whole output: 0/0 would be NaN)."""
    norm = float(b.norm())
    return float((a - b).norm()) / (norm if norm > 0 else 1.0)


def prune_(model, sparsity=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((torch.rand(m.weight.shape, generator=g) >= sparsity).to(m.weight.dtype))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.5, 0.5, generator=g)
    return model.eval()


def check(model, x, tol=1e-10, **kw):
    """prepare() the model, compare with the original; returns the FrontEnd."""
    front = prepare(model, x, dtypes=(x.dtype,), **kw)
    with torch.no_grad():
        want, got = model(x), front.module(x)
    assert got.shape == want.shape
    assert rel(got, want) <= tol, rel(got, want)
    return front


class Block(nn.Module):
    """Every spelling of the chain the pass must recognise."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1, self.r1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.c4, self.b4, self.r4 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6()
        self.c5, self.h5 = nn.Conv2d(8, 8, 3, padding=1), nn.Hardtanh(-0.5, 2.0)
        self.c6 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.c7 = nn.Conv2d(8, 8, 1)
        self.c8 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        a = self.r1(self.b1(self.c1(x)))                  # conv-bn-relu(module, inplace)
        b = F.relu(self.b2(self.c2(a)) + a)               # conv-bn-add-F.relu
        c = torch.relu(torch.add(a, self.c3(b)))          # add with the conv second, torch.add, torch.relu
        d = self.r4(self.b4(self.c4(c)))                  # ReLU6 module
        e = self.h5(self.c5(d))                           # hardtanh(-0.5, 2) -> clip
        f = self.c6(e)
        f += d                                            # in-place add, then clamp method
        f = f.clamp(min=0.0, max=6.0)
        g = torch.clamp(self.c7(f), min=0)                # clamp(min=0) -> relu
        h = F.hardtanh(self.c8(g), 0.0, 6.0, inplace=True)
        return h


def test_every_chain_spelling_fuses_and_matches_in_float64():
    m = prune_(Block()).double()
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64)
    front = check(m, x)
    fused = {p.name: p.fused for p in front.plans}
    assert fused == {"c1": ("bn", "relu"), "c2": ("bn", "add", "relu"), "c3": ("add", "relu"),
                     "c4": ("bn", "relu6"), "c5": ("clip",), "c6": ("add", "relu6"), "c7": ("relu",),
                     "c8": ("relu6",)}
    assert all(p.action == "sparseconv" for p in front.plans)
    assert front.convs["c5"].clip == (-0.5, 2.0)
    # The graph now holds only the fused convs' calls: no BN, add or activation left.
    ops = [n.op for n in front.module.graph.nodes]
    assert ops == ["placeholder"] + ["call_module"] * 8 + ["output"]
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in front.module.modules())
    assert isinstance(m.c1, nn.Conv2d)  # the model itself is untouched


class Pools(nn.Module):
    """VGG's Conv -> ReLU -> MaxPool2d(2, 2) and the spellings around it: the
    pools that fuse (module, F.max_pool2d, ceil_mode on even sides, no
    activation before) and those that must not (a 3x3 window, stride 1,
    padding, ceil_mode on an odd side, after a residual add, indices)."""

    def __init__(self):
        super().__init__()
        self.vgg, self.r, self.p = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)
        self.functional = nn.Conv2d(8, 8, 1)
        self.ceil_even, self.p_ceil = nn.Conv2d(8, 8, 1), nn.MaxPool2d(2, ceil_mode=True)
        self.window3, self.p3 = nn.Conv2d(8, 8, 3, padding=1), nn.MaxPool2d(3, 2)
        self.stride1 = nn.Conv2d(8, 8, 1)
        self.padded = nn.Conv2d(8, 8, 1)
        self.ceil_odd = nn.Conv2d(8, 8, 1)
        self.residual = nn.Conv2d(8, 8, 1)
        self.indices = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        a = self.p(self.r(self.vgg(x)))                                     # 16x12 -> 8x6
        b = F.max_pool2d(torch.relu(self.functional(a)), 2)                 # -> 4x3
        c = self.p_ceil(self.ceil_even(a))                                  # no activation; even: floor = ceil
        d = self.p3(self.window3(c))                                        # 3x3 window: left alone
        e = F.max_pool2d(self.stride1(a), 2, 1)                             # stride 1: left alone
        f = F.max_pool2d(self.padded(a), 2, 2, 1)                           # padding: left alone
        g = F.max_pool2d(self.ceil_odd(b), 2, ceil_mode=True)               # 4x3, ceil_mode: left alone
        h = F.max_pool2d(torch.relu(self.residual(a) + a), 2)               # after an add: the add fuses
        i, _ = F.max_pool2d(self.indices(a), 2, return_indices=True)        # indices: left alone
        return [b, d, e, f, g, h, i]


def test_a_2x2_max_pool_fuses_into_the_conv_before_it_and_matches_in_float64():
    m = prune_(Pools()).double()
    x = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    front = prepare(m, x, dtypes=F64)
    with torch.no_grad():
        for got, want in zip(front.module(x), m(x)):
            assert got.shape == want.shape and rel(got, want) <= 1e-10
    fused = {p.name: p.fused for p in front.plans}
    assert fused == {"vgg": ("relu", "maxpool"), "functional": ("relu", "maxpool"), "ceil_even": ("maxpool",),
                     "window3": (), "stride1": (), "padded": (), "ceil_odd": (), "residual": ("add", "relu"),
                     "indices": ()}
    assert front.convs["vgg"].pool and not front.convs["residual"].pool
    assert sum(isinstance(mod, nn.MaxPool2d) for mod in front.module.modules()) == 1  # p3 alone is left
    # sparsify's pools=False: every pool left to torch, the rest fused as before
    kept = prepare(m, x, dtypes=F64, fuse_pools=False)
    assert {p.name: p.fused for p in kept.plans} == {
        name: tuple(f for f in fused if f != "maxpool") for name, fused in fused.items()}
    assert not any(c.pool for c in kept.convs.values())


def test_a_fused_conv_refuses_a_pool_with_a_residual():
    with pytest.raises(ValueError, match="pools or adds a residual, not both"):
        FusedConv2d(torch.zeros(4, 4, 1, 1), None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                    residual=True, pool=True, name="c")


class OneBound(nn.Module):
    """Clamps with one bound, as an ONNX Clip with min or max alone converts."""

    def __init__(self):
        super().__init__()
        self.hi, self.lo, self.none = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return torch.cat([torch.clamp(self.hi(x), None, 0.25), self.lo(x).clamp(min=-0.1),
                          torch.clamp(self.none(x), min=torch.tensor(0.0))], 1)


def test_a_clamp_with_one_bound_fuses_as_a_clip_open_at_the_other_end():
    front = check(prune_(OneBound()).double(), torch.randn(2, 3, 7, 5, dtype=torch.float64))
    assert {p.name: p.fused for p in front.plans} == {"hi": ("clip",), "lo": ("clip",), "none": ()}
    assert front.convs["hi"].clip == (-math.inf, 0.25) and front.convs["lo"].clip == (-0.1, math.inf)


def test_float32_fusion_matches_within_1e_5():
    m = prune_(Block())
    check(m, torch.randn(3, 3, 8, 8), tol=1e-5)


def test_bn_folding_keeps_zeros_and_sparsity():
    conv, bn = nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6)
    prune_(nn.Sequential(conv, bn), 0.8)
    w, b = fold_batchnorm(conv.weight, conv.bias, bn)
    assert torch.equal(w == 0, conv.weight == 0)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    assert torch.allclose(w, conv.weight * scale[:, None, None, None])
    assert torch.allclose(b, bn.bias - bn.running_mean * scale)
    front = check(nn.Sequential(conv, bn).double(), torch.randn(1, 4, 7, 7, dtype=torch.float64))
    (p,) = front.plans
    assert p.fused == ("bn",) and abs(p.sparsity - float((conv.weight == 0).double().mean())) < 1e-12
    assert abs(float((front.convs["0"].weight == 0).double().mean()) - p.sparsity) < 1e-12


class Shared(nn.Module):
    """Chains that must NOT fuse: the conv output has another user, a training
    BN, a broadcast add, an in-place write between conv and add, a conv called
    twice, an in-place add into the other operand."""

    def __init__(self):
        super().__init__()
        self.used_twice, self.bn_a = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.train_bn_conv, self.bn_t = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.broadcast = nn.Conv2d(4, 4, 1)
        self.hazard = nn.Conv2d(4, 4, 1)
        self.twice = nn.Conv2d(4, 4, 1)
        self.into_other = nn.Conv2d(4, 4, 1)
        self.bias_map = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        y = self.used_twice(x)
        a = self.bn_a(y) + y                           # y has two users: nothing fuses into used_twice
        b = torch.relu(self.bn_t(self.train_bn_conv(a)))
        c = torch.relu(self.broadcast(b) + self.bias_map)  # broadcast add: the relu cannot fuse past it
        h = self.hazard(c)
        c.mul_(2)                                       # in place on the residual, between conv and add
        d = torch.relu(h + c)
        e = self.into_other(d)
        d.add_(e)                                       # writes into d, which is used again below
        return self.twice(self.twice(d)) + d


def test_chains_that_must_not_fuse_are_left_alone():
    m = prune_(Shared()).double()
    m.bn_t.train()  # a training-mode BN uses batch statistics: never folded
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    m_ref = copy.deepcopy(m)
    front = prepare(m, x, dtypes=F64)
    with torch.no_grad():
        assert rel(front.module(x), m_ref(x)) <= 1e-10
    p = {q.name: q for q in front.plans}
    assert p["used_twice"].fused == () and p["train_bn_conv"].fused == ()
    assert p["broadcast"].fused == () and p["hazard"].fused == ()
    assert p["twice"].fused == () and "called 2 times" in p["twice"].reason
    assert p["into_other"].fused == ()
    assert all(q.action == "sparseconv" for q in front.plans)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            x = -x
        return self.reflect(torch.relu(self.bn(self.conv(x))))


def test_untraceable_models_keep_the_per_module_swap_and_say_so():
    m = prune_(Untraceable()).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    front = check(m, x)
    assert not front.traced and "TraceError" in front.trace_error
    p = {q.name: q for q in front.plans}
    assert p["conv"].action == "sparseconv" and p["conv"].fused == () and "not traceable" in p["conv"].reason
    assert p["reflect"].action == "kept" and "reflect" in p["reflect"].reason
    assert isinstance(front.module.conv, FusedConv2d) and isinstance(m.conv, nn.Conv2d)


def test_fuse_false_compiles_convs_without_folding():
    m = prune_(Block()).double()
    front = check(m, torch.randn(1, 3, 8, 8, dtype=torch.float64), fuse=False)
    assert all(p.fused == () for p in front.plans)
    assert any(isinstance(mod, nn.BatchNorm2d) for mod in front.module.modules())


def test_ineligible_convs_stay_unfused_in_the_graph():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU())
    prune_(m, 0.5)
    with torch.no_grad():
        m[3].weight.fill_(1.0)  # dense: below min_sparsity
    front = prepare(m, torch.randn(1, 3, 9, 9), min_sparsity=0.4)
    p = {q.name: q for q in front.plans}
    assert p["0"].action == "sparseconv" and p["0"].fused == ("bn", "relu")
    assert p["3"].action == "kept" and "min_sparsity" in p["3"].reason
    assert isinstance(front.module.get_submodule("3"), nn.Conv2d)


def test_fused_conv_refuses_a_missing_residual():
    conv = FusedConv2d(torch.zeros(4, 3, 1, 1), None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                       residual=True, name="c")
    with pytest.raises(TypeError, match="c: this fused conv takes residual"):
        conv(torch.randn(1, 3, 2, 2))
    with pytest.raises(ValueError, match="clip=\\(lo, hi\\) goes with activation='clip'"):
        FusedConv2d(torch.zeros(4, 3, 1, 1), None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                    activation="clip", name="c")


def test_resnet50_fuses_every_conv_and_matches_in_float64():
    from sparseconv.zoo_torch import build_network

    m = build_network("resnet50", sparsity=0.9).double()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    front = check(m, x)
    kinds = {}
    for p in front.plans:
        assert p.action == "sparseconv", p
        kinds[p.fused] = kinds.get(p.fused, 0) + 1
    # stem + 2 per bottleneck: bn+relu; the last of each bottleneck: bn+add+relu; downsamples: bn.
    assert kinds == {("bn", "relu"): 33, ("bn", "add", "relu"): 16, ("bn",): 4}


def test_a_model_that_is_one_conv_is_swapped_whole():
    conv = prune_(nn.Sequential(nn.Conv2d(3, 4, 3)))[0]
    front = check(conv.double(), torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert isinstance(front.module, FusedConv2d) and front.plans[0].reason == "the model is one nn.Conv2d: swapped whole"
