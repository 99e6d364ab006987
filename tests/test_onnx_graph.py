"""CPU: what the ONNX runner's CUDA-graph and routing work needs and can be
checked without a GPU: constants converted once (not per call), float
parameters read on the host kept on the host, host tables uploaded once, the
route chosen from measured times, the plan's text, the CLI's options and
errors. The graph replays and the timing itself: tests/test_gpu_onnx_graph.py."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.cli import main
from sparseconv.routing import RouteChoice, choose_route
from sparseconv.tilings import ANY_BATCH
from sparseconv.testing import pruned_weight, relative_l2

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from onnx_models import save_model  # noqa: E402

from shipped_models import DIGITS, LENET  # noqa: E402
from sparseconv.runner import (SparseModel, UploadOnce, execute, compile_model, conv2d_dense,  # noqa: E402
                               load_program, prepare_constants, route_kernels)


def _graph(tmp_path):
    """Conv -> BN -> Clip (bounds as constant inputs) -> Resize (scales as a
    constant input) -> Mul by a constant -> Reshape: float constants of both
    kinds, computed with and read on the host."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    inits = {
        "w": pruned_weight(rng, (4, 3, 3, 3), 0.6), "b": rng.standard_normal(4).astype(f32),
        "s": rng.random(4).astype(f32) + 0.5, "bb": rng.standard_normal(4).astype(f32),
        "m": rng.standard_normal(4).astype(f32), "v": rng.random(4).astype(f32) + 0.5,
        "lo": np.array(-0.5, f32), "hi": np.array(2.0, f32),
        "scales": np.array([1, 1, 2, 2], f32), "c": rng.standard_normal((1, 4, 1, 1)).astype(f32),
        "shape": np.array([0, -1], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"]),
        helper.make_node("Clip", ["n1", "lo", "hi"], ["k1"]),
        helper.make_node("Resize", ["k1", "", "scales"], ["z1"], mode="nearest"),
        helper.make_node("Mul", ["z1", "c"], ["m1"]),
        helper.make_node("Reshape", ["m1", "shape"], ["out"]),
    ]
    return save_model(tmp_path / "g.onnx", nodes, inits, ["N", 3, 6, 6])


class _CountingNumPy:
    """NumPy, counting the arrays asarray() converts (what an upload would be on the GPU)."""

    def __init__(self):
        self.converted = []

    def __getattr__(self, name):
        return getattr(np, name)

    def asarray(self, a, dtype=None):
        self.converted.append(np.shape(a))
        return np.asarray(a, dtype=dtype)


def test_execute_converts_only_the_input_per_call_with_prepared_constants(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = _graph(tmp_path)
    program = load_program(path)
    xp = _CountingNumPy()
    constants = prepare_constants(program, xp, np.float64)
    assert len(xp.converted) == 5  # once: the BN's four and the Mul's constant (see the next test)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    run_xp = UploadOnce(xp)  # as SparseModel runs: host tables (Resize's indices) uploaded once
    for i, batch in enumerate((2, 2, 5)):
        xp.converted.clear()
        x = rng.standard_normal((batch, 3, 6, 6))
        (y,) = execute(program, x, run_xp, conv2d_dense, np.float64, constants)
        # The input (new each call), the Resize index table on the first call only
        # (6 -> 12 along both axes: one table), never a constant.
        assert xp.converted == [x.shape] + [(12,)] * (i == 0)
        assert relative_l2(y, sess.run(None, {"x": x.astype(np.float32)})[0]) <= 1e-5


def test_float_constants_read_on_the_host_stay_numpy_and_conv_weights_stay_put(tmp_path):
    program = load_program(_graph(tmp_path))
    constants = prepare_constants(program, np, np.float64)
    converted = {name for name, a in constants.items() if a.dtype == np.float64}
    # BN parameters and the Mul's constant are computed with; the conv's weight and bias
    # live in its kernel; Clip bounds and Resize scales are read on the host; shape stays int.
    assert converted == {"s", "bb", "m", "v", "c"}
    assert all(constants[n] is program.constants[n] for n in ("w", "b", "lo", "hi", "scales", "shape"))


def test_upload_once_keeps_one_copy_per_content():
    xp = UploadOnce(np)
    idx = np.array([2, 0, 1], np.int64)
    first = xp.asarray(idx, dtype=np.float64)  # a converting copy, like an upload
    assert first is not idx and first.dtype == np.float64
    assert xp.asarray(idx.copy(), dtype=np.float64) is first  # same content: the same copy
    assert xp.asarray(np.array([2, 0, 2], np.int64), dtype=np.float64) is not first
    assert xp.asarray(idx) is not first  # another dtype asked: another copy
    assert xp.float32 is np.float32  # everything else is the wrapped module's


def test_choose_route_sends_each_batch_to_the_faster_path():
    times = {1: (5.0, 7.25), 64: (90.0, 40.0)}
    choice = choose_route(lambda b: times[b], [64, 1, 64])
    assert choice.route == ((8, "sparseconv"), (ANY_BATCH, "dense"))
    assert (choice.path(1), choice.path(8), choice.path(9), choice.path(1000)) == \
        ("sparseconv", "sparseconv", "dense", "dense")
    assert choice.action == "mixed" and choice.describe_route() == "<=8: sparseconv, else dense"
    assert choice.describe() == ("batch 1: sparseconv 5.0 us, cuDNN fp32 7.2 us; "
                                 "batch 64: sparseconv 90.0 us, cuDNN fp32 40.0 us")
    tie = choose_route(lambda b: (3.0, 3.0), [1])
    assert tie.route == ((ANY_BATCH, "sparseconv"),) and tie.action == "sparseconv"


@pytest.mark.parametrize("bad", [[0], [1.5], "64", [True], 64])
def test_compile_model_refuses_bad_route_batches_before_any_work(bad):
    with pytest.raises(ValueError, match="compile_model: route_batches must be a list or tuple of positive batch"):
        compile_model(Path("no-such-file.onnx"), route_batches=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_compile_model_refuses_a_table_option_that_is_not_a_bool(bad):
    with pytest.raises(TypeError, match="compile_model: table must be True or False"):
        compile_model(Path("no-such-file.onnx"), table=bad)


def test_without_torch_every_conv_keeps_its_kernel_and_the_plan_says_so(monkeypatch):
    program = load_program(LENET)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    routes, dense, tables, note = route_kernels(program, {}, [1, 64])
    assert routes == {} and dense == {} and tables == {} and "torch with CUDA is not installed" in note
    # Stand-ins for the loaded kernels (the real ones need a GPU): the plan reads .backend only.
    kernels = {name: SimpleNamespace(backend="sparseconv") for name in program.convs}
    plan = [line for line in SparseModel(program, kernels, route_note=note).plan
            if ": Conv " in line or line.startswith("routing")]  # LeNet's Gemm lines are the runner's (test_runner_linear)
    assert plan == [f"{name}: Conv {layer.shape.describe()}, sparseconv" for name, layer in program.convs.items()] \
        + [f"routing: {note}"]


def test_the_call_picks_the_routed_path_by_batch_and_the_plan_shows_the_times():
    program = load_program(LENET)
    first, second = program.convs
    kernels = {name: SimpleNamespace(backend="sparseconv") for name in program.convs}
    cudnn = SimpleNamespace(backend="dense")
    mixed = RouteChoice(((8, "sparseconv"), (ANY_BATCH, "dense")), ((1, 5.0, 7.0), (64, 90.0, 40.0)))
    kept = RouteChoice(((ANY_BATCH, "sparseconv"),), ((1, 2.0, 6.0), (64, 9.0, 12.0)), note="a note")
    model = SparseModel(program, kernels, routes={first: mixed, second: kept}, dense={first: cudnn})
    assert model.kernel(first, 1) is kernels[first] and model.kernel(first, 8) is kernels[first]
    assert model.kernel(first, 9) is cudnn and model.kernel(first, 64) is cudnn
    assert model.kernel(second, 64) is kernels[second]
    assert [line for line in model.plan if ": Conv " in line] == [
        f"{first}: Conv {program.convs[first].shape.describe()}, mixed (<=8: sparseconv, else dense; batch 1: "
        "sparseconv 5.0 us, cuDNN fp32 7.0 us; batch 64: sparseconv 90.0 us, cuDNN fp32 40.0 us)",
        f"{second}: Conv {program.convs[second].shape.describe()}, sparseconv at every batch size (batch 1: "
        "sparseconv 2.0 us, cuDNN fp32 6.0 us; batch 64: sparseconv 9.0 us, cuDNN fp32 12.0 us (a note))",
    ]


def test_the_call_takes_the_weight_table_where_routed_and_the_plan_shows_its_times():
    program = load_program(LENET)
    first, _ = program.convs
    kernels = {name: SimpleNamespace(backend="sparseconv") for name in program.convs}
    table = SimpleNamespace(backend="table")
    routed = RouteChoice(((8, "table"), (ANY_BATCH, "sparseconv")), ((1, 5.0, 7.0), (64, 90.0, 140.0)),
                         table_us=((1, 3.0),))
    model = SparseModel(program, kernels, routes={first: routed}, tables={first: table})
    assert model.kernel(first, 1) is table and model.kernel(first, 8) is table
    assert model.kernel(first, 9) is kernels[first]
    assert [line for line in model.plan if line.startswith(first)] == [
        f"{first}: Conv {program.convs[first].shape.describe()}, mixed (<=8: table, else sparseconv; batch 1: "
        "sparseconv 5.0 us, table 3.0 us, cuDNN fp32 7.0 us; batch 64: sparseconv 90.0 us, cuDNN fp32 140.0 us)"]


def test_the_json_route_summary_gives_the_table_time_where_it_was_timed():
    from sparseconv.cli import _route_summary

    routed = RouteChoice(((8, "table"), (ANY_BATCH, "sparseconv")), ((1, 5.0, 7.0), (64, 90.0, 140.0)),
                         table_us=((1, 3.0),))
    assert _route_summary(routed)["times_us"] == [
        {"batch": 1, "sparseconv": 5.0, "table": 3.0, "cudnn_fp32": 7.0},
        {"batch": 64, "sparseconv": 90.0, "cudnn_fp32": 140.0}]
    assert _route_summary(routed)["route"] == "<=8: table, else sparseconv" and _route_summary(None) is None


def test_run_has_the_routing_and_graph_options():
    r = CliRunner().invoke(main, ["run", "--help"])
    assert r.exit_code == 0
    for option in ("--route / --no-route", "--route-batch", "--table / --no-table", "--cuda-graph"):
        assert option in r.output


@pytest.mark.parametrize("extra, message", [
    (["--route-batch", "0"], "--route-batch"),
    (["--cuda-graph"], "--cuda-graph replays GPU work"),
])
def test_run_refuses_bad_routing_and_graph_options_with_exit_2(extra, message):
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--backend", "reference"] + extra)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_run_reference_ignores_routing_options():
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--backend", "reference", "--json",
                                  "--no-route", "--route-batch", "4"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["images"] == 450
