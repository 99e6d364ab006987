"""CPU: the operators `sparseconv run` added for exported CNNs (Resize,
ConvTranspose, HardSigmoid/HardSwish, Clip by attributes, and the shape and
reduction arithmetic), each against onnxruntime on small hand-built graphs;
and the import-time folding of static subgraphs (issue 14)."""
import numpy as np
import pytest

from sparseconv.model import ModelError, load_model
from sparseconv.runner import load_program, run_reference
from sparseconv.testing import pruned_weight, relative_l2

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

I64_MAX = np.iinfo(np.int64).max


def _save(tmp_path, nodes, inits, in_shape, opset=17, name="g.onnx"):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _check(path, x, input_size=None, tol=1e-5):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    (y,) = run_reference(load_program(path, input_size), x)
    assert y.shape == want.shape
    assert relative_l2(y, want) <= tol
    return y


def _stem(rng, c_in=2, c_out=3):
    """A 1x1 conv first: the runner needs at least one Conv."""
    return ([helper.make_node("Conv", ["x", "w0"], ["c"], name="stem")],
            {"w0": pruned_weight(rng, (c_out, c_in, 1, 1), 0.3)})


@pytest.mark.parametrize("coord", ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                                   "tf_half_pixel_for_nn", "half_pixel_symmetric"])
@pytest.mark.parametrize("mode,nearest", [("nearest", "round_prefer_floor"), ("nearest", "round_prefer_ceil"),
                                          ("nearest", "floor"), ("nearest", "ceil"), ("linear", None)])
@pytest.mark.parametrize("by", ["scales", "sizes"])
def test_resize_matches_onnxruntime(tmp_path, coord, mode, nearest, by):
    if coord == "tf_half_pixel_for_nn" and mode == "linear":
        pytest.skip("tf_half_pixel_for_nn is defined for nearest only")
    rng = np.random.default_rng()
    nodes, inits = _stem(rng)
    if by == "scales":
        inits["scales"] = np.array([1, 1, 2.0, 0.75], np.float32)
        ins = ["c", "", "scales"]
    else:
        inits["sizes"] = np.array([2, 3, 11, 4], np.int64)   # up along H, down along W
        ins = ["c", "", "", "sizes"]
    attrs = {"mode": mode, "coordinate_transformation_mode": coord}
    if nearest:
        attrs["nearest_mode"] = nearest
    nodes.append(helper.make_node("Resize", ins, ["out"], **attrs))
    path = _save(tmp_path, nodes, inits, [2, 2, 5, 7], opset=19)
    x = rng.standard_normal((2, 2, 5, 7)).astype(np.float32)
    if (coord, nearest, by) == ("half_pixel_symmetric", "ceil", "scales"):
        # A coordinate lands exactly on pixel 3: float64 (ours, as the spec
        # writes it) gives 3 + 4e-16, onnxruntime's float32 gives 3 or less,
        # and ceil picks neighbouring pixels. Checked at another width instead.
        x = x[..., :6]
        path = _save(tmp_path, nodes, inits, [2, 2, 5, 6], opset=19)
    _check(path, x)


@pytest.mark.parametrize("stride,pads,dilation,groups,out_pad", [
    ((2, 2), (0, 0, 0, 0), (1, 1), 1, (0, 0)),
    ((2, 1), (1, 0, 1, 2), (1, 1), 1, (1, 0)),
    ((3, 2), (1, 1, 1, 1), (2, 1), 2, (1, 1)),
    ((1, 1), (0, 0, 0, 0), (1, 1), 3, (0, 0))])
def test_conv_transpose_matches_onnxruntime(tmp_path, stride, pads, dilation, groups, out_pad):
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 6)
    inits["wt"] = rng.standard_normal((6, 4 // groups if groups != 3 else 2, 3, 2)).astype(np.float32)
    inits["bt"] = rng.standard_normal((inits["wt"].shape[1] * groups,)).astype(np.float32)
    nodes.append(helper.make_node("ConvTranspose", ["c", "wt", "bt"], ["out"], strides=list(stride), pads=list(pads),
                                  dilations=list(dilation), group=groups, output_padding=list(out_pad)))
    path = _save(tmp_path, nodes, inits, [2, 2, 4, 5])
    _check(path, rng.standard_normal((2, 2, 4, 5)).astype(np.float32))


def test_recogniser_style_shape_and_reduction_ops_match_onnxruntime(tmp_path):
    """What an exported text recogniser adds after its convs: a LayerNorm
    written out (ReduceMean, Sub, Pow, Sqrt, Div), Squeeze, Transpose,
    MatMul, Slice with steps and INT64_MAX ends, Cast, Pad, Max/Min/Neg/Exp."""
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 4)
    inits.update({"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
                  "ax1": np.array([1], np.int64), "ax2": np.array([2], np.int64),
                  "mm": rng.standard_normal((4, 3)).astype(np.float32),
                  "st": np.array([1], np.int64), "en": np.array([I64_MAX], np.int64), "sp": np.array([2], np.int64),
                  "pads": np.array([0, 1, 0, 0, 2, 0], np.int64), "half": np.array(0.5, np.float32)})
    nodes += [
        helper.make_node("ReduceMean", ["c", "ax1"], ["mu"], keepdims=1),
        helper.make_node("Sub", ["c", "mu"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]),
        helper.make_node("ReduceMean", ["d2", "ax1"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Squeeze", ["n", "ax2"], ["sq"]),             # (N, 4, W)
        helper.make_node("Transpose", ["sq"], ["tr"], perm=[0, 2, 1]),  # (N, W, 4)
        helper.make_node("MatMul", ["tr", "mm"], ["seq"]),              # (N, W, 3)
        helper.make_node("Slice", ["seq", "st", "en", "ax1", "sp"], ["sl"]),
        helper.make_node("Cast", ["sl"], ["cf"], to=TensorProto.FLOAT),
        helper.make_node("Pad", ["cf", "pads", "half"], ["pd"]),
        helper.make_node("Neg", ["pd"], ["ng"]),
        helper.make_node("Exp", ["ng"], ["ex"]),
        helper.make_node("Max", ["ex", "pd", "half"], ["mx"]),
        helper.make_node("Min", ["mx", "two"], ["mn"]),
        helper.make_node("ReduceSum", ["mn"], ["out"], keepdims=0, noop_with_empty_axes=0),
    ]
    path = _save(tmp_path, nodes, inits, [2, 2, 1, 9], opset=18)
    _check(path, rng.standard_normal((2, 2, 1, 9)).astype(np.float32))


def test_resize_to_a_size_computed_by_shape_arithmetic(tmp_path):
    """FPN-style: Shape -> Slice -> Cast -> Concat gives Resize its sizes; with
    the image size free, --input-size sizes the conv after it."""
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 3)
    inits.update({"s0": np.array([0], np.int64), "s2": np.array([2], np.int64), "e4": np.array([4], np.int64),
                  "nc": np.array([2, 3], np.int64), "w1": pruned_weight(rng, (2, 3, 3, 3), 0.5)})
    nodes += [helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("Shape", ["x"], ["shx"]),
              helper.make_node("Slice", ["shx", "s2", "e4", "s0"], ["hw"]),
              helper.make_node("Cast", ["hw"], ["hw64"], to=TensorProto.INT64),
              helper.make_node("Concat", ["nc", "hw64"], ["size"], axis=0),
              helper.make_node("Resize", ["p", "", "", "size"], ["up"], mode="linear",
                               coordinate_transformation_mode="pytorch_half_pixel"),
              helper.make_node("Conv", ["up", "w1"], ["out"], name="after_resize", pads=[1, 1, 1, 1])]
    path = _save(tmp_path, nodes, inits, [2, 2, "H", "W"])
    with pytest.raises(ModelError, match="no static input size.*--input-size"):
        load_model(path)
    layer = load_model(path, input_size=(10, 14)).layers[-1]
    assert (layer.name, layer.shape.in_h, layer.shape.in_w) == ("after_resize", 10, 14)
    _check(path, rng.standard_normal((2, 2, 10, 14)).astype(np.float32), input_size=(10, 14))


def test_clip_attributes_and_hard_activations(tmp_path):
    """ReLU6 as Clip with min/max attributes (opset 6-10), HardSigmoid with its
    alpha/beta, HardSwish."""
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 3)
    nodes += [helper.make_node("Clip", ["c"], ["r6"], min=0.0, max=6.0),
              helper.make_node("HardSigmoid", ["c"], ["hs"], alpha=0.3, beta=0.4),
              helper.make_node("Mul", ["r6", "hs"], ["m"]),
              helper.make_node("Identity", ["m"], ["out"])]
    path = _save(tmp_path, nodes, inits, [2, 2, 4, 4], opset=10)
    _check(path, 4 * rng.standard_normal((2, 2, 4, 4)).astype(np.float32))
    nodes, inits = _stem(rng, 2, 3)
    nodes.append(helper.make_node("HardSwish", ["c"], ["out"]))
    path = _save(tmp_path, nodes, inits, [2, 2, 4, 4], name="hswish.onnx")
    _check(path, 4 * rng.standard_normal((2, 2, 4, 4)).astype(np.float32))


def test_static_subgraph_is_folded_once_for_compile_and_run(tmp_path):
    """A weight stored transposed in a Constant node and put right by
    Transpose, a bias reshaped from (1, K): compile/inspect and run see the
    folded values, and unnamed nodes keep the names of their file positions."""
    rng = np.random.default_rng()
    w = pruned_weight(rng, (4, 2, 3, 3), 0.8)
    b = rng.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["wt"], value=numpy_helper.from_array(w.transpose(3, 2, 1, 0), "wt")),
             helper.make_node("Transpose", ["wt"], ["w"], perm=[3, 2, 1, 0]),
             helper.make_node("Reshape", ["b2", "kshape"], ["b"]),
             helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),   # unnamed: "conv3"
             helper.make_node("Relu", ["c"], ["out"])]
    path = _save(tmp_path, nodes, {"b2": b.reshape(1, 4), "kshape": np.array([4], np.int64)}, [1, 2, 6, 6])
    (layer,) = load_model(path).layers
    assert layer.name == "conv3"
    np.testing.assert_array_equal(layer.weight, w)
    np.testing.assert_array_equal(layer.bias, b)
    program = load_program(path)
    assert [n.name for n in program.nodes] == ["conv3", "relu4"]
    _check(path, rng.standard_normal((1, 2, 6, 6)).astype(np.float32))


def test_a_broken_static_subgraph_names_the_node(tmp_path):
    rng = np.random.default_rng()
    nodes = [helper.make_node("Reshape", ["w9", "bad"], ["w"], name="reshape_weight"),
             helper.make_node("Conv", ["x", "w"], ["out"], name="c")]
    path = _save(tmp_path, nodes, {"w9": pruned_weight(rng, (2, 1, 3, 3), 0.5), "bad": np.array([5, 5], np.int64)},
                 [1, 1, 6, 6])
    with pytest.raises(ModelError, match="reshape_weight"):
        load_model(path)


def test_weight_computed_from_the_input_is_refused(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["w"]), helper.make_node("Conv", ["x", "w"], ["out"], name="dyn")]
    path = _save(tmp_path, nodes, {}, [1, 1, 3, 3])
    with pytest.raises(ModelError, match="dyn: the weight is computed from the graph input"):
        load_model(path)


@pytest.mark.parametrize("op,attrs,why", [
    ("Resize", {"mode": "cubic"}, "Resize mode 'cubic'"),
    ("Resize", {"coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
    ("ConvTranspose", {"output_shape": [8, 8]}, "output_shape"),
    ("Pad", {"mode": "reflect"}, r"Pad mode 'reflect' is not supported \(constant is\)"),  # as text, not b'...'
])
def test_unsupported_attributes_are_refused_at_load_naming_the_node(tmp_path, op, attrs, why):
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 2)
    if op == "Resize":
        inits["sc"] = np.array([1, 1, 2, 2], np.float32)
        nodes.append(helper.make_node(op, ["c", "", "sc"], ["out"], name="the_node", **attrs))
    elif op == "ConvTranspose":
        inits["wt"] = np.ones((2, 2, 2, 2), np.float32)
        nodes.append(helper.make_node(op, ["c", "wt"], ["out"], name="the_node", strides=[2, 2], **attrs))
    else:
        inits["pads"] = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
        nodes.append(helper.make_node(op, ["c", "pads"], ["out"], name="the_node", **attrs))
    path = _save(tmp_path, nodes, inits, [1, 2, 4, 4])
    with pytest.raises(ModelError, match=f"the_node: .*{why}"):
        load_program(path)


@pytest.mark.parametrize("auto_pad,kernel,stride,size", [("SAME_UPPER", 3, 1, 12), ("SAME_LOWER", 5, 1, 9),
                                                         ("VALID", 3, 2, 11), ("SAME_UPPER", 3, 2, 11)])
def test_conv_auto_pad_becomes_explicit_pads(tmp_path, auto_pad, kernel, stride, size):
    """auto_pad (tf2onnx writes it) is read as the pads it stands for."""
    rng = np.random.default_rng()
    nodes = [helper.make_node("Conv", ["x", "w"], ["out"], name="c", auto_pad=auto_pad, strides=[stride, stride])]
    path = _save(tmp_path, nodes, {"w": pruned_weight(rng, (3, 2, kernel, kernel), 0.5)}, [1, 2, size, size])
    _check(path, rng.standard_normal((1, 2, size, size)).astype(np.float32))


@pytest.mark.parametrize("pads,auto_pad,stride", [([0, 0, 1, 1], None, 1), (None, "SAME_UPPER", 1)])
def test_asymmetric_padding_is_refused_up_front_naming_the_limit(tmp_path, pads, auto_pad, stride):
    from click.testing import CliRunner

    from sparseconv.cli import main

    rng = np.random.default_rng()
    attrs = {"pads": pads} if pads else {"auto_pad": auto_pad}
    nodes = [helper.make_node("Conv", ["x", "w"], ["out"], name="odd_pad", strides=[stride, stride], **attrs)]
    path = _save(tmp_path, nodes, {"w": pruned_weight(rng, (3, 2, 2, 2), 0.5)}, [1, 2, 8, 8])
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(out), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and "odd_pad" in r.output and "symmetric" in r.output
    assert not out.exists()


@pytest.mark.nvcc
@pytest.mark.parametrize("wshape,hw,stride,pad,dil,groups", [
    ((8, 2, 1, 1), (1, 1), 1, 0, 1, 1), ((2, 8, 1, 1), (1, 1), 1, 0, 1, 1),   # squeeze-excite on a 1x1 input
    ((64, 1, 1, 1), (1, 1), 1, 0, 1, 1), ((64, 1, 1, 1), (4, 4), 1, 0, 1, 1),  # one input channel
    ((8, 2, 1, 1), (5, 3), 1, 0, 1, 1), ((6, 2, 1, 1), (1, 1), 1, 0, 1, 3),
    ((4, 3, 3, 3), (1, 1), 1, 1, 1, 1),                                       # kernel larger than the input
    ((8, 1, 7, 7), (2, 2), 1, 3, 1, 8),                                       # late depthwise 7x7
    ((4, 4, 3, 3), (2, 3), 2, 2, 2, 1), ((16, 1, 3, 3), (1, 7), 1, 1, 1, 16)])
def test_small_and_one_channel_geometries_compile_and_compute(tmp_path, wshape, hw, stride, pad, dil, groups,
                                                              session_cache_dir):
    """Geometries exported CNNs have and issue 14 found failing: squeeze-
    excite 1x1 convs (2 -> 8 channels on a 1x1 input), 1x1 convs with one
    input channel, kernels larger than their input. Each compiles, and its
    kernel, run in the PTX interpreter, matches the dense conv."""
    from sparseconv.build import build_conv2d
    from sparseconv.cache import ArtifactCache
    from sparseconv.shapes import shape_from_weight
    from sparseconv.testing import conv2d_reference

    from ptx_interpreter import run_kernel

    rng = np.random.default_rng()
    w = pruned_weight(rng, wshape, 0.5)
    shape = shape_from_weight(w, hw, stride, pad, dil, groups)
    cache = ArtifactCache(session_cache_dir)
    built = build_conv2d(w, shape, cache=cache, name="small")
    x = rng.standard_normal((2, shape.in_channels) + hw).astype(np.float32)
    y = np.full((2, shape.out_channels, shape.out_h, shape.out_w), np.nan, np.float32)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    run_kernel(cache.get_text("kernel", built.ptx_sha256, ".ptx"), built.entry, grid=built.grid(2),
               block=(built.tiling.threads, 1, 1), args=[x, y, bias, 0, 2, built.chunks],
               dynamic_shared_bytes=built.shared_bytes)
    want = conv2d_reference(x.astype(np.float64), w, bias, (stride, stride), (pad, pad), (dil, dil), groups)
    assert relative_l2(y, want) <= 1e-6


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_opset_20_and_erf_without_scipy(tmp_path, monkeypatch, approximate):
    """Gelu (opset 20) both ways; Erf falls back to math.erf where SciPy is
    not installed (it is no dependency)."""
    import sys

    from sparseconv import onnx_ops

    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 3)
    nodes += [helper.make_node("Gelu", ["c"], ["g"], approximate=approximate),
              helper.make_node("Erf", ["g"], ["out"])]
    path = _save(tmp_path, nodes, inits, [2, 2, 3, 5], opset=20)
    x = 2 * rng.standard_normal((2, 2, 3, 5)).astype(np.float32)
    with_scipy = _check(path, x)
    monkeypatch.setitem(sys.modules, "scipy.special", None)  # import fails
    np.testing.assert_allclose(onnx_ops.erf(np, np.array([-1.0, 0.5])), [-0.8427007929497149, 0.5204998778130465],
                               rtol=1e-15)
    # the two erfs differ by an ulp here and there; Gelu's 1 + erf(x / sqrt 2) cancels where x is very
    # negative, so an ulp of erf (times |x| / 2) can be 1e-13 of a result near zero (session 49's CI run)
    np.testing.assert_allclose(_check(path, x), with_scipy, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_channel_shuffling_split_and_activations_match_onnxruntime(tmp_path, mode):
    """DepthToSpace/SpaceToDepth (pixel shuffle), Split into sizes and into
    equal parts (ShuffleNet, YOLO C2f), PRelu, Elu, Softplus,
    InstanceNormalization."""
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 8)
    inits.update({"sizes": np.array([3, 5], np.int64), "slope": rng.random((8, 1, 1)).astype(np.float32),
                  "in_s": rng.random(8).astype(np.float32) + 0.5, "in_b": rng.standard_normal(8).astype(np.float32)})
    nodes += [helper.make_node("PRelu", ["c", "slope"], ["p"]),
              helper.make_node("DepthToSpace", ["p"], ["d2s"], blocksize=2, mode=mode),   # (N, 2, 8, 12)
              helper.make_node("SpaceToDepth", ["d2s"], ["s2d"], blocksize=2),           # (N, 8, 4, 6)
              helper.make_node("Split", ["s2d", "sizes"], ["a", "b"], axis=1),
              helper.make_node("Split", ["b"], ["b1", "b2"], axis=3),
              helper.make_node("Elu", ["b1"], ["e"], alpha=0.7),
              helper.make_node("Softplus", ["b2"], ["sp"]),
              helper.make_node("Concat", ["e", "sp"], ["b3"], axis=3),
              helper.make_node("Concat", ["a", "b3"], ["cat"], axis=1),
              helper.make_node("InstanceNormalization", ["cat", "in_s", "in_b"], ["out"], epsilon=1e-3)]
    path = _save(tmp_path, nodes, inits, [2, 2, 4, 6], opset=13)
    _check(path, 3 * rng.standard_normal((2, 2, 4, 6)).astype(np.float32))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_of_old_exports_matches_onnxruntime(tmp_path, mode):
    rng = np.random.default_rng()
    nodes, inits = _stem(rng, 2, 3)
    inits["scales"] = np.array([1, 1, 2, 3], np.float32)
    nodes.append(helper.make_node("Upsample", ["c", "scales"], ["out"], mode=mode))
    path = _save(tmp_path, nodes, inits, [2, 2, 3, 5], opset=9)
    _check(path, rng.standard_normal((2, 2, 3, 5)).astype(np.float32))


@pytest.mark.nvcc
@pytest.mark.parametrize("a_shape, b_shape", [((5, 37), (37, 20)), ((2, 3, 17, 9), (9, 18)), ((33,), (33, 4)),
                                              ((1, 19, 40), (3, 40, 1))])
def test_capture_matmul_kernel_computes_numpys_matmul(a_shape, b_shape):
    """The fp32 matmul kernel the GPU run uses inside a CUDA-graph capture
    (CuPy refuses cuBLAS there), run in the PTX interpreter on the batched,
    broadcast and partial-tile shapes matmul() hands it."""
    from ptx_interpreter import run_kernel
    from sparseconv.compile import compile_to_ptx
    from sparseconv.onnx_ops import _MATMUL_SOURCE
    from sparseconv.shapes import Target

    rng = np.random.default_rng()
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    a2 = a.reshape(1, -1) if a.ndim == 1 else a
    batch = np.broadcast_shapes(a2.shape[:-2], b.shape[:-2])
    m, k, n = a2.shape[-2], a2.shape[-1], b.shape[-1]
    count = int(np.prod(batch, dtype=np.int64))
    aa = np.ascontiguousarray(np.broadcast_to(a2, batch + (m, k))).reshape(count, m, k)
    bb = np.ascontiguousarray(np.broadcast_to(b, batch + (k, n))).reshape(count, k, n)
    out = np.full((count, m, n), np.nan, np.float32)
    ptx = compile_to_ptx(_MATMUL_SOURCE, Target(), "the capture matmul")
    run_kernel(ptx, "sc_matmul", ((n + 15) // 16, (m + 15) // 16, count), (16, 16, 1), [aa, bb, out, m, n, k])
    y = out.reshape(batch + (m, n))
    y = y[..., 0, :] if a.ndim == 1 else y
    # The fp32 dot-product error bound, (k + 1) * u * (|a| @ |b|) elementwise, rather than a relative L2 norm:
    # a four-output case with cancellation once measured 1.5e-6 relative L2 on a correct kernel.
    bound = (k + 1) * 2.0 ** -24 * np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64))
    assert y.shape == ref.shape and np.all(np.abs(y - ref) <= bound)
