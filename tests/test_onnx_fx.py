"""CPU: the fx front end for ONNX files (onnx_fx.py) and the choice between
front ends (onnx_compile.py): the plan text from a converted graph's real
front end, what compile_model refuses before any work, and where "auto"
falls back. `sparseconv run`'s refusals are in test_faults.py; the compiled
path is on the GPU (test_gpu_onnx_fx.py)."""
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from onnx_models import residual_net  # noqa: E402
from onnx_toys import EXPECTED, toy  # noqa: E402
from sparseconv.fx import LinearOptions, prepare  # noqa: E402
from sparseconv.model import ModelError  # noqa: E402
from sparseconv.onnx_compile import compile_model, torch_cuda_missing  # noqa: E402
from sparseconv.onnx_fx import FxOnnxModel, conv_fusion_totals, plan_line  # noqa: E402
from sparseconv.onnx_torch import onnx_to_torch  # noqa: E402
from shipped_models import LENET  # noqa: E402

NO_CUDA = not torch.cuda.is_available()


def _front_end(path):
    module, shape = onnx_to_torch(path)
    x = torch.from_numpy(np.random.default_rng().standard_normal((1,) + shape).astype(np.float32))
    return prepare(module, x, linear=LinearOptions()), shape


def test_the_plan_says_what_each_converted_layer_fused_and_the_totals(tmp_path):
    front, shape = _front_end(residual_net(tmp_path, np.random.default_rng(3)))
    lines = [plan_line(p) for p in front.plans]
    assert lines[0] == ("conv1: Conv C=3 K=8 12x12 kernel 3x3 stride (1, 1) pad (1, 1) dilation (1, 1) groups 1, "
                        "fused bn+relu, sparseconv")
    assert lines[1].startswith("conv2: Conv C=8 K=8 6x6 kernel 3x3") and lines[1].endswith("fused bn+add+relu, "
                                                                                            "sparseconv")
    assert len(lines) == 2  # fc, 30% zeros, is under the Linear threshold: not a candidate, not listed
    assert conv_fusion_totals(front.plans) == ["2 BatchNormalization folded, 1 residual adds and 2 activations fused "
                                          "into the conv kernels (2 of 2 convs)"]
    # the model object reads the same plan; without kernels attached it lists no layers
    front.module.sparseconv_plan = front.plans
    model = FxOnnxModel(tmp_path / "residual.onnx", front.module, shape, None)
    assert model.plan == lines and model.fused("conv2") == ("bn", "add", "relu") and model.fused("nope") == ()
    assert model.kernels == {} and model.routes == {} and model.graph_notes == {}


def test_conv_fusion_totals_count_only_compiled_convs():
    front, _ = _front_end(LENET)
    assert [(p.name, p.kind, p.fused) for p in front.plans if p.kind == "conv"] == [
        ("conv1", "conv", ("relu", "maxpool")), ("conv2", "conv", ("relu", "maxpool"))]
    assert conv_fusion_totals(front.plans) == ["0 BatchNormalization folded, 0 residual adds, 2 activations and 2 max "
                                          "pools fused into the conv kernels (2 of 2 convs)"]
    assert conv_fusion_totals([p for p in front.plans if p.kind != "conv"]) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_fx_front_end_fuses_each_onnx_toy_as_the_runner_does(tmp_path, name):
    """The chains onnx_fuse fuses (EXPECTED, checked on the runner in
    test_onnx_fuse.py), found again by sparsify's passes on the converted graph."""
    front, _ = _front_end(toy(name, tmp_path))
    assert {p.name: p.fused for p in front.plans if p.kind == "conv"} == EXPECTED[name]


@pytest.mark.parametrize("front_end", ["torch", "", None])
def test_compile_model_refuses_an_unknown_front_end_before_any_work(front_end):
    with pytest.raises(ValueError, match="compile_model: front_end must be one of runner, fx, auto"):
        compile_model(Path("no-such-file.onnx"), front_end=front_end)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal where torch has no CUDA device")
def test_the_fx_front_end_without_cuda_says_what_to_use_instead():
    assert torch_cuda_missing() == "torch has no usable CUDA device"
    with pytest.raises(ModelError, match=r"lenet_digits_pruned.onnx: the fx front end needs torch with CUDA \(torch "
                                         r"has no usable CUDA device\); use front_end='runner'"):
        compile_model(LENET, front_end="fx")


def _halving_export(tmp_path, forward, batch=2):
    """A conv, then `forward(y)`, exported at `batch` with a dynamic batch (TorchScript exporter, opset 17)."""
    import warnings

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return forward(self.conv(x))

    path = tmp_path / "halves.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notices
        torch.onnx.export(Net().eval(), torch.randn(batch, 3, 6, 6), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N"}})
    return path


def test_the_example_input_takes_batch_2_where_the_graph_fails_at_batch_1(tmp_path):
    """y.view(y.size(0) // 2, -1) is view(0, -1) at batch 1, which torch
    refuses: sparsify's example input (found on the GPU, session 33) is then
    batch 2, with the input's shape."""
    from sparseconv.onnx_fx import example_input

    path = _halving_export(tmp_path, lambda y: y.view(y.size(0) // 2, -1))
    module, shape = onnx_to_torch(path)
    x = example_input(path, module, shape, torch.device("cpu"))
    assert tuple(x.shape) == (2, 3, 6, 6) and float(x.std()) > 0.5  # random, not zeros
    assert tuple(module(x).shape) == (1, 2 * 4 * 36)
    plain = onnx_to_torch(_halving_export(tmp_path, torch.relu))[0]
    assert tuple(example_input(path, plain, shape, torch.device("cpu")).shape) == (1, 3, 6, 6)


def test_a_graph_that_runs_at_neither_batch_is_refused_naming_the_file_and_both_errors(tmp_path):
    """y.view(y.size(0) // 3, -1), exported at batch 3, is view(0, -1) at
    batch 1 and 2: a ModelError with the file, the input shape and each
    batch's error, which "auto" answers by taking the runner."""
    from sparseconv.onnx_fx import example_input

    path = _halving_export(tmp_path, lambda y: y.view(y.size(0) // 3, -1), batch=3)
    module, shape = onnx_to_torch(path)
    with pytest.raises(ModelError) as info:
        example_input(path, module, shape, torch.device("cpu"))
    text = str(info.value)
    assert text.startswith(f"{path}: the converted graph does not run on a random input of shape (N, 3, 6, 6) (")
    assert "batch 1: RuntimeError: shape '[0, -1]' is invalid" in text and "; batch 2: RuntimeError" in text
    assert text.endswith("or run it with front_end='runner' (`--front-end runner`)")


def test_an_exported_adaptive_pool_to_its_input_size_is_skipped_and_the_plan_says_so(tmp_path):
    """VGG's AdaptiveAvgPool2d((7, 7)) after 7x7 features, as the TorchScript
    exporter writes it (an AveragePool with a 1x1 window), converted: sparsify's
    skip_identity_pools takes it, the outputs stay the same, and
    FxOnnxModel.plan lists it."""
    from sparseconv.fx import SkipIdentityPool, skip_identity_pools

    path = _halving_export(tmp_path, lambda y: torch.flatten(torch.nn.AdaptiveAvgPool2d((6, 6))(torch.relu(y)), 1))
    module, shape = onnx_to_torch(path)
    x = torch.randn((3,) + shape)
    front = prepare(module, x[:1], linear=LinearOptions())
    gm = front.module
    want = module(x)
    skipped = skip_identity_pools(gm)
    assert len(skipped) == 1 and isinstance(gm.get_submodule(skipped[0]), SkipIdentityPool), gm
    assert torch.equal(gm(x), want)
    gm.sparseconv_plan, gm.sparseconv_skipped_pools = front.plans, skipped
    pool = type(gm.get_submodule(skipped[0]).pool).__name__
    plan = FxOnnxModel(path, gm, shape, None).plan
    assert f"{skipped[0]}: {pool}, skipped where it leaves its input as it is" in plan
