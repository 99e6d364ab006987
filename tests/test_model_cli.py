"""CPU: model import (npz + spec, ONNX) and `sparseconv compile / inspect`."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.cli import main
from sparseconv.model import ModelError, load_model

from sparseconv.testing import pruned_weight


def write_npz(path, names=("conv_a", "conv_b"), nan=False):
    rng = np.random.default_rng(0)
    wa = pruned_weight(rng, (6, 3, 3, 3), 0.8)
    wb = pruned_weight(rng, (4, 6, 1, 1), 0.6)
    if nan:
        wb[0, 0, 0, 0] = np.nan
    spec = [dict(name=names[0], in_h=9, in_w=11, padding=1),
            dict(name=names[1], in_h=9, in_w=11, stride=[2, 1])]
    np.savez(path, **{names[0]: wa, names[1]: wb, f"{names[0]}.bias": np.ones(6, np.float32)},
             __spec__=np.frombuffer(json.dumps(spec).encode(), np.uint8))
    return path


def onnx_model(path, auto_pad=None, with_conv=True):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w1 = pruned_weight(rng, (8, 3, 3, 3), 0.9)
    w2 = pruned_weight(rng, (8, 4, 3, 3), 0.9)  # groups=2
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
             numpy_helper.from_array(w2, "w2")]
    attrs = dict(pads=[1, 1, 1, 1])
    if auto_pad:
        attrs = dict(auto_pad=auto_pad)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="/stem/Conv", **attrs),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="/block/Conv", strides=[2, 2], group=2)]
    if not with_conv:
        nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits if with_conv else [])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path, w1, w2


def test_npz_with_embedded_spec(tmp_path):
    m = load_model(write_npz(tmp_path / "m.npz"))
    assert [layer.name for layer in m.layers] == ["conv_a", "conv_b"]
    a, b = m.layers
    assert a.shape.padding == (1, 1) and a.bias is not None and b.bias is None
    assert b.shape.stride == (2, 1) and b.shape.in_channels == 6


def test_onnx_import_reads_attributes_and_inferred_sizes(tmp_path):
    path, w1, w2 = onnx_model(tmp_path / "m.onnx")
    m = load_model(path)
    assert m.format == "onnx" and [layer.name for layer in m.layers] == ["/stem/Conv", "/block/Conv"]
    stem, block = m.layers
    np.testing.assert_array_equal(stem.weight, w1)
    assert stem.shape.padding == (1, 1) and (stem.shape.in_h, stem.shape.in_w) == (12, 12)
    assert block.shape.groups == 2 and block.shape.stride == (2, 2) and block.shape.in_channels == 8


@pytest.mark.nvcc
def test_compile_writes_artifacts_and_manifest(tmp_path):
    model = write_npz(tmp_path / "m.npz")
    out, cache = tmp_path / "out", tmp_path / "cache"
    r = CliRunner().invoke(main, ["compile", str(model), "-o", str(out), "--cache-dir", str(cache), "--json",
                                  "--jobs", "2"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["name"] for e in manifest["layers"]] == ["conv_a", "conv_b"]
    for e in manifest["layers"]:
        assert (out / e["ptx"]).read_text().count(".entry sc_conv2d") == 1
        assert (out / e["binary"]).read_bytes()[:4] == b"\x7fELF"
        assert e["fmas_kept"] == e["nonzero_weights"] * (e["fmas_kept"] // max(e["nonzero_weights"], 1))
    assert np.array_equal(np.load(out / manifest["layers"][0]["bias"]), np.ones(6, np.float32))
    r2 = CliRunner().invoke(main, ["compile", str(model), "-o", str(out), "--cache-dir", str(cache),
                                   "--layers", "conv_b"])
    assert r2.exit_code == 0, r2.output
    # the whole output on failure. Session 46 saw conv_b rebuilt here once: the sources had been edited
    # during that run, so this in-process build keyed by other code than the first run's workers
    # (test_build.py::test_build_many_warns_when_its_sources_changed_after_import)
    assert "hit" in r2.output and "conv_a" in r2.output and "skipped" in r2.output, r2.output
    assert [e["name"] for e in json.loads((out / "manifest.json").read_text())["layers"]] == ["conv_b"]
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())  # no temp folders left


@pytest.mark.nvcc
def test_compile_onnx_model(tmp_path):
    path, _, _ = onnx_model(tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["compile", str(path), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "m_sparseconv" / "manifest.json").read_text())
    assert [e["ptx"] for e in manifest["layers"]] == ["000_stem_Conv.ptx", "001_block_Conv.ptx"]


def test_inspect_lists_layers_and_filters(tmp_path):
    r = CliRunner().invoke(main, ["inspect", str(write_npz(tmp_path / "m.npz")), "--min-sparsity", "0.72"])
    assert r.exit_code == 0, r.output
    assert "2 conv layers, 1 to compile" in r.output and "skip: sparsity" in r.output
    # the kernel family each compiled layer takes, as tilings.default_tiling picks it
    assert sum("  compile (direct, " in line or "  compile (pointwise, " in line for line in r.output.splitlines()) == 1


def test_inspect_says_which_kernel_family_a_layer_takes(tmp_path):
    """A depthwise layer takes the pointwise family (session 41), with fewer
    threads at large outputs (session 42), a 3x3 on a large image the direct
    one; inspect shows it without building."""
    from sparseconv.zoo import mobilenet_v2

    path = tmp_path / "mnv2.npz"
    r = subprocess.run([sys.executable, "models/make_pruned_zoo.py", "mobilenet_v2", "--out", str(path)],
                       cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line for line in r.output.splitlines()[2:]}
    assert len(rows) == len(mobilenet_v2())
    assert rows["features.1.conv.0.0"].endswith("compile (pointwise, 128 threads)")   # depthwise 3x3, 112x112
    assert rows["features.13.conv.1.0"].endswith("compile (pointwise, 256 threads)")  # depthwise 3x3, 14x14
    assert rows["features.0.0"].rstrip().split("  ")[-1].startswith("compile (direct, ")  # the stem


def bad_inputs(tmp_path):
    good = write_npz(tmp_path / "good.npz")
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(good.read_bytes()[:200])
    cases = {
        "truncated": ([str(trunc)], "not a readable .npz"),
        "nan": ([str(write_npz(tmp_path / "nan.npz", nan=True))], "NaN or Inf"),
        "path_name": ([str(write_npz(tmp_path / "evil.npz", names=("../x", "conv_b")))], "'..' path segments"),
        "no_layer_left": ([str(good), "--layers", "nothing*"], "no layer left"),
        "unknown_ext": ([str(tmp_path / "m.bin")], "cannot tell the model format"),
    }
    (tmp_path / "m.bin").write_bytes(b"\x00\x01\x02\x03junk")
    if __import__("importlib").util.find_spec("onnx"):
        cases["no_conv"] = ([str(onnx_model(tmp_path / "noconv.onnx", with_conv=False)[0])], "no Conv layer")
        corrupt = tmp_path / "corrupt.onnx"
        corrupt.write_bytes(b"\x08\x07garbage-not-protobuf" * 3)
        cases["corrupt_onnx"] = ([str(corrupt)], "not a readable ONNX model")
    return cases


def test_bad_input_exits_2_and_writes_nothing(tmp_path):
    for label, (args, message) in bad_inputs(tmp_path).items():
        out, cache = tmp_path / f"out_{label}", tmp_path / f"cache_{label}"
        r = CliRunner().invoke(main, ["compile", *args, "-o", str(out), "--cache-dir", str(cache)])
        assert r.exit_code == 2, (label, r.output)
        assert message in r.output, (label, r.output)
        assert not out.exists(), label
        assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file() and p.name[0] != "."], label


def test_nonempty_foreign_output_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = CliRunner().invoke(main, ["compile", str(write_npz(tmp_path / "m.npz")), "-o", str(out)])
    assert r.exit_code == 2 and "refusing to write" in r.output
    assert (out / "precious.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1


def test_missing_onnx_extra_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x08\x07")
    real_import = builtins.__import__

    def no_onnx(name, *a, **k):
        if name == "onnx" or name.startswith("onnx."):
            raise ImportError("no onnx")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_onnx)
    with pytest.raises(ModelError, match=r"pip install 'sparseconv\[onnx\]'"):
        load_model(path)
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 2 and "sparseconv[onnx]" in r.output


def spec_json(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps([dict(name="features.0", in_h=10, in_w=10, padding=1)]))
    return path


def test_safetensors_with_weight_and_bias(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    w = pruned_weight(np.random.default_rng(2), (5, 3, 3, 3), 0.8)
    path = tmp_path / "m.safetensors"
    st.save_file({"features.0.weight": w, "features.0.bias": np.arange(5, dtype=np.float32)}, str(path))
    m = load_model(path, spec_path=spec_json(tmp_path))
    assert m.format == "safetensors"
    np.testing.assert_array_equal(m.layers[0].weight, w)
    assert m.layers[0].shape.padding == (1, 1) and m.layers[0].bias[4] == 4
    renamed = tmp_path / "m.bin"
    renamed.write_bytes(path.read_bytes())
    assert load_model(renamed, spec_path=spec_json(tmp_path)).format == "safetensors"  # by magic bytes


def test_torch_checkpoint_with_prune_mask(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.nn.utils.prune as prune

    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    prune.l1_unstructured(conv, "weight", amount=0.9)
    path = tmp_path / "m.pt"
    torch.save({"state_dict": {f"features.0.{k}": v for k, v in conv.state_dict().items()}}, path)
    m = load_model(path, spec_path=spec_json(tmp_path))
    want = (conv.weight_orig * conv.weight_mask).detach().numpy()
    np.testing.assert_array_equal(m.layers[0].weight, want)
    assert abs(m.layers[0].sparsity - 0.9) < 0.02
    renamed = tmp_path / "m.bin"
    renamed.write_bytes(path.read_bytes())
    assert load_model(renamed, spec_path=spec_json(tmp_path)).format == "torch"  # zip holding data.pkl


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_torch_checkpoint_is_never_unpickled_unsafely(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    path = tmp_path / "evil.pt"
    torch.save({"features.0.weight": torch.zeros(5, 3, 3, 3), "x": Payload()}, path)
    capsys.readouterr()
    r = CliRunner().invoke(main, ["compile", str(path), "--spec", str(spec_json(tmp_path)),
                                  "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and "weights_only=True" in r.output
    assert "this must never run" not in capsys.readouterr().out + r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.nvcc
def test_compile_bundle_api_writes_what_the_cli_writes(tmp_path, session_cache_dir):
    """sparseconv.bundle.compile_bundle is `sparseconv compile` for Python callers:
    the same files, byte for byte, and the same manifest but for timings."""
    from sparseconv.bundle import compile_bundle

    model = write_npz(tmp_path / "m.npz")
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    r = CliRunner().invoke(main, ["compile", str(model), "-o", str(cli_out), "--cache-dir", str(session_cache_dir)])
    assert r.exit_code == 0, r.output
    manifest = compile_bundle(load_model(model), api_out, cache_dir=str(session_cache_dir))
    assert json.loads(json.dumps(manifest)) == json.loads((api_out / "manifest.json").read_text())
    assert sorted(p.name for p in cli_out.iterdir()) == sorted(p.name for p in api_out.iterdir())
    for f in cli_out.iterdir():
        if f.name != "manifest.json":
            assert (api_out / f.name).read_bytes() == f.read_bytes(), f.name
    timing = {"seconds", "wall_s", "cache_hit"}
    strip = lambda m: [{k: v for k, v in e.items() if k not in timing} for e in m["layers"]]  # noqa: E731
    assert strip(json.loads(json.dumps(manifest))) == strip(json.loads((cli_out / "manifest.json").read_text()))


@pytest.mark.nvcc
def test_compile_bundle_shows_its_build_by_default(tmp_path, session_cache_dir, capfd):
    """Long work shows progress by default in the Python API too: the build's
    bar on stderr, naming the layers; progress=False is silent."""
    from sparseconv.bundle import compile_bundle

    model = load_model(write_npz(tmp_path / "m.npz"))
    compile_bundle(model, tmp_path / "loud", cache_dir=str(session_cache_dir))
    err = capfd.readouterr().err
    assert "compiling 2 layers" in err
    compile_bundle(model, tmp_path / "quiet", cache_dir=str(session_cache_dir), progress=False)
    assert capfd.readouterr().err == ""
