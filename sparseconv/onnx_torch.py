"""ONNX -> torch.fx: an ONNX CNN as an fx.GraphModule of torch modules, so
that the whole-network bench can time the same network, with the same
weights, through sparsify and through PyTorch eager / torch.compile.

No well-kept converter installs beside CI's CPU torch (onnx2torch and
onnx2pytorch import torchvision; docs/DESIGN.md), so this one covers the
operators `sparseconv run` runs (runner.OPS), each as the runner computes
it, and nothing more. Each Conv becomes an nn.Conv2d, each
BatchNormalization an nn.BatchNorm2d, each Gemm / MatMul with a constant
weight an nn.Linear, activations, pools and norms their nn modules: what
sparsify's fx passes fold and fuse; the rest are torch functions, with
their constant inputs (pads, slice bounds, axes, split sizes, indices,
scales) read here. The graph is read by runner.load_program (the parse
`sparseconv run` uses), so a model refused there is refused here with the
same message. What does not convert raises ModelError naming the node: an
operator outside CONVERTERS, or one whose bounds, pads, axes or indices are
computed at run time (Slice bounds and Reshape shapes computed from the
input's shape do convert), which `sparseconv run` still runs.

    module, input_shape = onnx_to_torch(Path("model.onnx"))   # input_shape: (C, H, W)
"""
from __future__ import annotations

import math
import operator
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


def onnx_int_div(a: Any, b: Any) -> Any:
    """ONNX Div of integers: the quotient truncated toward zero (C's
    division); Python's // floors, one less where the signs differ and b does
    not divide a. A leaf for fx (torch.fx.wrap below), which records the call
    rather than trace the branch; torch.compile reads the branch off its
    sizes' ranges (a size's quotient is never negative)."""
    q = a // b
    return q + 1 if q < 0 and q * b != a else q


fx.wrap("onnx_int_div")

_SHAPE_ARITHMETIC: Dict[str, Callable[[Any, Any], Any]] = {
    "Add": operator.add, "Sub": operator.sub, "Mul": operator.mul, "Div": onnx_int_div}


def shape_arithmetic(op: str, a: Any, b: Any, lengths: Tuple[Optional[int], Optional[int]]) -> Any:
    """Add / Sub / Mul / Div (_SHAPE_ARITHMETIC) of two integer shape values,
    element-wise and broadcast as ONNX does: `lengths` gives each operand's
    length, None for a scalar; a scalar or a 1-entry shape meets an n-entry
    one. Entries are read by index, never by iterating, so fx traces through
    a shape it holds as one value (x.size())."""
    fn = onnx_int_div if op == "Div" else _SHAPE_ARITHMETIC[op]   # the global: fx patches it while tracing
    if lengths[0] is None and lengths[1] is None:
        return fn(a, b)
    n = max(length or 1 for length in lengths)

    def entry(v: Any, length: Optional[int], i: int) -> Any:
        return v if length is None else v[i if length > 1 else 0]

    return tuple(fn(entry(a, lengths[0], i), entry(b, lengths[1], i)) for i in range(n))


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
        self.float_shapes: set = set()    # those cast to a float type: Div on them is not integer division

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

    def shape_length(self, n: Node, name: str) -> Optional[int]:
        """The number of entries of shape value or int64 constant `name`, an
        input of node n; None for a scalar."""
        const = self.constant(name) if name not in self.shape_values else None
        dims = np.shape(const) if const is not None else self.program.shapes.get(name)
        if dims is None or len(dims) > 1 or (dims and not isinstance(dims[0], int)):
            raise ModelError(f"{self.where(n)}: {name} must be a scalar or a 1-D shape of a length shape inference "
                             f"fixes, got dimensions {dims}")
        return dims[0] if dims else None

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

    def buffer(self, n: Node, what: str, array: np.ndarray) -> fx.Node:
        """A table of node n computed here (indices, weights) as a buffer."""
        attr = self.attribute_name(f"{n.name}/{what}")
        self.root.register_buffer(attr, torch.tensor(np.ascontiguousarray(array)))
        return self.graph.get_attr(attr)

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
    """Shape, and Gather / Unsqueeze / Slice / Concat / Cast / Add / Sub / Mul /
    Div on shape values: kept as Python ints and tuples in the graph (traced
    sizes where they depend on the input), so Reshape and Slice get the batch
    size of each call."""
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
    elif n.op in _SHAPE_ARITHMETIC:  # as exporters write x.size(0) // 2 (torch.chunk, x.view) or x.size(0) - 1
        a, c = n.inputs[:2]
        out = b.function(shape_arithmetic, n.op, _scalar_or_shape(b, a), _scalar_or_shape(b, c),
                         (b.shape_length(n, a), b.shape_length(n, c)))
    else:  # Cast: sizes are ints already; a float type is remembered, for Div
        out = b.shape_value(n.inputs[0])
        from onnx import helper

        if np.dtype(helper.tensor_dtype_to_np_dtype(int(n.attrs["to"]))).kind == "f":
            b.float_shapes.add(n.outputs[0])
    if n.op != "Cast" and any(i in b.float_shapes for i in n.inputs):
        b.float_shapes.add(n.outputs[0])
    b.shape_values.add(n.outputs[0])
    return out


def _scalar_or_shape(b: _Builder, name: str) -> Any:
    """An operand of shape arithmetic: a shape value, or an int64 constant
    as an int (a scalar) or a tuple of ints."""
    const = b.constant(name) if name not in b.shape_values else None
    return int(const) if const is not None and np.ndim(const) == 0 else b.shape_value(name)


def _on_shapes(n: Node, b: _Builder) -> bool:
    """Whether node n computes on shape values (see _shape_op)."""
    if n.op == "Shape":
        return True
    if n.op in ("Gather", "Unsqueeze", "Cast", "Slice"):
        return n.inputs[0] in b.shape_values
    shapes = any(i in b.shape_values for i in n.inputs) and all(b.is_shape(i) for i in n.inputs)
    if n.op in _SHAPE_ARITHMETIC:   # integer arithmetic only: a float Div is no integer division
        return shapes and not any(i in b.float_shapes for i in n.inputs)
    return n.op == "Concat" and shapes


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


def _input_const(b: _Builder, n: Node, k: int, what: str) -> Optional[np.ndarray]:
    """Input k of node n, read now: it must be a constant (None where absent)."""
    if len(n.inputs) <= k or not n.inputs[k]:
        return None
    const = b.constant(n.inputs[k])
    if const is None:
        raise ModelError(f"{b.where(n)}: {what} ({n.inputs[k]}) must be a constant (an initializer or a folded "
                         "subgraph), not computed at run time; `sparseconv run` runs such a model on the ONNX runner")
    return np.asarray(const)


def _ints(a: Optional[np.ndarray]) -> Optional[List[int]]:
    return None if a is None else [int(v) for v in a.reshape(-1)]


def _axes(b: _Builder, n: Node, k: int = 1) -> Optional[List[int]]:
    """Node n's axes: constant input k (newer opsets) or the attribute (older ones); None where neither."""
    axes = _ints(_input_const(b, n, k, "the axes"))
    return axes if axes is not None or "axes" not in n.attrs else [int(a) for a in n.attrs["axes"]]


def _rank(b: _Builder, n: Node, what: str) -> int:
    rank = b.rank(n.inputs[0])
    if rank is None:
        raise ModelError(f"{b.where(n)}: {what} needs the input's rank, which shape inference left open")
    return rank


def _dim(b: _Builder, n: Node, axis: int, what: str) -> int:
    """The size of axis `axis` of node n's input, which the graph must fix."""
    dims = b.program.shapes.get(n.inputs[0], ())
    size = dims[axis] if -len(dims) <= axis < len(dims) else None
    if not isinstance(size, int):
        raise ModelError(f"{b.where(n)}: {what} needs the size of axis {axis} of the input, which the graph "
                         "leaves free")
    return size


def _tensor(b: _Builder, n: Node, name: str) -> fx.Node:
    """Input `name` of node n, a tensor: shape values (from Shape) convert only
    through the operators of _shape_op."""
    if name in b.shape_values:
        raise ModelError(f"{b.where(n)}: {n.op} of a shape value (computed from a Shape node) does not convert; "
                         "`sparseconv run` computes it on the host")
    return b.value(name)


def _unary(fn: Callable[[Any], Any]) -> Callable[[_Builder, Node], fx.Node]:
    return lambda b, n: b.function(fn, _tensor(b, n, n.inputs[0]))


def _variadic(fn: Callable[[Any, Any], Any]) -> Callable[[_Builder, Node], fx.Node]:
    """Max / Min of any number of inputs, broadcast, folded pairwise as the runner does."""
    def convert(b: _Builder, n: Node) -> fx.Node:
        out = _tensor(b, n, n.inputs[0])
        for name in n.inputs[1:]:
            out = b.function(fn, out, _tensor(b, n, name))
        return out
    return convert


def onnx_prelu(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """ONNX PRelu with a slope broadcast to x (where it is not one per channel)."""
    return torch.where(x >= 0, x, x * slope)


def _prelu(b: _Builder, n: Node) -> fx.Node:
    """nn.PReLU where the slope is one value or one per channel (axis 1), else onnx_prelu."""
    slope, rank, x = b.constant(n.inputs[1]), b.rank(n.inputs[0]), b.value(n.inputs[0])
    if slope is not None and rank is not None and slope.ndim <= rank:
        aligned = (1,) * (rank - slope.ndim) + tuple(slope.shape)
        if slope.size == 1 or rank >= 2 and all(d == 1 for i, d in enumerate(aligned) if i != 1):
            prelu = nn.PReLU(slope.size)
            with torch.no_grad():
                prelu.weight.copy_(torch.tensor(np.asarray(slope, np.float32).reshape(-1)))
            return b.module(n, prelu, x)
    return b.function(onnx_prelu, x, b.value(n.inputs[1]))


def _gelu(n: Node) -> nn.Module:
    approximate = _text(n.attrs.get("approximate"), "none")
    if approximate not in ("none", "tanh"):
        raise ModelError(f"node {n.name} (Gelu): approximate {approximate!r} is not an ONNX value (none, tanh)")
    return nn.GELU(approximate=approximate)


def _transpose(b: _Builder, n: Node) -> fx.Node:
    perm = n.attrs.get("perm")
    if perm is None:  # ONNX: the axes reversed
        perm = range(_rank(b, n, "Transpose without perm") - 1, -1, -1)
    return b.function(torch.permute, _tensor(b, n, n.inputs[0]), tuple(int(p) for p in perm))


def _squeeze(b: _Builder, n: Node) -> fx.Node:
    axes, x = _axes(b, n), _tensor(b, n, n.inputs[0])
    return b.function(torch.squeeze, x) if axes is None else b.function(torch.squeeze, x, tuple(axes))


def _unsqueeze(b: _Builder, n: Node) -> fx.Node:
    axes = _axes(b, n)
    if axes is None:
        raise ModelError(f"{b.where(n)}: Unsqueeze needs its axes (the attribute, or a constant input)")
    if any(a < 0 for a in axes):  # counted in the output's rank
        rank = _rank(b, n, "a negative axis") + len(axes)
        axes = [a % rank for a in axes]
    out = b.value(n.inputs[0])
    for a in sorted(axes):
        out = b.function(torch.unsqueeze, out, a)
    return out


_BIG = 1 << 62  # ONNX's "to the end" bounds are INT64_MAX / INT64_MIN; clamped as the runner does


def _bounds(b: _Builder, n: Node, k: int, what: str) -> Optional[List[Any]]:
    """Slice's starts or ends (input k): constant ints, or the entries of an
    integer shape value as traced ints (torch.chunk and x[:x.size(0) - 1]
    export so); None where absent."""
    name = n.inputs[k] if len(n.inputs) > k else ""
    if name in b.shape_values and name not in b.float_shapes:
        length = b.shape_length(n, name)
        if length is None:
            raise ModelError(f"{b.where(n)}: {what} ({name}) must be 1-D, not a scalar")
        return [b.function(operator.getitem, b.shape_value(name), i) for i in range(length)]
    if name and b.constant(name) is None:
        raise ModelError(f"{b.where(n)}: {what} ({name}) must be a constant or computed from the input's shape "
                         "(Shape and integer arithmetic on it), not computed at run time from values; `sparseconv "
                         "run` runs such a model on the ONNX runner")
    return _ints(_input_const(b, n, k, what))


def _slice(b: _Builder, n: Node) -> fx.Node:
    """Slice (opset 10+) with constant bounds, clamped as Python slices are,
    or bounds computed from shapes (traced ints in Python slices); a
    negative step flips the axis (its size and the bounds must be fixed) and
    slices it forwards, since torch slices only forwards."""
    starts, ends = _bounds(b, n, 1, "the starts"), _bounds(b, n, 2, "the ends")
    if starts is None or ends is None:
        raise ModelError(f"{b.where(n)}: starts and ends as attributes (opset < 10) do not convert, as the runner "
                         "does not run them; export with opset 10 or later")
    axes, steps = _ints(_input_const(b, n, 3, "the axes")), _ints(_input_const(b, n, 4, "the steps"))
    index: Dict[int, slice] = {}
    flips = []
    for a, s, e, step in zip(range(len(starts)) if axes is None else axes, starts, ends, steps or [1] * len(starts)):
        a = a if a >= 0 else a + _rank(b, n, "a negative axis")
        s, e = (max(min(v, _BIG), -_BIG) if isinstance(v, int) else v for v in (s, e))
        if step > 0:
            index[a] = slice(s, e, step)
        elif step < 0:
            if not isinstance(s, int) or not isinstance(e, int):
                raise ModelError(f"{b.where(n)}: a negative step on axis {a} needs constant bounds, not ones "
                                 "computed from shapes")
            size = _dim(b, n, a, "a negative step")
            picked = range(*slice(s, e, step).indices(size))  # descending; after the flip, i is at size - 1 - i
            flips.append(a)
            index[a] = slice(size - 1 - picked[0], size - picked[-1], -step) if picked else slice(0, 0)
        else:
            raise ModelError(f"{b.where(n)}: a step of 0 on axis {a} is not an ONNX slice")
    x = b.value(n.inputs[0])
    if flips:
        x = b.function(torch.flip, x, tuple(flips))
    if not index:
        return x
    return b.function(operator.getitem, x, tuple(index.get(a, slice(None)) for a in range(max(index) + 1)))


def _pad(b: _Builder, n: Node) -> fx.Node:
    """Pad (opset 11+), constant mode, as torch's constant pad: negative pads crop."""
    mode = _text(n.attrs.get("mode"), "constant")
    if mode != "constant":  # runner.load_program refuses these first today
        raise ModelError(f"{b.where(n)}: Pad mode {mode!r} does not convert (constant does, as in the runner)")
    pads = _ints(_input_const(b, n, 1, "the pads"))
    if pads is None:
        raise ModelError(f"{b.where(n)}: pads as an attribute (opset < 11) do not convert, as the runner does not run "
                         "them; export with opset 11 or later")
    value = _input_const(b, n, 2, "the constant value")
    fill = 0.0 if value is None or value.size == 0 else float(value.reshape(-1)[0])
    axes = _ints(_input_const(b, n, 3, "the axes"))
    rank = b.rank(n.inputs[0])
    if rank is None:
        rank = _rank(b, n, "Pad with axes") if axes is not None else len(pads) // 2
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    if len(pads) != 2 * len(axes):
        raise ModelError(f"{b.where(n)}: {len(pads)} pads for {len(axes)} axes; ONNX wants a start and an end for each")
    before = dict(zip(axes, pads))
    after = dict(zip(axes, pads[len(axes):]))
    padded = [a for a in range(rank) if before.get(a, 0) or after.get(a, 0)]
    x = _tensor(b, n, n.inputs[0])
    if not padded:
        return x
    # F.pad's pairs run from the last axis back to the first padded one
    flat = [p for a in range(rank - 1, padded[0] - 1, -1) for p in (before.get(a, 0), after.get(a, 0))]
    return b.function(torch.nn.functional.pad, x, tuple(flat), value=fill)


def _split(b: _Builder, n: Node) -> List[fx.Node]:
    """Split: one torch.split, and one getitem per output. Sizes from the
    constant input (opset 13+) or the attribute, else equal parts, the last
    one smaller (opset 18), of an axis the graph fixes."""
    axis = int(n.attrs.get("axis", 0))
    axis = axis if axis >= 0 else axis + _rank(b, n, "a negative axis")
    sizes = _ints(_input_const(b, n, 1, "the split sizes"))
    if sizes is None and "split" in n.attrs:
        sizes = [int(v) for v in n.attrs["split"]]
    dims = b.program.shapes.get(n.inputs[0], ())
    size = dims[axis] if axis < len(dims) and isinstance(dims[axis], int) else None
    if sizes is None:
        part = -(-_dim(b, n, axis, "a split into equal parts") // len(n.outputs))
        sizes = [min(part, size - i * part) for i in range(len(n.outputs))]
    if len(sizes) != len(n.outputs) or min(sizes) < 0 or size is not None and sum(sizes) != size:
        raise ModelError(f"{b.where(n)}: sizes {sizes} do not split axis {axis} (size {size}) into "
                         f"{len(n.outputs)} outputs")
    parts = b.function(torch.split, _tensor(b, n, n.inputs[0]), sizes, axis)
    return [b.function(operator.getitem, parts, i) for i in range(len(sizes))]


def _gather(b: _Builder, n: Node) -> fx.Node:
    """Gather of a tensor by constant indices: x[..., indices, ...] at the
    axis (negative indices count from the end); a scalar index drops it."""
    idx = _input_const(b, n, 1, "the indices")
    if idx is None:
        raise ModelError(f"{b.where(n)}: Gather without indices")
    axis = int(n.attrs.get("axis", 0))
    axis = axis if axis >= 0 else axis + _rank(b, n, "a negative axis")
    key = int(idx) if idx.ndim == 0 else b.buffer(n, "indices", idx.astype(np.int64))
    return b.function(operator.getitem, b.value(n.inputs[0]), (slice(None),) * axis + (key,))


def _cast(b: _Builder, n: Node) -> fx.Node:
    """Cast of a tensor to a float type: the tensor as it is (float32), as
    the runner keeps its float type. (Casts of shape values: _shape_op.)"""
    from onnx import helper

    target = np.dtype(helper.tensor_dtype_to_np_dtype(int(n.attrs["to"])))
    if target.kind != "f":
        raise ModelError(f"{b.where(n)}: a Cast of a tensor to {target} does not convert (casts to a float type and "
                         "casts of shape values do)")
    return b.value(n.inputs[0])


def _reduce(b: _Builder, n: Node) -> fx.Node:
    """ReduceSum / ReduceMax: axes from the attribute or a constant input;
    none means every axis, or none at all with noop_with_empty_axes."""
    axes, x = _axes(b, n), _tensor(b, n, n.inputs[0])
    if not axes:
        if int(n.attrs.get("noop_with_empty_axes", 0)):
            return x
        axes = list(range(_rank(b, n, f"{n.op} over every axis")))
    fn = torch.sum if n.op == "ReduceSum" else torch.amax
    return b.function(fn, x, tuple(axes), keepdim=bool(int(n.attrs.get("keepdims", 1))))


def depth_to_space_dcr(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """ONNX DepthToSpace, DCR mode: channel (i * bs + j) * C + c goes to row i,
    column j of channel c's blocks. (CRD mode is nn.PixelShuffle.)"""
    y = x.unflatten(1, (blocksize, blocksize, -1)).permute(0, 3, 4, 1, 5, 2)   # N, C, H, bs, W, bs
    return y.flatten(4, 5).flatten(2, 3)


def space_to_depth(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """ONNX SpaceToDepth: row i, column j of each block goes to channel
    (i * bs + j) * C + c (not nn.PixelUnshuffle's c * bs * bs + i * bs + j)."""
    y = x.unflatten(3, (-1, blocksize)).unflatten(2, (-1, blocksize)).permute(0, 3, 5, 1, 2, 4)  # N, bs, bs, C, H, W
    return y.flatten(1, 3)


def _depth_to_space(b: _Builder, n: Node) -> fx.Node:
    blocksize, x = int(n.attrs["blocksize"]), b.value(n.inputs[0])
    if _text(n.attrs.get("mode"), "DCR") == "CRD":
        return b.module(n, nn.PixelShuffle(blocksize), x)
    return b.function(depth_to_space_dcr, x, blocksize)


def lerp_axis(x: torch.Tensor, axis: int, lo: torch.Tensor, hi: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One axis of a linear resize from the runner's tables: rows lo and hi mixed by w."""
    return x.index_select(axis, lo) * (1 - w) + x.index_select(axis, hi) * w


def _interpolate_picks(h: int, w: int, scales: Sequence[float], rows: np.ndarray, cols: np.ndarray) -> bool:
    """Whether F.interpolate(scale_factor=scales[2:], mode="nearest") picks these
    rows and columns. Its float32 arithmetic (1 / scale, times the output
    position) can land across a pixel's edge from the runner's float64
    quotient where the scale is not exact in binary (1.2). Tried on an index
    ramp."""
    ramp = torch.arange(h * w, dtype=torch.float64).reshape(1, 1, h, w)
    got = torch.nn.functional.interpolate(ramp, scale_factor=tuple(scales[2:]), mode="nearest")[0, 0].numpy()
    want = np.arange(h * w).reshape(h, w)[np.ix_(rows, cols)]
    return got.shape == want.shape and bool((got == want).all())


def _upsample(b: _Builder, n: Node) -> fx.Node:
    """Upsample (opsets 7-9) as the runner runs it: Resize with asymmetric
    coordinates, nearest (floor) or linear, along each axis whose scale is
    not 1, to floor(size * scale). Nearest is F.interpolate where torch picks
    the same pixels (scales on H and W exact in binary: 2, 1.5), else an
    index_select per axis; linear is the runner's index and weight tables
    (lerp_axis): F.interpolate has no asymmetric coordinates."""
    const = _input_const(b, n, 1, "the scales")
    if const is None and "scales" not in n.attrs:
        raise ModelError(f"{b.where(n)}: Upsample needs its scales (the attribute, or a constant input)")
    scales = [float(s) for s in np.asarray(n.attrs["scales"] if const is None else const, np.float64).reshape(-1)]
    rank = _rank(b, n, "Upsample")
    if len(scales) != rank:
        raise ModelError(f"{b.where(n)}: {len(scales)} scales for an input of rank {rank}")
    coords = {}  # axis -> (its size, the input coordinate of each output position)
    for a, s in enumerate(scales):
        if s != 1.0:
            size = _dim(b, n, a, f"a scale of {s}")
            coords[a] = (size, np.arange(int(np.floor(size * s)), dtype=np.float64) / s)
    x = b.value(n.inputs[0])
    if _text(n.attrs.get("mode"), "nearest") == "nearest":
        index = {a: np.clip(np.floor(src), 0, size - 1).astype(np.int64) for a, (size, src) in coords.items()}
        if index and rank == 4 and set(index) <= {2, 3}:
            h, w = (_dim(b, n, a, "Upsample") for a in (2, 3))
            if _interpolate_picks(h, w, scales, index.get(2, np.arange(h)), index.get(3, np.arange(w))):
                return b.function(torch.nn.functional.interpolate, x, scale_factor=tuple(scales[2:]), mode="nearest")
        for a, idx in index.items():
            x = b.graph.call_method("index_select", (x, a, b.buffer(n, f"index{a}", idx)))
        return x
    for a, (size, src) in coords.items():
        lo = np.floor(src)
        shape = [1] * rank
        shape[a] = len(src)
        x = b.function(lerp_axis, x, a, b.buffer(n, f"lo{a}", np.clip(lo, 0, size - 1).astype(np.int64)),
                       b.buffer(n, f"hi{a}", np.clip(lo + 1, 0, size - 1).astype(np.int64)),
                       b.buffer(n, f"weight{a}", (src - lo).reshape(shape).astype(np.float32)))
    return x


def _norm_params(b: _Builder, n: Node, names: Sequence[str]) -> List[Optional[np.ndarray]]:
    """The constant scale (and bias) of a normalization, as float32."""
    params = [_input_const(b, n, k, f"the {name}") for k, name in enumerate(names, 1)]
    if params[0] is None:
        raise ModelError(f"{b.where(n)}: the scale is missing")
    return [None if p is None else np.asarray(p, np.float32) for p in params]


def _instance_norm(b: _Builder, n: Node) -> fx.Node:
    scale, bias = _norm_params(b, n, ("scale", "bias"))
    rank = _rank(b, n, "InstanceNormalization")
    kinds = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}
    if rank not in kinds or bias is None:
        raise ModelError(f"{b.where(n)}: only 3-D to 5-D inputs with a scale and a bias convert, got rank {rank}")
    norm = kinds[rank](scale.size, eps=float(n.attrs.get("epsilon", 1e-5)), affine=True)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(scale.reshape(-1)))
        norm.bias.copy_(torch.tensor(bias.reshape(-1)))
    return b.module(n, norm.eval(), b.value(n.inputs[0]))


def _layer_norm(b: _Builder, n: Node) -> fx.Node:
    """LayerNormalization (opset 17): nn.LayerNorm over the axes from `axis`
    on, whose sizes the graph must fix; the scale and bias broadcast to them."""
    rank = _rank(b, n, "LayerNormalization")
    axis = int(n.attrs.get("axis", -1)) % rank
    shape = tuple(_dim(b, n, a, "LayerNormalization") for a in range(axis, rank))
    params = []
    for p in _norm_params(b, n, ("scale", "bias")):
        while p is not None and len(shape) < p.ndim <= rank and p.shape[0] == 1:
            p = p[0]
        try:
            params.append(None if p is None else np.broadcast_to(p, shape))
        except ValueError:
            raise ModelError(f"{b.where(n)}: a scale or bias of shape {p.shape} does not broadcast to the "
                             f"normalized shape {shape}") from None
    norm = nn.LayerNorm(shape, eps=float(n.attrs.get("epsilon", 1e-5)), bias=params[1] is not None)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(np.array(params[0])))
        if params[1] is not None:
            norm.bias.copy_(torch.tensor(np.array(params[1])))
    return b.module(n, norm.eval(), b.value(n.inputs[0]))


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[[_Builder, Node], fx.Node]:
    """Add / Sub / Mul / Div / Pow of tensors (of shape values: _shape_op)."""
    return lambda b, n: b.function(fn, _tensor(b, n, n.inputs[0]), _tensor(b, n, n.inputs[1]))


def _modular(make: Callable[[Node], nn.Module]) -> Callable[[_Builder, Node], fx.Node]:
    return lambda b, n: b.module(n, make(n), b.value(n.inputs[0]))


def _hard_sigmoid(n: Node) -> nn.Module:
    alpha, beta = float(n.attrs.get("alpha", 0.2)), float(n.attrs.get("beta", 0.5))
    if abs(alpha - 1 / 6) > 1e-7 or beta != 0.5:
        raise ModelError(f"node {n.name} (HardSigmoid): only alpha 1/6 and beta 0.5 (torch's Hardsigmoid) convert")
    return nn.Hardsigmoid()


# ONNX operator -> how it enters the graph: the fx value of the node's output,
# or a list of them, one per output (Split).
CONVERTERS: Dict[str, Callable[[_Builder, Node], Any]] = {
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
    "Shape": _shape_op,   # and Gather / Unsqueeze / Slice / Concat / Cast / Add / Sub / Mul / Div on shapes
    "Abs": _unary(torch.abs),
    "Neg": _unary(torch.neg),
    "Exp": _unary(torch.exp),
    "Sqrt": _unary(torch.sqrt),
    "Reciprocal": _unary(torch.reciprocal),
    "Floor": _unary(torch.floor),
    "Ceil": _unary(torch.ceil),
    "Erf": _unary(torch.erf),
    "Pow": _binary(torch.pow),
    "Max": _variadic(torch.maximum),
    "Min": _variadic(torch.minimum),
    "Elu": _modular(lambda n: nn.ELU(float(n.attrs.get("alpha", 1.0)))),
    "Softplus": _modular(lambda n: nn.Softplus()),   # linear above 20, where log(1 + e^x) rounds to x in float32
    "Gelu": _modular(_gelu),
    "PRelu": _prelu,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Slice": _slice,
    "Pad": _pad,
    "Split": _split,
    "Gather": _gather,
    "Cast": _cast,
    "ReduceSum": _reduce,
    "ReduceMax": _reduce,
    "DepthToSpace": _depth_to_space,
    "SpaceToDepth": lambda b, n: b.function(space_to_depth, b.value(n.inputs[0]), int(n.attrs["blocksize"])),
    "Upsample": _upsample,
    "InstanceNormalization": _instance_norm,
    "LayerNormalization": _layer_norm,
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
        if len(n.outputs) > 1 and any(n.outputs[1:]) and n.op not in ("Dropout", "Split"):
            raise ModelError(f"{builder.where(n)}: only its first output converts")
        out = convert(builder, n)
        if isinstance(out, list):   # one value per output
            builder.values.update(zip(n.outputs, out))
        else:
            builder.values[n.outputs[0]] = out
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
