"""Model import: the conv layers of a pruned model file, as weights + shapes.

Formats (detected from the extension or the file's first bytes; `fmt` overrides):
  * onnx  : Conv nodes; strides/pads/dilations/group from attributes, weights and
            biases from initializers, Constant nodes or static subgraphs (folded
            once by onnx's ReferenceEvaluator), input sizes from the graph's
            shapes (onnx shape inference with data propagation).
  * npz         : NumPy archive, no pickle.
  * safetensors : safetensors file (read as NumPy, no torch needed).
  * torch       : PyTorch checkpoint, read with torch.load(weights_only=True)
                  only; a state dict (or {"state_dict": ...}).
For these three, weights are looked up per layer as `<layer>`, `<layer>.weight`
or `<layer>.weight_orig` x `<layer>.weight_mask` (torch.nn.utils.prune), the
bias as `<layer>.bias`, and the shapes come from a layer spec: an entry
`__spec__` (UTF-8 JSON bytes, as models/make_pruned_zoo.py writes) or a
separate JSON file (`spec_path`).
A layer spec is a JSON list of {"name", "in_h", "in_w", "stride", "padding",
"dilation", "groups"} (the last four optional, ints or pairs).

Every problem raises ModelError naming the file and the layer."""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .limits import check_indexing
from .shapes import ConvShape, shape_from_weight

FORMATS = ("onnx", "npz", "safetensors", "torch")
# Layer names become part of artifact file names (slugged), but names that try
# to walk the file system are refused outright.
_BAD_NAME = re.compile(r"(^|[\\/])\.\.([\\/]|$)|[\x00-\x1f]")


class ModelError(ValueError):
    """Bad model input: says which file, which layer, what was expected."""


def _why(exc: BaseException) -> str:
    """A library's exception in a few words: its type and first sentence
    (torch and onnx append paragraphs of advice that would bury ours)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text.split(". ")[0]
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def numpy_why(exc: BaseException) -> str:
    """Why np.load(allow_pickle=False) failed. NumPy answers any file it does
    not recognise by suggesting allow_pickle=True; that advice is wrong here."""
    if "pickle" in str(exc):
        return "not a NumPy .npy/.npz file, or one holding Python objects, which sparseconv never unpickles"
    return _why(exc)


@dataclass(frozen=True)
class ConvLayer:
    name: str
    weight: np.ndarray            # (K, C/groups, R, S) float32
    bias: Optional[np.ndarray]    # (K,) float32 or None
    shape: ConvShape

    @property
    def sparsity(self) -> float:
        return 1.0 - np.count_nonzero(self.weight) / self.weight.size


@dataclass(frozen=True)
class PrunedModel:
    path: Path
    format: str
    layers: List[ConvLayer]


def detect_format(path: Path) -> str:
    suffix = path.suffix.lower()
    by_suffix = {".onnx": "onnx", ".npz": "npz", ".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}
    if suffix in by_suffix:
        return by_suffix[suffix]
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":  # a zip: NumPy .npz or PyTorch's zip checkpoint
        try:
            names = zipfile.ZipFile(path).namelist()
        except zipfile.BadZipFile:
            names = []
        return "torch" if any(n.endswith("data.pkl") for n in names) else "npz"
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: u64 header length, then JSON
        return "safetensors"
    raise ModelError(f"{path}: cannot tell the model format from the extension {suffix!r} or its first bytes; "
                     f"pass --format ({' or '.join(FORMATS)})")


def slug(name: str) -> str:
    """A file-name-safe version of a layer name (ONNX names look like /layer1/conv/Conv)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "layer"


def check_layer_name(path: Path, name: str) -> None:
    if not name or _BAD_NAME.search(name):
        raise ModelError(f"{path}: layer name {name!r} contains '..' path segments or control characters; "
                         "rename the layer")


def load_model(path: Path, fmt: Optional[str] = None, spec_path: Optional[Path] = None,
               input_size: Optional[Tuple[int, int]] = None) -> PrunedModel:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise ModelError(f"{path}: the file is empty; expected a model ({' or '.join(FORMATS)})")
    fmt = fmt or detect_format(path)
    if fmt == "onnx":
        layers = read_onnx(path, input_size).layers
    elif fmt in ("npz", "safetensors", "torch"):
        arrays = {"npz": _read_npz, "safetensors": _read_safetensors, "torch": _read_torch}[fmt](path)
        layers = _layers_from_arrays(path, arrays, spec_path, input_size)
    else:
        raise ModelError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not layers:
        raise ModelError(f"{path}: the model has no Conv layer; nothing to compile")
    check_names(path, layers)
    return PrunedModel(path, fmt, layers)


def check_names(path: Path, layers: List[ConvLayer]) -> None:
    """Layer names must be unique, also once made file-name safe, and never walk the file system."""
    names = [layer.name for layer in layers]
    for name in names:
        check_layer_name(path, name)
    if len(set(names)) != len(names):
        raise ModelError(f"{path}: duplicate layer names: {sorted({n for n in names if names.count(n) > 1})}")
    if len({slug(n) for n in names}) != len(names):
        raise ModelError(f"{path}: layer names collide once made file-name safe; rename the layers")


def _float_array(path: Path, layer: str, what: str, a: Any) -> np.ndarray:
    """The array as float32. Finite values too large for float32 are refused
    here, so that they are not later reported as NaN or Inf."""
    arr = np.asarray(a)
    if arr.dtype.kind != "f":
        raise ModelError(f"{path}: layer {layer}: {what} must be floating point, got {arr.dtype}")
    if arr.dtype.itemsize > 4 and arr.size:
        finite = arr[np.isfinite(arr)]
        biggest = float(np.abs(finite).max()) if finite.size else 0.0
        if biggest > float(np.finfo(np.float32).max):
            raise ModelError(f"{path}: layer {layer}: {what} has finite values up to {biggest:.3g}, beyond "
                             f"float32's {float(np.finfo(np.float32).max):.3g}; the kernels compute in float32")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _make_layer(path: Path, name: str, weight: np.ndarray, bias: Optional[np.ndarray],
                hw: Tuple[int, int], stride: Any, padding: Any, dilation: Any, groups: Any) -> ConvLayer:
    try:
        shape = shape_from_weight(weight, hw, stride, padding, dilation, groups)
        check_indexing(shape)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: layer {name}: {exc}") from None
    if bias is not None and bias.shape != (shape.out_channels,):
        raise ModelError(f"{path}: layer {name}: bias must have shape ({shape.out_channels},), got {bias.shape}")
    return ConvLayer(name, weight, bias, shape)


# --------------------------------------------------------------------------- npz

def _read_npz(path: Path) -> Dict[str, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
        return {k: archive[k] for k in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ModelError(f"{path}: not a readable .npz archive ({numpy_why(exc)})") from None


def _read_safetensors(path: Path) -> Dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ModelError(f"{path}: reading safetensors needs the safetensors package: "
                         "pip install 'sparseconv[safetensors]'") from None
    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError, OSError, ...
        raise ModelError(f"{path}: not a readable safetensors file ({_why(exc)})") from None


def _read_torch(path: Path) -> Dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ModelError(f"{path}: reading PyTorch checkpoints needs torch: pip install 'sparseconv[torch]'") from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # never retried with weights_only=False: that would run arbitrary pickle code
        raise ModelError(f"{path}: cannot load it with torch.load(weights_only=True) ({_why(exc)}); sparseconv "
                         "never unpickles arbitrary objects: save a plain state dict") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    out: Dict[str, np.ndarray] = {}
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            out[str(k)] = v.detach().cpu().numpy()
        elif k == "__spec__" and isinstance(v, str):
            out[k] = np.frombuffer(v.encode(), np.uint8)
    return out


def _layer_weight(path: Path, arrays: Dict[str, np.ndarray], name: str) -> np.ndarray:
    for key in (name, f"{name}.weight"):
        if key in arrays:
            return _float_array(path, name, "weight", arrays[key])
    orig, mask = arrays.get(f"{name}.weight_orig"), arrays.get(f"{name}.weight_mask")
    if orig is not None and mask is not None:
        if orig.shape != mask.shape:
            raise ModelError(f"{path}: layer {name}: weight_orig {orig.shape} and weight_mask {mask.shape} differ")
        return _float_array(path, name, "weight", orig * mask)
    raise ModelError(f"{path}: layer {name} is in the spec but has no weight ({name}, {name}.weight or "
                     f"{name}.weight_orig + {name}.weight_mask)")


def _layers_from_arrays(path: Path, arrays: Dict[str, np.ndarray], spec_path: Optional[Path],
                        input_size: Optional[Tuple[int, int]]) -> List[ConvLayer]:
    if spec_path is not None:
        try:
            spec = json.loads(Path(spec_path).read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{spec_path}: cannot read the layer spec as JSON ({exc})") from None
    elif "__spec__" in arrays:
        try:
            spec = json.loads(arrays["__spec__"].tobytes().decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelError(f"{path}: its __spec__ entry is not JSON ({exc})") from None
    else:
        raise ModelError(f"{path}: no layer spec: add a __spec__ entry or pass --spec FILE.json "
                         "(a list of {name, in_h, in_w, stride, padding, dilation, groups})")
    if not isinstance(spec, list):
        raise ModelError(f"{path}: the layer spec must be a JSON list of layer objects")
    layers = []
    for entry in spec:
        if not isinstance(entry, dict) or "name" not in entry:
            raise ModelError(f"{path}: every layer spec entry needs a name, got {entry!r}")
        name = str(entry["name"])
        hw = (entry.get("in_h"), entry.get("in_w"))
        if hw == (None, None) and input_size is not None:
            hw = input_size
        if hw == (None, None):
            raise ModelError(f"{path}: layer {name}: the spec gives no in_h/in_w; pass --input-size")
        bias = arrays.get(f"{name}.bias")
        layers.append(_make_layer(
            path, name, _layer_weight(path, arrays, name),
            None if bias is None else _float_array(path, name, "bias", bias),
            (_spec_int(path, name, "in_h", hw[0]), _spec_int(path, name, "in_w", hw[1])),
            _spec_value(path, name, entry, "stride", 1), _spec_value(path, name, entry, "padding", 0),
            _spec_value(path, name, entry, "dilation", 1), _spec_int(path, name, "groups", entry.get("groups", 1))))
    return layers


def _spec_int(path: Path, name: str, key: str, v: Any) -> int:
    """A spec number must be a JSON integer: 2.7 or "2" is refused, never rounded."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelError(f"{path}: layer {name}: spec value {key} must be an integer, got {v!r}")
    return v


def _spec_value(path: Path, name: str, entry: Dict[str, Any], key: str, default: int) -> Any:
    v = entry.get(key, default)
    if isinstance(v, list) and len(v) == 2:
        return tuple(_spec_int(path, name, key, x) for x in v)
    if isinstance(v, list):
        raise ModelError(f"{path}: layer {name}: spec value {key} must be an integer or a pair, got {v!r}")
    return _spec_int(path, name, key, v)


# --------------------------------------------------------------------------- onnx

def node_name(node: Any, index: int) -> str:
    """The name of graph node `index`: its own, else op + index ("conv3").
    The one naming rule: the compiled layers and the runner's nodes agree."""
    return node.name or f"{node.op_type.lower()}{index}"


@dataclass(frozen=True)
class OnnxFile:
    """One parse of an ONNX model: the graph with its static part folded and
    shapes inferred, every constant as an array (initializers converted once,
    folded values added), and the Conv layers. load_model
    (compile, inspect) and the runner (run) both read models through it."""

    path: Path
    graph: Any                         # onnx.GraphProto, shapes inferred
    constants: Dict[str, np.ndarray]   # initializer or folded value name -> array
    layers: List[ConvLayer]


def _safe_external_data(path: Path, model: Any) -> None:
    """Load external tensor data only from plain files next to the model: a
    location with a folder part, '..' or a link could read any file."""
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    external = [t for t in model.graph.initializer if uses_external_data(t)]
    for t in external:
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        target = path.parent / loc
        if (not loc or loc != Path(loc).name or loc.startswith(".") or target.is_symlink()
                or not target.is_file()):
            raise ModelError(f"{path}: initializer {t.name} keeps its data in {loc!r}, which is not a plain file "
                             "next to the model; save the model with its data inside (or beside it)")
        size = target.stat().st_size
        offset, length = int(info.get("offset", 0) or 0), int(info.get("length", 0) or 0)
        if offset < 0 or length < 0 or offset + length > size:
            raise ModelError(f"{path}: initializer {t.name}: external data range {offset}+{length} lies outside "
                             f"{loc} ({size} bytes)")
    if external:
        load_external_data_for_model(model, str(path.parent))


def _check_elements(path: Path, what: str, dims: Any) -> None:
    n = 1
    for d in dims:
        n *= max(int(d), 0)
    if n > 2 ** 34:  # more elements than any real layer; refuse before allocating
        raise ModelError(f"{path}: {what} declares shape {list(dims)} ({n} elements); "
                         "the file is damaged or not a real model")


def _initializer(path: Path, tensor: Any) -> np.ndarray:
    from onnx import numpy_helper

    _check_elements(path, f"initializer {tensor.name}", tensor.dims)
    try:
        return numpy_helper.to_array(tensor)
    except Exception as exc:  # ValueError from reshape when dims and data disagree, and friends
        raise ModelError(f"{path}: initializer {tensor.name}: its declared shape {list(tensor.dims)} does not "
                         f"match its data ({_why(exc)})") from None


# Nodes never folded although their inputs are static: their value changes per run.
_NOT_FOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                         "Multinomial", "Bernoulli"})


def _fold_constants(path: Path, model: Any, constants: Dict[str, np.ndarray]) -> None:
    """Fold the static part of the graph once, in place: every node whose
    inputs are all constant (Constant nodes, and Identity/Cast/Transpose/
    Reshape/... chains on initializers, as exporters write weights) is
    evaluated by onnx's own ReferenceEvaluator and replaced by an initializer.
    Compile, inspect and run then see weights wherever the exporter put them."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    static = set(constants)
    folded, kept = [], []
    for node in graph.node:
        subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if (node.domain in ("", "ai.onnx") and node.op_type not in _NOT_FOLDED and not subgraph
                and all(i in static for i in node.input if i)):
            folded.append(node)
            static.update(o for o in node.output if o)
        else:
            kept.append(node)
    if not folded:
        return
    for i, node in enumerate(folded):
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _check_elements(path, f"{node.op_type} node {node_name(node, i)}", a.t.dims)
    needed = {i for n in kept for i in n.input if i} | {o.name for o in graph.output}
    wanted = sorted({o for n in folded for o in n.output if o in needed})
    if not wanted:
        del graph.node[:]
        graph.node.extend(kept)
        return
    feeds = {i: constants[i] for n in folded for i in n.input if i in constants}
    from onnx.reference import ReferenceEvaluator

    opsets = {d.domain: d.version for d in model.opset_import}
    sub = helper.make_graph(folded, "static", [helper.make_empty_tensor_value_info(n) for n in feeds],
                            [helper.make_empty_tensor_value_info(n) for n in wanted])
    try:
        values = ReferenceEvaluator(sub, opsets=opsets).run(None, feeds)
    except Exception as exc:
        raise ModelError(f"{path}: cannot evaluate the static part of the graph ({_failing_node(folded, feeds, opsets)}"
                         f"{_why(exc)}); the file is damaged or uses an operator onnx cannot evaluate") from None
    for name, value in zip(wanted, values):
        value = np.asarray(value)
        constants[name] = value
        graph.initializer.append(numpy_helper.from_array(value, name))
    del graph.node[:]
    graph.node.extend(kept)


def _failing_node(nodes: List[Any], feeds: Dict[str, np.ndarray], opsets: Dict[str, int]) -> str:
    """Which static node fails, for the error message (only on the error path)."""
    from onnx.reference import ReferenceEvaluator

    values = dict(feeds)
    for i, node in enumerate(nodes):
        try:
            outs = ReferenceEvaluator(node, opsets=opsets).run(None, {n: values[n] for n in node.input if n})
        except Exception:
            return f"node {node.name} ({node.op_type}): "
        values.update(zip(node.output, outs))
    return ""


def read_onnx(path: Path, input_size: Optional[Tuple[int, int]] = None) -> OnnxFile:
    """Parse an ONNX model once: check it, name unnamed nodes by position,
    convert the initializers, fold the static subgraphs, infer shapes (with
    the image size fixed to input_size when given) and read every Conv node
    as a ConvLayer. Raises ModelError naming the file and node."""
    path = Path(path)
    try:
        import onnx
        from onnx import shape_inference
    except ImportError:
        raise ModelError(f"{path}: reading ONNX needs the onnx package: pip install 'sparseconv[onnx]'") from None
    if path.stat().st_size == 0:
        raise ModelError(f"{path}: the file is empty; expected an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ModelError(f"{path}: not a readable ONNX model ({_why(exc)})") from None
    if not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model, or one with an empty graph (no nodes)")
    _safe_external_data(path, model)
    for i, node in enumerate(model.graph.node):  # names by position in the file, before folding
        node.name = node_name(node, i)
    constants = {t.name: _initializer(path, t) for t in model.graph.initializer}
    _fold_constants(path, model, constants)
    try:
        if input_size is not None:  # fix the image size of every 4-D graph input, then re-infer
            init_names = {t.name for t in model.graph.initializer}
            for inp in model.graph.input:
                dims = inp.type.tensor_type.shape.dim
                if inp.name not in init_names and len(dims) == 4:
                    dims[2].dim_value, dims[3].dim_value = input_size
        # data_prop: sizes computed by Shape/Gather/Concat/... arithmetic
        # (Resize to another tensor's size) become static too. Should onnx's
        # data propagation stumble on a graph, plain inference still serves.
        try:
            model = shape_inference.infer_shapes(model, data_prop=True)
        except Exception:
            model = shape_inference.infer_shapes(model)
    except Exception as exc:
        raise ModelError(f"{path}: ONNX shape inference failed ({_why(exc)})") from None
    graph = model.graph
    shapes: Dict[str, List[Optional[int]]] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    layers = [_onnx_conv(path, node_name(node, i), node, constants, shapes)
              for i, node in enumerate(graph.node) if node.op_type == "Conv"]
    return OnnxFile(path, graph, constants, layers)


def _onnx_conv(path: Path, name: str, node: Any, constants: Dict[str, np.ndarray],
               shapes: Dict[str, List[Optional[int]]]) -> ConvLayer:
    import onnx

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    where = f"{path}: Conv node {name}"
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", "", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{where}: attribute auto_pad={auto_pad} is not an ONNX value")
    if len(node.input) < 2 or node.input[1] not in constants:
        raise ModelError(f"{where}: the weight is computed from the graph input, or by a node that cannot be "
                         "evaluated at import (custom domain, random), not stored in the file (initializer, "
                         "Constant node or a static subgraph); only static weights compile")
    weight = _float_array(path, name, "weight", constants[node.input[1]])
    if weight.ndim != 4:
        raise ModelError(f"{where}: only 2-D convolutions are supported (weight shape {weight.shape})")
    bias = None
    if len(node.input) > 2 and node.input[2]:
        if node.input[2] not in constants:
            raise ModelError(f"{where}: the bias is computed from the graph input; only static biases compile")
        bias = _float_array(path, name, "bias", constants[node.input[2]])
    if "kernel_shape" in attrs and tuple(attrs["kernel_shape"]) != weight.shape[2:]:
        raise ModelError(f"{where}: kernel_shape {attrs['kernel_shape']} disagrees with the weight "
                         f"{weight.shape}")
    in_shape = shapes.get(node.input[0])
    if in_shape is not None and len(in_shape) == 4 and in_shape[2] and in_shape[3]:
        hw: Tuple[int, int] = (int(in_shape[2]), int(in_shape[3]))
    else:
        raise ModelError(f"{where}: the graph gives no static input size for this layer; pass --input-size")
    strides = tuple(int(v) for v in attrs.get("strides", (1, 1)))
    dilations = tuple(int(v) for v in attrs.get("dilations", (1, 1)))
    pads = [int(v) for v in attrs.get("pads", [0, 0, 0, 0])]
    if auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    elif auto_pad.startswith("SAME") and len(strides) == len(dilations) == 2:
        pads = _same_pads(hw, weight.shape[2:], strides, dilations, upper=auto_pad == "SAME_UPPER")
    if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3]:
        shown = f"auto_pad={auto_pad}, which gives pads {pads}" if auto_pad.startswith("SAME") else f"pads {pads}"
        raise ModelError(f"{where}: {shown}: the kernels pad symmetrically (top == bottom, left == right); "
                         "asymmetric padding is not supported (re-export with symmetric padding, e.g. "
                         "padding=k//2 and an odd kernel)")
    return _make_layer(path, name, weight, bias, hw, strides, (pads[0], pads[1]), dilations, attrs.get("group", 1))


def _same_pads(hw: Tuple[int, int], kernel: Tuple[int, ...], strides: Tuple[int, ...],
               dilations: Tuple[int, ...], upper: bool) -> List[int]:
    """ONNX auto_pad SAME_UPPER / SAME_LOWER as explicit [top, left, bottom, right]."""
    begin, end = [], []
    for size, k, st, d in zip(hw, kernel, strides, dilations):
        total = max((-(-size // st) - 1) * st + (k - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        begin.append(small if upper else big)
        end.append(big if upper else small)
    return begin + end
