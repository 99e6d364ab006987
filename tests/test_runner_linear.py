"""CPU: Gemm and MatMul with a constant weight as Linear layers in the ONNX
runner (sparseconv/runner.py): which nodes become layers (weight as
nn.Linear's), the float64 reference against onnxruntime, the specialised
kernels run in the PTX interpreter inside the runner, and the plan."""
import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.api import linear_variants
from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.cli import main
from sparseconv.runner import execute, load_program, run_reference
from sparseconv.testing import pruned_weight, relative_l2

from ptx_interpreter import run_kernel

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402

from onnx_models import dense_head, pruned_head, save_model as _save  # noqa: E402

F32 = np.float32


def _classifier(tmp_path, rng, conv=True):
    """(conv) -> Flatten -> Gemm transB=1 + bias (N,) -> Relu -> MatMul -> Gemm
    transB=0 + bias (1, N) -> a dense Gemm -> Gemm alpha=2 -> out."""
    inits = {
        "w1": pruned_weight(rng, (12, 48), 0.8), "b1": rng.standard_normal(12).astype(F32),
        "w2": pruned_weight(rng, (12, 10), 0.7),                 # MatMul B: (in, out)
        "w3": pruned_weight(rng, (10, 6), 0.6), "b3": rng.standard_normal((1, 6)).astype(F32),
        "w4": rng.standard_normal((6, 6)).astype(F32), "b4": rng.standard_normal(6).astype(F32),
        "w5": pruned_weight(rng, (5, 6), 0.8),
    }
    nodes = [helper.make_node("Flatten", ["c" if conv else "x"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w1", "b1"], ["g1"], name="fc1", transB=1),
             helper.make_node("Relu", ["g1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["g2"], name="fc2"),
             helper.make_node("Gemm", ["g2", "w3", "b3"], ["g3"], name="fc3"),
             helper.make_node("Gemm", ["g3", "w4", "b4"], ["g4"], name="dense_fc", transB=1),
             helper.make_node("Gemm", ["g4", "w5"], ["out"], name="scaled", transB=1, alpha=2.0)]
    if conv:
        inits["wc"] = pruned_weight(rng, (3, 3, 3, 3), 0.5)
        nodes.insert(0, helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]))
    return _save(tmp_path / "clf.onnx", nodes, inits, ["N", 3, 4, 4] if conv else ["N", 48]), inits


def test_gemm_and_matmul_with_constant_weights_become_linear_layers(tmp_path):
    path, w = _classifier(tmp_path, np.random.default_rng(0))
    program = load_program(path)
    assert sorted(program.linears) == ["fc1", "fc2", "fc3"]
    np.testing.assert_array_equal(program.linears["fc1"].weight, w["w1"])      # transB=1: B is (out, in)
    np.testing.assert_array_equal(program.linears["fc2"].weight, w["w2"].T)    # MatMul: B is (in, out)
    np.testing.assert_array_equal(program.linears["fc3"].weight, w["w3"].T)
    np.testing.assert_array_equal(program.linears["fc3"].bias, w["b3"][0])
    assert program.linears["fc2"].bias is None
    assert list(program.dense_linears) == ["dense_fc"] and "sparsity 0.000 < 0.5" in program.dense_linears["dense_fc"]
    plan = program.plan()
    assert "fc1: Gemm as Linear 48->12, sparseconv" in plan and "fc2: MatMul as Linear 12->10, sparseconv" in plan
    assert any(line.startswith("dense_fc: Gemm, dense (matmul): sparsity") for line in plan)
    assert not any(line.startswith("scaled") for line in plan)  # alpha=2: an operator, not a layer


def test_reference_with_linear_layers_matches_onnxruntime(tmp_path):
    rng = np.random.default_rng(1)
    path, _ = _classifier(tmp_path, rng)
    x = rng.standard_normal((5, 3, 4, 4)).astype(F32)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = run_reference(load_program(path), x)
    assert got.dtype == np.float64 and relative_l2(got, want) <= 1e-5


@pytest.mark.nvcc
def test_specialised_linear_kernels_inside_the_runner(tmp_path):
    """Every Gemm/MatMul layer through its specialised kernel (the any-batch
    variant) in the PTX interpreter, the rest as the runner runs them: equal
    to onnxruntime within fp32 rounding."""
    rng = np.random.default_rng(2)
    path, _ = _classifier(tmp_path, rng, conv=False)
    program = load_program(path)
    cache = ArtifactCache(tmp_path / "cache")
    x = rng.standard_normal((3, 48)).astype(F32)

    def linear(layer, inp):
        s, n = layer.shape, inp.shape[0]
        tiling = linear_variants(s)[-1][1]
        built = build_conv2d(layer.weight.reshape(s.weight_shape), s, tiling=tiling, cache=cache, name=layer.name)
        y = np.full((n, s.out_channels, 1, 1), np.nan, np.float32)
        bias = layer.bias if layer.bias is not None else np.zeros(s.out_channels, np.float32)
        run_kernel(cache.get_text("kernel", built.ptx_sha256, ".ptx"), built.entry, grid=built.grid(n),
                   block=(built.tiling.threads, 1, 1),
                   args=[np.ascontiguousarray(inp, np.float32).reshape(n, -1, 1, 1), y, bias, 0, n, built.chunks],
                   dynamic_shared_bytes=0)
        return y.reshape(n, s.out_channels)

    (y,) = execute(program, x, np, None, np.float32, linear=linear)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert not np.isnan(y).any() and relative_l2(y, want) <= 1e-5


def test_matmul_of_a_batched_input_stays_an_operator(tmp_path):
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv"),
             helper.make_node("Reshape", ["c", "shape"], ["t"]),
             helper.make_node("MatMul", ["t", "w"], ["out"], name="tokens")]
    inits = {"wc": pruned_weight(rng, (4, 2, 1, 1), 0.5), "shape": np.array([0, 4, 9], np.int64),
             "w": pruned_weight(rng, (9, 5), 0.9)}
    path = _save(tmp_path / "t.onnx", nodes, inits, [2, 2, 3, 3])
    program = load_program(path)
    assert not program.linears and not program.dense_linears
    x = rng.standard_normal((2, 2, 3, 3)).astype(F32)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert relative_l2(run_reference(program, x)[0], want) <= 1e-5


def test_an_mlp_without_convs_runs(tmp_path):
    """A model whose only layers are Gemm/MatMul loads (it used to be refused
    for having no Conv) and runs on the reference backend from the CLI."""
    rng = np.random.default_rng(4)
    path, _ = _classifier(tmp_path, rng, conv=False)
    assert sorted(load_program(path).linears) == ["fc1", "fc2", "fc3"]
    data = tmp_path / "x.npy"
    np.save(data, rng.standard_normal((4, 48)).astype(F32))
    r = CliRunner().invoke(main, ["run", str(path), "--data", str(data), "--backend", "reference"])
    assert r.exit_code == 0, r.output
    only_dense = _save(tmp_path / "d.onnx", [helper.make_node("Gemm", ["x", "w"], ["out"], transB=1)],
                       {"w": rng.standard_normal((3, 4)).astype(F32)}, ["N", 4])
    r = CliRunner().invoke(main, ["run", str(only_dense), "--data", str(data), "--backend", "reference"])
    assert r.exit_code == 2 and "no Conv layer (nor a pruned Gemm/MatMul" in r.output


def test_inspect_lists_the_linear_layers_run_compiles(tmp_path):
    path, _ = _classifier(tmp_path, np.random.default_rng(5))
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line for line in r.output.splitlines()[2:] if line.strip()}
    assert "compile" in lines["conv"]
    assert "Linear 48->12" in lines["fc1"] and lines["fc1"].endswith("run: Linear kernel (not in `compile`)")
    assert "Linear 12->10" in lines["fc2"] and "Linear 10->6" in lines["fc3"]
    assert "run: dense, sparsity 0.000 < 0.5" in lines["dense_fc"] and "scaled" not in lines


def test_dense_heads_that_gemv_takes_are_listed_with_their_weights(tmp_path):
    path, w = dense_head(tmp_path, np.random.default_rng(5))
    program = load_program(path)
    assert sorted(program.dense_linears) == ["head1", "head2", "odd"]
    assert sorted(program.gemv_layers) == ["head1", "head2"]  # odd: 999 inputs, not a multiple of 4
    g1, g2 = program.gemv_layers["head1"], program.gemv_layers["head2"]
    assert g1.weight_input == "w1" and np.shares_memory(g1.weight, program.constants["w1"])  # no host copy
    assert g2.weight_input is None and np.array_equal(g2.weight, w["w2"].T) and g2.weight.flags.c_contiguous
    np.testing.assert_array_equal(g1.bias, w["b1"])
    plan = program.plan()
    assert any(line.startswith("head1: Gemm, dense (sparseconv.gemv at batch <= 8, else matmul): sparsity")
               for line in plan)
    assert any(line.startswith("odd: Gemm, dense (matmul)") for line in plan)
    r = CliRunner().invoke(main, ["inspect", str(path)])  # and `sparseconv inspect` says so
    lines = {line.split()[0]: line for line in r.output.splitlines()[2:] if line.strip()}
    assert "run: dense (sparseconv.gemv at batch <= 8), sparsity 0.000 < 0.5" in lines["head2"]
    assert "run: dense, sparsity" in lines["odd"]


@pytest.mark.nvcc
def test_the_gemv_kernel_inside_the_runner(tmp_path):
    """The runner's dense heads through the gemv kernel (PTX interpreter), the
    rest as the runner runs them: equal to onnxruntime within fp32 rounding."""
    from sparseconv.compile import compile_to_ptx
    from sparseconv.gemv import WARPS_PER_BLOCK, GemvVariant, gemv_source
    from sparseconv.shapes import Target

    rng = np.random.default_rng(6)
    path, _ = dense_head(tmp_path, rng)
    program = load_program(path)
    x = rng.standard_normal((2, 3, 4, 4)).astype(F32)
    ptx = compile_to_ptx(gemv_source(2), Target(), "the gemv kernel")
    ran = []

    def dense_linear(layer, inp, values):
        n, (out_f, in_f) = inp.shape[0], layer.weight.shape
        y = np.full((n, out_f), np.nan, F32)
        bias = layer.bias if layer.bias is not None else np.zeros(out_f, F32)
        rows = WARPS_PER_BLOCK // GemvVariant().split
        run_kernel(ptx, "sc_gemv", grid=(-(-out_f // rows), 1, 1), block=(WARPS_PER_BLOCK * 32, 1, 1),
                   args=[np.ascontiguousarray(inp, F32), layer.weight, bias, y, in_f, out_f])
        ran.append(layer.name)
        return y

    (y,) = execute(program, x, np, _conv_float32, np.float32, dense_linear=dense_linear)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert ran == ["head1", "head2"] and not np.isnan(y).any() and relative_l2(y, want) <= 1e-5


def test_pruned_heads_left_uncompiled_take_the_sparse_gemv(tmp_path, monkeypatch):
    """Pruned Gemm/MatMul layers over MAX_LINEAR_WEIGHTS (lowered here so the
    model stays small) are not compiled; the runner streams their nonzero
    weights through the sparse kernel (PTX interpreter here), 1,002 inputs
    included: equal to onnxruntime within fp32 rounding."""
    import sparseconv.runner as runner
    from sparseconv.compile import compile_to_ptx
    from sparseconv.gemv import SPARSE_GEMV_VARIANT, WARPS_PER_BLOCK, sparse_gemv_source, sparse_rows
    from sparseconv.shapes import Target

    monkeypatch.setattr(runner, "MAX_LINEAR_WEIGHTS", 1000)
    rng = np.random.default_rng(7)
    path, w = pruned_head(tmp_path, rng)
    program = load_program(path)
    assert sorted(program.gemv_layers) == ["head1", "head2", "head3"] and not program.linears
    assert all(g.sparse for g in program.gemv_layers.values())
    plan = program.plan()
    assert any(line.startswith("head3: Gemm, not compiled (sparseconv's sparse gemv at batch <= 8, else "
                               "matmul): 1,002,000 weights > 1,000") for line in plan), plan
    r = CliRunner().invoke(main, ["inspect", str(path)])  # and `sparseconv inspect` says so
    lines = {line.split()[0]: line for line in r.output.splitlines()[2:] if line.strip()}
    assert "run: not compiled (sparseconv's sparse gemv at batch <= 8), 1,002,000 weights" in lines["head2"]

    x = rng.standard_normal((2, 3, 4, 4)).astype(F32)
    ptx = compile_to_ptx(sparse_gemv_source(2), Target(), "the sparse gemv kernel")
    ran = []

    def sparse_linear(layer, inp, values):
        rows = sparse_rows(layer.weight)
        n, out_f = inp.shape[0], layer.weight.shape[0]
        y = np.full((n, out_f), np.nan, F32)
        bias = layer.bias if layer.bias is not None else np.zeros(out_f, F32)
        run_kernel(ptx, "sc_sparse_gemv", grid=(-(-out_f // (WARPS_PER_BLOCK // SPARSE_GEMV_VARIANT.split)), 1, 1),
                   block=(WARPS_PER_BLOCK * 32, 1, 1),
                   args=[np.ascontiguousarray(inp, F32), rows.entries, rows.row_start, bias, y, inp.shape[1], out_f])
        ran.append(layer.name)
        return y

    (y,) = execute(program, x, np, _conv_float32, np.float32, dense_linear=sparse_linear)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert ran == ["head1", "head2", "head3"] and not np.isnan(y).any() and relative_l2(y, want) <= 1e-5


def _conv_float32(layer, inp):
    from sparseconv.runner import conv2d_dense

    return conv2d_dense(layer, inp).astype(np.float32)
