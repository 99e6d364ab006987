"""CPU: the torch.fx front end on nn.Linear (sparseconv/fx.py): pruned Linear
layers become FusedLinear nodes with a following activation fused, checked
through the reference path against the original module in float64 (1e-10);
which Linear layers are left alone, and why the plan says so."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sparseconv.api import linear_shape  # noqa: E402
from sparseconv.fx import LINEAR_MIN_SPARSITY, FusedConv2d, FusedLinear, LinearOptions, prepare  # noqa: E402

F64 = (torch.float64,)
ON = LinearOptions()


def prune_(model, sparsity=0.8, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.mul_((torch.rand(m.weight.shape, generator=g) >= sparsity).to(m.weight.dtype))
    return model.eval()


class Mlp(nn.Module):
    """Linear+ReLU (module), Linear+relu6 (function), Linear+clamp (method), a
    plain Linear, and a dense head."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(40, 24), nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(24, 16)
        self.fc3 = nn.Linear(16, 12, bias=False)
        self.fc4 = nn.Linear(12, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        x = self.act1(self.fc1(x))
        x = F.relu6(self.fc2(x))
        x = self.fc3(x).clamp(-0.5, 0.5)
        return self.head(self.fc4(x))


def _mlp():
    torch.manual_seed(0)
    m = prune_(Mlp()).double()
    with torch.no_grad():  # the head stays dense: an unpruned classifier
        m.head.weight.copy_(torch.randn_like(m.head.weight))
    return m


def test_pruned_linears_fuse_their_activation_and_match_in_float64():
    model = _mlp()
    x = torch.randn(7, 40, dtype=torch.float64)
    front = prepare(model, x, dtypes=F64, linear=ON)
    with torch.no_grad():
        want, got = model(x), front.module(x)
    assert float((got - want).norm() / want.norm()) <= 1e-10
    plans = {p.name: (p.kind, p.action, p.fused) for p in front.plans}
    assert plans == {"fc1": ("linear", "sparseconv", ("relu",)), "fc2": ("linear", "sparseconv", ("relu6",)),
                     "fc3": ("linear", "sparseconv", ("clip",)), "fc4": ("linear", "sparseconv", ())}
    assert "head" not in plans  # dense: not a candidate, not listed
    assert isinstance(front.module.head, nn.Linear) and not isinstance(front.module.head, FusedLinear)
    assert front.convs["fc1"].activation == "relu" and front.convs["fc3"].clip == (-0.5, 0.5)
    assert {p.name: p.shape for p in front.plans}["fc1"] == linear_shape(40, 24)
    ops = [n.op for n in front.module.graph.nodes]
    assert "call_method" not in ops and "call_function" not in ops, "the activations must be fused away"
    assert isinstance(model.fc1, nn.Linear)  # the model itself is unchanged


def test_linear_is_off_unless_asked_and_convs_are_unchanged():
    """prepare() without LinearOptions (the default): Linear layers are not
    touched and not listed; a CNN's convs get the same plan either way."""
    class Cnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 5)

        def forward(self, x):
            return torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1)))

    model = prune_(Cnn()).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    off, on = prepare(model, x, dtypes=F64), prepare(model, x, dtypes=F64, linear=ON)
    assert [p.name for p in off.plans] == ["conv"] and set(off.convs) == {"conv"}
    assert [(p.name, p.kind, p.fused) for p in on.plans] == [("conv", "conv", ("relu",)),
                                                              ("fc", "linear", ("relu",))]
    assert on.plans[0] == off.plans[0]
    assert isinstance(on.convs["conv"], FusedConv2d) and isinstance(on.convs["fc"], FusedLinear)
    with torch.no_grad():
        want = model(x)
        for front in (off, on):
            assert float((front.module(x) - want).norm() / want.norm()) <= 1e-10


def test_linears_that_must_stay_say_why():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq3d = nn.Linear(8, 8)      # called on (N, T, 8): a token layer, not (N, in)
            self.twice = nn.Linear(8, 8)      # called twice
            self.big = nn.Linear(8, 64)       # over max_weights below
            self.unused = nn.Linear(8, 8)
            self.halfz = nn.Linear(8, 8)       # below LINEAR_MIN_SPARSITY

        def forward(self, x):
            y = self.seq3d(x.unsqueeze(1).expand(-1, 3, -1)).mean(1)
            return self.halfz(self.twice(self.twice(y))) + self.big(y)[:, :8]

    model = prune_(Odd()).double()
    with torch.no_grad():
        model.halfz.weight.copy_(torch.randn_like(model.halfz.weight))
        model.halfz.weight[:, :3] = 0.0
    x = torch.randn(4, 8, dtype=torch.float64)
    front = prepare(model, x, dtypes=F64, linear=LinearOptions(max_weights=100))
    why = {p.name: p.reason for p in front.plans if p.action == "kept"}
    assert set(why) == {"seq3d", "twice", "big", "unused"} and not front.convs
    assert "3-D" in why["seq3d"] and "called 2 times" in why["twice"]
    assert "512 weights > max_linear_weights 100" in why["big"] and "not called" in why["unused"]
    assert (model.halfz.weight == 0).float().mean() < LINEAR_MIN_SPARSITY
    # float32 weights with dtypes=(float64,): kept for the dtype
    f32 = prune_(Mlp())
    front32 = prepare(f32, torch.randn(2, 40), dtypes=F64, linear=ON)
    assert all(p.action == "kept" and "dtype" in p.reason for p in front32.plans)


def test_a_model_that_is_one_linear_is_swapped_whole():
    lin = prune_(nn.Linear(6, 5)).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    front = prepare(lin, x, dtypes=F64, linear=ON)
    assert isinstance(front.module, FusedLinear)
    assert front.plans[0].reason == "the model is one nn.Linear: swapped whole"
    with torch.no_grad():
        assert float((front.module(x) - lin(x)).norm() / lin(x).norm()) <= 1e-10


def test_untraceable_model_swaps_its_linears_per_module():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > -1e9 else x[:, :4]  # data-dependent: not traceable

    model = prune_(Branchy()).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    front = prepare(model, x, dtypes=F64, linear=ON)
    assert not front.traced and isinstance(front.module.fc, FusedLinear)
    assert front.plans[0].kind == "linear" and "per-module swap" in front.plans[0].reason
    with torch.no_grad():
        assert float((front.module(x) - model(x)).norm() / model(x).norm()) <= 1e-10


def test_fused_linear_reference_path_and_route():
    w = torch.tensor([[1.0, 0.0, -2.0], [0.0, 0.5, 0.0]])
    m = FusedLinear(w, torch.tensor([0.1, -3.0]), activation="relu", name="fc")
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(m(x), torch.relu(x @ w.T + torch.tensor([0.1, -3.0])))
    m.route = [(8, "dense"), (1 << 62, "sparseconv")]
    assert (m.path(1), m.path(8), m.path(9)) == ("dense", "dense", "sparseconv")
    assert "route <=8: dense, else sparseconv" in repr(m)
    with pytest.raises(TypeError, match="fc: a fused Linear takes no residual"):
        m(x, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="fc: weight must be 2-D"):
        FusedLinear(torch.zeros(2, 3, 1, 1), None, name="fc")
    with pytest.raises(ValueError, match="fc: clip=.* goes with activation='clip'"):
        FusedLinear(w, None, clip=(0.0, 1.0), name="fc")


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(linear="yes"), TypeError, "linear must be True or False"),
    (dict(max_linear_weights=0), ValueError, "max_linear_weights must be a positive int or None"),
    (dict(max_linear_weights=2.5), ValueError, "max_linear_weights must be a positive int or None"),
])
def test_sparsify_refuses_bad_linear_options(kwargs, error, needle):
    import sparseconv.torch as sct

    with pytest.raises(error, match=needle):
        sct.sparsify(nn.Linear(4, 4), torch.randn(2, 4), **kwargs)
