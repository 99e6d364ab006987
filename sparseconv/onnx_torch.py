"""ONNX -> torch.fx: an ONNX CNN as an fx.GraphModule of torch modules, so
that the whole-network bench can time the same network, with the same
weights, through sparsify and through PyTorch eager / torch.compile.

No well-kept converter installs beside CI's CPU torch (onnx2torch and
onnx2pytorch import torchvision; docs/DESIGN.md), so this one covers the
operators CNN exports use, and nothing more. Each Conv becomes an
nn.Conv2d, each BatchNormalization an nn.BatchNorm2d, each Gemm / MatMul with
a constant weight an nn.Linear, activations and pools their nn modules:
what sparsify's fx passes fold and fuse. The graph is read by
runner.load_program (the parse `sparseconv run` uses), so a model refused
there is refused here with the same message. Anything outside CONVERTERS
raises ModelError naming the node; `sparseconv run` runs more operators.

    module, input_shape = onnx_to_torch(Path("model.onnx"))   # input_shape: (C, H, W)
"""
from __future__ import annotations

import math
import operator
import re
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import fx, nn

from .model import ModelError
from .runner import Node, OnnxProgram, load_program


def onnx_reshape(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """ONNX Reshape (allowzero 0): a 0 copies the input's dimension there."""
    return x.reshape(*[x.shape[i] if d == 0 else d for i, d in enumerate(shape)])


def one_tuple(v: Any) -> Tuple[Any, ...]:
    """Unsqueeze of a scalar shape value: (v,). Builds the tuple around a
    traced value without iterating it, so fx can trace through."""
    return (v,)


def gather_ints(shape: Any, indices: Tuple[int, ...]) -> Tuple[Any, ...]:
    """Gather of several entries of a shape value (indices are constants)."""
    return tuple(shape[i] for i in indices)


def onnx_flatten(x: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX Flatten (axis >= 0): 2-D, the dimensions before `axis` in the
    first, the rest (or 1) in the second. No branch on the rank, so fx can
    trace it: the trailing 1 makes axis == rank come out (P, 1)."""
    if axis == 0:
        return x.reshape(1, -1)
    return torch.flatten(torch.flatten(x, 0, axis - 1).unsqueeze(-1), 1)


def _flatten(b: "_Builder", n: Node) -> fx.Node:
    axis, rank = int(n.attrs.get("axis", 1)), b.rank(n.inputs[0])
    if axis < 0:
        if rank is None:
            raise ModelError(f"{b.where(n)}: a negative axis needs the input's rank, which shape inference left open")
        axis += rank
    x = b.value(n.inputs[0])
    if axis == 1 and rank is not None and rank > 1:  # the usual CNN head: torch's own flatten, which sparsify expects
        return b.function(torch.flatten, x, 1)
    return b.function(onnx_flatten, x, axis)


class _Builder:
    """The fx graph under construction: ONNX value name -> fx node."""

    def __init__(self, program: OnnxProgram) -> None:
        self.program = program
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.values: Dict[str, Any] = {program.input_name: self.graph.placeholder("x")}
        self.names: Dict[str, int] = {}
        # ONNX values that hold a shape or a part of one (Shape -> Gather ->
        # Unsqueeze -> Concat -> Reshape, as exporters write x.view(x.size(0), -1))
        self.shape_values: set = set()

    def where(self, n: Node) -> str:
        return f"{self.program.path}: node {n.name} ({n.op})"

    def attribute_name(self, name: str, op: str = "") -> str:
        """A unique Python identifier for a submodule or buffer named after
        `name`. Exporters' scope paths read as torch's module names:
        "/layer1/layer1.0/conv1/Conv" -> "layer1_0_conv1"."""
        parts = [p for p in name.split("/") if p]
        if op and parts and re.fullmatch(re.escape(op) + r"(_\d+)?", parts[-1]):
            parts = parts[:-1]    # the operator's own name adds nothing
        parts = [p for i, p in enumerate(parts) if not (i + 1 < len(parts) and parts[i + 1].startswith(p + "."))]
        base = re.sub(r"\W", "_", "_".join(parts)).strip("_") or op.lower() or "v"
        base = base if not base[0].isdigit() else f"v_{base}"
        base = base if not hasattr(nn.Module, base) else f"{base}_"   # a node named "forward" or "eval"
        count = self.names.get(base, 0)
        self.names[base] = count + 1
        return base if count == 0 else f"{base}_{count}"

    def constant(self, name: str) -> Optional[np.ndarray]:
        return self.program.constants.get(name)

    def is_shape(self, name: str) -> bool:
        const = self.constant(name)
        return name in self.shape_values or (const is not None and const.dtype == np.int64 and name not in self.values)

    def shape_value(self, name: str) -> Any:
        """A shape value: an fx node, or a constant int64 array as a tuple of ints."""
        if name in self.shape_values:
            return self.values[name]
        return tuple(int(d) for d in np.asarray(self.constant(name)).reshape(-1))

    def value(self, name: str) -> fx.Node:
        """The fx node of an ONNX value; a constant becomes a buffer read once."""
        if name not in self.values:
            const = self.constant(name)
            if const is None:
                raise ModelError(f"{self.program.path}: value {name!r} is used before it is computed")
            attr = self.attribute_name(f"const_{name}")
            tensor = torch.tensor(np.array(const, dtype=np.float32 if const.dtype.kind == "f" else const.dtype))
            self.root.register_buffer(attr, tensor)
            self.values[name] = self.graph.get_attr(attr)
        return self.values[name]

    def module(self, n: Node, module: nn.Module, *inputs: fx.Node) -> fx.Node:
        attr = self.attribute_name(n.name, n.op)
        self.root.add_module(attr, module)
        return self.graph.call_module(attr, tuple(inputs))

    def function(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(fn, tuple(args), kwargs)

    def rank(self, name: str) -> Optional[int]:
        dims = self.program.shapes.get(name)
        return None if dims is None else len(dims)


def _conv(b: _Builder, n: Node) -> fx.Node:
    layer = b.program.convs[n.name]
    s = layer.shape
    conv = nn.Conv2d(s.in_channels, s.out_channels, (s.kernel_h, s.kernel_w), s.stride, s.padding, s.dilation,
                     s.groups, bias=layer.bias is not None)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor(np.array(layer.weight, np.float32)))
        if layer.bias is not None:
            conv.bias.copy_(torch.tensor(np.array(layer.bias, np.float32)))
    return b.module(n, conv, b.value(n.inputs[0]))


def _batchnorm(b: _Builder, n: Node) -> fx.Node:
    params = [b.constant(i) for i in n.inputs[1:5]]
    if any(p is None for p in params):
        raise ModelError(f"{b.where(n)}: scale, bias, mean and variance must be constants (inference BN)")
    scale, bias, mean, var = (torch.tensor(np.asarray(p, np.float32).reshape(-1)) for p in params)
    bn = (nn.BatchNorm1d if b.rank(n.inputs[0]) == 2 else nn.BatchNorm2d)(scale.numel(),
                                                                          eps=float(n.attrs.get("epsilon", 1e-5)))
    with torch.no_grad():
        bn.weight.copy_(scale)
        bn.bias.copy_(bias)
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
    return b.module(n, bn.eval(), b.value(n.inputs[0]))


def _clip(b: _Builder, n: Node) -> fx.Node:
    bounds = []
    for i, key, default in ((1, "min", -math.inf), (2, "max", math.inf)):  # inputs since opset 11, else attributes
        if len(n.inputs) > i and n.inputs[i]:
            const = b.constant(n.inputs[i])
            if const is None:
                raise ModelError(f"{b.where(n)}: the bounds must be constants")
            bounds.append(float(np.asarray(const).reshape(())))
        else:
            bounds.append(float(n.attrs.get(key, default)))
    lo, hi = bounds
    x = b.value(n.inputs[0])
    if (lo, hi) == (0.0, 6.0):
        return b.module(n, nn.ReLU6(), x)
    if math.isfinite(lo) and math.isfinite(hi):
        return b.module(n, nn.Hardtanh(lo, hi), x)
    return b.function(torch.clamp, x, None if math.isinf(lo) else lo, None if math.isinf(hi) else hi)


def _pads(b: _Builder, n: Node) -> Tuple[int, int]:
    pads = [int(p) for p in n.attrs.get("pads", [0, 0, 0, 0])]
    if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3]:
        raise ModelError(f"{b.where(n)}: pads {pads} are not symmetric; torch's pools pad both sides alike")
    return pads[0], pads[1]


def _pool(b: _Builder, n: Node) -> fx.Node:
    kernel = tuple(int(k) for k in n.attrs["kernel_shape"])
    if len(kernel) != 2:
        raise ModelError(f"{b.where(n)}: only 2-D pools convert, got kernel_shape {list(kernel)}")
    stride = tuple(int(s) for s in n.attrs.get("strides", (1, 1)))
    ceil = bool(int(n.attrs.get("ceil_mode", 0)))
    if n.op == "MaxPool":
        pool: nn.Module = nn.MaxPool2d(kernel, stride, _pads(b, n), ceil_mode=ceil)
    else:
        pool = nn.AvgPool2d(kernel, stride, _pads(b, n), ceil_mode=ceil,
                            count_include_pad=bool(int(n.attrs.get("count_include_pad", 0))))
    return b.module(n, pool, b.value(n.inputs[0]))


def _linear(b: _Builder, n: Node) -> fx.Node:
    """Gemm (alpha 1, transA 0, beta 1, constant B and C) or MatMul of a 2-D
    input by a constant 2-D B, as an nn.Linear; a MatMul of two computed
    values as torch.matmul."""
    w = b.constant(n.inputs[1])
    x = b.value(n.inputs[0])
    if n.op == "MatMul" and (w is None or w.ndim != 2 or b.rank(n.inputs[0]) != 2):
        return b.function(torch.matmul, x, b.value(n.inputs[1]))
    if w is None or w.ndim != 2:
        raise ModelError(f"{b.where(n)}: B must be a constant 2-D weight")
    bias = None
    if n.op == "Gemm":
        if float(n.attrs.get("alpha", 1.0)) != 1.0 or int(n.attrs.get("transA", 0)):
            raise ModelError(f"{b.where(n)}: only alpha 1 and transA 0 convert")
        w = w if int(n.attrs.get("transB", 0)) else w.T
        if len(n.inputs) > 2 and n.inputs[2]:
            c = b.constant(n.inputs[2])
            if c is None or float(n.attrs.get("beta", 1.0)) != 1.0 or c.size not in (1, w.shape[0]):
                raise ModelError(f"{b.where(n)}: C must be a constant bias of shape (N,), (1, N) or a scalar, "
                                 "with beta 1")
            bias = np.broadcast_to(np.asarray(c, np.float32).reshape(-1), (w.shape[0],))
    else:
        w = w.T
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(np.ascontiguousarray(w, np.float32)))
        if bias is not None:
            linear.bias.copy_(torch.tensor(np.ascontiguousarray(bias)))
    return b.module(n, linear, x)


def _reshape(b: _Builder, n: Node) -> fx.Node:
    if int(n.attrs.get("allowzero", 0)):
        raise ModelError(f"{b.where(n)}: allowzero 1 does not convert")
    if n.inputs[1] in b.shape_values:  # computed from the input's shape: its entries are the sizes themselves
        return b.graph.call_method("reshape", (b.value(n.inputs[0]), b.values[n.inputs[1]]))
    shape = b.constant(n.inputs[1])
    if shape is None:
        raise ModelError(f"{b.where(n)}: the shape must be a constant or computed from a Shape node")
    return b.function(onnx_reshape, b.value(n.inputs[0]), tuple(int(d) for d in np.asarray(shape).reshape(-1)))


def _shape_op(b: _Builder, n: Node) -> Any:
    """Shape, and Gather / Unsqueeze / Slice / Concat / Cast on shape values: kept as
    Python ints and tuples in the graph (traced sizes where they depend on the
    input), so Reshape gets the batch size of each call."""
    if n.op == "Shape":
        size = b.graph.call_method("size", (b.value(n.inputs[0]),))
        start, end = n.attrs.get("start"), n.attrs.get("end")
        out = size if start is None and end is None else b.function(
            operator.getitem, size, slice(None if start is None else int(start), None if end is None else int(end)))
    elif n.op == "Gather":
        idx = b.constant(n.inputs[1])
        if idx is None or int(n.attrs.get("axis", 0)) != 0:
            raise ModelError(f"{b.where(n)}: only constant indices on axis 0 of a shape convert")
        shape = b.shape_value(n.inputs[0])
        out = b.function(operator.getitem, shape, int(idx)) if idx.ndim == 0 else \
            b.function(gather_ints, shape, tuple(int(i) for i in idx.reshape(-1)))
    elif n.op == "Unsqueeze":  # a scalar size -> a 1-entry shape
        out = b.function(one_tuple, b.shape_value(n.inputs[0]))
    elif n.op == "Slice":
        def ints(k: int) -> Optional[list]:  # input k as constant ints; None where absent or computed
            const = b.constant(n.inputs[k]) if len(n.inputs) > k and n.inputs[k] else None
            return None if const is None else [int(e) for e in np.asarray(const).reshape(-1)]

        starts, ends, axes, steps = (ints(k) for k in range(1, 5))
        if starts is None or ends is None or len(starts) != 1 or (axes or [0]) != [0]:
            raise ModelError(f"{b.where(n)}: only a constant slice of a shape converts")
        big = 1 << 62    # ONNX's "to the end" is a huge int
        out = b.function(operator.getitem, b.shape_value(n.inputs[0]),
                         slice(starts[0], None if ends[0] >= big else ends[0], (steps or [1])[0]))
    elif n.op == "Concat":
        parts = [b.shape_value(i) for i in n.inputs]
        out = parts[0]
        for part in parts[1:]:
            out = b.function(operator.add, out, part)
    else:  # Cast: sizes are ints already
        out = b.shape_value(n.inputs[0])
    b.shape_values.add(n.outputs[0])
    return out


def _on_shapes(n: Node, b: _Builder) -> bool:
    """Whether node n computes on shape values (see _shape_op)."""
    if n.op == "Shape":
        return True
    if n.op in ("Gather", "Unsqueeze", "Cast", "Slice"):
        return n.inputs[0] in b.shape_values
    return n.op == "Concat" and any(i in b.shape_values for i in n.inputs) and all(b.is_shape(i) for i in n.inputs)


def _conv_transpose(b: _Builder, n: Node) -> fx.Node:
    w = b.constant(n.inputs[1])
    bias = b.constant(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
    if w is None or w.ndim != 4 or (len(n.inputs) > 2 and n.inputs[2] and bias is None):
        raise ModelError(f"{b.where(n)}: the weight (and bias) must be constants of a 2-D ConvTranspose")
    if n.attrs.get("output_shape") is not None or n.attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise ModelError(f"{b.where(n)}: output_shape and auto_pad do not convert; export with explicit pads")
    groups = int(n.attrs.get("group", 1))
    conv = nn.ConvTranspose2d(w.shape[0], w.shape[1] * groups, tuple(w.shape[2:]),
                              tuple(int(v) for v in n.attrs.get("strides", (1, 1))), _pads(b, n),
                              tuple(int(v) for v in n.attrs.get("output_padding", (0, 0))), groups,
                              bias=bias is not None, dilation=tuple(int(v) for v in n.attrs.get("dilations", (1, 1))))
    with torch.no_grad():
        conv.weight.copy_(torch.tensor(np.array(w, np.float32)))
        if bias is not None:
            conv.bias.copy_(torch.tensor(np.array(bias, np.float32)))
    return b.module(n, conv, b.value(n.inputs[0]))


def _reduce_mean(b: _Builder, n: Node) -> fx.Node:
    axes = n.attrs.get("axes")
    if axes is None and len(n.inputs) > 1 and n.inputs[1]:  # an input since opset 18
        const = b.constant(n.inputs[1])
        if const is None:
            raise ModelError(f"{b.where(n)}: the axes must be constants")
        axes = [int(a) for a in np.asarray(const).reshape(-1)]
    x = b.value(n.inputs[0])
    keep = bool(int(n.attrs.get("keepdims", 1)))
    if not axes:
        return b.function(torch.mean, x) if not keep else b.graph.call_method(
            "mean", (x, tuple(range(b.rank(n.inputs[0]) or 0))), {"keepdim": True})
    return b.graph.call_method("mean", (x, tuple(int(a) for a in axes)), {"keepdim": keep})


def _text(v: Any, default: str) -> str:
    return default if v is None else v.decode() if isinstance(v, bytes) else str(v)


def _resize(b: _Builder, n: Node) -> fx.Node:
    """Resize of an NCHW tensor to sizes (constant or computed) or by constant
    scales, in the modes F.interpolate has: nearest (asymmetric, floor) and
    bilinear (half_pixel, pytorch_half_pixel or align_corners)."""
    mode = _text(n.attrs.get("mode"), "nearest")
    coords = _text(n.attrs.get("coordinate_transformation_mode"), "half_pixel")
    kwargs: Dict[str, Any] = {}
    if mode == "nearest" and coords == "asymmetric" and _text(n.attrs.get("nearest_mode"), "round_prefer_floor") \
            == "floor":
        kwargs["mode"] = "nearest"
    elif mode == "linear" and coords in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        kwargs.update(mode="bilinear", align_corners=coords == "align_corners")
    else:
        raise ModelError(f"{b.where(n)}: mode {mode} with coordinate_transformation_mode {coords} does not "
                         "convert (nearest asymmetric floor, or linear half_pixel / align_corners do)")
    scales = b.constant(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
    sizes = n.inputs[3] if len(n.inputs) > 3 and n.inputs[3] else None
    if sizes is not None and b.is_shape(sizes):
        kwargs["size"] = b.function(operator.getitem, b.shape_value(sizes), slice(2, None))
    elif scales is not None and scales.size == 4 and tuple(scales[:2]) == (1.0, 1.0):
        kwargs["scale_factor"] = tuple(float(v) for v in scales[2:])
    else:
        raise ModelError(f"{b.where(n)}: the sizes or the scales (1, 1, h, w) must be constants or computed "
                         "from shapes")
    return b.function(torch.nn.functional.interpolate, b.value(n.inputs[0]), **kwargs)


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[[_Builder, Node], fx.Node]:
    return lambda b, n: b.function(fn, b.value(n.inputs[0]), b.value(n.inputs[1]))


def _modular(make: Callable[[Node], nn.Module]) -> Callable[[_Builder, Node], fx.Node]:
    return lambda b, n: b.module(n, make(n), b.value(n.inputs[0]))


def _hard_sigmoid(n: Node) -> nn.Module:
    alpha, beta = float(n.attrs.get("alpha", 0.2)), float(n.attrs.get("beta", 0.5))
    if abs(alpha - 1 / 6) > 1e-7 or beta != 0.5:
        raise ModelError(f"node {n.name} (HardSigmoid): only alpha 1/6 and beta 0.5 (torch's Hardsigmoid) convert")
    return nn.Hardsigmoid()


# ONNX operator -> how it enters the graph.
CONVERTERS: Dict[str, Callable[[_Builder, Node], fx.Node]] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "ReduceMean": _reduce_mean,
    "Resize": _resize,
    "BatchNormalization": _batchnorm,
    "Relu": _modular(lambda n: nn.ReLU()),
    "LeakyRelu": _modular(lambda n: nn.LeakyReLU(float(n.attrs.get("alpha", 0.01)))),
    "Sigmoid": _modular(lambda n: nn.Sigmoid()),
    "Tanh": _modular(lambda n: nn.Tanh()),
    "HardSwish": _modular(lambda n: nn.Hardswish()),
    "HardSigmoid": _modular(_hard_sigmoid),
    "Clip": _clip,
    "MaxPool": _pool,
    "AveragePool": _pool,
    "GlobalAveragePool": _modular(lambda n: nn.AdaptiveAvgPool2d(1)),
    "GlobalMaxPool": _modular(lambda n: nn.AdaptiveMaxPool2d(1)),
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Gemm": _linear,
    "MatMul": _linear,
    "Add": _binary(operator.add),
    "Sub": _binary(operator.sub),
    "Mul": _binary(operator.mul),
    "Div": _binary(operator.truediv),
    "Concat": lambda b, n: b.function(torch.cat, [b.value(i) for i in n.inputs], dim=int(n.attrs["axis"])),
    "Softmax": lambda b, n: b.function(torch.softmax, b.value(n.inputs[0]), int(n.attrs.get("axis", -1))),
    "Dropout": lambda b, n: b.value(n.inputs[0]),    # inference: identity
    "Identity": lambda b, n: b.value(n.inputs[0]),
}


def onnx_to_torch(path: Path, input_size: Optional[Tuple[int, int]] = None) -> Tuple[fx.GraphModule, Tuple[int, ...]]:
    """The ONNX model at `path` as an fx.GraphModule in eval mode (one input,
    NCHW float32; one output, or a tuple), and its input shape without the
    batch, (C, H, W), with H x W = input_size where given. The module's
    `onnx_batch` is the batch size the file fixes, or None. Raises
    ModelError naming the file and node for what does not convert."""
    program = load_program(Path(path), input_size)
    builder = _Builder(program)
    for n in program.nodes:
        convert = _shape_op if _on_shapes(n, builder) else CONVERTERS.get(n.op)
        if convert is None:
            raise ModelError(f"{program.path}: node {n.name} has operator {n.op}, which the ONNX -> torch conversion "
                             "does not cover (onnx_torch.CONVERTERS lists what it does); `sparseconv run` runs the "
                             "model on the ONNX runner instead")
        if len(n.outputs) > 1 and any(n.outputs[1:]) and n.op != "Dropout":
            raise ModelError(f"{builder.where(n)}: only its first output converts")
        builder.values[n.outputs[0]] = convert(builder, n)
    outputs = [builder.value(o) for o in program.output_names]
    builder.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    module = fx.GraphModule(builder.root, builder.graph, class_name=re.sub(r"\W", "_", program.path.stem) or "Onnx")
    shape = program.input_shape[1:]
    if len(shape) != 3 or any(not isinstance(d, int) for d in shape):
        raise ModelError(f"{program.path}: the input must be NCHW with C, H and W fixed, got {program.input_shape}; "
                         "pass the image size (--input-size) where H and W are free")
    # a batch size the file fixes (None: free); constants folded at export may depend on it
    module.onnx_batch = program.input_shape[0] if isinstance(program.input_shape[0], int) else None
    return module.eval(), tuple(shape)
