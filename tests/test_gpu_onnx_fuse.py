"""GPU: compile_model with the ONNX fusion pass (onnx_fuse.py) on the
ResNet-style toys: each fused conv one kernel with BN folded and its residual
add, clamp and 2x2 max pool in the epilogue; the outputs must match the
float64 reference of the graph as written and onnxruntime, at several batch
sizes, and the same model compiled with fuse=False."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from onnx_toys import EXPECTED, onnxruntime_all, toy, toy_input
from sparseconv.testing import relative_l2

pytestmark = pytest.mark.gpu
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compiled_fused_model_matches_the_unfused_float64_graph(tmp_path, session_cache_dir, name):
    import cupy

    from sparseconv.runner import compile_model, load_program, run_reference

    path = toy(name, tmp_path)
    model = compile_model(path, cache_dir=str(session_cache_dir), route_batches=None)  # fusion, not routing
    assert {n: layer.fused for n, layer in model.program.convs.items()} == EXPECTED[name]
    for conv, fused in EXPECTED[name].items():
        assert model.kernels[conv].epilogue.residual == ("add" in fused)
        assert model.kernels[conv].epilogue.pool == ("maxpool" in fused)
        line = next(line for line in model.plan if line.startswith(f"{conv}: Conv"))
        assert (f", fused {'+'.join(fused)}" in line) == bool(fused) and line.endswith(", sparseconv")
    original = load_program(path)
    for batch in (1, 5, 64):
        x = toy_input(batch, seed=batch)
        got = [y.get() for y in model.run(cupy.asarray(x))]
        for g, ref, ort in zip(got, run_reference(original, x), onnxruntime_all(path, x)):
            assert relative_l2(g, ref) <= 1e-5
            assert relative_l2(g, ort) <= 1e-5


def test_fused_max_pools_write_the_pooled_tensor_on_fresh_inputs(tmp_path, session_cache_dir):
    """Conv -> Relu -> MaxPool(2, 2) -> Conv -> MaxPool(2, 2): each conv one
    kernel that writes the pooled tensor (no MaxPool node left), matching the
    float64 reference of the graph as written on fresh random inputs."""
    import cupy

    from sparseconv.runner import compile_model, load_program, run_reference

    path = toy("conv_relu_maxpool", tmp_path)
    model = compile_model(path, cache_dir=str(session_cache_dir), route_batches=None)  # fusion, not routing
    assert [n.op for n in model.program.nodes] == ["Conv", "Conv"]
    assert all(k.epilogue.pool for k in model.kernels.values())
    original = load_program(path)
    rng = np.random.default_rng()
    for batch in (1, 4, 33):
        x = rng.standard_normal((batch, 4, 8, 8)).astype(np.float32)
        (y,) = model.run(cupy.asarray(x))
        assert y.shape == (batch, 8, 2, 2)  # 8x8 pooled to 4x4, then to 2x2
        assert relative_l2(y.get(), run_reference(original, x)[0]) <= 1e-5


def test_fuse_false_compiles_every_node_as_written(tmp_path, session_cache_dir):
    from sparseconv.runner import compile_model

    path = toy("resnet_shortcut", tmp_path)
    fused = compile_model(path, cache_dir=str(session_cache_dir))
    plain = compile_model(path, cache_dir=str(session_cache_dir), fuse=False)
    assert len(plain.program.nodes) == 13 and len(fused.program.nodes) == 4
    assert all(k.epilogue.activation == "none" and not k.epilogue.residual for k in plain.kernels.values())
    assert not any("fused" in line for line in plain.plan)
    x = toy_input(8)
    assert relative_l2(fused(x).get(), plain(x).get()) <= 1e-5


def test_run_check_reports_the_fusion_and_compares_with_the_graph_as_written(tmp_path):
    from sparseconv.cli import main

    path = toy("resnet_shortcut", tmp_path)
    np.savez(tmp_path / "d.npz", x=toy_input(6))
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(tmp_path / "d.npz"), "--check", "--json",
                                  "--cache-dir", str(tmp_path / "cache")])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output[r.output.index("{"):])
    assert {n: tuple(info["fused"]) for n, info in summary["layers"].items()} == EXPECTED["resnet_shortcut"]
    assert summary["relative_l2_vs_reference"] <= 1e-5
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(tmp_path / "d.npz"),
                                  "--cache-dir", str(tmp_path / "cache")])
    assert r.exit_code == 0, r.output
    assert "4 BatchNormalization folded, 2 residual adds and 3 activations fused into the conv kernels" in r.output
