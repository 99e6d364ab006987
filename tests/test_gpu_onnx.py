"""GPU: `sparseconv run --check` on CNNs exported by torch.onnx.export (issue
14): MobileNetV3-like with squeeze-excite, a ResNet block, a UNet/FPN head
with Resize, ConvTranspose and Concat, pruned to 90%, in both weight forms.
Every Conv runs as a sparseconv kernel; the output must match the float64
reference and onnxruntime."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from onnx_families import FAMILIES, FORMS, export, inputs, onnxruntime_outputs
from sparseconv.cli import main
from sparseconv.testing import relative_l2

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")
pytest.importorskip("onnxruntime")


def _run(path, x, tmp_path, *extra):
    np.savez(tmp_path / "d.npz", x=x)
    out = tmp_path / "y.npy"
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(tmp_path / "d.npz"), "--check", "--json",
                                  "-o", str(out), "--cache-dir", str(tmp_path / "cache"), *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):]), np.load(out)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_run_check_on_exported_models(tmp_path, family, form):
    path = export(family, tmp_path / f"{family}.onnx", form)
    x = inputs(5)
    summary, y = _run(path, x, tmp_path)
    assert summary["conv_layers"] >= 4
    assert all(info["backend"] == "sparseconv" for info in summary["layers"].values())
    assert summary["relative_l2_vs_reference"] <= 1e-5
    assert relative_l2(y, onnxruntime_outputs(path, x)) <= 1e-5


@pytest.mark.parametrize("size", [(16, 16), (20, 24)])
def test_run_check_with_input_size_after_resize_and_conv_transpose(tmp_path, size):
    path = export("unet_head", tmp_path / "unet.onnx", "constants", dynamic_hw=True)
    x = inputs(3, size)
    summary, y = _run(path, x, tmp_path, "--input-size", f"{size[0]}x{size[1]}")
    assert summary["relative_l2_vs_reference"] <= 1e-5
    assert relative_l2(y, onnxruntime_outputs(path, x)) <= 1e-5


def test_compile_model_plan_says_conv_transpose_runs_dense(tmp_path):
    from sparseconv.runner import compile_model

    model = compile_model(export("unet_head", tmp_path / "unet.onnx"), cache_dir=str(tmp_path / "cache"),
                          route_batches=None)  # the plan as compiled; routing is tested in test_gpu_onnx_graph
    plan = model.plan
    assert sum(": Conv " in line and line.endswith("sparseconv") for line in plan) == 6
    assert any("/up/ConvTranspose: ConvTranspose, dense" in line for line in plan)
    x = inputs(2)
    y = model(x).get()
    assert relative_l2(y, onnxruntime_outputs(tmp_path / "unet.onnx", x)) <= 1e-5
