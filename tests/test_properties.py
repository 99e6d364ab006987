"""Property-based tests (hypothesis) for shapes and arguments (issue 11).

Random small conv geometries either build and compute the convolution (the
specialised PTX run in the PTX interpreter against a float64 reference), or
are refused with a clear ValueError; random arguments never end in anything
but a result or a clear refusal. Examples are few (CI time): each geometry
costs an nvcc run."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sparseconv.build import build_conv2d  # noqa: E402
from sparseconv.cache import ArtifactCache  # noqa: E402
from sparseconv.cli import main  # noqa: E402
from sparseconv.limits import check_layer  # noqa: E402
from sparseconv.shapes import ConvShape, Tiling, kernel_shape, shape_from_weight  # noqa: E402
from sparseconv.specialise import arrange_weights  # noqa: E402

from ptx_interpreter import run_kernel  # noqa: E402
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2  # noqa: E402

SETTINGS = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def geometries(draw):
    groups = draw(st.integers(1, 4))
    cpg = draw(st.integers(1, 8 // groups))
    kpg = draw(st.integers(1, 8 // groups))
    return dict(weight_shape=(kpg * groups, cpg, draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                input_size=(draw(st.integers(1, 9)), draw(st.integers(1, 9))),
                stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                padding=(draw(st.integers(0, 2)), draw(st.integers(0, 2))),
                dilation=(draw(st.integers(1, 2)), draw(st.integers(1, 2))), groups=groups,
                sparsity=draw(st.sampled_from([0.0, 0.5, 0.9])), seed=draw(st.integers(0, 2 ** 16)))


@pytest.mark.nvcc
@settings(max_examples=15, **SETTINGS)
@given(g=geometries())
def test_random_geometries_compute_the_convolution_or_are_refused(g, session_cache_dir):
    rng = np.random.default_rng(g["seed"])
    w = pruned_weight(rng, g["weight_shape"], g["sparsity"])
    try:
        shape = shape_from_weight(w, g["input_size"], g["stride"], g["padding"], g["dilation"], g["groups"])
        check_layer(shape)
    except ValueError as exc:  # refused: with a reason a user can act on
        assert str(exc) and "\n" not in str(exc)
        return
    cache = ArtifactCache(session_cache_dir)
    built = build_conv2d(w, shape, cache=cache, name="prop")
    ptx = cache.get_text("kernel", built.ptx_sha256, ".ptx")
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    x = rng.standard_normal((1, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
    y = np.full((1, shape.out_channels, shape.out_h, shape.out_w), np.nan, np.float32)
    run_kernel(ptx, built.entry, grid=built.grid(1), block=(built.tiling.threads, 1, 1),
               args=[x, y, bias, 0, 1, built.chunks], dynamic_shared_bytes=built.shared_bytes)
    ref = conv2d_reference(x, w, bias, shape.stride, shape.padding, shape.dilation, shape.groups)
    assert not np.isnan(y).any(), "outputs left unwritten"
    assert relative_l2(y, ref) <= 1e-5


_ANY = st.one_of(st.integers(-2 ** 40, 2 ** 40), st.floats(allow_nan=True), st.booleans(), st.none(),
                 st.text(max_size=4), st.tuples(st.integers(-3, 3), st.integers(-3, 3)),
                 st.lists(st.integers(-3, 3), max_size=3))


@settings(max_examples=60, **SETTINGS)
@given(input_size=_ANY, stride=_ANY, padding=_ANY, dilation=_ANY, groups=_ANY)
def test_any_arguments_give_a_shape_or_a_clear_error(input_size, stride, padding, dilation, groups):
    w = np.ones((4, 2, 3, 3), np.float32)
    try:
        shape = shape_from_weight(w, input_size, stride, padding, dilation, groups)
        check_layer(shape)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        return
    assert shape.weight_shape == w.shape and shape.out_h >= 1 and shape.out_w >= 1


@settings(max_examples=40, **SETTINGS)
@given(size=st.one_of(st.text(max_size=12), st.from_regex(r"-?[0-9]{1,22}(x-?[0-9]{1,22})?", fullmatch=True)),
       groups=st.one_of(st.integers(-2, 2 ** 33), st.floats(allow_nan=False, allow_infinity=False, width=16),
                        st.text(max_size=3), st.none()))
def test_cli_sizes_and_spec_values_exit_0_or_2(tmp_path_factory, size, groups):
    """inspect (no build) with a random --input-size and a random spec groups: a
    table, or exit 2 with one Error line; never a traceback."""
    assume("\x00" not in size)
    folder = tmp_path_factory.mktemp("m")
    spec = [dict(name="conv", groups=groups)] if groups is not None else [dict(name="conv")]
    path = folder / "m.npz"
    np.savez(path, conv=np.ones((4, 2, 3, 3), np.float32),
             __spec__=np.frombuffer(json.dumps(spec).encode(), np.uint8))
    r = CliRunner().invoke(main, ["inspect", str(path), "--input-size", size])
    assert r.exit_code in (0, 2), (r.output, r.exception)
    assert "Traceback" not in r.output
    if r.exit_code == 2:
        assert len([line for line in r.output.splitlines() if line.startswith("Error:")]) == 1, r.output


@settings(max_examples=40, **SETTINGS)
@given(rows=st.integers(1, 12), cols=st.integers(1, 40), zero_fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_sparse_rows_hold_exactly_the_nonzero_weights_of_any_matrix(rows, cols, zero_fraction, seed):
    """The sparse gemv's entries (gemv.sparse_rows): every nonzero weight once,
    in row then column order, and the matrix back from them, for any shape
    and sparsity (empty rows, a full matrix, an all-zero one)."""
    from sparseconv.gemv import sparse_rows

    rng = np.random.default_rng(seed)
    w = pruned_weight(rng, (rows, cols), zero_fraction)
    r = sparse_rows(w)
    assert r.nnz == np.count_nonzero(w) and r.row_start[0] == 0 and r.row_start[-1] == r.nnz
    assert np.all(np.diff(r.row_start) >= 0) and np.array_equal(np.diff(r.row_start), np.count_nonzero(w, axis=1))
    assert np.array_equal(r.to_dense(), w)
    for i in range(rows):
        assert np.all(np.diff(r.entries[r.row_start[i]:r.row_start[i + 1], 0].astype(np.int64)) > 0)


@settings(max_examples=40, **SETTINGS)
@given(dims=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_onnx_reshape_and_flatten_follow_the_onnx_rules(dims, data):
    """onnx_torch's Reshape (0 copies a dimension, -1 infers one) and Flatten
    (2-D, the dimensions before axis in the first), against their ONNX
    definitions written with numpy."""
    torch = pytest.importorskip("torch")
    from sparseconv.onnx_torch import onnx_flatten, onnx_reshape

    x = torch.arange(int(np.prod(dims)), dtype=torch.float32).reshape(dims)
    axis = data.draw(st.integers(0, len(dims)))
    want = x.numpy().reshape(int(np.prod(dims[:axis])), -1)
    assert np.array_equal(onnx_flatten(x, axis).numpy(), want)
    keep = data.draw(st.integers(0, len(dims)))  # copy the first `keep` dimensions with 0, infer the rest with -1
    shape = [0] * keep + ([-1] if keep < len(dims) else [])
    assert np.array_equal(onnx_reshape(x, shape).numpy(), x.numpy().reshape(dims[:keep] + ([-1] if keep < len(dims)
                                                                                           else [])))


@st.composite
def onnx_chains(draw):
    """A random small CNN as ONNX nodes: a first conv, then convs (1x1 or
    3x3, strided, grouped), BN, activations, pools (ceil_mode too), a
    residual Add, a constant Mul, then GlobalAveragePool -> Flatten -> Gemm.
    Returns (nodes, inits, input shape (C, H, W))."""
    from onnx import helper

    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    c, h, w = draw(st.integers(1, 6)), draw(st.integers(4, 12)), draw(st.integers(4, 12))
    in_shape = (c, h, w)
    nodes, inits, cur, count = [], {}, "x", 0

    def name(prefix):
        nonlocal count
        count += 1
        return f"{prefix}{count}"

    kinds = ["conv"] + draw(st.lists(st.sampled_from(["conv", "bn", "act", "pool", "residual", "mul"]), max_size=5))
    for kind in kinds:
        out = name("v")
        if kind in ("conv", "residual"):
            k = draw(st.sampled_from([1, 3]))
            groups = draw(st.sampled_from([1, c])) if kind == "conv" else 1
            cout = c if kind == "residual" else groups * draw(st.integers(1, 3))
            stride = 1 if kind == "residual" else draw(st.integers(1, 2))
            wname = name("w")
            inits[wname] = pruned_weight(rng, (cout, c // groups, k, k), 0.6)
            conv_out = name("c") if kind == "residual" else out
            nodes.append(helper.make_node("Conv", [cur, wname], [conv_out], name=name("conv"), group=groups,
                                          pads=[k // 2] * 4, strides=[stride, stride]))
            if kind == "residual":
                nodes.append(helper.make_node("Add", [conv_out, cur], [out]))
            c, h, w = cout, (h - 1) // stride + 1, (w - 1) // stride + 1
        elif kind == "bn":
            names = [name(p) for p in ("s", "b", "m", "v")]
            for n_, lo, hi in zip(names, (0.5, -0.2, -0.1, 0.5), (1.5, 0.2, 0.1, 2.0)):
                inits[n_] = rng.uniform(lo, hi, c).astype(np.float32)
            nodes.append(helper.make_node("BatchNormalization", [cur] + names, [out], name=name("bn")))
        elif kind == "act":
            op = draw(st.sampled_from(["Relu", "LeakyRelu", "Sigmoid", "HardSwish", "Clip"]))
            if op == "Clip":
                lo, hi = name("lo"), name("hi")
                inits[lo], inits[hi] = np.array(-0.5, np.float32), np.array(0.75, np.float32)
                nodes.append(helper.make_node("Clip", [cur, lo, hi], [out]))
            else:
                nodes.append(helper.make_node(op, [cur], [out]))
        elif kind == "pool":
            k, ceil = draw(st.integers(2, 3)), draw(st.booleans())
            s_, p = draw(st.integers(1, 2)), draw(st.integers(0, 1))
            if min(h, w) + 2 * p < k:
                continue
            op = draw(st.sampled_from(["MaxPool", "AveragePool"]))
            extra = {"count_include_pad": draw(st.integers(0, 1))} if op == "AveragePool" else {}
            nodes.append(helper.make_node(op, [cur], [out], kernel_shape=[k, k], strides=[s_, s_], pads=[p] * 4,
                                          ceil_mode=int(ceil), **extra))
            size = [(n + 2 * p - k + (s_ - 1 if ceil else 0)) // s_ + 1 for n in (h, w)]
            if ceil:   # a last window that would start in the right padding is dropped
                size = [z - 1 if (z - 1) * s_ >= n + p else z for z, n in zip(size, (h, w))]
            h, w = size
        else:
            k = name("k")
            inits[k] = rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(np.float32)
            nodes.append(helper.make_node("Mul", [cur, k], [out]))
        cur = out
    inits["wf"] = rng.standard_normal((5, c)).astype(np.float32)
    inits["bf"] = rng.standard_normal(5).astype(np.float32)
    nodes += [helper.make_node("GlobalAveragePool", [cur], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
              helper.make_node("Gemm", ["f", "wf", "bf"], ["out"], name="fc", transB=1)]
    return nodes, inits, in_shape


@settings(max_examples=30, **SETTINGS)
@given(chain=onnx_chains(), batch=st.integers(1, 3))
def test_onnx_torch_matches_onnxruntime_on_random_cnns(tmp_path_factory, chain, batch):
    """Random small CNNs converted by onnx_torch (what `bench --network
    model.onnx` times) give onnxruntime's outputs, and so does the graph
    sparsify's front end makes of them (BN folded, epilogues fused)."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from onnx_models import save_model

    from sparseconv.fx import LinearOptions, prepare
    from sparseconv.onnx_torch import onnx_to_torch

    nodes, inits, shape = chain
    path = save_model(tmp_path_factory.mktemp("chain") / "chain.onnx", nodes, inits, ["N", *shape])
    x = np.random.default_rng(batch).standard_normal((batch, *shape)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    module, got_shape = onnx_to_torch(path)
    assert got_shape == shape
    with torch.no_grad():
        assert relative_l2(module(torch.from_numpy(x)).numpy(), want) <= 1e-5
        front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
        assert front.traced, front.trace_error
        assert relative_l2(front.module(torch.from_numpy(x)).numpy(), want) <= 1e-5


@settings(max_examples=40, deadline=None)
@given(groups_a_block=st.integers(2, 4), blocks=st.integers(1, 3), multiplier=st.integers(1, 3),
       k_block=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_depthwise_groups_a_block_are_the_same_conv_with_block_diagonal_weights(groups_a_block, blocks, multiplier,
                                                                             k_block, seed):
    """shapes.kernel_shape builds G depthwise groups a block as a grouped conv
    of G input channels a group; arrange_weights must put each output
    channel's weights at its own group's channel and zeros elsewhere, which
    is the same convolution (float64, any multiplier and k_block)."""
    g = groups_a_block * blocks
    shape = ConvShape(g, g * multiplier, 5, 6, 3, 3, padding=(1, 1), groups=g)
    tiling = Tiling(min(k_block, groups_a_block * multiplier), groups_a_block, 1, 32, 1, 1, 1, "pointwise")
    kshape = kernel_shape(shape, tiling)
    assert kshape == replace(shape, groups=blocks) and kernel_shape(kshape, tiling) == kshape
    rng = np.random.default_rng(seed)
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    merged = np.zeros(kshape.weight_shape, np.float32)  # written out channel by channel, apart from the code
    for k in range(shape.out_channels):
        merged[k, (k // multiplier) % groups_a_block] = w[k, 0]
    np.testing.assert_array_equal(arrange_weights(w, shape, tiling), arrange_weights(merged, kshape, tiling))
    x = rng.standard_normal((2, g, 5, 6))
    ref = conv2d_reference(x, w, padding=(1, 1), groups=g)
    assert relative_l2(conv2d_reference(x, merged, padding=(1, 1), groups=blocks), ref) < 1e-12
