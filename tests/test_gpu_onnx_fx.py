"""GPU: ONNX models through the fx front end (onnx_fx.py: onnx_torch's
conversion, then sparsify's passes), against the float64 reference of the
graph as written and against onnxruntime, eagerly and in CUDA graphs, through
compile_model and `sparseconv run --front-end fx` (issue 13, item 0)."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.testing import relative_l2
from shipped_models import DIGITS, LENET, MODELS

pytestmark = pytest.mark.gpu


def test_lenet_through_fx_gives_the_dense_predictions_on_the_whole_test_split(session_cache_dir):
    pytest.importorskip("onnx")
    pytest.importorskip("torch")
    import cupy as cp

    from sparseconv import compile_model
    from sparseconv.runner import load_data, load_program, predict, run_reference

    model = compile_model(LENET, front_end="fx", cache_dir=str(session_cache_dir), cuda_graph=True)
    assert model.front_end == "fx" and sorted(model.kernels) == ["conv1", "conv2"], model.plan
    program = load_program(LENET)
    x, labels = load_data(DIGITS, program)
    y = predict(model, x, 128)
    ref = predict(lambda b: run_reference(program, b)[0], x, 450)
    assert np.array_equal(y.argmax(1), ref.argmax(1))  # all 450 predictions
    assert relative_l2(y, ref) <= 1e-5
    record = json.loads((MODELS / "lenet_digits.json").read_text())
    assert int(np.sum(y.argmax(1) == labels)) == round(record["pruned_test_accuracy"] * len(x))
    xr = cp.random.default_rng().random((7, 1, 8, 8), dtype=cp.float32)  # fresh inputs, on the device
    assert relative_l2(model(xr).get(), run_reference(program, xr)[0]) <= 1e-5
    with cp.cuda.Stream(non_blocking=True):  # replays follow CuPy's current stream, not only the default one
        for _ in range(3):
            xr = cp.random.default_rng().random((7, 1, 8, 8), dtype=cp.float32)
            y = model(xr)
            assert relative_l2(y.get(), run_reference(program, xr.get())[0]) <= 1e-5
    assert model.graph_notes == {(128, 1, 8, 8): "captured", (66, 1, 8, 8): "captured", (7, 1, 8, 8): "captured"}
    conv_lines = [line for line in model.plan if line.startswith("conv")]
    assert len(conv_lines) == 2 and all("fused relu" in s and "cuDNN fp32" in s for s in conv_lines), model.plan
    assert sorted(model.routes) == ["conv1", "conv2"]


@pytest.mark.parametrize("family", ["mobilenetv3", "resnet_block", "unet_head"])
def test_exported_families_through_fx_match_onnxruntime_in_a_graph(tmp_path, family):
    """Residual adds and activations fused by sparsify's passes, not
    onnx_fuse: the outputs still match onnxruntime, replayed in a CUDA graph."""
    pytest.importorskip("onnxruntime")
    from onnx_families import export, inputs, onnxruntime_outputs

    from sparseconv.onnx_compile import compile_model

    path = export(family, tmp_path / f"{family}.onnx")
    model = compile_model(path, front_end="fx", cache_dir=str(tmp_path / "cache"), cuda_graph=True,
                          route_batches=None)
    assert model.kernels, model.plan
    for seed in (11, 12):
        x = inputs(3, seed=seed)
        assert relative_l2(model(x).get(), onnxruntime_outputs(path, x)) <= 1e-5
    assert model.graph_notes == {tuple(x.shape): "captured"}
    if family == "resnet_block":  # the exporter folded BN; sparsify's passes fuse the residual adds
        assert [p.fused for p in model.plans if p.kind == "conv"] == [("relu",), ("add", "relu"), ("add", "relu"), ()]


def test_fx_model_runs_a_shape_whose_capture_fails_eagerly_and_notes_it(session_cache_dir):
    """As the runner's SparseModel: a shape whose forward syncs with the host
    is not captured; it runs eagerly, with the right results, and graph_notes
    says so; other shapes still replay."""
    import cupy as cp
    import torch

    from sparseconv import compile_model
    from sparseconv.onnx_fx import FxOnnxModel
    from sparseconv.runner import load_program, run_reference
    from sparseconv.torch import CudaGraphModule

    class SyncsOnLargeBatches(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            if x.shape[0] > 4:
                y = y + float(x.amax().item() > 1e30)  # adds 0.0, after a host sync no capture can hold
            return y

    compiled = compile_model(LENET, front_end="fx", cache_dir=str(session_cache_dir), cuda_graph=True,
                             route_batches=None)
    model = FxOnnxModel(LENET, CudaGraphModule(SyncsOnLargeBatches(compiled.module.module)), (1, 8, 8), None)
    program = load_program(LENET)
    for batch in (3, 9, 3, 9):
        x = cp.random.default_rng().random((batch, 1, 8, 8), dtype=cp.float32)
        assert relative_l2(model(x).get(), run_reference(program, x.get())[0]) <= 1e-5
    notes = model.graph_notes
    assert notes[(3, 1, 8, 8)] == "captured" and notes[(9, 1, 8, 8)].startswith("not captured, runs eagerly: ")
    assert any(line.startswith("CUDA graph for input 9x1x8x8: not captured") for line in model.plan), model.plan


def test_auto_takes_fx_where_the_conversion_takes_the_model(session_cache_dir):
    pytest.importorskip("torch")
    from sparseconv import compile_model

    model = compile_model(LENET, front_end="auto", cache_dir=str(session_cache_dir), route_batches=None)
    assert model.front_end == "fx" and model.front_end_note == "fx: every node converted"


def test_auto_runs_a_model_the_conversion_refuses_on_the_runner_and_says_why(tmp_path):
    """A Slice backwards along the batch axis: the conversion needs the axis'
    size, which the file leaves free, but the runner slices at run time."""
    pytest.importorskip("torch")
    from onnx import helper
    from onnx_models import save_model

    from sparseconv import compile_model
    from sparseconv.runner import load_program, run_reference
    from sparseconv.testing import pruned_weight

    rng = np.random.default_rng(5)
    back = {"s": np.array([-1], np.int64), "e": np.array([np.iinfo(np.int64).min], np.int64),
            "a": np.array([0], np.int64), "st": np.array([-1], np.int64)}
    path = save_model(tmp_path / "back.onnx", [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1] * 4),
                                                helper.make_node("Slice", ["c", "s", "e", "a", "st"], ["out"],
                                                                 name="backwards")],
                      {"w": pruned_weight(rng, (8, 4, 3, 3), 0.8), **back}, ["N", 4, 10, 10])
    model = compile_model(path, cache_dir=str(tmp_path / "cache"), route_batches=None)
    assert model.front_end == "runner" and "node backwards (Slice): a negative step needs the size of axis 0" in \
        model.front_end_note, model.front_end_note
    x = rng.standard_normal((3, 4, 10, 10)).astype(np.float32)
    assert relative_l2(model(x).get(), run_reference(load_program(path), x)[0]) <= 1e-5


def test_cli_run_through_fx_checks_against_the_dense_reference(session_cache_dir, tmp_path):
    pytest.importorskip("torch")
    from sparseconv.cli import main

    out = tmp_path / "logits.npy"
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--check", "--json", "--front-end", "fx",
                                  "--cuda-graph", "--batch-size", "128", "-o", str(out),
                                  "--cache-dir", str(session_cache_dir)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output[r.output.index("{"):])
    assert s["front_end"] == "fx" and s["same_predictions"] == 450 and s["relative_l2_vs_reference"] <= 1e-5
    assert s["cuda_graphs"] == {"128x1x8x8": "captured", "66x1x8x8": "captured"}, s["cuda_graphs"]
    for info in s["layers"].values():
        assert [t["batch"] for t in info["route"]["times_us"]] == [1, 64] and info["fused"] == ["relu", "maxpool"]
    assert np.load(out).shape == (450, 10)


@pytest.mark.parametrize("how", ["chunk", "view"])
def test_an_export_that_halves_the_batch_replays_in_graphs_like_onnxruntime(tmp_path, how):
    """torch.chunk(y, 2) and y.view(y.size(0) // 2, -1) after a pruned conv,
    exported with a dynamic batch (shape arithmetic on sizes, 2bfd23c): the fx
    front end takes the file, compiles the conv, and replays each batch size in
    a graph of its own with onnxruntime's outputs (an odd batch for the view)."""
    ort = pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn

    from sparseconv import compile_model
    from sparseconv.testing import pruned_weight

    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(16, 32, 3, padding=1)
            w = pruned_weight(np.random.default_rng(), (32, 16, 3, 3), 0.8)
            self.conv.weight.data = torch.from_numpy(w)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            if how == "chunk":
                a, b = torch.chunk(y, 2, dim=0)
                return a - b
            return y.view(y.size(0) // 2, -1)

    path = tmp_path / f"{how}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(Halves().eval(), torch.randn(2, 16, 12, 12), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N"}})
    model = compile_model(path, front_end="fx", cache_dir=str(tmp_path / "cache"), cuda_graph=True,
                          route_batches=None)
    assert model.front_end == "fx" and len(model.kernels) == 1, model.plan
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batches = (4, 6) if how == "chunk" else (4, 5)
    for batch in batches + batches:  # each shape captured once, then replayed with fresh inputs
        x = np.random.default_rng().standard_normal((batch, 16, 12, 12)).astype(np.float32)
        want = session.run(None, {"x": x})[0]
        got = model(x).get()
        assert got.shape == want.shape and got.shape[0] == batch // 2
        assert relative_l2(got, want) <= 1e-5
    assert model.graph_notes == {(b, 16, 12, 12): "captured" for b in batches}, model.graph_notes
