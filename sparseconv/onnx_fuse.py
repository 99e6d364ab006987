"""The ONNX front end's graph passes: fold BatchNormalization into the Conv
before it, and fuse Conv -> (BatchNormalization) -> (Add of a same-shape
residual) -> (Relu | Clip with constant bounds) -> (MaxPool 2x2 of stride 2,
not after an Add) chains into one Conv whose kernel applies the epilogue at
the store (shapes.Epilogue). The ONNX twin of fx.py's passes (the pool under
fx._fused_pool's conditions); compile_model (runner.py) runs it at load time.

    fused = fuse_program(load_program(path))   # OnnxProgram -> OnnxProgram

The result is a program like any other: execute() and run_reference() run it
(in float64 too), and its plan says per conv what was fused. The original
program is left as it was: `sparseconv run --check` evaluates that one, the
real model. In the fused program, a Conv that absorbed nodes
  * keeps op "Conv" and its name; its layer in program.convs is a FusedConv
    (BN folded into weight and bias, the epilogue, what was fused);
  * writes the chain's last output (a fused MaxPool's Y: the kernel writes
    the pooled tensor), at the place of the chain's last node in the node
    order (where the residual is known to exist);
  * reads the residual, if any, as its 4th input: (x, W, B, residual).
Only values with one consumer that are not graph outputs are fused through,
so no tensor a later node or the caller reads disappears.

This module sits below runner.py (runner imports it), so it names the
program's types by protocol only.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Set, Tuple, TypeVar

import numpy as np

from .dense import fold_batchnorm
from .model import ConvLayer
from .shapes import Epilogue

Dim = Any  # an inferred dimension: int, a symbolic name (str), or None when unknown


@dataclass(frozen=True)
class FusedConv(ConvLayer):
    """A Conv layer of a fused program: weight and bias with any BatchNorm
    folded in, the epilogue its kernel applies, and what was fused, in order
    ("bn", "add", "relu", "relu6", "clip", "maxpool": fx's words). With a
    pool the kernel writes the pooled tensor (Epilogue.output_hw), not
    shape.out_h x out_w. `note`: why the chain stopped
    where a fusable node followed but could not fuse ("" otherwise)."""

    epilogue: Epilogue = Epilogue()
    fused: Tuple[str, ...] = ()
    note: str = ""

    def describe_fusion(self) -> str:
        """', fused bn+add+relu', with the note in brackets; '' for nothing to say."""
        text = f", fused {'+'.join(self.fused)}" if self.fused else ""
        return text + (f" ({self.note})" if self.note else "")


class _Node(Protocol):  # runner.Node
    @property
    def op(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> Tuple[str, ...]: ...
    @property
    def outputs(self) -> Tuple[str, ...]: ...
    @property
    def attrs(self) -> Dict[str, Any]: ...


class _Program(Protocol):  # runner.OnnxProgram
    @property
    def nodes(self) -> Tuple[Any, ...]: ...
    @property
    def constants(self) -> Dict[str, np.ndarray]: ...
    @property
    def output_names(self) -> Tuple[str, ...]: ...
    @property
    def convs(self) -> Dict[str, ConvLayer]: ...
    @property
    def shapes(self) -> Dict[str, Tuple[Dim, ...]]: ...


P = TypeVar("P", bound=_Program)

# Where a fused Conv node reads its residual: after ONNX Conv's X, W, B.
RESIDUAL_INPUT = 3


def value_shapes(graph: Any) -> Dict[str, Tuple[Dim, ...]]:
    """Value name -> inferred shape (int, symbolic name or None per
    dimension) of an onnx.GraphProto after shape inference; values without
    shape information are left out."""
    shapes: Dict[str, Tuple[Dim, ...]] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                    for d in t.shape.dim)
    return shapes


class _Uses:
    """Who reads each value: fusing through a value is safe only when one
    node reads it, once, and it is not a graph output."""

    def __init__(self, nodes: Sequence[_Node], outputs: Sequence[str]) -> None:
        self.count: Counter = Counter(i for n in nodes for i in n.inputs if i)
        self.readers: Dict[str, List[_Node]] = {}
        for n in nodes:
            for i in dict.fromkeys(n.inputs):
                if i:
                    self.readers.setdefault(i, []).append(n)
        self.outputs = set(outputs)

    def sole_reader(self, value: str) -> Optional[_Node]:
        if value in self.outputs or self.count[value] != 1:
            return None
        return self.readers[value][0]

    def why_not(self, value: str, what: str) -> str:
        """Why `what` (the node that reads `value`) cannot fuse through it."""
        if value in self.outputs:
            return f"not {what}: {value} is a graph output"
        return f"not {what}: {value} has {self.count[value]} readers"


def _fold(layer: ConvLayer, bn: _Node, constants: Mapping[str, np.ndarray]
          ) -> Tuple[Optional[Tuple[np.ndarray, np.ndarray]], str]:
    """The layer's (weight, bias) float32 with BatchNormalization `bn` folded
    in, or None and why it cannot fold (then it stays a CuPy op)."""
    k = layer.shape.out_channels
    if len(bn.inputs) < 5 or not all(i in constants for i in bn.inputs[1:5]):
        return None, "its scale, bias, mean or variance is computed at run time"
    if int(bn.attrs.get("training_mode", 0)) or any(bn.outputs[1:]):
        return None, "it runs in training mode"
    if not int(bn.attrs.get("spatial", 1)):
        return None, "spatial=0 (per-pixel statistics)"
    params = [np.asarray(constants[i]) for i in bn.inputs[1:5]]
    if any(p.dtype.kind != "f" or p.shape != (k,) for p in params):
        return None, f"its parameters are not {k} floats each (one per output channel)"
    with np.errstate(all="ignore"):  # a zero variance or an overflow shows as non-finite, refused below
        w, b = fold_batchnorm(layer.weight, layer.bias, *params, float(bn.attrs.get("epsilon", 1e-5)))
        w32, b32 = w.astype(np.float32), b.astype(np.float32)
    if not (np.isfinite(w32).all() and np.isfinite(b32).all()):
        return None, "folding gives weights or biases that are not finite float32 (variance + epsilon <= 0?)"
    return (w32, b32), ""


def _clip_bounds(node: _Node, constants: Mapping[str, np.ndarray]) -> Optional[Tuple[float, float]]:
    """(lo, hi) of a Clip whose bounds are constants (inputs since opset 11,
    attributes before), None when one is computed at run time."""
    bounds = [float(node.attrs.get("min", -math.inf)), float(node.attrs.get("max", math.inf))]
    for slot, name in enumerate(node.inputs[1:3]):
        if not name:
            continue
        if name not in constants or np.asarray(constants[name]).size != 1:
            return None
        bounds[slot] = float(np.asarray(constants[name]).reshape(()))
    return bounds[0], bounds[1]


def _activation(node: _Node, constants: Mapping[str, np.ndarray]) -> Tuple[Optional[Epilogue], str]:
    """The epilogue activation a Relu or Clip node is, or None and why not."""
    if node.op == "Relu":
        return Epilogue("relu"), ""
    bounds = _clip_bounds(node, constants)
    if bounds is None:
        return None, "its bounds are computed at run time"
    lo, hi = bounds
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        return None, f"its bounds ({lo}, {hi}) are not an interval"
    if (lo, hi) == (0.0, math.inf):
        return Epilogue("relu"), ""
    if (lo, hi) == (0.0, 6.0):
        return Epilogue("relu6"), ""
    return Epilogue("clip", (lo, hi)), ""


def _residual(add: _Node, value: str, conv_out: Tuple[Dim, ...], shapes: Mapping[str, Tuple[Dim, ...]],
              constants: Mapping[str, np.ndarray]) -> Tuple[Optional[str], str]:
    """The other operand of Add `add` when it is a residual the kernel can
    read: a computed tensor of the conv output's own shape. A broadcast add
    (a bias map, a scalar) or a constant is not one."""
    if len(add.inputs) != 2 or value not in add.inputs:
        return None, "not a two-input add"
    other = add.inputs[1] if add.inputs[0] == value else add.inputs[0]
    if other in constants:
        return None, "it adds a constant, not a residual"
    shape = tuple(shapes.get(other, ()))
    # Channels and size must be known and equal; the batch dimensions equal
    # as inferred (the same number or symbol, or unknown on both sides:
    # both come from the one graph input, and the kernel checks at run time).
    if len(shape) != 4 or len(conv_out) != 4 or shape[0] != conv_out[0] or \
            not all(isinstance(d, int) and d == e for d, e in zip(shape[1:], conv_out[1:])):
        return None, f"the other operand {other} has shape {list(shape) or 'unknown'}, not the conv output's"
    return other, ""


def _pool_refusal(pool: _Node, value: str, conv_hw: Tuple[int, int], uses: _Uses) -> str:
    """Why MaxPool `pool`, the sole reader of `value`, is not the epilogue's
    pool; "" when it is. fx._fused_pool's conditions: a 2x2 window at stride
    2, no pads or dilation, ceil_mode only where both sides of the conv's
    output are even (then it pools as floor mode does); and no one reads its
    Indices, which the kernel does not write."""
    if pool.inputs[:1] != (value,):
        return "not a pool of the conv's output"
    if any(o and (uses.count[o] or o in uses.outputs) for o in pool.outputs[1:]):
        return "its Indices output is read"
    a = pool.attrs
    window = [list(a.get(k, d)) for k, d in (("kernel_shape", ()), ("strides", (1, 1)), ("pads", (0, 0, 0, 0)),
                                              ("dilations", (1, 1)))]
    # auto_pad (refused by load_program for pools today) would pad implicitly
    if window != [[2, 2], [2, 2], [0, 0, 0, 0], [1, 1]] or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return (f"kernel_shape {window[0]}, strides {window[1]}, pads {window[2]}: not a 2x2 window at stride 2 "
                "without pads")
    if int(a.get("storage_order", 0)):
        return "storage_order=1"
    h, w = conv_hw
    if int(a.get("ceil_mode", 0)) and (h % 2 or w % 2):
        return f"ceil_mode=1 on a {h}x{w} input (an odd side: a partial window)"
    return ""


def _chain(conv: _Node, layer: ConvLayer, uses: _Uses, claimed: Set[int], constants: Mapping[str, np.ndarray],
           shapes: Mapping[str, Tuple[Dim, ...]]) -> Tuple[List[_Node], FusedConv, str]:
    """The nodes after `conv` that fuse into it, the fused layer, and the
    residual's value name ("" when none)."""
    chain: List[_Node] = []
    w, b = layer.weight, layer.bias
    fused: List[str] = []
    residual, act, note = "", Epilogue(), ""
    cur = conv.outputs[0]
    conv_out = (shapes.get(cur, (None,))[0], layer.shape.out_channels, layer.shape.out_h, layer.shape.out_w)

    def next_node(ops: Tuple[str, ...]) -> Optional[_Node]:
        """The sole reader of `cur` if it is one of `ops` and unclaimed; a
        note when a reader of those ops exists but cannot fuse."""
        nonlocal note
        nxt = uses.sole_reader(cur)
        if nxt is not None and nxt.op in ops and id(nxt) not in claimed:
            return nxt
        candidates = [n for n in uses.readers.get(cur, []) if n.op in ops]
        if nxt is None and candidates and not note:
            note = uses.why_not(cur, candidates[0].name)
        return None

    nxt = next_node(("BatchNormalization", "Add", "Relu", "Clip", "MaxPool"))
    if nxt is not None and nxt.op == "BatchNormalization":
        folded, why = _fold(layer, nxt, constants) if nxt.inputs[0] == cur else (None, "")
        if folded is None:
            note = note or f"{nxt.name} not folded: {why}"
            nxt = None
        else:
            (w, b), cur = folded, nxt.outputs[0]
            chain.append(nxt)
            fused.append("bn")
            nxt = next_node(("Add", "Relu", "Clip", "MaxPool"))
    if nxt is not None and nxt.op == "Add":
        other, why = _residual(nxt, cur, conv_out, shapes, constants)
        if other is None:
            note = note or f"not {nxt.name}: {why}"
            nxt = None
        else:
            residual, cur = other, nxt.outputs[0]
            chain.append(nxt)
            fused.append("add")
            nxt = next_node(("Relu", "Clip", "MaxPool"))
    if nxt is not None and nxt.op in ("Relu", "Clip") and nxt.inputs[0] == cur:
        ep, why = _activation(nxt, constants)
        if ep is None:
            note = note or f"not {nxt.name}: {why}"
            nxt = None
        else:
            act, cur = ep, nxt.outputs[0]
            chain.append(nxt)
            fused.append(ep.activation)
            nxt = next_node(("MaxPool",))
    pool = False
    if nxt is not None and nxt.op == "MaxPool":
        # Not after an Add, as in fx: the residual is read at the conv's shape, the kernel writes the pool's.
        why = "a pool after a residual add is not fused" if residual else \
            _pool_refusal(nxt, cur, (layer.shape.out_h, layer.shape.out_w), uses)
        if why:
            note = note or f"not {nxt.name}: {why}"
        else:
            pool = True
            chain.append(nxt)
            fused.append("maxpool")
    epilogue = Epilogue(act.activation, act.clip, bool(residual), pool)
    return chain, FusedConv(layer.name, w, b, layer.shape, epilogue, tuple(fused), note), residual


def fuse_program(program: P) -> P:
    """The program with every Conv's chain folded and fused (see the module
    docstring); every conv layer becomes a FusedConv, those with nothing
    fused keep their weights and a default epilogue."""
    nodes = list(program.nodes)
    uses = _Uses(nodes, program.output_names)
    claimed: Set[int] = set()                 # id() of every node absorbed by a chain (names need not be unique)
    place: Dict[int, Any] = {}                # id() of a chain's last node -> the fused Conv node that replaces it
    convs: Dict[str, ConvLayer] = dict(program.convs)
    for node in nodes:
        if node.op != "Conv":
            continue
        chain, layer, residual = _chain(node, program.convs[node.name], uses, claimed, program.constants,
                                        program.shapes)
        convs[node.name] = layer
        if not chain:
            continue
        claimed.update(id(n) for n in [node] + chain)
        inputs = tuple(node.inputs[:RESIDUAL_INPUT]) + ("",) * (RESIDUAL_INPUT - len(node.inputs[:RESIDUAL_INPUT]))
        place[id(chain[-1])] = replace(node, inputs=inputs + ((residual,) if residual else ()),
                                       outputs=(chain[-1].outputs[0],))
    out = [place.get(id(n), n) for n in nodes if id(n) in place or id(n) not in claimed]
    return replace(program, nodes=tuple(out), convs=convs)


def fusion_totals(fused: Sequence[Tuple[str, ...]]) -> str:
    """One line from what fused into each conv (("bn", "relu"), ...): the
    BatchNorms folded, the adds, activations and (where any) max pools
    fused, into how many convs. The fx front end's plan (onnx_fx.py) says it
    the same way."""
    count = Counter(part for parts in fused for part in parts)
    acts = sum(count[a] for a in ("relu", "relu6", "clip"))
    what = f"{count['add']} residual adds and {acts} activations"
    if count["maxpool"]:
        what = f"{count['add']} residual adds, {acts} activations and {count['maxpool']} max pools"
    return (f"{count['bn']} BatchNormalization folded, {what} "
            f"fused into the conv kernels ({sum(bool(parts) for parts in fused)} of {len(fused)} convs)")


def fusion_lines(convs: Mapping[str, ConvLayer]) -> List[str]:
    """For the CLI: the totals, then per conv what fused into it (and why a
    chain stopped); nothing when no conv is a FusedConv."""
    fused = {n: layer for n, layer in convs.items() if isinstance(layer, FusedConv)}
    if not fused:
        return []
    lines = [fusion_totals([layer.fused for layer in fused.values()])]
    lines += [f"  {n}: {'+'.join(layer.fused) or 'nothing'}" + (f" ({layer.note})" if layer.note else "")
              for n, layer in fused.items() if layer.fused or layer.note]
    return lines
