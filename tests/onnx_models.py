"""Small ONNX models written with onnx.helper, shared by the runner's tests:
save_model (one float input x, one output out, opset 17); dense_head, a
model with dense classifier heads wide enough for sparseconv.gemv, and
pruned_head, its pruned counterpart for the sparse gemv
(test_runner_linear.py on the CPU, test_gpu_linear.py on the GPU);
residual_net, a residual block with BN, pooling and a Gemm head (the ONNX
-> fx conversion and the fx front end's plan, test_onnx_torch.py and
test_onnx_fx.py)."""
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sparseconv.testing import pruned_weight

F32 = np.float32


def save_model(path: Path, nodes: List[Any], inits: Dict[str, Any], in_shape: Sequence[Any]) -> Path:
    """Write nodes and initializers as a model with input x of in_shape and output out."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return Path(path)


def dense_head(folder: Path, rng: np.random.Generator) -> Tuple[Path, Dict[str, np.ndarray]]:
    """Conv -> Flatten -> dense Gemm transB=1 (1,000 outputs, its B already
    (out, in)) -> Relu -> dense MatMul (1,000 outputs, B (in, out)) -> Slice to
    999 -> dense Gemm with 999 inputs (not a multiple of 4: stays an operator).
    Returns the file and its initializers."""
    inits = {"wc": pruned_weight(rng, (4, 3, 3, 3), 0.5),
             "w1": (rng.standard_normal((1000, 64)) / 8).astype(F32), "b1": rng.standard_normal(1000).astype(F32),
             "w2": (rng.standard_normal((1000, 1000)) / 32).astype(F32),
             "w3": (rng.standard_normal((1000, 999)) / 32).astype(F32),
             "s0": np.array([0], np.int64), "s1": np.array([999], np.int64), "s2": np.array([1], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Gemm", ["f", "w1", "b1"], ["g1"], name="head1", transB=1),
             helper.make_node("Relu", ["g1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["g2"], name="head2"),
             helper.make_node("Slice", ["g2", "s0", "s1", "s2"], ["g2s"]),
             helper.make_node("Gemm", ["g2s", "w3"], ["out"], name="odd", transB=1)]
    return save_model(Path(folder) / "head.onnx", nodes, inits, ["N", 3, 4, 4]), inits


def pruned_head(folder: Path, rng: np.random.Generator) -> Tuple[Path, Dict[str, np.ndarray]]:
    """Conv -> Flatten -> pruned Gemm transB=1 (1,000 outputs, 80% zeros) ->
    Relu -> pruned MatMul (1,000 -> 1,002 outputs, 90% zeros, no bias) ->
    Relu -> pruned Gemm with 1,002 inputs (1,000 outputs; not a multiple of 4,
    which the sparse kernel takes). Compiled as code unless the caller lowers
    MAX_LINEAR_WEIGHTS; then each runs the sparse gemv."""
    inits = {"wc": pruned_weight(rng, (4, 3, 3, 3), 0.5),
             "w1": pruned_weight(rng, (1000, 64), 0.8), "b1": rng.standard_normal(1000).astype(F32),
             "w2": pruned_weight(rng, (1002, 1000), 0.9).T.copy(),
             "w3": pruned_weight(rng, (1000, 1002), 0.9), "b3": rng.standard_normal(1000).astype(F32)}
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Gemm", ["f", "w1", "b1"], ["g1"], name="head1", transB=1),
             helper.make_node("Relu", ["g1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["g2"], name="head2"),
             helper.make_node("Relu", ["g2"], ["r2"]),
             helper.make_node("Gemm", ["r2", "w3", "b3"], ["out"], name="head3", transB=1)]
    return save_model(Path(folder) / "pruned_head.onnx", nodes, inits, ["N", 3, 4, 4]), inits


def residual_net(folder: Path, rng: np.random.Generator) -> Path:
    """Conv -> BN -> Relu -> MaxPool (3, stride 2, pad 1) -> Conv -> BN -> Add
    (the pool's output) -> Relu -> Clip(0, 6) -> Mul by a constant ->
    GlobalAveragePool -> Reshape (0, -1) -> Gemm transB=1 -> Softmax."""
    def bn(prefix, c):
        return {f"{prefix}_s": rng.uniform(0.5, 1.5, c).astype(F32), f"{prefix}_b": rng.uniform(-.2, .2, c).astype(F32),
                f"{prefix}_m": rng.uniform(-.1, .1, c).astype(F32), f"{prefix}_v": rng.uniform(.5, 2, c).astype(F32)}

    inits = {"w1": pruned_weight(rng, (8, 3, 3, 3), 0.5), "w2": pruned_weight(rng, (8, 8, 3, 3), 0.8),
             **bn("bn1", 8), **bn("bn2", 8), "lo": np.array(0.0, F32), "hi": np.array(6.0, F32),
             "k": np.array(0.5, F32), "shape": np.array([0, -1], np.int64),
             "wf": pruned_weight(rng, (10, 8), 0.3), "bf": rng.standard_normal(10).astype(F32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["n1"], name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["n2"], name="bn2"),
             helper.make_node("Add", ["n2", "p1"], ["a2"]),
             helper.make_node("Relu", ["a2"], ["r2"]),
             helper.make_node("Clip", ["r2", "lo", "hi"], ["q2"]),
             helper.make_node("Mul", ["q2", "k"], ["m2"]),
             helper.make_node("GlobalAveragePool", ["m2"], ["g"]),
             helper.make_node("Reshape", ["g", "shape"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
             helper.make_node("Softmax", ["logits"], ["out"], axis=1)]
    return save_model(Path(folder) / "residual.onnx", nodes, inits, ["N", 3, 12, 12])
