"""CPU: the operators the ONNX -> torch.fx conversion (onnx_torch.py) took
over from the ONNX runner's table (runner.OPS), each converted from a small
hand-built graph and checked against onnxruntime on fresh random inputs:
exactly where the operator only moves or picks values, to a relative L2 of
1e-6 where it computes. Then what the conversion refuses (inputs computed at
run time, attributes it does not take), naming the node, and that the new
nodes leave sparsify's fx passes their work (a conv's BatchNormalization
still folds)."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from sparseconv import onnx_torch  # noqa: E402
from sparseconv.fx import LinearOptions, prepare  # noqa: E402
from sparseconv.model import ModelError  # noqa: E402
from sparseconv.onnx_torch import onnx_to_torch  # noqa: E402
from sparseconv.runner import load_program, run_reference  # noqa: E402
from sparseconv.testing import pruned_weight, relative_l2  # noqa: E402

F32 = np.float32
I64_MAX, I64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min
C, H, W = 3, 5, 6
IN_SHAPE = ["N", C, H, W]


def _stem():
    """An identity 1x1 conv first (the conversion needs a Conv): its output is
    the input exactly, in onnxruntime as in torch, so exact ops compare exactly."""
    return [helper.make_node("Conv", ["x", "eye"], ["c"], name="stem")], {"eye": np.eye(C, dtype=F32)[:, :, None, None]}


def _save(tmp_path, nodes, inits, opset=17, outputs=("out",), in_shape=IN_SHAPE, name="g.onnx"):
    stem, stem_inits = _stem()
    graph = helper.make_graph(
        stem + nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in {**stem_inits, **inits}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _run(module, x):
    with torch.no_grad():
        got = module(torch.from_numpy(x))
    return [t.numpy() for t in (got if isinstance(got, tuple) else (got,))]


def _matches_onnxruntime(path, exact=False, scale=1.0, batch=2):
    """Convert `path`, run it on a fresh random batch (never zeros) and compare
    every output with onnxruntime's; returns the module."""
    module, shape = onnx_to_torch(path)
    x = (scale * np.random.default_rng().standard_normal((batch,) + shape)).astype(F32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = session.run(None, {session.get_inputs()[0].name: x})
    got = _run(module, x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            assert relative_l2(g, w) <= 1e-6
    return module


def _types(module):
    return {type(m).__name__ for m in module.modules()}


def _targets(module):
    return {getattr(n.target, "__name__", n.target) for n in module.graph.nodes}


# --------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("op,attrs,exact,opset,scale", [
    ("Abs", {}, True, 17, 1.0), ("Neg", {}, True, 17, 1.0), ("Floor", {}, True, 17, 3.0),
    ("Ceil", {}, True, 17, 3.0), ("Exp", {}, False, 17, 2.0), ("Reciprocal", {}, False, 17, 1.0),
    ("Erf", {}, False, 17, 1.5), ("Elu", {"alpha": 0.7}, False, 17, 2.0), ("Elu", {}, False, 17, 2.0),
    # log(1 + e^x) over its whole range: torch's Softplus turns linear above 20
    ("Softplus", {}, False, 17, 15.0),
    ("Gelu", {}, False, 20, 2.0), ("Gelu", {"approximate": "tanh"}, False, 20, 2.0)])
def test_elementwise_operators_match_onnxruntime(tmp_path, op, attrs, exact, opset, scale):
    path = _save(tmp_path, [helper.make_node(op, ["c"], ["out"], name="op", **attrs)], {}, opset=opset)
    module = _matches_onnxruntime(path, exact=exact, scale=scale)
    if op in ("Elu", "Softplus", "Gelu"):   # nn modules; the others torch functions
        assert {"Elu": "ELU", "Softplus": "Softplus", "Gelu": "GELU"}[op] in _types(module)


def test_sqrt_of_a_positive_tensor_and_pow_by_constants_and_tensors(tmp_path):
    """Pow by a float scalar, an int64 exponent (ONNX's T1) and a per-channel
    tensor, and by a computed tensor; Sqrt."""
    rng = np.random.default_rng()
    inits = {"half": np.array(0.5, F32), "three": np.array(3, np.int64),
             "per_channel": (rng.random((1, C, 1, 1)) + 0.5).astype(F32)}
    nodes = [helper.make_node("Abs", ["c"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["s"]),
             helper.make_node("Pow", ["a", "half"], ["p1"]),
             helper.make_node("Pow", ["c", "three"], ["p2"]),
             helper.make_node("Pow", ["a", "per_channel"], ["p3"]),
             helper.make_node("Pow", ["a", "s"], ["p4"])]
    path = _save(tmp_path, nodes, inits, outputs=("s", "p1", "p2", "p3", "p4"))
    _matches_onnxruntime(path)


def test_max_and_min_of_any_number_of_inputs_broadcast(tmp_path):
    rng = np.random.default_rng()
    inits = {"lo": np.array(-0.3, F32), "row": rng.standard_normal((1, 1, 1, W)).astype(F32)}
    nodes = [helper.make_node("Neg", ["c"], ["n"]),
             helper.make_node("Max", ["c", "lo", "n", "row"], ["mx"]),
             helper.make_node("Min", ["c", "row"], ["mn"]),
             helper.make_node("Min", ["c"], ["one"])]      # a single input: itself
    path = _save(tmp_path, nodes, inits, outputs=("mx", "mn", "one"))
    _matches_onnxruntime(path, exact=True)


@pytest.mark.parametrize("slope_shape,module", [((C, 1, 1), True), ((1,), True), ((1, C, 1, 1), True), ((W,), False),
                                                ((H, 1), False), (None, False)])
def test_prelu_as_nn_prelu_where_the_slope_is_per_channel_else_broadcast(tmp_path, slope_shape, module):
    """The slope broadcast to x as ONNX does (unidirectionally): nn.PReLU for
    one slope or one per channel; a slope along W or H, or computed, broadcast."""
    rng = np.random.default_rng()
    if slope_shape is None:     # computed: a slope per element
        nodes = [helper.make_node("Sigmoid", ["c"], ["slope"]), helper.make_node("PRelu", ["c", "slope"], ["out"])]
        inits = {}
    else:
        nodes = [helper.make_node("PRelu", ["c", "slope"], ["out"])]
        inits = {"slope": rng.random(slope_shape).astype(F32)}
    m = _matches_onnxruntime(_save(tmp_path, nodes, inits), exact=slope_shape is not None)  # torch's sigmoid differs
    assert ("PReLU" in _types(m)) == module and ("onnx_prelu" in _targets(m)) != module


# --------------------------------------------------------------------------- moving values


@pytest.mark.parametrize("perm", [[0, 2, 3, 1], [3, 1, 0, 2], None])
def test_transpose_with_and_without_perm(tmp_path, perm):
    attrs = {} if perm is None else {"perm": perm}
    path = _save(tmp_path, [helper.make_node("Transpose", ["c"], ["out"], **attrs)], {})
    _matches_onnxruntime(path, exact=True)


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_and_unsqueeze_on_tensors_by_attribute_or_input(tmp_path, opset):
    """Axes as the attribute (opset 11) or a constant input (13), negative
    ones counted in the output's rank; Squeeze without axes drops every 1."""
    def node(op, x, out, axes):
        if opset >= 13:
            return helper.make_node(op, [x, f"{out}_axes"], [out]), {f"{out}_axes": np.array(axes, np.int64)}
        return helper.make_node(op, [x], [out], axes=axes), {}

    nodes, inits = [], {"st": np.array([1], np.int64), "en": np.array([2], np.int64), "ax": np.array([1], np.int64)}
    for op, x, out, axes in (("Unsqueeze", "c", "u", [0, -1, 3]), ("Squeeze", "u", "s", [-1, 0, 3])):
        n, i = node(op, x, out, axes)
        nodes.append(n)
        inits.update(i)
    nodes += [helper.make_node("Slice", ["c", "st", "en", "ax"], ["one"]),     # (N, 1, H, W)
              helper.make_node("Squeeze", ["one"], ["all"])]
    path = _save(tmp_path, nodes, inits, opset=opset, outputs=("u", "s", "all"))
    _matches_onnxruntime(path, exact=True)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1, 2], [3, I64_MAX], [2, 3], None),                 # no steps, "to the end"
    ([-4, 0], [-1, 5], [-1, 1], [2, 1]),                  # negative bounds and axes
    ([-100], [100], [2], [3]),                            # clamped
    ([I64_MAX, -2], [I64_MIN, 0], [3, 2], [-1, -2]),      # reversed whole, and backwards from the end
    ([4, 1], [0, -10], [2, 3], [-3, -1]),
    ([2], [1], [3], [1]),                                 # empty
    ([0, 1], [2, 3], None, None)])                        # axes omitted: 0, 1
def test_slice_of_tensors_with_constant_bounds(tmp_path, starts, ends, axes, steps):
    inits = {"s": np.array(starts, np.int64), "e": np.array(ends, np.int64)}
    ins = ["c", "s", "e"]
    if axes is not None or steps is not None:
        inits["a"] = np.array(axes if axes is not None else range(len(starts)), np.int64)
        ins.append("a")
    if steps is not None:
        inits["st"] = np.array(steps, np.int64)
        ins.append("st")
    path = _save(tmp_path, [helper.make_node("Slice", ins, ["out"])], inits)
    _matches_onnxruntime(path, exact=True)


@pytest.mark.parametrize("pads,value,axes,opset", [
    ([0, 0, 1, 2, 0, 0, 3, 0], None, None, 17),
    ([0, 1, 0, 0, 1, 0, 0, 0], 2.5, None, 17),           # channels, and a fill value
    ([1, 0, -1, 2, 0, 0, 0, -2], -1.0, None, 17),         # the batch, and negative pads that crop
    ([2, -1, 1, 3], 0.5, [2, -1], 18),                    # opset 18 axes
    ([1, 1], None, [1], 18)])
def test_constant_pad_with_values_axes_and_cropping(tmp_path, pads, value, axes, opset):
    inits = {"pads": np.array(pads, np.int64)}
    ins = ["c", "pads"]
    if value is not None or axes is not None:
        ins.append("" if value is None else "v")
        if value is not None:
            inits["v"] = np.array(value, F32)
    if axes is not None:
        inits["axes"] = np.array(axes, np.int64)
        ins.append("axes")
    path = _save(tmp_path, [helper.make_node("Pad", ins, ["out"], mode="constant")], inits, opset=opset)
    _matches_onnxruntime(path, exact=True)


@pytest.mark.parametrize("how,axis,opset,n_out", [
    ("input", 1, 13, 2), ("attribute", -1, 11, 3), ("equal", 3, 13, 3), ("equal", 2, 18, 3), ("input", 0, 13, 2)])
def test_split_gives_every_output(tmp_path, how, axis, opset, n_out):
    """Sizes from the input (13+) or the attribute (older), or equal parts,
    the last one smaller with opset 18's num_outputs; outputs used apart."""
    outs = [f"o{i}" for i in range(n_out)]
    attrs, inits, ins = {"axis": axis}, {}, ["c"]
    sizes = {1: [1, 2], -1: [1, 3, 2], 0: [1, 1]}.get(axis)
    if how == "input":
        inits["sizes"] = np.array(sizes, np.int64)
        ins.append("sizes")
    elif how == "attribute":
        attrs["split"] = sizes
    elif opset >= 18:
        attrs["num_outputs"] = n_out        # H = 5: 2, 2, 1
    nodes = [helper.make_node("Split", ins, outs, name="split", **attrs)]
    nodes += [helper.make_node("Neg", [o], [f"{o}_neg"]) for o in outs]    # each output read downstream
    path = _save(tmp_path, nodes, inits, opset=opset, outputs=[f"{o}_neg" for o in outs] + outs[:1],
                 in_shape=[2, C, H, W] if axis == 0 else IN_SHAPE)
    module = _matches_onnxruntime(path, exact=True)
    assert sum(n.target is torch.split for n in module.graph.nodes) == 1


@pytest.mark.parametrize("indices,axis", [(np.array(1), 1), (np.array([-1, 0, 2, 2]), 3),
                                          (np.array([[0, -2], [1, 4]]), -2), (np.array([1, 0]), 0),
                                          (np.array(-1, np.int32), 3)])
def test_gather_of_tensors_by_constant_indices(tmp_path, indices, axis):
    """A scalar index drops the axis; negative indices count from the end;
    several dimensions of indices take the axis' place."""
    path = _save(tmp_path, [helper.make_node("Gather", ["c", "idx"], ["out"], axis=axis)], {"idx": indices},
                 in_shape=[2, C, H, W] if axis == 0 else IN_SHAPE)
    _matches_onnxruntime(path, exact=True)


def test_cast_of_float_tensors_keeps_float32(tmp_path):
    nodes = [helper.make_node("Cast", ["c"], ["d"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["d"], ["out"], to=TensorProto.FLOAT)]
    module = _matches_onnxruntime(_save(tmp_path, nodes, {}), exact=True)
    assert module(torch.ones(1, C, H, W)).dtype == torch.float32


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_space_to_depth(tmp_path, mode):
    """Both modes of DepthToSpace (CRD is nn.PixelShuffle), and SpaceToDepth,
    whose channel order is DCR's (not nn.PixelUnshuffle's)."""
    rng = np.random.default_rng()
    nodes = [helper.make_node("Conv", ["c", "w8"], ["c8"], name="widen"),     # (N, 8, H, W)
             helper.make_node("DepthToSpace", ["c8"], ["d2s"], blocksize=2, mode=mode),
             helper.make_node("SpaceToDepth", ["d2s"], ["s2d"], blocksize=2),
             helper.make_node("Sub", ["s2d", "c8"], ["out"])]
    path = _save(tmp_path, nodes, {"w8": pruned_weight(rng, (8, C, 1, 1), 0.3)}, outputs=("d2s", "s2d", "out"))
    module = _matches_onnxruntime(path)
    d2s, s2d, diff = _run(module, rng.standard_normal((2, C, H, W)).astype(F32))
    assert d2s.shape == (2, 2, 2 * H, 2 * W) and ("PixelShuffle" in _types(module)) == (mode == "CRD")
    if mode == "DCR":
        assert not diff.any()        # SpaceToDepth undoes DCR exactly
    # exact against onnxruntime from an exactly computed input: SpaceToDepth of the input itself
    nodes = [helper.make_node("Pad", ["c", "p"], ["even"]),                  # (N, 3, 6, 6)
             helper.make_node("SpaceToDepth", ["even"], ["s"], blocksize=2),  # (N, 12, 3, 3)
             helper.make_node("DepthToSpace", ["s"], ["out"], blocksize=2, mode=mode)]
    _matches_onnxruntime(_save(tmp_path, nodes, {"p": np.array([0, 0, 0, 0, 0, 0, 1, 0], np.int64)},
                               outputs=("s", "out"), name="exact.onnx"), exact=True)


# --------------------------------------------------------------------------- reductions and norms


@pytest.mark.parametrize("op,axes,keepdims,noop,opset,by", [
    ("ReduceSum", [2, 3], 1, 0, 13, "input"), ("ReduceSum", [-1], 0, 0, 11, "attribute"),
    ("ReduceSum", None, 0, 0, 13, "input"), ("ReduceSum", None, 1, 1, 13, "input"),
    ("ReduceSum", [], 1, 0, 13, "input"),
    ("ReduceMax", [1], 0, 0, 18, "input"), ("ReduceMax", [1, -1], 1, 0, 13, "attribute"),
    ("ReduceMax", None, 1, 0, 18, "input"), ("ReduceMax", None, 0, 1, 18, "input")])
def test_reduce_sum_and_max(tmp_path, op, axes, keepdims, noop, opset, by):
    """Axes from the input or the attribute, none (every axis, or none at all
    with noop_with_empty_axes). Sums of |x|: a sum that cancels to near 0 would
    measure the summation order, not the conversion."""
    attrs = {"keepdims": keepdims}
    if noop:
        attrs["noop_with_empty_axes"] = 1
    nodes = [helper.make_node("Abs", ["c"], ["a"])] if op == "ReduceSum" else []
    ins, inits = ["a" if nodes else "c"], {}
    if axes is not None and by == "input":
        inits["axes"] = np.array(axes, np.int64)
        ins.append("axes")
    elif axes is not None:
        attrs["axes"] = axes
    path = _save(tmp_path, nodes + [helper.make_node(op, ins, ["out"], **attrs)], inits, opset=opset)
    _matches_onnxruntime(path, exact=op == "ReduceMax")


def test_instance_normalization(tmp_path):
    rng = np.random.default_rng()
    inits = {"s": (rng.random(C) + 0.5).astype(F32), "b": rng.standard_normal(C).astype(F32)}
    path = _save(tmp_path, [helper.make_node("InstanceNormalization", ["c", "s", "b"], ["out"], epsilon=1e-3)],
                 inits)
    assert "InstanceNorm2d" in _types(_matches_onnxruntime(path, scale=3.0))


@pytest.mark.parametrize("axis,scale_shape,bias", [(-1, (W,), True), (2, (H, W), True), (2, (W,), False),
                                                   (1, (C, 1, 1), True), (-2, (1, H, W), True)])
def test_layer_normalization_over_the_trailing_axes(tmp_path, axis, scale_shape, bias):
    rng = np.random.default_rng()
    inits = {"g": (rng.random(scale_shape) + 0.5).astype(F32)}
    ins = ["c", "g"]
    if bias:
        inits["b"] = rng.standard_normal(scale_shape).astype(F32)
        ins.append("b")
    path = _save(tmp_path, [helper.make_node("LayerNormalization", ins, ["out"], axis=axis, epsilon=1e-4)], inits)
    assert "LayerNorm" in _types(_matches_onnxruntime(path, scale=2.0))


# --------------------------------------------------------------------------- Upsample


@pytest.mark.parametrize("mode,scales,opset,path_taken", [
    ("nearest", [1, 1, 2, 2], 9, "interpolate"), ("nearest", [1, 1, 2, 1.5], 9, "interpolate"),
    ("nearest", [1, 1, 3, 1], 7, "interpolate"), ("nearest", [1, 2, 1, 2.5], 9, "index_select"),
    ("linear", [1, 1, 2, 3], 9, "lerp_axis"), ("linear", [1, 1, 1.5, 2.5], 7, "lerp_axis"),
    ("linear", [1, 2, 2, 1], 9, "lerp_axis")])
def test_upsample_of_old_exports(tmp_path, mode, scales, opset, path_taken):
    """Upsample (opsets 7-9: scales as an attribute, then an input), with
    Resize's asymmetric coordinates: nearest as F.interpolate where torch
    picks the same pixels, else index tables; linear from index and weight
    tables, since F.interpolate has no asymmetric coordinates."""
    if opset == 7:
        nodes, inits = [helper.make_node("Upsample", ["c"], ["out"], mode=mode, scales=[float(s) for s in scales])], {}
    else:
        nodes, inits = [helper.make_node("Upsample", ["c", "sc"], ["out"], mode=mode)], {"sc": np.array(scales, F32)}
    module = _matches_onnxruntime(_save(tmp_path, nodes, inits, opset=opset), exact=mode == "nearest")
    assert path_taken in _targets(module)
    x = torch.from_numpy(np.random.default_rng().standard_normal((2, C, H, W)).astype(F32))
    front = prepare(module, x[:1], linear=LinearOptions())    # sparsify's trace goes through the tables
    assert front.traced
    with torch.no_grad():
        torch.testing.assert_close(front.module(x), module(x), rtol=0, atol=0)
    assert onnx_to_torch(_save(tmp_path, nodes, inits, opset=opset, name="free.onnx",
                               in_shape=["N", C, "H", "W"]), (4, 7))[1] == (C, 4, 7)


def test_upsample_where_torch_would_pick_other_pixels_follows_the_runner(tmp_path):
    """Scale 1.2 (1.2000000477 in float32): at an output that lands on a
    pixel's edge, torch's float32 1 / scale picks the next pixel, the runner
    (float64, as onnx's reference) this one; so the conversion takes index
    tables, the runner's pixels. (onnxruntime's float32 differs from both
    there, in the output's size too; the runner is the reference here.)"""
    nodes = [helper.make_node("Upsample", ["c", "sc"], ["out"], mode="nearest")]
    path = _save(tmp_path, nodes, {"sc": np.array([1, 1, 1, 1.2], F32)}, opset=9)
    module, shape = onnx_to_torch(path)
    assert "index_select" in _targets(module) and "interpolate" not in _targets(module)
    x = np.random.default_rng().standard_normal((2,) + shape).astype(F32)
    (want,) = run_reference(load_program(path), x)
    (got,) = _run(module, x)
    np.testing.assert_array_equal(got, want.astype(F32))


# --------------------------------------------------------------------------- shape arithmetic


def _i64(*values):
    return np.array(values, np.int64)


def _traces_like(module, batches):
    """sparsify's fx trace goes through the shape arithmetic (Div as a leaf
    call of its own) and computes what the module does at each batch size."""
    rng = np.random.default_rng()
    front = prepare(module, torch.from_numpy(rng.standard_normal((batches[0], C, H, W)).astype(F32)),
                    linear=LinearOptions())
    assert front.traced
    for batch in batches:
        x = rng.standard_normal((batch, C, H, W)).astype(F32)
        for got, want in zip(_run(front.module, x), _run(module, x)):
            np.testing.assert_array_equal(got, want)
    return front


def test_add_sub_mul_div_of_sizes_reshape_by_each_calls_batch(tmp_path):
    """Shape -> Gather -> Div / Mul / Add / Sub -> Unsqueeze -> Concat ->
    Reshape, as exporters write x.view(x.size(0) // 2, ...): scalars with
    scalars, a 1-entry shape with a scalar, n entries with n entries and
    with one, both operands sizes or one a constant; onnxruntime's results
    at two batch sizes, and sparsify's trace goes through."""
    inits = {"zero": _i64(0), "one": _i64(1), "two": np.array(2, np.int64), "three": np.array(3, np.int64),
             "tail": _i64(2), "end": _i64(4), "pick": _i64(1, 2, 3), "halve_w": _i64(1, 2), "zeros": _i64(0, 0, 0)}
    nodes = [helper.make_node("Shape", ["c"], ["shp"]),                                  # (N, C, H, W)
             helper.make_node("Gather", ["shp", "zero"], ["n"], axis=0),                 # [N]: 1 entry
             helper.make_node("Div", ["n", "tail"], ["half"]),                           # [N / 2]
             helper.make_node("Gather", ["shp", "one"], ["c1"], axis=0),                 # [C]
             helper.make_node("Mul", ["c1", "two"], ["c2"]),                             # [2C]: 1 entry by a scalar
             helper.make_node("Slice", ["shp", "tail", "end"], ["hw"]),                  # [H, W]
             helper.make_node("Div", ["hw", "halve_w"], ["hw_half"]),                    # [H, W / 2]: n by n
             helper.make_node("Mul", ["hw_half", "halve_w"], ["hw2"]),                   # [H, W]
             helper.make_node("Concat", ["half", "c2", "hw2"], ["to_pairs"], axis=0),
             helper.make_node("Reshape", ["c", "to_pairs"], ["pairs"]),                  # (N / 2, 2C, H, W)
             helper.make_node("Add", ["half", "half"], ["n_again"]),                     # sizes and sizes
             helper.make_node("Gather", ["shp", "pick"], ["chw"], axis=0),
             helper.make_node("Sub", ["chw", "zeros"], ["chw0"]),                        # n and n
             helper.make_node("Sub", ["chw0", "zero"], ["chw1"]),                        # n and 1
             helper.make_node("Concat", ["n_again", "chw1"], ["back"], axis=0),
             helper.make_node("Reshape", ["pairs", "back"], ["undone"]),                 # (N, C, H, W)
             helper.make_node("Gather", ["shp", "two"], ["h"], axis=0),                  # scalars
             helper.make_node("Gather", ["shp", "three"], ["w"], axis=0),
             helper.make_node("Mul", ["h", "w"], ["hw_prod"]),                           # H * W
             helper.make_node("Unsqueeze", ["hw_prod", "zero"], ["hw_1"]),
             helper.make_node("Concat", ["n", "c1", "hw_1"], ["flat_shape"], axis=0),
             helper.make_node("Reshape", ["c", "flat_shape"], ["flat"])]                 # (N, C, H * W)
    path = _save(tmp_path, nodes, inits, outputs=("pairs", "undone", "flat"))
    for batch in (2, 6):
        module = _matches_onnxruntime(path, exact=True, batch=batch)
    assert "shape_arithmetic" in _targets(module)
    front = _traces_like(module, (2, 6))
    assert "onnx_int_div" in _targets(front.module)


def test_slice_bounds_computed_from_sizes_divide_toward_zero(tmp_path):
    """torch.chunk(x, 2) as exported: Slice bounds (N + 1) / 2 * 1 and * 2;
    then starts (N - 7) / 2 and (N + 1) / -2, negative at batch 2 and 6,
    where ONNX's integer Div truncates toward zero (floor division would
    take one more row or column); and bounds on two axes with a step."""
    inits = {"zero": _i64(0), "one": _i64(1), "two": _i64(2), "seven": _i64(7), "minus_two": _i64(-2),
             "to_end": _i64(I64_MAX), "ax0": _i64(0), "ax2": _i64(2), "ax3": _i64(3), "ax03": _i64(0, 3),
             "steps": _i64(1, 2), "one_col": _i64(1)}
    nodes = [helper.make_node("Shape", ["c"], ["shp"]),
             helper.make_node("Gather", ["shp", "zero"], ["n"], axis=0),                 # [N]
             helper.make_node("Add", ["n", "one"], ["n1"]),
             helper.make_node("Div", ["n1", "two"], ["half"]),
             helper.make_node("Mul", ["half", "one"], ["mid"]),
             helper.make_node("Mul", ["half", "two"], ["stop"]),
             helper.make_node("Slice", ["c", "zero", "mid", "ax0"], ["first"]),
             helper.make_node("Slice", ["c", "mid", "stop", "ax0"], ["second"]),
             helper.make_node("Sub", ["first", "second"], ["chunks"]),
             helper.make_node("Sub", ["n", "seven"], ["n7"]),
             helper.make_node("Div", ["n7", "two"], ["back_w"]),                         # -2 at N = 2 (floor: -3)
             helper.make_node("Slice", ["c", "back_w", "to_end", "ax3"], ["cols"]),
             helper.make_node("Div", ["n1", "minus_two"], ["back_h"]),                   # -3 at N = 6 (floor: -4)
             helper.make_node("Slice", ["c", "back_h", "to_end", "ax2"], ["rows"]),
             helper.make_node("Concat", ["half", "one_col"], ["starts"], axis=0),
             helper.make_node("Concat", ["stop", "to_end"], ["ends"], axis=0),
             helper.make_node("Slice", ["c", "starts", "ends", "ax03", "steps"], ["two_axes"])]
    path = _save(tmp_path, nodes, inits, outputs=("chunks", "cols", "rows", "two_axes"))
    for batch, cols, rows in ((2, 2, 1), (6, W, 3)):
        module = _matches_onnxruntime(path, exact=True, batch=batch)
        x = np.random.default_rng().standard_normal((batch, C, H, W)).astype(F32)
        got = _run(module, x)
        assert got[0].shape[0] == batch // 2 and got[1].shape[3] == cols and got[2].shape[2] == rows
        # the runner's host shape arithmetic divides the same way (its Div once made float64 bounds, and the
        # INT64_MAX end overflowed back to an empty slice)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        want = session.run(None, {session.get_inputs()[0].name: x})
        for g, w in zip(run_reference(load_program(path), x), want):
            assert g.shape == w.shape and relative_l2(np.asarray(g), w) <= 1e-6  # float64 against float32
    _traces_like(module, (2, 6))


def _export(net, path):
    """net exported as users bring it: torch.onnx's TorchScript exporter,
    opset 17, a dynamic batch axis (as tests/test_onnx_torch.py does)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(net.eval(), torch.randn(2, C, H, W), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N"}})
    return path


@pytest.mark.parametrize("how,batches", [("chunk", (2, 6)), ("view", (2, 5))])
def test_an_export_that_halves_the_batch_converts(tmp_path, how, batches):
    """torch.chunk(y, 2) and y.view(y.size(0) // 2, -1) after a conv, exported
    with a dynamic batch: the exporter writes Shape -> Gather -> (Add ->) Div
    on sizes into Slice bounds or a Reshape, which converted to nothing
    before this shape arithmetic (the Slice's ends, or a Cast of the
    quotient, were refused); now like onnxruntime at two batch sizes, an odd
    one for the view (5 // 2)."""
    from torch import nn

    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(C, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            if how == "chunk":
                a, b = torch.chunk(y, 2, dim=0)
                return a - b
            return y.view(y.size(0) // 2, -1)

    path = _export(Halves(), tmp_path / f"{how}.onnx")
    assert {"Shape", "Gather", "Div"} <= {n.op_type for n in onnx.load(str(path)).graph.node}
    for batch in batches:
        module = _matches_onnxruntime(path, batch=batch)
    rng = np.random.default_rng()
    assert _run(module, rng.standard_normal((batches[1], C, H, W)).astype(F32))[0].shape[0] == batches[1] // 2
    x = torch.from_numpy(rng.standard_normal((batches[0], C, H, W)).astype(F32))
    front = prepare(module, x, linear=LinearOptions())
    assert front.traced and "onnx_int_div" in _targets(front.module)


# --------------------------------------------------------------------------- refusals


def _refused(tmp_path, nodes, inits, match, opset=17, in_shape=IN_SHAPE):
    path = _save(tmp_path, nodes, inits, opset=opset, in_shape=in_shape)
    with pytest.raises(ModelError, match=match):
        onnx_to_torch(path)


def test_computed_bounds_pads_axes_and_indices_are_refused_naming_the_node(tmp_path):
    """A Slice start the shape arithmetic does not follow (here through an
    Identity), a backwards Slice from the batch size, a Pad width, Squeeze
    axes or Gather indices computed at run time (here from the input's
    shape), a Div of sizes cast to float (no integer division): ModelError
    naming the node and what it expects; `sparseconv run` still runs such a
    model."""
    shape = [helper.make_node("Shape", ["c"], ["shp"]),
             helper.make_node("Slice", ["shp", "i0", "i1"], ["n1"])]     # the batch size, a shape value
    inits = {"i0": np.array([0], np.int64), "i1": np.array([1], np.int64), "e": np.array([3], np.int64),
             "ax": np.array([2], np.int64), "back": np.array([-1], np.int64), "ax0": np.array([0], np.int64)}
    cases = [
        ([helper.make_node("Identity", ["n1"], ["n1_copy"]),
          helper.make_node("Slice", ["c", "n1_copy", "e", "ax"], ["out"], name="slice_by_batch")],
         r"node slice_by_batch \(Slice\): the starts \(n1_copy\) must be a constant or computed from the "
         r"input's shape .*not computed at run time from values"),
        ([helper.make_node("Slice", ["c", "n1", "i0", "ax0", "back"], ["out"], name="back_from_batch")],
         r"node back_from_batch \(Slice\): a negative step on axis 0 needs constant bounds"),
        ([helper.make_node("Cast", ["n1"], ["f"], to=TensorProto.FLOAT),
          helper.make_node("Div", ["f", "f"], ["q"], name="float_div"),
          helper.make_node("Cast", ["q"], ["qi"], to=TensorProto.INT64),
          helper.make_node("Slice", ["c", "i0", "qi", "ax0"], ["out"])],
         r"node float_div \(Div\): Div of a shape value .* does not convert"),
        ([helper.make_node("Concat", ["n1", "n1", "n1", "n1", "n1", "n1", "n1", "n1"], ["p"], axis=0),
          helper.make_node("Pad", ["c", "p"], ["out"], name="pad_by_batch")],
         r"node pad_by_batch \(Pad\): the pads \(p\) must be a constant"),
        ([helper.make_node("Squeeze", ["c", "n1"], ["out"], name="squeeze_by_batch")],
         r"node squeeze_by_batch \(Squeeze\): the axes \(n1\) must be a constant"),
        ([helper.make_node("Gather", ["c", "n1"], ["out"], name="gather_by_batch", axis=3)],
         r"node gather_by_batch \(Gather\): the indices \(n1\) must be a constant"),
    ]
    for i, (nodes, match) in enumerate(cases):
        path = _save(tmp_path, shape + nodes, inits, name=f"refused{i}.onnx")
        with pytest.raises(ModelError, match=match):
            onnx_to_torch(path)


@pytest.mark.parametrize("nodes,inits,match,in_shape", [
    ([helper.make_node("Cast", ["c"], ["out"], name="to_int", to=TensorProto.INT32)], {},
     r"node to_int \(Cast\): a Cast of a tensor to int32 does not convert", IN_SHAPE),
    ([helper.make_node("Split", ["c"], ["a", "b"], name="halves", axis=0)], {},
     r"node halves \(Split\): a split into equal parts needs the size of axis 0 .*leaves free", IN_SHAPE),
    ([helper.make_node("Slice", ["c", "s", "e", "a", "st"], ["out"], name="backwards")],
     {"s": np.array([-1], np.int64), "e": np.array([I64_MIN], np.int64), "a": np.array([0], np.int64),
      "st": np.array([-1], np.int64)},
     r"node backwards \(Slice\): a negative step needs the size of axis 0", IN_SHAPE),
    ([helper.make_node("Upsample", ["c", "sc"], ["out"], name="up")], {"sc": np.array([2, 1, 1, 1], F32)},
     r"node up \(Upsample\): a scale of 2.0 needs the size of axis 0", IN_SHAPE),
    ([helper.make_node("LayerNormalization", ["c", "g"], ["out"], name="ln", axis=0)], {"g": np.ones(W, F32)},
     r"node ln \(LayerNormalization\): LayerNormalization needs the size of axis 0", IN_SHAPE),
    ([helper.make_node("Pad", ["c", "p"], ["out"], name="reflect", mode="reflect")],
     {"p": np.zeros(8, np.int64)}, r"node reflect: Pad mode b?'reflect' is not supported", IN_SHAPE),  # runner's check
], ids=["cast-to-int", "split-free-axis", "slice-back-free-axis", "upsample-batch", "layernorm-batch",
        "pad-reflect"])
def test_what_does_not_convert_is_refused_naming_the_node(tmp_path, nodes, inits, match, in_shape):
    opset = 9 if nodes[0].op_type == "Upsample" else 17
    _refused(tmp_path, nodes, inits, match, opset=opset, in_shape=in_shape)


def test_pad_modes_other_than_constant_are_refused_by_the_converter_too(tmp_path):
    """runner.load_program refuses reflect and edge first today; the converter
    says so itself, should the runner ever take them."""
    path = _save(tmp_path, [helper.make_node("Pad", ["c", "p"], ["out"], name="the_pad")],
                 {"p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)})
    program = load_program(path)
    pad = next(n for n in program.nodes if n.op == "Pad")
    builder = onnx_torch._Builder(program)
    builder.values["c"] = builder.graph.placeholder("c")
    for mode in ("reflect", "edge"):
        with pytest.raises(ModelError, match=rf"node the_pad \(Pad\): Pad mode '{mode}' does not convert"):
            onnx_torch.CONVERTERS["Pad"](builder, dataclasses.replace(pad, attrs={"mode": mode}))


def test_an_operator_on_shape_values_outside_the_shape_arithmetic_is_refused(tmp_path):
    nodes = [helper.make_node("Shape", ["c"], ["shp"]),
             helper.make_node("ReduceMax", ["shp"], ["biggest"], name="largest_dim", keepdims=0),
             helper.make_node("Relu", ["c"], ["out"])]
    _refused(tmp_path, nodes, {}, r"node largest_dim \(ReduceMax\): ReduceMax of a shape value .* does not convert")


def test_every_operator_the_runner_runs_has_a_converter():
    from sparseconv import runner

    assert sorted(set(runner.OPS) - set(onnx_torch.CONVERTERS)) == []


# --------------------------------------------------------------------------- sparsify's passes


def test_new_operators_between_convs_leave_the_bn_fold_and_fusion_to_sparsify(tmp_path):
    """Conv -> BN -> Relu, then Transpose, Pad, Slice, Split, PRelu, Gather,
    Max, DepthToSpace, SpaceToDepth, then Conv -> BN, LayerNorm, Softplus,
    ReduceSum: the graph
    converts like onnxruntime, sparsify's fx trace goes through every new
    node, and both BatchNormalizations still fold into their convs."""
    rng = np.random.default_rng()

    def bn(name, k):
        inits.update({f"{name}_s": (rng.random(k) + 0.5).astype(F32), f"{name}_b": rng.standard_normal(k).astype(F32),
                      f"{name}_m": rng.standard_normal(k).astype(F32), f"{name}_v": (rng.random(k) + 0.5).astype(F32)})
        return [f"{name}_s", f"{name}_b", f"{name}_m", f"{name}_v"]

    inits = {"w1": pruned_weight(rng, (8, C, 3, 3), 0.6), "w2": pruned_weight(rng, (6, 4, 3, 3), 0.6),
             "pads": np.array([0, 0, 1, 0, 0, 0, 0, 1], np.int64), "st": np.array([1], np.int64),
             "en": np.array([I64_MAX], np.int64), "ax": np.array([2], np.int64), "sizes": np.array([4, 4], np.int64),
             "slope": rng.random((4, 1, 1)).astype(F32), "idx": np.array([3, 0, 1, 2], np.int64),
             "g": (rng.random(6) + 0.5).astype(F32),
             "rax": np.array([3], np.int64)}
    nodes = [helper.make_node("Conv", ["c", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1"] + bn("bn1", 8), ["b1"]),
             helper.make_node("Relu", ["b1"], ["r1"]),                                          # (N, 8, 5, 6)
             helper.make_node("Transpose", ["r1"], ["t"], perm=[0, 1, 3, 2]),                   # (N, 8, 6, 5)
             helper.make_node("Pad", ["t", "pads"], ["p"]),                                     # (N, 8, 7, 6)
             helper.make_node("Slice", ["p", "st", "en", "ax"], ["s"]),                         # (N, 8, 6, 6)
             helper.make_node("Split", ["s", "sizes"], ["s1", "s2"], axis=1),                   # 2 x (N, 4, 6, 6)
             helper.make_node("PRelu", ["s1", "slope"], ["pr"]),
             helper.make_node("Gather", ["s2", "idx"], ["ga"], axis=1),
             helper.make_node("Max", ["pr", "ga"], ["mx"]),                                     # (N, 4, 6, 6)
             helper.make_node("DepthToSpace", ["mx"], ["d2s"], blocksize=2, mode="DCR"),        # (N, 1, 12, 12)
             helper.make_node("SpaceToDepth", ["d2s"], ["s2d"], blocksize=2),                   # (N, 4, 6, 6)
             helper.make_node("Conv", ["s2d", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c2"] + bn("bn2", 6), ["b2"]),             # (N, 6, 6, 6)
             helper.make_node("LayerNormalization", ["b2", "g"], ["ln"], axis=-1),
             helper.make_node("Softplus", ["ln"], ["sp"]),
             helper.make_node("ReduceSum", ["sp", "rax"], ["out"], keepdims=0)]                # (N, 6, 6)
    path = _save(tmp_path, nodes, inits)
    module = _matches_onnxruntime(path)
    x = torch.from_numpy(np.random.default_rng().standard_normal((1, C, H, W)).astype(F32))
    front = prepare(module, x, linear=LinearOptions())
    assert front.traced
    fused = {p.name: p.fused for p in front.plans if p.kind == "conv"}
    assert fused["conv1"] == ("bn", "relu") and fused["conv2"] == ("bn",)
    xs = torch.from_numpy(np.random.default_rng().standard_normal((3, C, H, W)).astype(F32))
    with torch.no_grad():
        assert relative_l2(front.module(xs).numpy(), module(xs).numpy()) <= 1e-5
