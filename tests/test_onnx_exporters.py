"""CPU: CNNs exported by torch.onnx.export, in the two weight forms
(initializers; Constant nodes behind Cast/Identity), pruned to 90%, through
`sparseconv inspect`, `compile` and `run --backend reference`, checked
against onnxruntime on the same weights and inputs (issue 14)."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from onnx_families import FAMILIES, FORMS, SIZE, export, inputs, onnxruntime_outputs
from sparseconv.cli import main
from sparseconv.model import ModelError, load_model
from sparseconv.runner import load_program
from sparseconv.testing import relative_l2

pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    models = {(f, form): export(f, root / f"{f}_{form}.onnx", form) for f in FAMILIES for form in FORMS}
    for form in FORMS:  # image size left free: --input-size has to size every conv
        models["unet_head", form + "_dynamic"] = export("unet_head", root / f"unet_dyn_{form}.onnx", form,
                                                        dynamic_hw=True)
    return models


def _ops(path):
    import onnx

    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_exports_hold_the_operators_they_are_meant_to_test(exported):
    mobile, resnet, unet = (_ops(exported[f, "initializers"]) for f in FAMILIES)
    assert {"HardSwish", "HardSigmoid", "Clip", "GlobalAveragePool", "Mul", "ReduceMean", "Gemm"} <= mobile
    assert {"Add", "Relu", "MaxPool", "Flatten", "Gemm"} <= resnet
    assert {"Resize", "ConvTranspose", "Concat", "Shape", "Slice", "Cast", "Sigmoid"} <= unet
    assert {"Constant", "Cast", "Identity"} <= _ops(exported["resnet_block", "constants"])
    import onnx

    assert not onnx.load(str(exported["resnet_block", "constants"])).graph.initializer


@pytest.mark.parametrize("family", FAMILIES)
def test_both_weight_forms_give_the_same_pruned_layers(exported, family):
    a = load_model(exported[family, "initializers"]).layers
    b = load_model(exported[family, "constants"]).layers
    assert [x.name for x in a] == [x.name for x in b] and len(a) >= 4
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_array_equal(x.weight, y.weight)
        assert (x.bias is None) == (y.bias is None)
        if x.bias is not None:
            np.testing.assert_array_equal(x.bias, y.bias)
        assert x.sparsity >= 0.85
    if family == "mobilenetv3":  # squeeze-excite: 8 -> 2 -> 8 channels on a 1x1 input
        se = {x.name: x.shape for x in a if "/se/" in x.name}
        assert [(s.in_channels, s.out_channels, s.in_h, s.in_w) for s in se.values()] == [(8, 2, 1, 1),
                                                                                          (2, 8, 1, 1)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_run_matches_onnxruntime(exported, family, form, tmp_path):
    x = inputs()
    np.savez(tmp_path / "d.npz", x=x)
    out = tmp_path / "y.npy"
    r = CliRunner().invoke(main, ["run", str(exported[family, form]), "--data", str(tmp_path / "d.npz"),
                                  "--backend", "reference", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    want = onnxruntime_outputs(exported[family, "initializers"], x)
    np.testing.assert_allclose(onnxruntime_outputs(exported[family, form], x), want, rtol=1e-5, atol=1e-6)
    y = np.load(out)
    assert y.shape == want.shape and relative_l2(y, want) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_lists_every_conv_alike_in_both_forms(exported, family):
    outputs = []
    for form in FORMS:
        r = CliRunner().invoke(main, ["inspect", str(exported[family, form])])
        assert r.exit_code == 0, r.output
        outputs.append(r.output.splitlines()[1:])  # the first line names the file
    assert outputs[0] == outputs[1]
    names = [layer.name for layer in load_model(exported[family, "initializers"]).layers]
    rows = [line for line in outputs[0] if line.split(" ")[0] in names]
    assert len(rows) == len(names) and all(line.split("  ")[-1].startswith("compile (") for line in rows)


@pytest.mark.parametrize("size", [SIZE, (20, 24)])
@pytest.mark.parametrize("form", ["initializers_dynamic", "constants_dynamic"])
def test_input_size_sizes_the_convs_after_resize_and_conv_transpose(exported, form, size, tmp_path):
    path = exported["unet_head", form]
    with pytest.raises(ModelError, match="no static input size.*--input-size"):
        load_model(path)
    hw = f"{size[0]}x{size[1]}"
    layers = {layer.name: layer.shape for layer in load_model(path, input_size=size).layers}
    assert (layers["/d/Conv"].in_h, layers["/d/Conv"].in_w) == size      # after Resize(scale) and Concat
    assert (layers["/lat/Conv"].in_h, layers["/lat/Conv"].in_w) == (size[0] // 2, size[1] // 2)
    x = inputs(2, size)
    np.savez(tmp_path / "d.npz", x=x)
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(tmp_path / "d.npz"), "--input-size", hw,
                                  "--backend", "reference", "-o", str(tmp_path / "y.npy")])
    assert r.exit_code == 0, r.output
    assert relative_l2(np.load(tmp_path / "y.npy"), onnxruntime_outputs(path, x)) <= 1e-5


@pytest.mark.nvcc
@pytest.mark.parametrize("family", FAMILIES)
def test_compile_both_forms_builds_the_same_kernels(exported, family, tmp_path, session_cache_dir):
    """Every conv compiles, the squeeze-excite 1x1 convs on a 1x1 input
    included; the Constant-node form builds the very same kernels (cache hits)."""
    manifests = []
    for form in FORMS:
        out = tmp_path / form
        r = CliRunner().invoke(main, ["compile", str(exported[family, form]), "-o", str(out), "--cache-dir",
                                      str(session_cache_dir), "--json"])
        assert r.exit_code == 0, r.output
        manifests.append(json.loads((out / "manifest.json").read_text()))
    first, second = ([(e["name"], e["nonzero_weights"], e["fmas_deleted"]) for e in m["layers"]] for m in manifests)
    assert first == second and len(first) == len(load_model(exported[family, "initializers"]).layers)
    assert all(e["cache_hit"] for e in manifests[1]["layers"])


def test_an_operator_the_runner_lacks_is_refused_naming_the_node(tmp_path):
    import torch

    class RunningSum(torch.nn.Module):  # cumsum exports as CumSum
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.cumsum(self.conv(x), dim=3)

    path = tmp_path / "cumsum.onnx"
    torch.onnx.export(RunningSum().eval(), (torch.zeros(1, 3, 8, 8),), str(path), dynamo=False, opset_version=17)
    with pytest.raises(ModelError, match=r"node /CumSum has operator CumSum"):
        load_program(path)
    np.savez(tmp_path / "d.npz", x=np.zeros((1, 3, 8, 8), np.float32))
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(tmp_path / "d.npz")])
    assert r.exit_code == 2 and "CumSum" in r.output


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_convnext_style_block_with_layer_norm_and_gelu_matches_onnxruntime(tmp_path, approximate):
    """Depthwise conv, channels-last LayerNormalization, Linear, GELU (Erf, or
    Tanh for the approximation), Linear, back to channels-first."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = torch.nn.Conv2d(8, 8, 7, padding=3, groups=8)
            self.stem = torch.nn.Conv2d(3, 8, 2, 2)
            self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            x = self.stem(x)
            y = self.norm(self.dw(x).permute(0, 2, 3, 1))
            y = self.fc2(torch.nn.functional.gelu(self.fc1(y), approximate=approximate))
            return x + y.permute(0, 3, 1, 2)

    torch.manual_seed(0)
    path = tmp_path / "convnext.onnx"
    torch.onnx.export(Block().eval(), (torch.zeros(1, 3, *SIZE),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], dynamic_axes={"x": {0: "N"}})
    from sparseconv.runner import run_reference

    x = inputs(2)
    (y,) = run_reference(load_program(path), x)
    assert relative_l2(y, onnxruntime_outputs(path, x)) <= 1e-5


def test_plan_says_conv_transpose_runs_dense(exported):
    plan = load_program(exported["unet_head", "initializers"]).plan()
    assert [line.split(":")[0] for line in plan if ": Conv " in line] == [
        "/e1/Conv", "/e2/Conv", "/e3/Conv", "/lat/Conv", "/d/Conv", "/out/Conv"]
    assert "/up/ConvTranspose: ConvTranspose, dense (matmuls; not a sparseconv kernel)" in plan


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_run_of_the_graph_matches_onnxruntime(exported, family):
    """The graph run as the GPU runs it, in float32 (NumPy standing in for
    CuPy, dense convs standing in for the kernels): dtypes hold through Cast,
    Resize and ConvTranspose."""
    from sparseconv.runner import conv2d_dense, execute

    program = load_program(exported[family, "constants"])
    x = inputs()
    (y,) = execute(program, x, np, lambda layer, a: conv2d_dense(layer, a).astype(np.float32), np.float32)
    assert y.dtype == np.float32
    assert relative_l2(y, onnxruntime_outputs(exported[family, "initializers"], x)) <= 1e-5


def _view_head():
    """A classifier written the old way: ReLU6, F.pad (asymmetric, a Pad
    node), slicing, x.reshape(x.size(0), -1) (Shape/Gather/Unsqueeze/Concat/
    Reshape), squeeze and softmax."""
    import torch

    class ViewHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4 * 16 * 16, 3)

        def forward(self, x):
            y = torch.nn.functional.pad(torch.nn.functional.relu6(self.c(x)), (1, 0, 0, 1))[:, :, :16, 1:]
            return self.fc(y.reshape(y.size(0), -1)).unsqueeze(1).squeeze(1).softmax(-1)

    torch.manual_seed(0)
    return ViewHead().eval()


@pytest.mark.parametrize("opset", [11, 13, 18])
@pytest.mark.parametrize("family", FAMILIES + ("view_head",))
def test_other_opsets_and_unfolded_exports_match_onnxruntime(tmp_path, opset, family):
    """Opsets move Clip bounds, Squeeze/ReduceMean axes and Resize's roi
    between attributes and inputs; do_constant_folding=False leaves the
    exporter's static subgraphs for the importer to fold. Image size free."""
    import warnings

    import torch

    from onnx_families import build
    from sparseconv.runner import run_reference

    model = _view_head() if family == "view_head" else build(family)
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.zeros(1, 3, *SIZE),), str(path), dynamo=False, opset_version=opset,
                          input_names=["x"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}},
                          do_constant_folding=False)
    x = inputs(2)
    (y,) = run_reference(load_program(path, SIZE), x)
    assert relative_l2(y, onnxruntime_outputs(path, x)) <= 1e-5


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_network_bench_conversion_matches_onnxruntime(exported, family, form):
    """onnx_torch (what `bench --network model.onnx` times) on each exported
    family: ReduceMean, ConvTranspose, Resize to computed sizes and by scales,
    shapes sliced and concatenated; the same outputs as onnxruntime, also
    after sparsify's front end has folded and fused the graph."""
    import torch

    from sparseconv.fx import LinearOptions, prepare
    from sparseconv.onnx_torch import onnx_to_torch

    module, shape = onnx_to_torch(exported[family, form])
    assert shape == (3,) + tuple(SIZE)
    x = inputs()
    want = onnxruntime_outputs(exported[family, form], x)
    with torch.no_grad():
        assert relative_l2(module(torch.from_numpy(x)).numpy(), want) <= 1e-5
        front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
        assert front.traced, front.trace_error
        assert relative_l2(front.module(torch.from_numpy(x)).numpy(), want) <= 1e-5
