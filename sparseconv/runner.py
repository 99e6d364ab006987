"""Run a pruned ONNX model end to end.

Every Conv node runs as a sparseconv kernel on the GPU; the other nodes are
small array functions written once for an array module `xp` (CuPy on the GPU,
NumPy for the float64 dense reference); the larger ones (Resize,
ConvTranspose, Slice, reductions, Cast, Pad) are in onnx_ops.py. Only the
operators in `OPS` are supported: enough for LeNet/VGG/ResNet, MobileNetV2/V3
and UNet/FPN-style exports. Anything else is refused when the model is
loaded, naming the node, before any compile starts. Constant nodes and static
subgraphs never reach the runner: model.read_onnx folds them.
compile_model folds BatchNormalization into the convs and fuses Conv ->
(BN) -> (Add) -> (Relu/Clip) -> (MaxPool 2x2, not after an Add) chains into
single kernels (onnx_fuse.py); load_program gives the graph as written, which
`--check` evaluates.

A SparseModel uploads the graph's constants once; with torch installed,
compile_model times each kernel against cuDNN strict fp32 at the batch sizes
named (default 1 and 64) and each batch size runs the faster path;
cuda_graph=True replays one CUDA graph per input shape. model.plan says which
path each Conv took, the times behind it, and each shape's graph.

    model = compile_model("models/lenet_digits_pruned.onnx")   # SparseModel
    logits = model(x)                       # x: CuPy or NumPy (N, 1, 8, 8) float32
    ref = run_reference(load_program("models/lenet_digits_pruned.onnx"), x)  # float64 NumPy, dense convs
"""
from __future__ import annotations

import contextlib
import zipfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import onnx_ops as ops
from .dense import conv2d_im2col, epilogue_reference, torch_with_cuda
from .gemv import (MAX_GEMV_BATCH, gemv_supported, gemv_takes, linear_gemv, linear_sparse_gemv, sparse_gemv_takes,
                   sparse_rows)
from .api import LINEAR_MIN_SPARSITY, MAX_LINEAR_WEIGHTS, compile_layers, linear_limits, linear_shape
from .model import ConvLayer, ModelError, check_names, node_name, numpy_why, read_onnx
from .onnx_fuse import RESIDUAL_INPUT, FusedConv, fuse_program, fusion_lines, value_shapes
from .pool import launch_max_pool
from .progress import StepLine
from .routing import DENSE, SPARSE, TABLE, RouteChoice, check_route_batches, choose_route, timing_label
from .runtime import DenseConv2dKernel
from .table import MAX_TABLE_BATCH, routable_table
from .timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold


@dataclass(frozen=True)
class Node:
    op: str
    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    attrs: Dict[str, Any]


@dataclass(frozen=True)
class GemvLayer:
    """A Gemm / MatMul with a constant weight, not compiled, that the GPU
    runner streams through sparseconv.gemv at batch <= MAX_GEMV_BATCH (other
    batches: the operator): through the sparse kernel (only the nonzero
    weights read) when `sparse`, else the dense one. weight is (out, in) as
    nn.Linear's; weight_input names the constant when it already is that
    matrix (Gemm transB=1), so the GPU copy of the constant serves, else None
    (a transposed copy is uploaded)."""

    name: str
    weight: np.ndarray
    bias: Optional[np.ndarray]
    weight_input: Optional[str]
    sparse: bool = False

    def describe(self) -> str:
        kernel = "sparseconv's sparse gemv" if self.sparse else "sparseconv.gemv"
        return f"{kernel} at batch <= {MAX_GEMV_BATCH}"


@dataclass(frozen=True)
class OnnxProgram:
    """A parsed ONNX graph: nodes in order, constant tensors, and its conv layers."""

    path: Path
    nodes: Tuple[Node, ...]
    constants: Dict[str, np.ndarray]
    input_name: str
    input_shape: Tuple[Optional[int], ...]  # None where the graph leaves a dimension free
    output_names: Tuple[str, ...]
    convs: Dict[str, ConvLayer]  # node name -> layer (a FusedConv in a fused program)
    shapes: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)  # value -> inferred dims (int, name or None)
    # Gemm / MatMul node name -> its layer as a Linear (weight (out, in)), for
    # those that run as kernels (linear_layers); the others run as OPS.
    linears: Dict[str, ConvLayer] = field(default_factory=dict)
    dense_linears: Dict[str, str] = field(default_factory=dict)  # node name -> why it runs densely
    gemv_layers: Dict[str, GemvLayer] = field(default_factory=dict)  # dense ones sparseconv.gemv takes

    def plan(self, backends: Optional[Dict[str, str]] = None) -> List[str]:
        """One line per conv-like node: how it runs, and what was fused into
        it. backends: Conv name -> the compiled kernel's backend (default:
        'sparseconv')."""
        lines = []
        for node in self.nodes:
            if node.op == "Conv":
                layer = self.convs[node.name]
                fused = layer.describe_fusion() if isinstance(layer, FusedConv) else ""
                lines.append(f"{node.name}: Conv {layer.shape.describe()}{fused}, "
                             f"{(backends or {}).get(node.name, 'sparseconv')}")
            elif node.name in self.linears:
                s = self.linears[node.name].shape
                lines.append(f"{node.name}: {node.op} as Linear {s.in_channels}->{s.out_channels}, "
                             f"{(backends or {}).get(node.name, 'sparseconv')}")
            elif node.name in self.dense_linears:
                gemv = self.gemv_layers.get(node.name)
                how = "dense (matmul)" if gemv is None else \
                    f"{'not compiled' if gemv.sparse else 'dense'} ({gemv.describe()}, else matmul)"
                lines.append(f"{node.name}: {node.op}, {how}: {self.dense_linears[node.name]}")
            elif node.op == "ConvTranspose":
                lines.append(f"{node.name}: ConvTranspose, dense (matmuls; not a sparseconv kernel)")
        return lines


# --------------------------------------------------------------------------- operators

def _pool(xp: Any, x: Any, attrs: Dict[str, Any], reduce: str) -> Any:
    kh, kw = attrs["kernel_shape"]
    sh, sw = attrs.get("strides", (1, 1))
    top, left, bottom, right = attrs.get("pads", (0, 0, 0, 0))
    if (kh, kw, sh, sw, top, left, bottom, right) == (1, 1, 1, 1, 0, 0, 0, 0):
        return x  # each window is one element (as exporters write AdaptiveAvgPool2d((7, 7)) after 7x7 features)
    n, c, h, w = x.shape
    ceil = int(attrs.get("ceil_mode", 0))
    rnd = (lambda a, b: -(-a // b)) if ceil else (lambda a, b: a // b)
    ho = rnd(h + top + bottom - kh, sh) + 1
    wo = rnd(w + left + right - kw, sw) + 1
    # Extra bottom/right padding for ceil_mode; it never counts as data.
    eh = max(0, (ho - 1) * sh + kh - (h + top + bottom))
    ew = max(0, (wo - 1) * sw + kw - (w + left + right))
    if reduce == "max" and xp is not np and x.dtype == np.float32:
        # One kernel pass, no padded copy (sparseconv.pool); the same maxima.
        y = xp.empty((n, c, ho, wo), dtype=x.dtype)
        launch_max_pool(xp.cuda.Device().id, xp.ascontiguousarray(x), y, (kh, kw), (sh, sw), (top, left), (1, 1))
        return y
    fill = -np.inf if reduce == "max" else 0.0
    xpad = xp.full((n, c, h + top + bottom + eh, w + left + right + ew), fill, dtype=x.dtype)
    xpad[:, :, top:top + h, left:left + w] = x
    acc = None
    for i in range(kh):
        for j in range(kw):
            win = xpad[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
            acc = win if acc is None else (xp.maximum(acc, win) if reduce == "max" else acc + win)
    if reduce == "max":
        return acc
    if int(attrs.get("count_include_pad", 0)):
        return acc / (kh * kw)
    ones = xp.zeros((1, 1) + xpad.shape[2:], dtype=x.dtype)
    ones[:, :, top:top + h, left:left + w] = 1
    count = sum(ones[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
                for i in range(kh) for j in range(kw))
    return acc / count


def _gemm(xp: Any, a: Any, b: Any, c: Any, attrs: Dict[str, Any]) -> Any:
    a = a.T if int(attrs.get("transA", 0)) else a
    b = b.T if int(attrs.get("transB", 0)) else b
    # alpha and beta of 1 (as exporters write them) are not multiplied: each
    # multiply was a kernel of its own (9.7 us on VGG-16's classifier at batch 64)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    y = ops.matmul(xp, a, b)
    y = y if alpha == 1.0 else alpha * y
    return y if c is None else y + (c if beta == 1.0 else beta * c)


def _reshape(x: Any, shape: np.ndarray, allowzero: int) -> Any:
    dims = [int(d) for d in shape]
    if not allowzero:  # ONNX: a 0 copies the input's dimension
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _softmax(xp: Any, x: Any, axis: int) -> Any:
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _batchnorm(xp: Any, x: Any, scale: Any, bias: Any, mean: Any, var: Any, eps: float) -> Any:
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = scale / xp.sqrt(var + eps)
    return x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)


def _host_ints(a: Any) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.int64)


def _unsqueeze(x: Any, axes: Sequence[int]) -> Any:
    for ax in sorted(int(a) % (x.ndim + len(axes)) for a in axes):
        x = x.reshape(x.shape[:ax] + (1,) + x.shape[ax:])
    return x


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def op(xp: Any, n: Node, a: Any, b: Any) -> Any:
        if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):  # host shape value meets a device tensor
            a, b = xp.asarray(a), xp.asarray(b)
        return fn(a, b)
    return op


def _divide(a: Any, b: Any) -> Any:
    """ONNX Div: integer operands (shape arithmetic on the host) truncate
    toward zero, as the ONNX spec and onnxruntime do, and stay int64 (a true
    division made them float64, and INT64_MAX bounds overflowed back);
    float operands divide."""
    if all(isinstance(v, (np.ndarray, np.integer)) and np.asarray(v).dtype.kind in "iu" for v in (a, b)):
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        return np.abs(a) // np.abs(b) * (np.sign(a) * np.sign(b))
    return a / b


def _clip(xp: Any, n: Node, x: Any, lo: Any = None, hi: Any = None) -> Any:
    """Clip; bounds as inputs (opset 11+) or attributes min/max (older), ReLU6 in exports."""
    lo = n.attrs.get("min", -np.inf) if lo is None else float(lo)
    hi = n.attrs.get("max", np.inf) if hi is None else float(hi)
    return xp.clip(x, float(lo), float(hi))


def _variadic(name: str) -> Callable[..., Any]:
    """Max / Min of any number of inputs, broadcast."""
    def op(xp: Any, n: Node, *xs: Any) -> Any:
        out = xs[0]
        for x in xs[1:]:
            out = _binary(getattr(xp, name))(xp, n, out, x)
        return out
    return op


# op -> f(xp, node, *inputs); absent optional inputs arrive as None. Shape
# arithmetic (Shape, Gather, Unsqueeze, Concat on shapes) stays on the host.
OPS: Dict[str, Callable[..., Any]] = {
    "Relu": lambda xp, n, x: xp.maximum(x, 0),
    "LeakyRelu": lambda xp, n, x: xp.where(x >= 0, x, x * float(n.attrs.get("alpha", 0.01))),
    "Sigmoid": lambda xp, n, x: 1 / (1 + xp.exp(-x)),
    "Tanh": lambda xp, n, x: xp.tanh(x),
    "Clip": _clip,
    "HardSigmoid": lambda xp, n, x: xp.clip(x * float(n.attrs.get("alpha", 0.2)) + float(n.attrs.get("beta", 0.5)),
                                            0.0, 1.0),
    "HardSwish": lambda xp, n, x: x * xp.clip(x / 6 + 0.5, 0.0, 1.0),
    "Sqrt": lambda xp, n, x: xp.sqrt(x),
    "Exp": lambda xp, n, x: xp.exp(x),
    "Neg": lambda xp, n, x: -x,
    "Abs": lambda xp, n, x: abs(x),
    "Reciprocal": lambda xp, n, x: 1 / x,
    "Floor": lambda xp, n, x: xp.floor(x),
    "Ceil": lambda xp, n, x: xp.ceil(x),
    "Pow": _binary(lambda a, b: a ** b),
    "Max": _variadic("maximum"),
    "Min": _variadic("minimum"),
    "MaxPool": lambda xp, n, x: _pool(xp, x, n.attrs, "max"),
    "AveragePool": lambda xp, n, x: _pool(xp, x, n.attrs, "mean"),
    "GlobalAveragePool": lambda xp, n, x: x.mean(axis=(2, 3), keepdims=True),
    "GlobalMaxPool": lambda xp, n, x: x.max(axis=(2, 3), keepdims=True),
    "Flatten": lambda xp, n, x: x.reshape(int(np.prod(x.shape[:int(n.attrs.get("axis", 1))])), -1),
    "Reshape": lambda xp, n, x, shape: _reshape(x, _host_ints(shape), int(n.attrs.get("allowzero", 0))),
    "Gemm": lambda xp, n, a, b, c=None: _gemm(xp, a, b, c, n.attrs),
    "MatMul": lambda xp, n, a, b: _binary(lambda u, v: ops.matmul(xp, u, v))(xp, n, a, b),
    "Add": _binary(lambda a, b: a + b),
    "Sub": _binary(lambda a, b: a - b),
    "Mul": _binary(lambda a, b: a * b),
    "Div": _binary(_divide),
    "BatchNormalization": lambda xp, n, x, s, b, m, v: _batchnorm(xp, x, s, b, m, v,
                                                                  float(n.attrs.get("epsilon", 1e-5))),
    "Softmax": lambda xp, n, x: _softmax(xp, x, int(n.attrs.get("axis", -1))),
    "Concat": lambda xp, n, *xs: (np.concatenate([_host_ints(a) for a in xs]) if all(
        isinstance(a, np.ndarray) and a.dtype == np.int64 for a in xs)
        else xp.concatenate([xp.asarray(a) for a in xs], axis=int(n.attrs["axis"]))),
    "Identity": lambda xp, n, x: x,
    "Dropout": lambda xp, n, x, *_: x,  # inference: identity
    "Shape": lambda xp, n, x: np.asarray(x.shape, dtype=np.int64),
    "Gather": lambda xp, n, x, idx: (np.take(x, _host_ints(idx), axis=int(n.attrs.get("axis", 0)))
                                     if isinstance(x, np.ndarray) and x.dtype == np.int64
                                     else xp.take(x, xp.asarray(_host_ints(idx)), axis=int(n.attrs.get("axis", 0)))),
    "Unsqueeze": lambda xp, n, x, axes=None: _unsqueeze(
        x, n.attrs["axes"] if axes is None else _host_ints(axes).tolist()),
    "Squeeze": lambda xp, n, x, axes=None: ops.squeeze(x, ops.axes_of(n.attrs, axes)),
    "Slice": lambda xp, n, x, starts, ends, axes=None, steps=None: ops.slice_(xp, x, starts, ends, axes, steps),
    "Transpose": lambda xp, n, x: x.transpose(tuple(n.attrs.get("perm", range(x.ndim)[::-1]))),
    "Cast": lambda xp, n, x: ops.cast(xp, x, int(n.attrs["to"])),
    "ReduceMean": lambda xp, n, x, axes=None: ops.reduce(xp, "mean", x, n.attrs, axes),
    "ReduceSum": lambda xp, n, x, axes=None: ops.reduce(xp, "sum", x, n.attrs, axes),
    "ReduceMax": lambda xp, n, x, axes=None: ops.reduce(xp, "max", x, n.attrs, axes),
    "Resize": lambda xp, n, x, roi=None, scales=None, sizes=None: ops.resize(xp, x, roi, scales, sizes, n.attrs),
    "ConvTranspose": lambda xp, n, x, w, b=None: ops.conv_transpose(xp, x, w, b, n.attrs),
    "Pad": lambda xp, n, x, pads, value=None, axes=None: ops.pad(xp, x, pads, value, axes),
    "LayerNormalization": lambda xp, n, x, scale, bias=None: ops.layer_norm(xp, x, scale, bias, n.attrs),
    "Erf": lambda xp, n, x: ops.erf(xp, x),
    "Gelu": lambda xp, n, x: ops.gelu(xp, x, ops.text(n.attrs.get("approximate"), "none")),
    "PRelu": lambda xp, n, x, slope: xp.where(x >= 0, x, x * slope),
    "Elu": lambda xp, n, x: xp.where(x > 0, x, float(n.attrs.get("alpha", 1.0)) * (xp.exp(xp.minimum(x, 0)) - 1)),
    "Softplus": lambda xp, n, x: xp.logaddexp(0, x),
    "InstanceNormalization": lambda xp, n, x, s, b: ops.instance_norm(xp, x, s, b, float(n.attrs.get("epsilon",
                                                                                                       1e-5))),
    "Split": lambda xp, n, x, sizes=None: ops.split(xp, x, sizes, n.attrs, len(n.outputs)),
    "DepthToSpace": lambda xp, n, x: ops.depth_to_space(x, int(n.attrs["blocksize"]),
                                                        ops.text(n.attrs.get("mode"), "DCR")),
    "SpaceToDepth": lambda xp, n, x: ops.space_to_depth(x, int(n.attrs["blocksize"])),
    # Upsample (opsets 7-9): Resize with the coordinates it always used.
    "Upsample": lambda xp, n, x, scales=None: ops.resize(
        xp, x, None, np.asarray(n.attrs["scales"]) if scales is None else scales, None,
        {"mode": n.attrs.get("mode", "nearest"), "coordinate_transformation_mode": "asymmetric",
         "nearest_mode": "floor"}),
}


# --------------------------------------------------------------------------- loading

def load_program(path: Path, input_size: Optional[Tuple[int, int]] = None) -> OnnxProgram:
    """Parse an ONNX model for running (through model.read_onnx, the parse
    compile and inspect use too). Raises ModelError naming the file and node
    for anything the runner cannot execute."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    parsed = read_onnx(path, input_size)
    linears, dense_linears, gemvs = linear_layers(parsed)
    if not parsed.layers and not linears:
        raise ModelError(f"{path}: the model has no Conv layer (nor a pruned Gemm/MatMul with a constant "
                         "weight); nothing for sparseconv to run")
    check_names(path, parsed.layers + list(linears.values()))
    import onnx

    graph = parsed.graph
    constants = dict(parsed.constants)
    inputs = [i for i in graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise ModelError(f"{path}: the runner needs exactly one graph input, found {[i.name for i in inputs]}")
    dims = [d.dim_value or None for d in inputs[0].type.tensor_type.shape.dim]
    if input_size is not None and len(dims) == 4:
        dims[2:] = input_size
    convs = {layer.name: layer for layer in parsed.layers}
    nodes = []
    for i, nd in enumerate(graph.node):  # Constant nodes and static subgraphs are already folded
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute}
        name = node_name(nd, i)
        if nd.op_type != "Conv" and (nd.op_type not in OPS or nd.domain not in ("", "ai.onnx")):
            raise ModelError(f"{path}: node {name} has operator {nd.op_type}, which `sparseconv run` does not "
                             f"support (supported: Conv, Constant, {', '.join(sorted(OPS))}); use the PyTorch "
                             "drop-in sparseconv.torch.sparsify for other models")
        why = ops.check(nd.op_type, attrs)
        if why:
            raise ModelError(f"{path}: node {name}: {why}")
        if nd.op_type in ("MaxPool", "AveragePool") and any(d != 1 for d in attrs.get("dilations", (1, 1))):
            raise ModelError(f"{path}: node {name}: pooling dilations {attrs['dilations']} are not supported")
        if nd.op_type in ("MaxPool", "AveragePool") and attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise ModelError(f"{path}: node {name}: pooling auto_pad is not supported; export with explicit pads")
        nodes.append(Node(nd.op_type, name, tuple(nd.input), tuple(nd.output), attrs))
    return OnnxProgram(path, tuple(nodes), constants, inputs[0].name, tuple(dims),
                       tuple(o.name for o in graph.output), convs, value_shapes(graph), linears, dense_linears,
                       gemvs)


def linear_layers(parsed: Any) -> Tuple[Dict[str, ConvLayer], Dict[str, str], Dict[str, GemvLayer]]:
    """The Gemm and MatMul nodes of a parsed ONNX graph (model.OnnxFile) that
    are fully connected layers with a constant weight: Gemm with constant B,
    alpha 1, transA 0, any transB, and no C or beta 1 with a constant C of
    shape (N,), (1, N) or a scalar (the bias); MatMul of a 2-D input by a
    constant 2-D B. Returns (node name -> layer, weight (out, in) as
    nn.Linear's, shape api.linear_shape) for those that compile, and (node
    name -> why) for those that stay dense: under LINEAR_MIN_SPARSITY zeros,
    over MAX_LINEAR_WEIGHTS weights (their build would take minutes), or
    over the build limits; and (node name -> GemvLayer) for those of the
    dense ones that a sparseconv.gemv kernel takes (gemv.sparse_gemv_takes
    for the sparse one, else gemv.gemv_takes)."""
    import onnx

    consts = parsed.constants
    ranks: Dict[str, int] = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
                             list(parsed.graph.input) + list(parsed.graph.value_info) + list(parsed.graph.output)
                             if vi.type.tensor_type.HasField("shape")}
    linears: Dict[str, ConvLayer] = {}
    dense: Dict[str, str] = {}
    gemvs: Dict[str, GemvLayer] = {}
    for i, nd in enumerate(parsed.graph.node):
        if nd.op_type not in ("Gemm", "MatMul") or nd.domain not in ("", "ai.onnx") or len(nd.input) < 2 \
                or nd.input[1] not in consts or consts[nd.input[1]].ndim != 2 or consts[nd.input[1]].dtype.kind != "f":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute}
        b = consts[nd.input[1]]
        bias = None
        as_is = nd.op_type == "Gemm" and bool(int(attrs.get("transB", 0)))  # B is already (out, in)
        if nd.op_type == "MatMul":
            if ranks.get(nd.input[0]) != 2:
                continue  # batched or unknown rank: a matmul, not a Linear layer
            weight = b.T
        else:
            if float(attrs.get("alpha", 1.0)) != 1.0 or int(attrs.get("transA", 0)):
                continue
            weight = b if int(attrs.get("transB", 0)) else b.T
            if len(nd.input) > 2 and nd.input[2]:
                c = consts.get(nd.input[2])
                if c is None or float(attrs.get("beta", 1.0)) != 1.0 or c.dtype.kind != "f" or \
                        c.size not in (1, weight.shape[0]) or c.ndim > 2 or c.ndim == 2 and c.shape[0] != 1:
                    continue  # a computed or per-row C: not a bias
                bias = np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (weight.shape[0],)), np.float32)
        name = node_name(nd, i)
        weight = np.ascontiguousarray(weight, np.float32)
        shape = linear_shape(weight.shape[1], weight.shape[0])
        sparsity = 1.0 - np.count_nonzero(weight) / weight.size
        if sparsity < LINEAR_MIN_SPARSITY:
            dense[name] = f"sparsity {sparsity:.3f} < {LINEAR_MIN_SPARSITY}"
        elif weight.size > MAX_LINEAR_WEIGHTS:
            dense[name] = f"{weight.size:,} weights > {MAX_LINEAR_WEIGHTS:,} (its build would take minutes)"
        elif linear_limits(shape):
            dense[name] = linear_limits(shape).split(": ", 1)[-1]
        else:
            linears[name] = ConvLayer(name, weight, bias, shape)
        sparse = sparse_gemv_takes(weight.shape[0], sparsity)
        if name in dense and (sparse or gemv_takes(weight.shape[0], weight.shape[1])):
            # B's GPU copy is float32 whatever B's dtype (prepare_constants); _gemv checks it anyway
            gemvs[name] = GemvLayer(name, weight, bias, nd.input[1] if as_is else None, sparse)
    return linears, dense, gemvs


# --------------------------------------------------------------------------- execution

# Operators that compute through onnx_ops.matmul (torch's cuBLAS where torch has CUDA): a broadcast
# product allocates a copy inside torch, so a capture of them takes a pool of its own (_torch_pool).
MATMUL_OPS = ("Gemm", "MatMul", "ConvTranspose")

# Inputs an operator reads on the host (shape values, bounds, scales, fill
# values), by position; and a Conv's weight and bias, which its kernel holds.
# A float constant used only here stays NumPy: reading it never waits for the
# GPU (a CUDA-graph capture forbids that) and nothing is uploaded for it.
HOST_INPUTS: Dict[str, Tuple[int, ...]] = {
    "Conv": (1, 2), "Reshape": (1,), "Clip": (1, 2), "Resize": (1, 2, 3), "Upsample": (1,), "Pad": (1, 2, 3),
    "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
    "ReduceMax": (1,), "Split": (1,), "Gather": (1,),
}


def prepare_constants(program: OnnxProgram, xp: Any, dtype: Any) -> Dict[str, Any]:
    """The graph's constants for runs with array module xp, converted once:
    a float tensor some operator computes with becomes an xp array of `dtype`
    (on the GPU for CuPy); shape values, indices and the inputs in HOST_INPUTS
    stay NumPy on the host."""
    device_uses = {name for node in program.nodes for i, name in enumerate(node.inputs)
                   if name and i not in HOST_INPUTS.get(node.op, ())}
    return {name: xp.asarray(a, dtype=dtype) if a.dtype.kind == "f" and name in device_uses else a
            for name, a in program.constants.items()}


class UploadOnce:
    """CuPy, except that asarray() of a host NumPy array uploads each distinct
    one once (kept by content): Gather indices, Resize tables, shape values
    meeting a tensor. The first run of an input shape uploads them; later runs,
    and the CUDA-graph capture of that shape (which may not copy from the host),
    find them on the device. Never pass it the graph's input: that would be kept."""

    def __init__(self, xp: Any) -> None:
        self._xp = xp
        self._uploaded: Dict[Tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xp, name)

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        if not isinstance(a, np.ndarray):
            return self._xp.asarray(a, dtype=dtype)
        key = (a.dtype.str, a.shape, None if dtype is None else np.dtype(dtype).str, a.tobytes())
        if key not in self._uploaded:
            self._uploaded[key] = self._xp.asarray(a, dtype=dtype)
        return self._uploaded[key]


def execute(program: OnnxProgram, x: Any, xp: Any, conv: Callable[..., Any],
            dtype: Any, constants: Optional[Dict[str, Any]] = None,
            linear: Optional[Callable[[ConvLayer, Any], Any]] = None,
            dense_linear: Optional[Callable[[GemvLayer, Any, Dict[str, Any]], Any]] = None) -> List[Any]:
    """Run the graph on input x with array module xp; conv(layer, x) computes
    each Conv, conv(layer, x, residual) a fused one that adds a residual, and
    linear(layer, x) each Gemm/MatMul of program.linears (without it they run
    as OPS). dense_linear(layer, x, values) may compute a Gemm/MatMul of
    program.gemv_layers (values: the graph's values so far, constants
    included); where it returns None, the operator runs.
    constants: prepare_constants(program, xp, dtype), made once by the caller
    (SparseModel keeps its own on the GPU); None converts them for this call."""
    values: Dict[str, Any] = dict(prepare_constants(program, xp, dtype) if constants is None else constants)
    values[program.input_name] = xp.asarray(x, dtype=dtype)
    for node in program.nodes:
        try:
            if node.op == "Conv":
                residual = [values[i] for i in node.inputs[RESIDUAL_INPUT:]]  # fused by onnx_fuse
                out = conv(program.convs[node.name], values[node.inputs[0]], *residual)
            elif linear is not None and node.name in program.linears:
                out = linear(program.linears[node.name], values[node.inputs[0]])
            else:
                out = None
                if dense_linear is not None and node.name in program.gemv_layers:
                    out = dense_linear(program.gemv_layers[node.name], values[node.inputs[0]], values)
                if out is None:
                    args = [values[i] if i else None for i in node.inputs]
                    out = OPS[node.op](xp, node, *args)
        except KeyError as exc:
            raise ModelError(f"{program.path}: node {node.name} ({node.op}): input {exc} is not produced "
                             "by any earlier node") from None
        if isinstance(out, tuple):  # several outputs (Split)
            values.update(zip(node.outputs, out))
        else:
            values[node.outputs[0]] = out
    return [values[name] for name in program.output_names]


def conv2d_dense(layer: ConvLayer, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
    """Dense float64 convolution of one layer (the reference), with its
    epilogue when it is a FusedConv."""
    y = conv2d_im2col(x, layer.weight, layer.shape, layer.bias)
    if isinstance(layer, FusedConv):
        y = epilogue_reference(y, layer.epilogue, residual)
    return np.ascontiguousarray(y)


def linear_dense(layer: ConvLayer, x: np.ndarray) -> np.ndarray:
    """Dense float64 x @ W.T + b of one Linear layer (the reference)."""
    y = np.asarray(x, np.float64) @ layer.weight.astype(np.float64).T
    return y if layer.bias is None else y + layer.bias.astype(np.float64)


def run_reference(program: OnnxProgram, x: Any) -> List[np.ndarray]:
    """The dense reference: the whole graph in float64 NumPy on the CPU (for
    `--check`, the program load_program gives: the model as written). On a
    fused program each conv applies its epilogue, pool included (conv2d_dense)."""
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    return execute(program, x, np, conv2d_dense, np.float64, linear=linear_dense)


@dataclass(frozen=True)
class CapturedForward:
    """One input shape's CUDA graph and the memory it reads and writes."""

    graph: Any                # cupy.cuda.Graph
    input: Any                # the static input the graph reads: a call copies its input in
    outputs: Tuple[Any, ...]  # the static outputs each replay overwrites
    held: Tuple[Any, ...]     # what the capture allocated (CuPy blocks, torch's MemPool): the graph's own


def _torch_with_cuda() -> Any:
    """torch, where it is installed with a usable CUDA; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _end_capture_quietly(stream: Any) -> None:
    """End a capture that already failed: the stream is usable again, and the
    first error (the one that names the operator) is the one the caller sees."""
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001 -- the capture is invalid anyway; its first error is being raised
        pass


class SparseModel:
    """A pruned ONNX model on the GPU: each Conv a specialised kernel, the rest CuPy.

    The graph's constants are uploaded once (on the first call); a call uploads
    only its input. routes: Conv name -> RouteChoice, where compile_model timed
    the kernel against cuDNN strict fp32 (and the weight table at small
    batches); `dense` holds the cuDNN path of the layers routed to it at some
    batch size, `tables` the weight-table kernel (sparseconv.table) of those
    routed to it, and each call picks by its batch.

    cuda_graph=True: the first call of each input shape runs the forward once
    eagerly (modules loaded, split-variant workspaces and index tables in
    place, cuDNN plans chosen, so the batch variant of every layer is fixed for
    the shape), then captures it as one CUDA graph on a side stream with
    static buffers; later calls of that shape copy the input in and replay it.
    Each call returns copies of the outputs: a result the caller keeps is not
    overwritten by the next call. A shape whose forward cannot be captured
    (an operator that reads a device value on the host) runs eagerly instead;
    `graph_notes` says which happened for each shape, and why."""

    front_end = "runner"  # onnx_compile.compile_model's front ends: this one, or "fx" (onnx_fx.FxOnnxModel)

    def __init__(self, program: OnnxProgram, kernels: Dict[str, Any], *, cuda_graph: bool = False,
                 routes: Optional[Dict[str, RouteChoice]] = None, dense: Optional[Dict[str, Any]] = None,
                 route_note: str = "", tables: Optional[Dict[str, Any]] = None) -> None:
        self.program = program
        self.kernels = kernels  # layer name -> Conv2dKernel
        self.routes = dict(routes or {})
        self.dense = dict(dense or {})  # layer name -> DenseConv2dKernel, where a route sends a batch to cuDNN
        self.tables = dict(tables or {})  # layer name -> TableConv2d, where a route sends a batch to the table
        self.route_note = route_note
        self.front_end_note = ""  # why onnx_compile.compile_model(front_end="auto") took this front end
        self.cuda_graph = cuda_graph
        self.graph_notes: Dict[Tuple[int, ...], str] = {}
        self._graphs: Dict[Tuple[int, ...], Optional[CapturedForward]] = {}
        self._constants: Optional[Dict[str, Any]] = None  # on the GPU after the first call
        self._xp: Any = None
        # GemvLayer name -> (weight, bias), or (entries, row_start, bias) for a sparse one, on the GPU
        self._gemv_arrays: Dict[str, Tuple[Any, ...]] = {}

    def kernel(self, name: str, batch: int) -> Any:
        """What runs Conv `name` at this batch size: its kernel, or cuDNN or the
        weight table where the route says so."""
        choice = self.routes.get(name)
        path = choice.path(batch) if choice is not None else SPARSE
        if path == DENSE:
            return self.dense[name]
        if path == TABLE:
            return self.tables[name]
        return self.kernels[name]

    def _conv(self, layer: ConvLayer, x: Any, residual: Any = None) -> Any:
        import cupy

        extra = {} if residual is None else {"residual": cupy.ascontiguousarray(residual)}
        return self.kernel(layer.name, x.shape[0])(cupy.ascontiguousarray(x), **extra)

    def _eager(self, x: Any) -> List[Any]:
        import cupy

        if self._constants is None:
            self._constants = prepare_constants(self.program, cupy, cupy.float32)
            self._xp = UploadOnce(cupy)
        return execute(self.program, x, self._xp, self._conv, cupy.float32, self._constants, linear=self._conv,
                       dense_linear=self._gemv)

    def _gemv(self, layer: GemvLayer, x: Any, values: Dict[str, Any]) -> Any:
        """layer's x @ W.T + b through sparseconv.gemv, or None (the operator
        runs) where the kernel does not take x: more than MAX_GEMV_BATCH rows,
        not 2-D float32, or misaligned."""
        import cupy

        if x.ndim != 2 or x.dtype != cupy.float32 or x.shape[1] != layer.weight.shape[1]:
            return None
        x = cupy.ascontiguousarray(x)
        if layer.sparse:
            if not 1 <= x.shape[0] <= MAX_GEMV_BATCH:
                return None
            if layer.name not in self._gemv_arrays:  # the entries, uploaded once (the warm-up runs first)
                rows = sparse_rows(layer.weight)
                bias = layer.bias if layer.bias is not None else np.zeros(layer.weight.shape[0], np.float32)
                self._gemv_arrays[layer.name] = (cupy.asarray(rows.entries), cupy.asarray(rows.row_start),
                                                 cupy.asarray(bias, dtype=cupy.float32))
            entries, row_start, bias = self._gemv_arrays[layer.name]
            y = cupy.empty((x.shape[0], layer.weight.shape[0]), cupy.float32)
            linear_sparse_gemv(x.device.id, x, entries, row_start, bias, y)
            return y
        if layer.name not in self._gemv_arrays:  # uploaded once (outside any capture: the warm-up runs first)
            w = values.get(layer.weight_input) if layer.weight_input else None
            if w is None or w.dtype != cupy.float32 or not w.flags.c_contiguous:
                w = cupy.asarray(layer.weight)
            bias = layer.bias if layer.bias is not None else np.zeros(layer.weight.shape[0], np.float32)
            self._gemv_arrays[layer.name] = (w, cupy.asarray(bias, dtype=cupy.float32))
        w, bias = self._gemv_arrays[layer.name]
        if not gemv_supported(x.shape[0], x.shape[1], x.data.ptr, w.data.ptr):
            return None
        y = cupy.empty((x.shape[0], w.shape[0]), cupy.float32)
        linear_gemv(x.device.id, x, w, bias, y)
        return y

    def run(self, x: Any) -> List[Any]:
        """All graph outputs, as CuPy float32 arrays (asynchronous on the current stream)."""
        import cupy

        # A host input is uploaded here: outside any capture, and not through UploadOnce (which would keep it).
        x = cupy.asarray(x, dtype=cupy.float32)
        if not self.cuda_graph:
            return self._eager(x)
        key = tuple(x.shape)
        if key not in self._graphs:
            self._graphs[key] = self._capture(x)
        captured = self._graphs[key]
        if captured is None:
            return self._eager(x)
        cupy.copyto(captured.input, x)
        captured.graph.launch()  # on the current stream
        return [y.copy() for y in captured.outputs]

    def _capture(self, x: Any) -> Optional[CapturedForward]:
        """The CUDA graph of the forward at x's shape, or None (the reason in graph_notes)."""
        import cupy

        shape = tuple(x.shape)
        self._eager(x)  # warm-up: nothing is loaded, uploaded or chosen during the capture
        pool = cupy.get_default_memory_pool()
        held: List[Any] = []

        def alloc(size: int) -> Any:  # kept as long as the graph: its replays write to these addresses
            mem = pool.malloc(size)
            held.append(mem)
            return mem

        static_in = x.copy()
        torch_context, torch_held = self._torch_pool(shape[0])
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(cupy.cuda.get_current_stream().record())
        try:
            with cupy.cuda.using_allocator(alloc), stream, torch_context:
                stream.begin_capture()
                try:
                    outputs = self._eager(static_in)
                except BaseException:
                    _end_capture_quietly(stream)
                    raise
                graph = stream.end_capture()
        except Exception as exc:  # noqa: BLE001 -- an operator that syncs: this shape runs eagerly, noted
            self.graph_notes[shape] = f"not captured, runs eagerly: {type(exc).__name__}: {' '.join(str(exc).split())}"
            return None
        self.graph_notes[shape] = "captured"
        return CapturedForward(graph, static_in, tuple(outputs), tuple(held) + torch_held)

    def _torch_pool(self, batch: int) -> Tuple[Any, Tuple[Any, ...]]:
        """Where a layer runs through cuDNN at this batch size, or a matrix
        product through torch's cuBLAS (onnx_ops.matmul), torch allocates
        (conv outputs, cuDNN or cuBLAS workspace) while the graph is captured; those
        allocations go to a MemPool of the graph's own, so torch never hands
        that memory to anyone else while the graph may replay. (context, held)."""
        matmuls = torch_with_cuda() is not None and any(n.op in MATMUL_OPS for n in self.program.nodes)
        if not matmuls and not any(self.kernel(name, batch).backend == DENSE for name in self.kernels):
            return contextlib.nullcontext(), ()
        import cupy
        import torch

        mem_pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(mem_pool, device=cupy.cuda.Device().id), (mem_pool,)

    def __call__(self, x: Any) -> Any:
        return self.run(x)[0]

    def fused(self, name: str) -> Tuple[str, ...]:
        """What was folded or fused into layer `name` ("bn", "add", "relu", ...)."""
        return tuple(getattr(self.program.convs.get(name), "fused", ()))

    def fusion_lines(self) -> List[str]:
        """What fusion did: the totals, then per conv (onnx_fuse.fusion_lines)."""
        return fusion_lines(self.program.convs)

    @property
    def plan(self) -> List[str]:
        """How each conv-like node runs (its kernel's backend; where routed, the
        path per batch size and the times behind it), then how routing went and
        each input shape's CUDA graph."""
        paths = {}
        for name, k in self.kernels.items():
            choice = self.routes.get(name)
            if choice is None:
                paths[name] = k.backend
            elif choice.action == "mixed":
                paths[name] = f"mixed ({choice.describe_route()}; {choice.describe()})"
            else:
                paths[name] = f"{choice.action} at every batch size ({choice.describe()})"
        lines = self.program.plan(paths)
        if self.route_note:
            lines.append(f"routing: {self.route_note}")
        lines += [f"CUDA graph for input {'x'.join(map(str, s))}: {note}" for s, note in self.graph_notes.items()]
        return lines


def route_kernels(program: OnnxProgram, kernels: Dict[str, Any], batches: Sequence[int],
                  progress: bool = False, table: bool = True
                  ) -> Tuple[Dict[str, RouteChoice], Dict[str, Any], Dict[str, Any], str]:
    """Time each sparseconv kernel against cuDNN strict fp32 (a DenseConv2dKernel:
    the same call, bias and epilogue) at each batch size, and at batch sizes
    up to MAX_TABLE_BATCH against the weight table (TableConv2d; `table`
    False: not), by CUDA-graph replays as the model runs them (CUDA events for
    the kernel and cuDNN where a capture fails), with L2 overwritten before
    each call, as inside a network.
    Returns (name -> RouteChoice, name -> the cuDNN kernel of each layer some
    batch size is routed to, name -> the table kernel of each layer some batch
    size is routed to, a note). Without torch with CUDA nothing is timed:
    every conv keeps its kernel, and the note says so."""
    torch = _torch_with_cuda()
    if torch is None:
        return {}, {}, {}, "not routed: torch with CUDA is not installed, so every conv runs its sparseconv kernel"
    import cupy

    device = cupy.cuda.Device().id
    # L2 overwritten, then the inputs read back, before every timed call: as a
    # network meets each layer (sparseconv.torch.route_by_batch says why).
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
    routes: Dict[str, RouteChoice] = {}
    dense: Dict[str, Any] = {}
    tables: Dict[str, Any] = {}
    # convs only: a Linear kernel (program.linears) keeps its kernel
    items = [(name, k) for name, k in kernels.items() if k.backend == SPARSE and name in program.convs]
    line = StepLine(timing_label(table), len(items), progress)
    for name, k in items:
        line.step(name)
        layer = program.convs[name]
        cudnn = DenseConv2dKernel(k.layer, layer.bias, layer.weight)
        on_table = routable_table(layer.weight, layer.bias, k.shape, k.epilogue, batches, name) if table else None
        notes: List[str] = []

        def arrays(b: int) -> Tuple[Any, Any, Any]:
            """Fresh random x (and residual, where the kernel adds one) of batch b, and an out."""
            s = k.shape
            x = cupy.random.standard_normal((b, s.in_channels, s.in_h, s.in_w), dtype=cupy.float32)
            out = cupy.empty(k.output_shape(b), cupy.float32)
            r = cupy.random.standard_normal(out.shape, dtype=cupy.float32) if k.epilogue.residual else None
            return x, out, r

        def time_both(b: int) -> Tuple[float, float]:
            x, out, r = arrays(b)
            t = {}
            for path, fn in ((SPARSE, k), (DENSE, cudnn)):
                # torch's allocations inside the timing graph stay in a pool of their own
                ctx = torch.cuda.use_mem_pool(torch.cuda.MemPool(), device=device) if path == DENSE \
                    else contextlib.nullcontext()
                with ctx:
                    t[path] = time_cold(lambda: fn(x, out=out, residual=r), l2_flush(flush, x, r), repeat=20,
                                        max_seconds=0.2, capture=cupy_graph)
            if t[SPARSE].method == t[DENSE].method == "graph":
                return t[SPARSE].us, t[DENSE].us
            notes.append(f"batch {b} timed by CUDA events: {t[SPARSE].note or t[DENSE].note}")
            return t[SPARSE].events_us, t[DENSE].events_us

        def time_table(b: int) -> Optional[float]:
            if on_table is None or b > MAX_TABLE_BATCH:
                return None
            x, out, r = arrays(b)
            return time_cold(lambda: on_table(x, out=out, residual=r), l2_flush(flush, x, r), repeat=20,
                             max_seconds=0.2, capture=cupy_graph).us

        choice = choose_route(time_both, batches, time_table=time_table)
        routes[name] = replace(choice, note="; ".join(notes)) if notes else choice
        taken = {path for _, path in choice.route}
        if DENSE in taken:
            dense[name] = cudnn
        if TABLE in taken:
            tables[name] = on_table
    line.close()
    return routes, dense, tables, ""


def compile_model(path: Path, *, input_size: Optional[Tuple[int, int]] = None, cache_dir: Optional[str] = None,
                  jobs: Optional[int] = None, progress: bool = True, tiling: Optional[str] = None,
                  backend: str = "sparseconv", tune_batch: int = 64, cuda_graph: bool = False, fuse: bool = True,
                  route_batches: Optional[Sequence[int]] = (1, 64), table: bool = True) -> SparseModel:
    """Compile every Conv of an ONNX model (in parallel) and load the kernels on
    the current GPU. tiling="auto" / backend="auto" tune each layer (see
    sparseconv.tune); each kernel's .backend says which path it took.

    route_batches (default 1 and 64): where torch with CUDA is installed, each
    sparseconv kernel is timed against cuDNN strict fp32 at these batch sizes
    and each batch size then runs the faster path (route_kernels); without
    torch every conv keeps its kernel and the plan says so. None or () turns
    routing off. table=True (default) also times the weight-table family
    (sparseconv.table) at the route batch sizes of at most MAX_TABLE_BATCH
    and routes them to it where it is the fastest. cuda_graph=True replays
    one CUDA graph per input shape (see SparseModel); model.plan shows the
    paths, the times and the graphs.
    fuse: fold BatchNormalization into the convs and fuse residual adds,
    Relu/Clip and 2x2 max pools into their kernels (onnx_fuse.py); the plan
    says what was fused per conv, and .program is the fused program.
    progress (default on): the build, the tuning and the routing each say on
    stderr which layer they are at; progress=False is silent."""
    check_route_batches(route_batches, "compile_model")
    if not isinstance(table, bool):
        raise TypeError(f"compile_model: table must be True or False, got {table!r}")
    program = load_program(path, input_size)
    if fuse:
        program = fuse_program(program)
    epilogues = {n: layer.epilogue for n, layer in program.convs.items() if isinstance(layer, FusedConv)}
    layers = {**program.convs, **program.linears}  # one build; Gemm/MatMul layers as LinearKernel
    kernels = compile_layers([(n, layer.weight, layer.bias, layer.shape) for n, layer in layers.items()],
                             tiling=tiling, backend=backend, tune_batch=tune_batch, cache_dir=cache_dir,
                             jobs=jobs, progress=progress, epilogues=epilogues, linears=set(program.linears))
    routes: Dict[str, RouteChoice] = {}
    dense: Dict[str, Any] = {}
    tables: Dict[str, Any] = {}
    note = ""
    if route_batches:
        routes, dense, tables, note = route_kernels(program, kernels, route_batches, progress, table)
    return SparseModel(program, kernels, cuda_graph=cuda_graph, routes=routes, dense=dense, route_note=note,
                       tables=tables)


# --------------------------------------------------------------------------- data

_INPUT_KEYS = ("x", "image", "images", "input", "data")
_LABEL_KEYS = ("label", "labels", "y", "target", "targets")


def _read_arrays(path: Path, program: OnnxProgram, input_key: Optional[str],
                 label_key: Optional[str]) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.ndarray):
        if input_key or label_key:
            raise ModelError(f"{path}: a .npy file holds one array; --input-key/--label-key need an .npz")
        return loaded, None
    with loaded:
        keys = list(loaded.files)
        key = input_key or next((k for k in (program.input_name,) + _INPUT_KEYS if k in keys),
                                keys[0] if len(keys) == 1 else None)
        if key is None or key not in keys:
            raise ModelError(f"{path}: no input array {'named ' + repr(input_key) if input_key else 'found'} "
                             f"(arrays: {', '.join(keys)}); pass --input-key")
        lkey = label_key or next((k for k in _LABEL_KEYS if k in keys), None)
        if label_key and label_key not in keys:
            raise ModelError(f"{path}: no label array named {label_key!r} (arrays: {', '.join(keys)})")
        return loaded[key], (loaded[lkey] if lkey else None)


def load_data(path: Path, program: OnnxProgram, input_key: Optional[str] = None,
              label_key: Optional[str] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Inputs (N, C, H, W) float32 and optional labels (N,) from a .npy or .npz
    file (no pickle). Raises ModelError saying what was found and expected."""
    path = Path(path)
    try:
        x, labels = _read_arrays(path, program, input_key, label_key)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"{path}: cannot read data as .npy or .npz ({numpy_why(exc)})") from None
    if x.dtype.kind != "f":
        raise ModelError(f"{path}: inputs must be floating point (scaled as in training), got {x.dtype}")
    want = program.input_shape
    if x.ndim != len(want) or any(w is not None and w != g for w, g in zip(want[1:], x.shape[1:])):
        shown = "x".join("N" if i == 0 else str(d or "?") for i, d in enumerate(want))
        raise ModelError(f"{path}: inputs have shape {x.shape}, the model's input {program.input_name} is {shown}")
    if labels is not None and (labels.ndim != 1 or len(labels) != len(x) or labels.dtype.kind not in "iu"):
        raise ModelError(f"{path}: labels must be {len(x)} integers, got {labels.dtype} {labels.shape}")
    return np.ascontiguousarray(x, dtype=np.float32), labels


def predict(forward: Callable[[np.ndarray], Any], x: np.ndarray, batch_size: int) -> np.ndarray:
    """The first output for every input, batch by batch, as a host float array."""
    outs = []
    for i in range(0, len(x), batch_size):
        y = forward(x[i:i + batch_size])
        outs.append(y.get() if hasattr(y, "get") else np.asarray(y))
    return np.concatenate(outs) if outs else np.zeros((0,), np.float32)
