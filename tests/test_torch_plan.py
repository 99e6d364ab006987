"""CPU: which nn.Conv2d layers sparseconv.torch.sparsify would compile, and why
the others stay (runs the model once on the CPU; no GPU needed)."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from sparseconv.torch import plan, sparsify  # noqa: E402


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.same = nn.Conv2d(8, 8, 3, padding="same", dilation=2)
        self.even_same = nn.Conv2d(8, 8, 2, padding="same")
        self.reflect = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.shared = nn.Conv2d(8, 8, 1)
        self.unused = nn.Conv2d(8, 8, 1)
        self.f64 = nn.Conv2d(8, 8, 1).double()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = self.reflect(self.even_same(self.same(self.stem(x))))
        x = self.shared(x)
        x = self.shared(self.pool(x))  # a second input size for the same module
        return self.f64(x.double()).float()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own, for even_same
def test_plan_says_which_convs_compile_and_why_the_others_stay():
    m = Mixed()
    with torch.no_grad():
        m.stem.weight[:, :, 0] = 0  # 1/3 zeros
    plans = {p.name: p for p in plan(m, torch.randn(2, 3, 10, 12), min_sparsity=0.0)}
    assert plans["stem"].action == "sparseconv" and plans["stem"].shape.in_h == 10
    assert abs(plans["stem"].sparsity - 1 / 3) < 1e-6
    assert plans["same"].action == "sparseconv" and plans["same"].shape.padding == (2, 2)
    assert plans["same"].shape.out_h == 10
    assert "asymmetric" in plans["even_same"].reason
    assert "reflect" in plans["reflect"].reason
    assert "several input sizes" in plans["shared"].reason
    assert "not called" in plans["unused"].reason
    assert "float64" in plans["f64"].reason
    high = {p.name: p for p in plan(m, torch.randn(1, 3, 10, 12), min_sparsity=0.3)}
    assert high["stem"].action == "sparseconv" and high["same"].action == "kept"
    assert "min_sparsity" in high["same"].reason


def test_sparsify_needs_a_cuda_example():
    with pytest.raises(ValueError, match="CUDA tensor"):
        sparsify(Mixed(), torch.randn(1, 3, 10, 12))


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_sparsify_refuses_a_min_sparsity_outside_0_1(value):
    with pytest.raises(ValueError, match="min_sparsity"):
        sparsify(Mixed(), torch.randn(1, 3, 10, 12), min_sparsity=value)


def test_format_plan_lists_action_fusion_and_reason():
    from sparseconv.fx import prepare
    from sparseconv.torch import format_plan

    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")).eval()
    text = format_plan(prepare(m, torch.randn(1, 3, 8, 8)).plans)
    assert text.splitlines() == ["0  sparseconv  bn+relu", "3  kept        -               padding_mode='circular' "
                                 "(only 'zeros' compiles)"]


def test_cuda_graph_module_runs_cpu_inputs_directly():
    from sparseconv.torch import CudaGraphModule

    m = nn.Conv2d(3, 4, 1)
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        assert torch.equal(CudaGraphModule(m)(x), m(x))


def test_route_from_choices_takes_the_nearer_measured_batch():
    from sparseconv.tilings import ANY_BATCH
    from sparseconv.torch import route_from_choices

    assert route_from_choices([(1, "sparseconv"), (64, "dense")]) == [(8, "sparseconv"), (ANY_BATCH, "dense")]
    assert route_from_choices([(1, "dense"), (64, "dense")]) == [(ANY_BATCH, "dense")]
    assert route_from_choices([(1, "sparseconv"), (16, "dense"), (256, "sparseconv")]) == \
        [(4, "sparseconv"), (64, "dense"), (ANY_BATCH, "sparseconv")]


def test_fused_conv_path_follows_its_route():
    import torch

    from sparseconv.fx import FusedConv2d
    from sparseconv.tilings import ANY_BATCH

    m = FusedConv2d(torch.zeros(2, 2, 1, 1), None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)
    assert m.path(1) == "sparseconv" and m.path(1000) == "sparseconv"  # no route: the kernel
    m.route = [(8, "sparseconv"), (ANY_BATCH, "dense")]
    assert [m.path(b) for b in (1, 8, 9, 64)] == ["sparseconv", "sparseconv", "dense", "dense"]


class DeepTail(nn.Module):
    """A VGG-16 conv5-like 3x3 (512 -> 512 at 14x14) after a shallow one."""

    def __init__(self):
        super().__init__()
        self.shallow = nn.Conv2d(3, 512, 3, padding=1)
        self.deep = nn.Conv2d(512, 512, 3, padding=1)
        self.pointwise = nn.Conv2d(512, 512, 1)

    def forward(self, x):
        return self.pointwise(torch.relu(self.deep(torch.relu(self.shallow(x)))))


def test_deep_small_image_convs_skip_their_split_code_where_the_table_runs_small_batches():
    """sparsify builds VGG-16 conv5-like layers without their small-batch code
    when routing times the table at a small batch (tilings.code_variants)."""
    from sparseconv.fx import prepare
    from sparseconv.torch import small_batch_table_layers

    front = prepare(DeepTail(), torch.randn(1, 3, 14, 14))
    shapes = {p.name: p.shape for p in front.plans if p.name in front.convs}
    assert set(shapes) == {"shallow", "deep", "pointwise"}
    assert small_batch_table_layers(front.convs, shapes, (1, 64), table=True) == ["deep"]
    assert small_batch_table_layers(front.convs, shapes, (1, 64), table=False) == []
    assert small_batch_table_layers(front.convs, shapes, (16, 64), table=True) == []  # the table is not timed
    assert small_batch_table_layers(front.convs, shapes, None, table=True) == []
