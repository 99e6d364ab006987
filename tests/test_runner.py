"""CPU: the ONNX runner (sparseconv/runner.py) and `sparseconv run`.

The operators are checked against onnxruntime (the reference implementation of
ONNX semantics) on small graphs; the shipped LeNet reproduces its recorded test
accuracy; its specialised conv kernels, run in the PTX interpreter inside the
runner, give the dense model's predictions."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.cli import main
from sparseconv.model import ModelError
from sparseconv.runner import conv2d_dense, execute, load_data, load_program, run_reference

from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from shipped_models import DIGITS, LENET, MODELS  # noqa: E402


def _save(tmp_path, nodes, inits, in_shape, out_name="out", name="g.onnx"):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _resnet_like(tmp_path, rng):
    """Most supported operators in one graph: grouped/strided/dilated convs, BN,
    pooling with pads and ceil_mode, a residual Add, Clip, shape arithmetic
    (Shape/Gather/Unsqueeze/Concat/Reshape), Gemm and Softmax."""
    f32 = np.float32
    inits = {
        "w1": pruned_weight(rng, (8, 3, 3, 3), 0.5), "b1": rng.standard_normal(8).astype(f32),
        "s": rng.random(8).astype(f32) + 0.5, "bb": rng.standard_normal(8).astype(f32),
        "m": rng.standard_normal(8).astype(f32), "v": rng.random(8).astype(f32) + 0.5,
        "w2": pruned_weight(rng, (8, 4, 3, 3), 0.7),
        "w3": pruned_weight(rng, (8, 8, 3, 3), 0.8),
        "lo": np.array(0.0, f32), "hi": np.array(6.0, f32),
        "axes0": np.array([0], np.int64), "idx0": np.array(0, np.int64), "minus1": np.array([-1], np.int64),
        "fw": rng.standard_normal((5, 8)).astype(f32), "fb": rng.standard_normal(5).astype(f32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"], epsilon=1e-3),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                         ceil_mode=1),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], name="grouped", pads=[2, 2, 2, 2], dilations=[2, 2],
                         group=2),
        helper.make_node("Conv", ["c2", "w3"], ["c3"], name="plain", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "p1"], ["a1"]),
        helper.make_node("Clip", ["a1", "lo", "hi"], ["k1"]),
        helper.make_node("AveragePool", ["k1"], ["q1"], kernel_shape=[2, 2], pads=[1, 1, 1, 1],
                         count_include_pad=0),
        helper.make_node("AveragePool", ["q1"], ["q2"], kernel_shape=[2, 2], pads=[1, 1, 0, 0],
                         count_include_pad=1),
        helper.make_node("GlobalAveragePool", ["q2"], ["g1"]),
        helper.make_node("Shape", ["g1"], ["sh"]),
        helper.make_node("Gather", ["sh", "idx0"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1d"]),
        helper.make_node("Concat", ["n1d", "minus1"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["g1", "newshape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fw", "fb"], ["logits"], transB=1, alpha=0.5),
        helper.make_node("Softmax", ["logits"], ["out"], axis=1),
    ]
    return _save(tmp_path, nodes, inits, ["N", 3, 19, 17])


def _onnxruntime(path, x):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_operators_match_onnxruntime(tmp_path):
    rng = np.random.default_rng()
    path = _resnet_like(tmp_path, rng)
    program = load_program(path)
    assert sorted(program.convs) == ["grouped", "plain", "stem"]
    x = rng.standard_normal((4, 3, 19, 17)).astype(np.float32)
    (y,) = run_reference(program, x)
    want = _onnxruntime(path, x)
    assert y.shape == want.shape == (4, 5)
    assert relative_l2(y, want) <= 1e-5


def test_flatten_matmul_and_elementwise_ops_match_onnxruntime(tmp_path):
    rng = np.random.default_rng()
    inits = {"w": pruned_weight(rng, (4, 2, 1, 1), 0.25), "mm": rng.standard_normal((4 * 5 * 6, 3)).astype("f4"),
             "two": np.array(2.0, "f4")}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="pointwise"),
             helper.make_node("LeakyRelu", ["c"], ["l"], alpha=0.2),
             helper.make_node("Sigmoid", ["l"], ["s"]),
             helper.make_node("Tanh", ["c"], ["t"]),
             helper.make_node("Sub", ["s", "t"], ["d"]),
             helper.make_node("Div", ["d", "two"], ["e"]),
             helper.make_node("Mul", ["e", "c"], ["f"]),
             helper.make_node("GlobalMaxPool", ["f"], ["gm"]),
             helper.make_node("Add", ["f", "gm"], ["h"]),
             helper.make_node("Flatten", ["h"], ["fl"], axis=1),
             helper.make_node("MatMul", ["fl", "mm"], ["mo"]),
             helper.make_node("Identity", ["mo"], ["out"])]
    path = _save(tmp_path, nodes, inits, ["N", 2, 5, 6])
    x = rng.standard_normal((3, 2, 5, 6)).astype(np.float32)
    (y,) = run_reference(load_program(path), x)
    assert relative_l2(y, _onnxruntime(path, x)) <= 1e-5


@pytest.mark.parametrize("stride,padding,dilation,groups", [((1, 1), (0, 0), (1, 1), 1), ((2, 1), (1, 2), (1, 1), 1),
                                                            ((1, 1), (2, 2), (2, 2), 2), ((2, 2), (1, 1), (1, 1), 6)])
def test_dense_conv_matches_the_test_reference(stride, padding, dilation, groups):
    from sparseconv.model import ConvLayer
    from sparseconv.shapes import shape_from_weight

    rng = np.random.default_rng()
    w = pruned_weight(rng, (12, 6 // groups, 3, 3), 0.5)
    b = rng.standard_normal(12).astype(np.float32)
    layer = ConvLayer("c", w, b, shape_from_weight(w, (9, 11), stride, padding, dilation, groups))
    x = rng.standard_normal((2, 6, 9, 11))
    ref = conv2d_reference(x, w, b, stride, padding, dilation, groups)
    assert relative_l2(conv2d_dense(layer, x), ref) <= 1e-12


def test_reference_run_reproduces_the_recorded_accuracy():
    record = json.loads((MODELS / "lenet_digits.json").read_text())
    program = load_program(LENET)
    x, labels = load_data(DIGITS, program)
    assert x.shape == (record["test_images"], 1, 8, 8) and labels.shape == (record["test_images"],)
    (y,) = run_reference(program, x)
    correct = int(np.sum(y.argmax(1) == labels))
    assert correct == round(record["pruned_test_accuracy"] * len(x))
    assert relative_l2(y, _onnxruntime(LENET, x)) <= 1e-5


def test_shipped_test_set_is_the_training_split():
    pytest.importorskip("sklearn")
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", MODELS / "make_digits_test_set.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    x, y = mk.digits_test_split()
    with np.load(DIGITS) as d:
        assert np.array_equal(d["image"], x) and np.array_equal(d["label"], y)


@pytest.mark.nvcc
def test_specialised_kernels_inside_the_runner_give_the_dense_predictions(tmp_path):
    """The whole LeNet with both convs run as specialised PTX (interpreted):
    same predictions as the dense float64 model on 24 test images."""
    from sparseconv.build import build_conv2d
    from sparseconv.cache import ArtifactCache

    from ptx_interpreter import run_kernel

    program = load_program(LENET)
    x, _ = load_data(DIGITS, program)
    x = x[::19][:24]
    cache = ArtifactCache(tmp_path)

    def conv(layer, inp):
        built = build_conv2d(layer.weight, layer.shape, cache=cache, name=layer.name)
        s, n = layer.shape, inp.shape[0]
        y = np.full((n, s.out_channels, s.out_h, s.out_w), np.nan, np.float32)
        run_kernel(cache.get_text("kernel", built.ptx_sha256, ".ptx"), built.entry,
                   grid=built.grid(n), block=(built.tiling.threads, 1, 1),
                   args=[np.ascontiguousarray(inp, np.float32), y, layer.bias, 0, n, built.chunks],
                   dynamic_shared_bytes=built.shared_bytes)
        return y

    (y,) = execute(program, x, np, conv, np.float32)
    (ref,) = run_reference(program, x)
    assert np.array_equal(y.argmax(1), ref.argmax(1))
    assert relative_l2(y, ref) <= 1e-5


def test_unsupported_operator_names_the_node(tmp_path):
    rng = np.random.default_rng()
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="c0"),
             helper.make_node("LpNormalization", ["c"], ["out"], name="weird_norm")]
    path = _save(tmp_path, nodes, {"w": pruned_weight(rng, (2, 1, 3, 3), 0.5)}, [1, 1, 6, 6])
    with pytest.raises(ModelError, match="weird_norm.*LpNormalization"):
        load_program(path)
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(DIGITS)])
    assert r.exit_code == 2 and "LpNormalization" in r.output


# --------------------------------------------------------------------------- the CLI

def test_run_reference_backend_prints_accuracy_and_writes_outputs(tmp_path):
    out = tmp_path / "logits.npy"
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--backend", "reference",
                                  "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    record = json.loads((MODELS / "lenet_digits.json").read_text())
    assert summary["images"] == 450 and abs(summary["accuracy"] - record["pruned_test_accuracy"]) < 1e-6
    assert np.load(out).shape == (450, 10)
    assert [p.name for p in tmp_path.iterdir()] == ["logits.npy"]  # no temporary left behind


@pytest.mark.parametrize("case", ["wrong_shape", "integer_images", "missing_key", "truncated", "pickled",
                                  "labels_mismatch", "not_onnx", "bad_output_suffix"])
def test_run_refuses_bad_input_with_exit_2_and_writes_nothing(tmp_path, case):
    x = np.random.default_rng().random((5, 1, 8, 8), dtype=np.float32)
    data, model, out = tmp_path / "d.npz", LENET, tmp_path / "out.npy"
    extra = []
    if case == "wrong_shape":
        np.savez(data, image=np.zeros((5, 1, 7, 8), np.float32) + 0.5)
    elif case == "integer_images":
        np.savez(data, image=(x * 16).astype(np.uint8))
    elif case == "missing_key":
        np.savez(data, pictures=x, other=x)
    elif case == "truncated":
        np.savez(data, image=x)
        data.write_bytes(data.read_bytes()[:100])
    elif case == "pickled":
        np.savez(data, image=np.array([{"a": 1}], dtype=object))
    elif case == "labels_mismatch":
        np.savez(data, image=x, label=np.arange(4))
    elif case == "not_onnx":
        np.savez(data, image=x)
        model = tmp_path / "weights.npz"
        np.savez(model, conv=np.ones((2, 1, 3, 3), np.float32))
    elif case == "bad_output_suffix":
        np.savez(data, image=x)
        out = tmp_path / "out.txt"
    before = set(tmp_path.iterdir())
    r = CliRunner().invoke(main, ["run", str(model), "--data", str(data), "--backend", "reference", "-o", str(out)]
                           + extra)
    assert r.exit_code == 2, r.output
    assert "Error" in r.output and len(r.output.strip().splitlines()[-1]) < 400
    assert set(tmp_path.iterdir()) == before


def test_run_help_has_an_example():
    r = CliRunner().invoke(main, ["run", "--help"])
    assert r.exit_code == 0 and "sparseconv run models/lenet_digits_pruned.onnx" in r.output


def test_one_parse_and_one_naming_rule_for_compile_and_run(tmp_path, monkeypatch):
    """load_model (compile, inspect) and load_program (run) read the file
    through model.read_onnx, once each, and name unnamed nodes alike."""
    from sparseconv import model as model_mod

    rng = np.random.default_rng(0)
    inits = {"w1": pruned_weight(rng, (4, 2, 3, 3), 0.5), "w2": pruned_weight(rng, (3, 4, 1, 1), 0.5)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),  # unnamed
             helper.make_node("Relu", ["a"], ["r"]),                          # unnamed
             helper.make_node("Conv", ["r", "w2"], ["out"])]                   # unnamed
    path = _save(tmp_path, nodes, inits, [1, 2, 6, 6])
    loads = []
    real_load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    program = load_program(path)
    assert len(loads) == 1
    pruned = model_mod.load_model(path)
    assert len(loads) == 2
    assert [layer.name for layer in pruned.layers] == ["conv0", "conv2"]
    assert [n.name for n in program.nodes] == ["conv0", "relu1", "conv2"]
    assert sorted(program.convs) == ["conv0", "conv2"]
    for layer in pruned.layers:
        np.testing.assert_array_equal(program.convs[layer.name].weight, layer.weight)
        assert program.convs[layer.name].shape == layer.shape


def test_gemm_scales_only_by_an_alpha_or_beta_other_than_1():
    """alpha = beta = 1 (as exporters write them): exactly A @ B + C, no
    multiply; other values still scale, transposes as ONNX's Gemm takes them."""
    from sparseconv.runner import _gemm

    rng = np.random.default_rng()
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5), (4, 5), (4,)))
    assert np.array_equal(_gemm(np, a, b, c, {"transB": 1}), a @ b.T + c)
    assert np.array_equal(_gemm(np, a, b.T, None, {}), a @ b.T)
    scaled = _gemm(np, a.T, b, c, {"transA": 1, "transB": 1, "alpha": 2.0, "beta": 0.5})
    assert np.allclose(scaled, 2.0 * (a @ b.T) + 0.5 * c, rtol=1e-6, atol=1e-6)
