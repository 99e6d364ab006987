"""ResNet-style toy ONNX graphs for the fusion pass (sparseconv/onnx_fuse.py),
written with onnx.helper, each with what the pass must fuse into each conv.
Shared by test_onnx_fuse.py (CPU, float64 vs onnxruntime) and
test_gpu_onnx_fuse.py (the compiled kernels vs float64)."""
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
from onnx import TensorProto, helper, numpy_helper
import onnx

from sparseconv.testing import pruned_weight

IN_SHAPE = ("N", 4, 8, 8)

# toy -> {conv: what fuses into it}, and the words of the plan's note where a chain stops
EXPECTED: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "conv_bn_relu": {"c1": ("bn", "relu")},
    "resnet_shortcut": {"c1": ("bn", "relu"), "c2": ("bn", "add", "relu"), "down": ("bn",),
                        "c3": ("bn", "add", "relu")},
    "clip": {"c6": ("relu6",), "cc": ("clip",), "cr": ("relu",), "cm": ("clip",)},
    "bn_two_readers": {"c1": (), "c2": ("bn",)},
    "conv_is_output": {"c1": (), "c2": ("bn",)},
    "broadcast_add": {"c1": (), "c2": ()},
    # 2x2 max pools of stride 2 (fx's rule): after a Relu, after a bare conv, after BN + Relu; not after an Add
    "conv_relu_maxpool": {"c1": ("relu", "maxpool"), "c2": ("maxpool",)},
    "conv_bn_relu_maxpool": {"c1": ("bn", "relu", "maxpool")},
    "add_relu_maxpool": {"c1": ("relu",), "c2": ("add", "relu")},
}
NOTES = {
    ("bn_two_readers", "c1"): "not bn1: c1 has 2 readers",
    ("bn_two_readers", "c2"): "not relu2: n2 has 2 readers",
    ("conv_is_output", "c1"): "not relu1: c1 is a graph output",
    ("conv_is_output", "c2"): "not relu2: n2 is a graph output",
    ("broadcast_add", "c1"): "it adds a constant",
    ("broadcast_add", "c2"): "has shape",
    ("add_relu_maxpool", "c2"): "not pool2: a pool after a residual add is not fused",
}


def _bn(rng: np.random.Generator, inits: dict, name: str, k: int) -> list:
    f32 = np.float32
    inits.update({f"{name}_s": rng.random(k).astype(f32) + 0.5, f"{name}_b": rng.standard_normal(k).astype(f32),
                  f"{name}_m": rng.standard_normal(k).astype(f32), f"{name}_v": rng.random(k).astype(f32) + 0.5})
    return [f"{name}_s", f"{name}_b", f"{name}_m", f"{name}_v"]


def _graph(name: str, rng: np.random.Generator) -> Tuple[list, dict, list]:
    """(nodes, initializers, output names) of one toy."""
    f32 = np.float32
    node = helper.make_node
    inits: dict = {}

    def conv(cname: str, x: str, out: str, k: int, c: int, r: int = 3, bias: bool = True) -> object:
        inits[f"{cname}_w"] = pruned_weight(rng, (k, c, r, r), 0.7)
        ins = [x, f"{cname}_w"]
        if bias:
            inits[f"{cname}_bias"] = rng.standard_normal(k).astype(f32)
            ins.append(f"{cname}_bias")
        return node("Conv", ins, [out], name=cname, pads=[r // 2] * 4)

    if name == "conv_bn_relu":
        nodes = [conv("c1", "x", "c1", 8, 4),
                 node("BatchNormalization", ["c1"] + _bn(rng, inits, "bn1", 8), ["n1"], name="bn1", epsilon=1e-3),
                 node("Relu", ["n1"], ["out"], name="relu1")]
        return nodes, inits, ["out"]
    if name == "resnet_shortcut":
        nodes = [conv("c1", "x", "c1", 8, 4, bias=False),
                 node("BatchNormalization", ["c1"] + _bn(rng, inits, "bn1", 8), ["n1"], name="bn1"),
                 node("Relu", ["n1"], ["r1"], name="relu1"),
                 conv("c2", "r1", "c2", 8, 8, bias=False),
                 node("BatchNormalization", ["c2"] + _bn(rng, inits, "bn2", 8), ["n2"], name="bn2"),
                 conv("down", "x", "d", 8, 4, r=1, bias=False),          # the projection shortcut
                 node("BatchNormalization", ["d"] + _bn(rng, inits, "bnd", 8), ["nd"], name="bnd"),
                 node("Add", ["n2", "nd"], ["a2"], name="add2"),
                 node("Relu", ["a2"], ["r2"], name="relu2"),
                 conv("c3", "r2", "c3", 8, 8),
                 node("BatchNormalization", ["c3"] + _bn(rng, inits, "bn3", 8), ["n3"], name="bn3"),
                 node("Add", ["r2", "n3"], ["a3"], name="add3"),              # the identity shortcut, first operand
                 node("Relu", ["a3"], ["out"], name="relu3")]
        return nodes, inits, ["out"]
    if name == "clip":
        inits.update({"zero": np.array(0.0, f32), "six": np.array(6.0, f32), "lo": np.array(-1.0, f32),
                      "hi": np.array(1.5, f32)})
        nodes = [conv("c6", "x", "c6", 4, 4), node("Clip", ["c6", "zero", "six"], ["k6"], name="relu6"),
                 conv("cc", "x", "cc", 4, 4), node("Clip", ["cc", "lo", "hi"], ["kc"], name="clip"),
                 conv("cr", "x", "cr", 4, 4), node("Clip", ["cr", "zero"], ["kr"], name="min_only"),
                 conv("cm", "x", "cm", 4, 4), node("Clip", ["cm", "", "hi"], ["km"], name="max_only"),
                 node("Concat", ["k6", "kc", "kr", "km"], ["out"], name="cat", axis=1)]
        return nodes, inits, ["out"]
    if name == "bn_two_readers":
        nodes = [conv("c1", "x", "c1", 8, 4),                                   # c1 read by bn1 and relu1
                 node("BatchNormalization", ["c1"] + _bn(rng, inits, "bn1", 8), ["n1"], name="bn1"),
                 node("Relu", ["c1"], ["r1"], name="relu1"),
                 node("Add", ["n1", "r1"], ["a1"], name="add1"),
                 conv("c2", "a1", "c2", 8, 8),                                  # bn2's output read twice
                 node("BatchNormalization", ["c2"] + _bn(rng, inits, "bn2", 8), ["n2"], name="bn2"),
                 node("Relu", ["n2"], ["r2"], name="relu2"),
                 node("Mul", ["n2", "r2"], ["out"], name="mul2")]
        return nodes, inits, ["out"]
    if name == "conv_is_output":
        nodes = [conv("c1", "x", "c1", 8, 4), node("Relu", ["c1"], ["r1"], name="relu1"),
                 conv("c2", "r1", "c2", 8, 8),
                 node("BatchNormalization", ["c2"] + _bn(rng, inits, "bn2", 8), ["n2"], name="bn2"),
                 node("Relu", ["n2"], ["out"], name="relu2")]
        return nodes, inits, ["out", "c1", "n2"]
    if name == "broadcast_add":
        inits["bias_map"] = rng.standard_normal((1, 8, 1, 1)).astype(f32)
        nodes = [conv("c1", "x", "c1", 8, 4), node("Add", ["c1", "bias_map"], ["a1"], name="add1"),
                 node("Relu", ["a1"], ["r1"], name="relu1"),
                 node("GlobalAveragePool", ["r1"], ["g1"], name="gap"),
                 conv("c2", "r1", "c2", 8, 8), node("Add", ["g1", "c2"], ["a2"], name="add2"),
                 node("Relu", ["a2"], ["out"], name="relu2")]
        return nodes, inits, ["out"]
    if name == "conv_relu_maxpool":   # 8x8 -> pooled 4x4 -> 1x1 conv (its kernel pools itself) -> pooled 2x2
        nodes = [conv("c1", "x", "c1", 8, 4), node("Relu", ["c1"], ["r1"], name="relu1"),
                 node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
                 conv("c2", "p1", "c2", 8, 8, r=1),
                 node("MaxPool", ["c2"], ["out"], name="pool2", kernel_shape=[2, 2], strides=[2, 2])]
        return nodes, inits, ["out"]
    if name == "conv_bn_relu_maxpool":  # as torch.onnx.export writes nn.MaxPool2d(2, 2)
        nodes = [conv("c1", "x", "c1", 8, 4),
                 node("BatchNormalization", ["c1"] + _bn(rng, inits, "bn1", 8), ["n1"], name="bn1"),
                 node("Relu", ["n1"], ["r1"], name="relu1"),
                 node("MaxPool", ["r1"], ["out"], name="pool1", kernel_shape=[2, 2], strides=[2, 2],
                      pads=[0, 0, 0, 0], dilations=[1, 1], ceil_mode=0)]
        return nodes, inits, ["out"]
    if name == "add_relu_maxpool":
        nodes = [conv("c1", "x", "c1", 8, 4), node("Relu", ["c1"], ["r1"], name="relu1"),
                 conv("c2", "r1", "c2", 8, 8), node("Add", ["c2", "r1"], ["a2"], name="add2"),
                 node("Relu", ["a2"], ["r2"], name="relu2"),
                 node("MaxPool", ["r2"], ["out"], name="pool2", kernel_shape=[2, 2], strides=[2, 2])]
        return nodes, inits, ["out"]
    raise ValueError(name)


def toy(name: str, folder: Path, seed: int = 0) -> Path:
    """Write toy `name` (one of EXPECTED) as folder/<name>.onnx."""
    nodes, inits, outs = _graph(name, np.random.default_rng(seed))
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, IN_SHAPE)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = Path(folder) / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def toy_input(n: int = 3, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n,) + IN_SHAPE[1:]).astype(np.float32)


def onnxruntime_all(path: Path, x: np.ndarray) -> list:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})
