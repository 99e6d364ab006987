"""Run a pruned ONNX model end to end.

Every Conv node runs as a sparseconv kernel on the GPU; the other nodes are
small array functions written once for an array module `xp` (CuPy on the GPU,
NumPy for the float64 dense reference); the larger ones (Resize,
ConvTranspose, Slice, reductions, Cast, Pad) are in onnx_ops.py. Only the
operators in `OPS` are supported: enough for LeNet/VGG/ResNet, MobileNetV2/V3
and UNet/FPN-style exports. Anything else is refused when the model is
loaded, naming the node, before any compile starts. Constant nodes and static
subgraphs never reach the runner: model.read_onnx folds them.

    model = compile_model("models/lenet_digits_pruned.onnx")   # SparseModel
    logits = model(x)                       # x: CuPy or NumPy (N, 1, 8, 8) float32
    ref = run_reference(model.program, x)   # float64 NumPy, dense convs
"""
from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import onnx_ops as ops
from .dense import conv2d_im2col
from .api import LINEAR_MIN_SPARSITY, MAX_LINEAR_WEIGHTS, compile_layers, linear_limits, linear_shape
from .model import ConvLayer, ModelError, check_names, node_name, numpy_why, read_onnx


@dataclass(frozen=True)
class Node:
    op: str
    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    attrs: Dict[str, Any]


@dataclass(frozen=True)
class OnnxProgram:
    """A parsed ONNX graph: nodes in order, constant tensors, and its conv layers."""

    path: Path
    nodes: Tuple[Node, ...]
    constants: Dict[str, np.ndarray]
    input_name: str
    input_shape: Tuple[Optional[int], ...]  # None where the graph leaves a dimension free
    output_names: Tuple[str, ...]
    convs: Dict[str, ConvLayer]  # node name -> layer
    # Gemm / MatMul node name -> its layer as a Linear (weight (out, in)), for
    # those that run as kernels (linear_layers); the others run as OPS.
    linears: Dict[str, ConvLayer] = field(default_factory=dict)
    dense_linears: Dict[str, str] = field(default_factory=dict)  # node name -> why it runs densely

    def plan(self, backends: Optional[Dict[str, str]] = None) -> List[str]:
        """One line per conv-like node: how it runs. backends: Conv name ->
        the compiled kernel's backend (default: 'sparseconv')."""
        lines = []
        for node in self.nodes:
            if node.op == "Conv":
                s = self.convs[node.name].shape
                lines.append(f"{node.name}: Conv {s.describe()}, {(backends or {}).get(node.name, 'sparseconv')}")
            elif node.name in self.linears:
                s = self.linears[node.name].shape
                lines.append(f"{node.name}: {node.op} as Linear {s.in_channels}->{s.out_channels}, "
                             f"{(backends or {}).get(node.name, 'sparseconv')}")
            elif node.name in self.dense_linears:
                lines.append(f"{node.name}: {node.op}, dense (CuPy matmul): {self.dense_linears[node.name]}")
            elif node.op == "ConvTranspose":
                lines.append(f"{node.name}: ConvTranspose, dense (CuPy matmuls; not a sparseconv kernel)")
        return lines


# --------------------------------------------------------------------------- operators

def _pool(xp: Any, x: Any, attrs: Dict[str, Any], reduce: str) -> Any:
    kh, kw = attrs["kernel_shape"]
    sh, sw = attrs.get("strides", (1, 1))
    top, left, bottom, right = attrs.get("pads", (0, 0, 0, 0))
    n, c, h, w = x.shape
    ceil = int(attrs.get("ceil_mode", 0))
    rnd = (lambda a, b: -(-a // b)) if ceil else (lambda a, b: a // b)
    ho = rnd(h + top + bottom - kh, sh) + 1
    wo = rnd(w + left + right - kw, sw) + 1
    # Extra bottom/right padding for ceil_mode; it never counts as data.
    eh = max(0, (ho - 1) * sh + kh - (h + top + bottom))
    ew = max(0, (wo - 1) * sw + kw - (w + left + right))
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
    y = float(attrs.get("alpha", 1.0)) * (a @ b)
    return y if c is None else y + float(attrs.get("beta", 1.0)) * c


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
    "MatMul": _binary(lambda a, b: a @ b),
    "Add": _binary(lambda a, b: a + b),
    "Sub": _binary(lambda a, b: a - b),
    "Mul": _binary(lambda a, b: a * b),
    "Div": _binary(lambda a, b: a / b),
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
    linears, dense_linears = linear_layers(parsed)
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
                       tuple(o.name for o in graph.output), convs, linears, dense_linears)


def linear_layers(parsed: Any) -> Tuple[Dict[str, ConvLayer], Dict[str, str]]:
    """The Gemm and MatMul nodes of a parsed ONNX graph (model.OnnxFile) that
    are fully connected layers with a constant weight: Gemm with constant B,
    alpha 1, transA 0, any transB, and no C or beta 1 with a constant C of
    shape (N,), (1, N) or a scalar (the bias); MatMul of a 2-D input by a
    constant 2-D B. Returns (node name -> layer, weight (out, in) as
    nn.Linear's, shape api.linear_shape) for those that compile, and (node
    name -> why) for those that stay dense: under LINEAR_MIN_SPARSITY zeros,
    over MAX_LINEAR_WEIGHTS weights (their build would take minutes), or
    over the build limits."""
    import onnx

    consts = parsed.constants
    ranks: Dict[str, int] = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
                             list(parsed.graph.input) + list(parsed.graph.value_info) + list(parsed.graph.output)
                             if vi.type.tensor_type.HasField("shape")}
    linears: Dict[str, ConvLayer] = {}
    dense: Dict[str, str] = {}
    for i, nd in enumerate(parsed.graph.node):
        if nd.op_type not in ("Gemm", "MatMul") or nd.domain not in ("", "ai.onnx") or len(nd.input) < 2 \
                or nd.input[1] not in consts or consts[nd.input[1]].ndim != 2 or consts[nd.input[1]].dtype.kind != "f":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute}
        b = consts[nd.input[1]]
        bias = None
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
    return linears, dense


# --------------------------------------------------------------------------- execution

def execute(program: OnnxProgram, x: Any, xp: Any, conv: Callable[[ConvLayer, Any], Any],
            dtype: Any, linear: Optional[Callable[[ConvLayer, Any], Any]] = None) -> List[Any]:
    """Run the graph on input x with array module xp; conv(layer, x) computes
    each Conv, linear(layer, x) each Gemm/MatMul of program.linears (without
    it they run as OPS)."""
    values: Dict[str, Any] = {name: xp.asarray(a, dtype=dtype) if a.dtype.kind == "f" else a
                              for name, a in program.constants.items()}
    values[program.input_name] = xp.asarray(x, dtype=dtype)
    for node in program.nodes:
        try:
            if node.op == "Conv":
                out = conv(program.convs[node.name], values[node.inputs[0]])
            elif linear is not None and node.name in program.linears:
                out = linear(program.linears[node.name], values[node.inputs[0]])
            else:
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


def conv2d_dense(layer: ConvLayer, x: np.ndarray) -> np.ndarray:
    """Dense float64 convolution of one layer (the reference)."""
    return np.ascontiguousarray(conv2d_im2col(x, layer.weight, layer.shape, layer.bias))


def linear_dense(layer: ConvLayer, x: np.ndarray) -> np.ndarray:
    """Dense float64 x @ W.T + b of one Linear layer (the reference)."""
    y = np.asarray(x, np.float64) @ layer.weight.astype(np.float64).T
    return y if layer.bias is None else y + layer.bias.astype(np.float64)


def run_reference(program: OnnxProgram, x: Any) -> List[np.ndarray]:
    """The dense reference: the whole graph in float64 NumPy on the CPU."""
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    return execute(program, x, np, conv2d_dense, np.float64, linear_dense)


class SparseModel:
    """A pruned ONNX model on the GPU: each Conv a specialised kernel, the rest CuPy."""

    def __init__(self, program: OnnxProgram, kernels: Dict[str, Any]) -> None:
        self.program = program
        self.kernels = kernels  # layer name -> Conv2dKernel

    def _conv(self, layer: ConvLayer, x: Any) -> Any:
        import cupy

        return self.kernels[layer.name](cupy.ascontiguousarray(x))

    def run(self, x: Any) -> List[Any]:
        """All graph outputs, as CuPy float32 arrays (asynchronous on the current stream)."""
        import cupy

        return execute(self.program, x, cupy, self._conv, cupy.float32, self._conv)

    def __call__(self, x: Any) -> Any:
        return self.run(x)[0]

    @property
    def plan(self) -> List[str]:
        """How each conv-like node runs: its kernel's backend, or dense."""
        return self.program.plan({name: k.backend for name, k in self.kernels.items()})


def compile_model(path: Path, *, input_size: Optional[Tuple[int, int]] = None, cache_dir: Optional[str] = None,
                  jobs: Optional[int] = None, progress: bool = False, tiling: Optional[str] = None,
                  backend: str = "sparseconv", tune_batch: int = 64) -> SparseModel:
    """Compile every Conv of an ONNX model (in parallel) and load the kernels on
    the current GPU. tiling="auto" / backend="auto" tune each layer (see
    sparseconv.tune); each kernel's .backend says which path it took."""
    program = load_program(path, input_size)
    layers = {**program.convs, **program.linears}  # one build; Gemm/MatMul layers as LinearKernel
    kernels = compile_layers([(n, layer.weight, layer.bias, layer.shape) for n, layer in layers.items()],
                             tiling=tiling, backend=backend, tune_batch=tune_batch, cache_dir=cache_dir,
                             jobs=jobs, progress=progress, linears=set(program.linears))
    return SparseModel(program, kernels)


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
