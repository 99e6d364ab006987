"""GPU: the ONNX runner's CUDA graphs (one per input shape, replayed) and its
routing by measurement against cuDNN strict fp32 (issue 13 item 3, issue 12
item 3). Graph replays must equal the eager run exactly, on fresh inputs and
two shapes; a kept output must survive the next call; a layer routed to cuDNN
must be captured too."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.testing import relative_l2
from shipped_models import DIGITS, LENET

pytestmark = pytest.mark.gpu


def _same(graphed, eager):
    """A replay computes what the eager run does, to fp32 rounding: the dense
    Gemm/MatMul/ConvTranspose products run torch's cuBLAS in both, which may
    pick another algorithm inside a capture (without torch, our own fp32
    kernel there: CuPy refuses cuBLAS in a capture), so not bit for bit."""
    import cupy as cp

    assert graphed.shape == eager.shape
    assert float(cp.linalg.norm(graphed - eager) / cp.linalg.norm(eager)) <= 1e-6

def test_graph_replays_equal_eager_runs_on_two_shapes_and_kept_outputs_survive(session_cache_dir):
    pytest.importorskip("onnx")
    import cupy as cp

    from sparseconv.runner import compile_model  # the runner's graphs and routes
    from sparseconv.runner import run_reference

    eager = compile_model(LENET, cache_dir=str(session_cache_dir), route_batches=None)
    graphed = compile_model(LENET, cache_dir=str(session_cache_dir), route_batches=None, cuda_graph=True)
    rng = cp.random.default_rng()
    kept = []
    for batch in (5, 5, 12, 5, 12):  # the second call of a shape replays its graph
        x = rng.random((batch, 1, 8, 8), dtype=cp.float32)
        y = graphed(x)
        _same(y, eager(x))
        assert relative_l2(y.get(), run_reference(graphed.program, x)[0]) <= 1e-5
        kept.append((x, y))
    assert graphed.graph_notes == {(5, 1, 8, 8): "captured", (12, 1, 8, 8): "captured"}
    for x, y in kept:  # no later replay overwrote an output the caller kept
        _same(y, eager(x))
    # A host (NumPy) input works the same way.
    xh = np.random.default_rng().random((5, 1, 8, 8), dtype=np.float32)
    _same(graphed(xh), eager(xh))
    assert any(line.startswith("CUDA graph for input 5x1x8x8: captured") for line in graphed.plan)


@pytest.mark.parametrize("family", ["mobilenetv3", "resnet_block", "unet_head"])
def test_exported_families_are_captured_and_replay_like_eager(tmp_path, family):
    """Squeeze-excite with Clip bounds as constants, a residual block with
    pooling and Gemm, a UNet head with Resize (index tables), ConvTranspose
    and Concat: each captured whole, and replays equal to the eager run."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from onnx_families import export, inputs, onnxruntime_outputs

    from sparseconv.runner import compile_model

    path = export(family, tmp_path / f"{family}.onnx", "constants")
    eager = compile_model(path, cache_dir=str(tmp_path / "cache"), route_batches=None)
    graphed = compile_model(path, cache_dir=str(tmp_path / "cache"), route_batches=None, cuda_graph=True)
    for seed in (11, 12, 13):
        x = inputs(3, seed=seed)
        y = graphed(x)
        _same(y, eager(x))
        assert relative_l2(y.get(), onnxruntime_outputs(path, x)) <= 1e-5
    assert graphed.graph_notes == {tuple(x.shape): "captured"}, graphed.graph_notes


def test_routing_measures_every_conv_and_routed_layers_replay_in_the_graph(session_cache_dir):
    """Default routing (batch 1 and 64): every kernel timed against cuDNN
    fp32, the times in the plan. Then one layer is sent to cuDNN for batches
    above 8: eager and graph runs at batch 4 (kernel) and 16 (cuDNN, captured
    inside the CuPy graph with torch's allocations in the graph's pool) match
    the float64 reference, and replays equal the eager run."""
    pytest.importorskip("onnx")
    pytest.importorskip("torch")
    import cupy as cp

    from sparseconv.runner import compile_model  # the runner's graphs and routes
    from sparseconv.routing import RouteChoice
    from sparseconv.runner import run_reference
    from sparseconv.runtime import DenseConv2dKernel
    from sparseconv.tilings import ANY_BATCH

    model = compile_model(LENET, cache_dir=str(session_cache_dir), cuda_graph=True)
    assert sorted(model.routes) == sorted(model.kernels) and not model.route_note
    conv_lines = [line for line in model.plan if line.startswith("/conv")]
    assert len(conv_lines) == 2 and all("batch 1: sparseconv" in s and "cuDNN fp32" in s for s in conv_lines)
    for name, choice in model.routes.items():
        assert [b for b, _, _ in choice.times_us] == [1, 64] and all(t > 0 for _, s, d in choice.times_us
                                                                     for t in (s, d))
        taken = {path for _, path in choice.route}
        assert (name in model.dense) == ("dense" in taken) and (name in model.tables) == ("table" in taken)
    print("\n".join(model.plan))

    name = "/conv2/Conv"
    layer = model.program.convs[name]
    model.routes[name] = RouteChoice(((8, "sparseconv"), (ANY_BATCH, "dense")), ((1, 1.0, 2.0), (64, 2.0, 1.0)))
    model.dense[name] = DenseConv2dKernel(model.kernels[name].layer, layer.bias, layer.weight)
    assert model.kernel(name, 4) is model.kernels[name] and model.kernel(name, 16) is model.dense[name]
    eager = compile_model(LENET, cache_dir=str(session_cache_dir), route_batches=None)
    # the same paths (a route may take the table at batch 4, by measurement)
    eager.routes, eager.dense, eager.tables = dict(model.routes), dict(model.dense), dict(model.tables)
    rng = cp.random.default_rng()
    for batch in (4, 16, 16, 4):
        x = rng.random((batch, 1, 8, 8), dtype=cp.float32)
        y = model(x)
        _same(y, eager(x))
        assert relative_l2(y.get(), run_reference(model.program, x)[0]) <= 1e-5
    assert model.graph_notes == {(4, 1, 8, 8): "captured", (16, 1, 8, 8): "captured"}, model.graph_notes


def test_cli_run_with_cuda_graph_and_routing_gives_the_same_predictions(session_cache_dir):
    pytest.importorskip("onnx")
    from sparseconv.cli import main

    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--check", "--json", "--cuda-graph",
                                  "--route-batch", "1", "--route-batch", "128", "--batch-size", "128",
                                  "--cache-dir", str(session_cache_dir)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output[r.output.index("{"):])
    assert s["same_predictions"] == 450 and s["relative_l2_vs_reference"] <= 1e-5
    # 450 = 3 x 128 + 66: two shapes, both captured
    assert s["cuda_graphs"] == {"128x1x8x8": "captured", "66x1x8x8": "captured"}, s["cuda_graphs"]
    for info in s["layers"].values():
        assert [t["batch"] for t in info["route"]["times_us"]] == [1, 128]
        assert info["route"]["action"] in ("sparseconv", "dense", "mixed")


def test_cli_run_text_output_shows_the_plan(session_cache_dir):
    pytest.importorskip("onnx")
    from sparseconv.cli import main

    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--cuda-graph",
                                  "--cache-dir", str(session_cache_dir)])
    assert r.exit_code == 0, r.output
    assert "cuDNN fp32" in r.output and "CUDA graph for input 256x1x8x8: captured" in r.output


def test_convs_routed_to_the_weight_table_match_float64_eager_and_in_a_graph(session_cache_dir):
    """compile_model times the table at batch 1 (the plan shows it); every conv
    forced onto the table then gives the float64 answer, eagerly and replayed.
    LeNet's convs fuse their 2x2 max pools: the table takes them too."""
    pytest.importorskip("onnx")
    pytest.importorskip("torch")
    import cupy as cp

    from sparseconv.runner import compile_model  # the runner's graphs and routes
    from sparseconv.routing import RouteChoice
    from sparseconv.runner import run_reference
    from sparseconv.tilings import ANY_BATCH
    from sparseconv.table import TableConv2d

    model = compile_model(LENET, cache_dir=str(session_cache_dir), cuda_graph=True, route_batches=(1,))
    assert all("table" in line for line in model.plan if line.startswith("/conv"))
    for name, layer in model.program.convs.items():
        ep = model.kernels[name].epilogue
        assert ep.pool  # Conv -> Relu -> MaxPool(2, 2), fused
        if name not in model.tables:
            model.tables[name] = TableConv2d(layer.weight, layer.bias, model.kernels[name].shape, ep, name=name)
        model.routes[name] = RouteChoice(((ANY_BATCH, "table"),), ((1, 2.0, 3.0),), table_us=((1, 1.0),))
        assert model.kernel(name, 7) is model.tables[name]
    rng = cp.random.default_rng()
    for batch in (3, 3):
        x = rng.random((batch, 1, 8, 8), dtype=cp.float32)
        assert relative_l2(model(x).get(), run_reference(model.program, x)[0]) <= 1e-5
    assert model.graph_notes == {(3, 1, 8, 8): "captured"}, model.graph_notes
