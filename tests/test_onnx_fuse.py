"""CPU: the ONNX fusion pass (sparseconv/onnx_fuse.py). The fused program,
evaluated in float64 NumPy with its folded weights and epilogues, must give
what onnxruntime and the unfused float64 reference give, on ResNet-style toy
graphs and on real torch.onnx.export output; what must not fuse stays."""
import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx_toys import EXPECTED, NOTES, onnxruntime_all, toy, toy_input  # noqa: E402
from sparseconv.dense import fold_batchnorm  # noqa: E402
from sparseconv.onnx_fuse import RESIDUAL_INPUT, FusedConv, fuse_program  # noqa: E402
from sparseconv.runner import execute, load_program, run_reference  # noqa: E402
from sparseconv.testing import relative_l2  # noqa: E402


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fused_program_matches_onnxruntime_and_the_unfused_reference(tmp_path, name):
    path = toy(name, tmp_path)
    original = load_program(path)
    fused = fuse_program(original)
    assert {n: layer.fused for n, layer in fused.convs.items()} == EXPECTED[name]
    for conv, words in ((c, w) for (t, c), w in NOTES.items() if t == name):
        assert words in fused.convs[conv].note
    # One node less per fused BN/Add/activation; the original is untouched.
    absorbed = sum(len(f) for f in EXPECTED[name].values())
    assert len(fused.nodes) == len(original.nodes) - absorbed
    assert all(not isinstance(layer, FusedConv) for layer in original.convs.values())
    x = toy_input()
    want = onnxruntime_all(path, x)
    got, unfused = run_reference(fused, x), run_reference(original, x)
    assert len(got) == len(want) == len(unfused)
    for g, w, u in zip(got, want, unfused):
        assert g.shape == w.shape
        assert relative_l2(g, w) <= 1e-5
        assert relative_l2(g, u) <= 1e-6  # folded weights are rounded to float32 once


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_folding_keeps_every_zero_and_the_epilogue_says_what_was_fused(tmp_path, name):
    original = load_program(toy(name, tmp_path))
    fused = fuse_program(original)
    for conv, layer in fused.convs.items():
        before = original.convs[conv]
        assert layer.weight.dtype == np.float32 and layer.shape == before.shape
        assert np.array_equal(layer.weight == 0, before.weight == 0)   # sparsity unchanged
        assert layer.sparsity == before.sparsity
        if "bn" not in layer.fused:
            assert np.array_equal(layer.weight, before.weight)
        ep = layer.epilogue
        assert ep.residual == ("add" in layer.fused)
        assert ep.activation == next((a for a in layer.fused if a in ("relu", "relu6", "clip")), "none")
        assert ep.pool == ("maxpool" in layer.fused)


def test_bn_folding_formula_and_zeros():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 2, 3, 3))
    w[rng.random(w.shape) < 0.8] = 0
    gamma, beta, mean, var = rng.random(6) + 0.5, rng.standard_normal(6), rng.standard_normal(6), rng.random(6)
    fw, fb = fold_batchnorm(w, None, gamma, beta, mean, var, 1e-5)
    scale = gamma / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(fw, w * scale[:, None, None, None], rtol=1e-15)
    np.testing.assert_allclose(fb, beta - mean * scale, rtol=1e-14)
    assert np.array_equal(fw == 0, w == 0)
    x = rng.standard_normal((2, 3, 3))  # one output position: conv then BN == folded conv
    y = np.einsum("kcrs,crs->k", w, x)
    np.testing.assert_allclose(np.einsum("kcrs,crs->k", fw, x) + fb, (y - mean) * scale + beta, rtol=1e-12)


def test_clip_bounds_become_the_epilogue(tmp_path):
    fused = fuse_program(load_program(toy("clip", tmp_path)))
    eps = {n: (layer.epilogue.activation, layer.epilogue.clip) for n, layer in fused.convs.items()}
    assert eps == {"c6": ("relu6", None), "cc": ("clip", (-1.0, 1.5)), "cr": ("relu", None),
                   "cm": ("clip", (-np.inf, 1.5))}


def test_fused_conv_node_reads_the_residual_and_runs_where_the_add_was(tmp_path):
    fused = fuse_program(load_program(toy("resnet_shortcut", tmp_path)))
    order = [n.name for n in fused.nodes]
    assert order == ["c1", "down", "c2", "c3"]  # every BN, Add and Relu absorbed; c2 moved after down
    by_name = {n.name: n for n in fused.nodes}
    # c2 takes the projection shortcut (down's folded output), so it runs after down.
    assert by_name["c2"].inputs[RESIDUAL_INPUT:] == ("nd",) and by_name["c2"].outputs == ("r2",)
    assert by_name["down"].outputs == ("nd",) and len(by_name["down"].inputs) <= RESIDUAL_INPUT
    assert by_name["c3"].inputs[RESIDUAL_INPUT:] == ("r2",) and by_name["c3"].outputs == ("out",)
    assert fused.nodes[0].outputs == ("r1",)


def test_plan_says_what_was_fused_and_why_not(tmp_path):
    fused = fuse_program(load_program(toy("bn_two_readers", tmp_path)))
    plan = fused.plan({"c1": "sparseconv", "c2": "dense"})
    assert plan[0].startswith("c1: Conv C=4 K=8 8x8") and "(not bn1: c1 has 2 readers)" in plan[0]
    assert plan[0].endswith(", sparseconv")
    assert ", fused bn (not relu2: n2 has 2 readers), dense" in plan[1]
    assert "fused" not in "".join(load_program(toy("bn_two_readers", tmp_path)).plan())


def test_batchnorm_that_cannot_fold_stays(tmp_path):
    """variance + epsilon == 0 in one channel: folding would divide by zero,
    so the BatchNormalization stays a node of its own (as it would compute)."""
    import onnx
    from onnx import numpy_helper

    path = toy("conv_bn_relu", tmp_path)
    model = onnx.load(str(path))
    for t in model.graph.initializer:
        if t.name == "bn1_v":
            v = numpy_helper.to_array(t).copy()
            v[2] = -1e-3
            t.CopyFrom(numpy_helper.from_array(v, t.name))
    onnx.save(model, str(path))
    fused = fuse_program(load_program(path))
    assert fused.convs["c1"].fused == ()
    assert "bn1 not folded: folding gives weights or biases that are not finite" in fused.convs["c1"].note
    assert [n.op for n in fused.nodes] == ["Conv", "BatchNormalization", "Relu"]


@pytest.mark.parametrize("family", ["resnet_block", "mobilenetv3"])
def test_fusion_on_torch_exports_matches_onnxruntime(tmp_path, family):
    pytest.importorskip("torch")
    from onnx_families import export, inputs, onnxruntime_outputs

    path = export(family, tmp_path / f"{family}.onnx")
    original = load_program(path)
    fused = fuse_program(original)
    what = [layer.fused for layer in fused.convs.values()]
    if family == "resnet_block":  # relu(x + b2(c2(x))) and relu(c3(x) + down(x))
        assert sum("add" in f for f in what) == 2 and sum("relu" in f for f in what) >= 3
    else:                         # F.relu6 after the depthwise conv, ReLU in the squeeze-excite
        assert ("relu6",) in what and ("relu",) in what
    x = inputs(4)
    (got,), (unfused,) = run_reference(fused, x), run_reference(original, x)
    assert relative_l2(got, onnxruntime_outputs(path, x)) <= 1e-5
    assert relative_l2(got, unfused) <= 1e-6


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ["resnet_shortcut", "clip", "conv_relu_maxpool"])
def test_fused_kernels_in_the_ptx_interpreter_give_the_model_as_written(tmp_path, name):
    """The fused program run as the GPU runs it, on the CPU: each fused Conv
    a specialised kernel with its epilogue (residual add, clamp, 2x2 max pool
    at the store), interpreted; the other nodes in float32 NumPy. It must
    match the float64 reference of the unfused graph (what `--check`
    compares with)."""
    from ptx_interpreter import run_kernel
    from sparseconv.build import build_conv2d
    from sparseconv.cache import ArtifactCache
    from sparseconv.dense import max_pool_2x2
    from sparseconv.tilings import pools_in_kernel

    path = toy(name, tmp_path)
    fused = fuse_program(load_program(path))
    cache = ArtifactCache(tmp_path / "cache")

    def conv(layer, inp, residual=None):
        built = build_conv2d(layer.weight, layer.shape, cache=cache, name=layer.name, epilogue=layer.epilogue)
        assert built.tiling.slices == 1  # split variants add their slices outside the kernel
        s, n = layer.shape, inp.shape[0]
        in_kernel = layer.epilogue.pool and pools_in_kernel(s, built.tiling)  # else runtime pools after it
        hw = layer.epilogue.output_hw(s) if in_kernel else (s.out_h, s.out_w)
        y = np.full((n, s.out_channels) + hw, np.nan, np.float32)
        bias = layer.bias if layer.bias is not None else np.zeros(s.out_channels, np.float32)
        res = 0 if residual is None else np.ascontiguousarray(residual, np.float32)
        run_kernel(cache.get_text("kernel", built.ptx_sha256, ".ptx"), built.entry, grid=built.grid(n),
                   block=(built.tiling.threads, 1, 1),
                   args=[np.ascontiguousarray(inp, np.float32), y, bias, res, n, built.chunks],
                   dynamic_shared_bytes=built.shared_bytes)
        return max_pool_2x2(y) if layer.epilogue.pool and not in_kernel else y

    x = toy_input(2)
    (y,) = execute(fused, x, np, conv, np.float32)
    (ref,) = run_reference(load_program(path), x)
    assert not np.isnan(y).any()
    assert relative_l2(y, ref) <= 1e-5


def test_inspect_says_what_run_folds_and_fuses(tmp_path):
    from click.testing import CliRunner
    from sparseconv.cli import main

    r = CliRunner().invoke(main, ["inspect", str(toy("resnet_shortcut", tmp_path))])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    # compile builds the layers as written
    assert [line.split("  ")[-1].split(" (")[0] for line in lines[2:6]] == ["compile"] * 4
    assert lines[6] == ("sparseconv run: 4 BatchNormalization folded, 2 residual adds and 3 activations fused "
                        "into the conv kernels (4 of 4 convs)")
    assert lines[7:-1] == ["  c1: bn+relu", "  c2: bn+add+relu", "  down: bn", "  c3: bn+add+relu"]
    assert lines[-1].startswith("fx front end (`run`, `bench --network`): converts to a torch.fx graph of 4 convs")
    r = CliRunner().invoke(main, ["inspect", str(toy("conv_is_output", tmp_path))])
    assert "  c1: nothing (not relu1: c1 is a graph output)" in r.output.splitlines()


def test_resnet50_export_fuses_every_bn_add_and_relu(tmp_path):
    """The whole pruned ResNet-50 (BN kept by the exporter): 53 convs, each
    with its BN folded; 16 residual adds and 49 ReLUs fused; only the stem's
    MaxPool, the head and nothing else left beside the convs."""
    torch = pytest.importorskip("torch")
    import warnings

    from sparseconv.zoo_torch import build_network

    path = tmp_path / "r50.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(build_network("resnet50").eval(), (torch.zeros(1, 3, 32, 32),), str(path), dynamo=False,
                          opset_version=17, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, do_constant_folding=False)
    original = load_program(path)
    assert sum(n.op == "BatchNormalization" for n in original.nodes) == 53
    fused = fuse_program(original)
    parts = [p for layer in fused.convs.values() for p in layer.fused]
    assert (parts.count("bn"), parts.count("add"), parts.count("relu")) == (53, 16, 49)
    assert sorted({n.op for n in fused.nodes}) == ["Conv", "Flatten", "Gemm", "GlobalAveragePool", "MaxPool"]
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    (got,), (unfused,) = run_reference(fused, x), run_reference(original, x)
    assert relative_l2(got, unfused) <= 1e-6


@pytest.mark.parametrize("case", ["clip_attrs_opset10", "clip_bound_from_the_input", "bn_training_outputs"])
def test_clip_attributes_fuse_and_run_time_bounds_do_not(tmp_path, case):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from sparseconv.testing import pruned_weight

    rng = np.random.default_rng(7)
    inits = {"w": pruned_weight(rng, (4, 4, 3, 3), 0.6), "zero": np.array(0.0, np.float32)}
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="c", pads=[1, 1, 1, 1])
    opset = 17
    if case == "clip_attrs_opset10":   # before opset 11 the bounds were attributes
        opset, inits = 10, {"w": inits["w"]}
        nodes = [conv, helper.make_node("Clip", ["c"], ["out"], name="clip", min=0.0, max=6.0)]
        want, note = ("relu6",), ""
    elif case == "clip_bound_from_the_input":
        nodes = [conv, helper.make_node("ReduceMax", ["x"], ["m"], name="rmax", keepdims=0),
                 helper.make_node("Clip", ["c", "zero", "m"], ["out"], name="clip")]
        want, note = (), "not clip: its bounds are computed at run time"
    else:                              # a training-mode BatchNormalization also writes its running statistics
        for k in ("s", "b", "m", "v"):
            inits[k] = (rng.random(4) + 0.5).astype(np.float32)
        nodes = [conv, helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["out", "rm", "rv"],
                                        name="bn", training_mode=1)]
        want, note = (), "bn not folded: it runs in training mode"
    graph = helper.make_graph(nodes, case, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / f"{case}.onnx"
    onnx.save(model, str(path))
    original = load_program(path)
    fused = fuse_program(original)
    assert fused.convs["c"].fused == want and fused.convs["c"].note == note
    if case != "bn_training_outputs":  # the runner evaluates BN in inference form either way
        x = toy_input(2)[:, :, :6, :6].copy()
        (got,), (ref,) = run_reference(fused, x), run_reference(original, x)
        assert relative_l2(got, onnxruntime_all(path, x)[0]) <= 1e-5 and relative_l2(got, ref) <= 1e-6


# MaxPool attributes -> whether the pool fuses (fx._fused_pool's rule) and the plan's note where not. The conv
# (3x3, pads 1) keeps its input's size: 6x6, or 7x7 where the case says so.
POOLS = {
    "2x2_stride_2": (dict(kernel_shape=[2, 2], strides=[2, 2]), True, ""),
    "zero_pads_and_defaults_written": (dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 0, 0], dilations=[1, 1],
                                            ceil_mode=0, storage_order=0), True, ""),
    "odd_sides_floor": (dict(kernel_shape=[2, 2], strides=[2, 2]), True, ""),           # floor drops the last row
    "ceil_mode_even_sides": (dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), True, ""),  # as floor mode
    "ceil_mode_odd_sides": (dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), False, "ceil_mode=1 on a 7x7"),
    "pads": (dict(kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 1, 1]), False, "pads [0, 0, 1, 1]"),
    "stride_1": (dict(kernel_shape=[2, 2], strides=[1, 1]), False, "strides [1, 1]"),
    "strides_absent": (dict(kernel_shape=[2, 2]), False, "strides [1, 1]"),            # ONNX's default is 1
    "kernel_3": (dict(kernel_shape=[3, 3], strides=[2, 2]), False, "kernel_shape [3, 3]"),
    "storage_order": (dict(kernel_shape=[2, 2], strides=[2, 2], storage_order=1), False, "storage_order=1"),
    "indices_unused": (dict(kernel_shape=[2, 2], strides=[2, 2]), True, ""),
    "indices_read": (dict(kernel_shape=[2, 2], strides=[2, 2]), False, "its Indices output is read"),
    "two_readers": (dict(kernel_shape=[2, 2], strides=[2, 2]), False, "not pool: r has 2 readers"),
}


def _conv_relu_pool(tmp_path, case):
    """x -> Conv c -> Relu r -> MaxPool (POOLS[case]) -> out, as an ONNX file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from sparseconv.testing import pruned_weight

    rng = np.random.default_rng(11)
    side = 7 if case in ("odd_sides_floor", "ceil_mode_odd_sides") else 6
    inits = {"w": pruned_weight(rng, (8, 4, 3, 3), 0.6), "b": rng.standard_normal(8).astype(np.float32)}
    pool_out = ["out", "idx"] if case.startswith("indices") else ["out"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="c", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], pool_out, name="pool", **POOLS[case][0])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if case == "indices_read":
        outputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, None))
    if case == "two_readers":
        nodes.append(helper.make_node("ReduceMax", ["r"], ["m"], name="rmax", keepdims=0))
        outputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, side, side])
    graph = helper.make_graph(nodes, case, [x], outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"{case}.onnx"
    onnx.save(model, str(path))
    return path, side


@pytest.mark.parametrize("case", sorted(POOLS))
def test_max_pool_fuses_under_fx_rule_only_and_computes_the_same(tmp_path, case):
    """A qualifying MaxPool becomes the conv's epilogue pool: its node is gone
    and the fused conv writes its output name, pooled; any other stays a node
    of its own, with the reason in the plan. Either way the fused program's
    float64 result is the graph's (onnxruntime and the unfused reference)."""
    from sparseconv.onnx_fuse import fusion_lines

    _, fuses, note = POOLS[case]
    path, side = _conv_relu_pool(tmp_path, case)
    original = load_program(path)
    fused = fuse_program(original)
    layer = fused.convs["c"]
    assert layer.fused == (("relu", "maxpool") if fuses else ("relu",))
    assert layer.epilogue.pool == fuses and layer.epilogue.activation == "relu"
    assert (note in layer.note) if note else layer.note == ""
    ops = [n.op for n in fused.nodes]
    if fuses:
        assert "MaxPool" not in ops and fused.nodes[0].op == "Conv" and fused.nodes[0].outputs == ("out",)
        assert layer.epilogue.output_hw(layer.shape) == (side // 2, side // 2) == fused.shapes["out"][2:]
        assert ", fused relu+maxpool, " in fused.plan()[0]
        assert fusion_lines(fused.convs)[0].startswith(
            "0 BatchNormalization folded, 0 residual adds, 1 activations and 1 max pools fused")
    else:
        assert ops.count("MaxPool") == 1 and ", fused relu (not pool: " in fused.plan()[0]
    if case == "indices_read":
        return  # the runner's MaxPool writes no Indices: there is nothing to evaluate
    x = np.random.default_rng(5).standard_normal((3, 4, side, side)).astype(np.float32)
    got, unfused, want = run_reference(fused, x), run_reference(original, x), onnxruntime_all(path, x)
    for g, u, w in zip(got, unfused, want):
        assert g.shape == u.shape == w.shape
        assert relative_l2(g, u) <= 1e-12  # the same float64 sums: the epilogue's clamp and pool are exact
        assert relative_l2(g, w) <= 1e-5
