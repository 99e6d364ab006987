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
        ("conv1", "conv", ("relu",)), ("conv2", "conv", ("relu",))]
    assert conv_fusion_totals(front.plans) == ["0 BatchNormalization folded, 0 residual adds and 2 activations fused "
                                          "into the conv kernels (2 of 2 convs)"]
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
