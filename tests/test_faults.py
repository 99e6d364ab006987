"""CPU fault injection (issue 11): bad files of every format, hostile ONNX,
arguments out of range, awkward output folders, a killed compile, concurrent
writers, a damaged cache. Every case ends in a correct result, or in exit 2
(exit 1 for a damaged tool or cache) with one clear line and nothing partial
written. Grow this file with every new way in."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.bundle import BundleError, check_output_dir, compile_bundle
from sparseconv.cli import main
from sparseconv.limits import MAX_BODY_COPIES, LimitError, check_layer
from sparseconv.model import ModelError, load_model
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import ConvShape, Tiling, shape_from_weight

from sparseconv.testing import pruned_weight

REPO = Path(__file__).resolve().parent.parent
LENET = REPO / "models" / "lenet_digits_pruned.onnx"
DIGITS = REPO / "models" / "digits_test.npz"


# --------------------------------------------------------------------------- helpers

def files_under(folder: Path) -> set:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def refused(r, needle: str, code: int = 2) -> None:
    """Exit `code`, no traceback, the error on one line naming `needle`."""
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output
    error = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, r.output
    assert needle in error[0], r.output
    assert len(error[0]) < 500, error[0]


def spec_bytes(spec) -> np.ndarray:
    return np.frombuffer(json.dumps(spec).encode(), np.uint8)


def write_npz(path: Path, spec=None, seed: int = 0, **extra) -> Path:
    w = pruned_weight(np.random.default_rng(seed), (4, 3, 3, 3), 0.7)
    spec = spec if spec is not None else [dict(name="conv", in_h=6, in_w=6, padding=1)]
    np.savez(path, conv=w, __spec__=spec_bytes(spec), **extra)
    return path


def compile_args(model: Path, out: Path, cache: Path, *extra: str) -> list:
    return ["compile", str(model), "-o", str(out), "--cache-dir", str(cache), "--jobs", "1", *extra]


def onnx_conv_model(path: Path, weight: np.ndarray, in_hw=(6, 6), **attrs) -> Path:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[1], *in_hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


# --------------------------------------------------------------------------- damaged files of every format

def _damaged(tmp_path: Path, fmt: str, damage: str) -> Path:
    good = {"npz": lambda p: write_npz(p),
            "onnx": lambda p: onnx_conv_model(p, np.ones((2, 1, 3, 3), np.float32)),
            "safetensors": lambda p: pytest.importorskip("safetensors.numpy").save_file(
                {"conv.weight": np.ones((2, 1, 3, 3), np.float32)}, str(p)),
            "pt": lambda p: pytest.importorskip("torch").save(
                {"conv.weight": pytest.importorskip("torch").ones(2, 1, 3, 3)}, str(p))}
    path = tmp_path / f"model.{fmt}"
    good[fmt](path)
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": data[:len(data) // 2],
                      "garbage": bytes(range(256)) * 4}[damage])
    return path


@pytest.mark.parametrize("fmt", ["npz", "onnx", "safetensors", "pt"])
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_model_files_exit_2_and_write_nothing(tmp_path, fmt, damage):
    path = _damaged(tmp_path, fmt, damage)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([dict(name="conv", in_h=6, in_w=6)]))
    before = files_under(tmp_path)
    for verb in (compile_args(path, tmp_path / "out", tmp_path / "cache", "--spec", str(spec)),
                 ["inspect", str(path), "--spec", str(spec)]):
        r = CliRunner().invoke(main, verb)
        refused(r, str(path))
        if damage == "empty":
            assert "empty" in r.output  # not "no Conv layer" (issue 11, defect 7)
    assert files_under(tmp_path) == before


def test_damaged_npy_for_layer(tmp_path):
    cases = {"empty.npy": b"", "truncated.npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order'"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "ints.npy", np.ones((2, 1, 3, 3), np.int32))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "archive.npz", w=np.ones((2, 1, 3, 3), np.float32))
    before = files_under(tmp_path)
    for name, needle in [("empty.npy", "empty or truncated"), ("truncated.npy", "cannot read"),
                         ("ints.npy", "floating point"), ("objects.npy", "cannot read"),
                         ("archive.npz", "is an .npz archive")]:
        r = CliRunner().invoke(main, ["layer", str(tmp_path / name), "--input-size", "8",
                                      "--cache-dir", str(tmp_path / "cache")])
        refused(r, needle)
        assert "Aborted" not in r.output
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("damage", ["empty", "truncated", "pickled"])
def test_damaged_data_for_run(tmp_path, damage):
    data = tmp_path / "data.npy"
    if damage == "pickled":
        np.save(data, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        np.save(data, np.zeros((3, 1, 8, 8), np.float32))
        data.write_bytes(b"" if damage == "empty" else data.read_bytes()[:90])
    before = files_under(tmp_path)
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(data), "--backend", "reference",
                                  "-o", str(tmp_path / "y.npy")])
    refused(r, str(data))
    assert files_under(tmp_path) == before


class Boom:
    def __reduce__(self):
        return (os.system, ("touch sparseconv-pwned",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickles_never_run(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps({"conv.weight": Boom()}))
    zipped = tmp_path / "zipped.pt"
    torch.save({"conv.weight": torch.zeros(2, 1, 3, 3), "evil": Boom()}, zipped)
    npz = tmp_path / "objects.npz"
    np.savez(npz, conv=np.array([Boom()], dtype=object), __spec__=spec_bytes([dict(name="conv", in_h=6, in_w=6)]))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([dict(name="conv", in_h=6, in_w=6)]))
    for path in (plain, zipped, npz):
        r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache", "--spec", str(spec)))
        refused(r, str(path))
        assert not (tmp_path / "sparseconv-pwned").exists()
        assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- layer specs

@pytest.mark.parametrize("entry, needle", [
    (dict(groups="abc"), "groups must be an integer"),
    (dict(groups=None), "groups must be an integer"),
    (dict(groups=2.7), "groups must be an integer"),     # never silently groups 2 (defect 6)
    (dict(groups=True), "groups must be an integer"),
    (dict(stride=[1, 2, 3]), "stride must be an integer or a pair"),
    (dict(padding="1"), "padding must be an integer"),
    (dict(in_h=6.5), "in_h must be an integer"),
    (dict(in_h=2 ** 40, in_w=2 ** 40), "32-bit"),
    (dict(dilation=0), "dilation must be >= 1"),
    (dict(stride=-1), "stride must be >= 1"),
])
def test_bad_spec_values_are_refused(tmp_path, entry, needle):
    spec = [dict(dict(name="conv", in_h=6, in_w=6), **entry)]
    path = write_npz(tmp_path / "m.npz", spec=spec)
    with pytest.raises(ModelError, match=needle):
        load_model(path)
    r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache"))
    refused(r, needle)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- hostile ONNX

def test_onnx_external_data_outside_the_model_folder_is_refused(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto

    path = onnx_conv_model(tmp_path / "m.onnx", np.ones((2, 1, 3, 3), np.float32))
    model = onnx.load(str(path))
    t = model.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../../../etc/passwd"), ("offset", "0"), ("length", "72")):
        e = t.external_data.add()
        e.key, e.value = key, value
    onnx.save(model, str(path))
    r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache"))
    refused(r, "not a plain file next to the model")
    assert not (tmp_path / "out").exists()


def test_onnx_external_data_beside_the_model_loads(tmp_path):
    onnx = pytest.importorskip("onnx")
    w = pruned_weight(np.random.default_rng(3), (2, 1, 3, 3), 0.5)
    path = onnx_conv_model(tmp_path / "m.onnx", w)
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    assert (tmp_path / "m.data").is_file()
    np.testing.assert_array_equal(load_model(path).layers[0].weight, w)


def test_onnx_initializer_shape_disagreeing_with_data(tmp_path):
    onnx = pytest.importorskip("onnx")
    path = onnx_conv_model(tmp_path / "m.onnx", np.ones((2, 1, 3, 3), np.float32))
    model = onnx.load(str(path))
    model.graph.initializer[0].dims[0] = 5  # says 5x1x3x3, holds 2x1x3x3
    onnx.save(model, str(path))
    for verb in (compile_args(path, tmp_path / "out", tmp_path / "cache"), ["inspect", str(path)],
                 ["run", str(path), "--data", str(DIGITS), "--backend", "reference"]):
        refused(CliRunner().invoke(main, verb), "does not match its data")
    assert not (tmp_path / "out").exists()


def test_onnx_huge_declared_sizes(tmp_path):
    onnx = pytest.importorskip("onnx")
    path = onnx_conv_model(tmp_path / "m.onnx", np.ones((2, 1, 3, 3), np.float32))
    model = onnx.load(str(path))
    model.graph.initializer[0].dims[:] = [2 ** 20, 2 ** 20, 3, 3]
    onnx.save(model, str(path))
    refused(CliRunner().invoke(main, ["inspect", str(path)]), "elements")
    big = onnx_conv_model(tmp_path / "big.onnx", np.ones((2, 1, 3, 3), np.float32), in_hw=(100000, 100000))
    refused(CliRunner().invoke(main, compile_args(big, tmp_path / "out", tmp_path / "cache")), "32-bit")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- arguments out of range

@pytest.fixture
def weight_npy(tmp_path):
    path = tmp_path / "w.npy"
    np.save(path, pruned_weight(np.random.default_rng(0), (4, 2, 3, 3), 0.7))
    return path


@pytest.mark.parametrize("args, needle", [
    (["--input-size", "99999999999999999999"], "--input-size must be between"),
    (["--input-size", "0"], "--input-size must be between"),
    (["--input-size", "-3"], "--input-size must be between"),
    (["--input-size", "3.5"], "--input-size must look like"),
    (["--input-size", "8x8x8"], "--input-size must look like"),
    (["--input-size", "8", "--groups", "2.7"], "'2.7' is not a valid integer"),
    (["--input-size", "8", "--groups", "0"], "--groups"),
    (["--input-size", "8", "--stride", "0"], "--stride must be between"),
    (["--input-size", "8", "--padding", "-1"], "--padding must be between"),
    (["--input-size", "8", "--dilation", "0"], "--dilation must be between"),
    (["--input-size", "8", "--dilation", "1000"], "output would be empty"),
    (["--input-size", "2000", "--dilation", "300"], "no tiling fits shared memory"),
    (["--input-size", "46341x46341"], "32-bit"),
    (["--input-size", "8", "--target", "foo"], "target arch must look like"),
    (["--input-size", "8", "--target", "sm_75"], "sm_80 and newer GPUs"),
    (["--input-size", "8", "--emit-ptx", "/nonexistent-folder/x.ptx"], "does not exist"),
])
def test_layer_arguments_out_of_range(tmp_path, weight_npy, args, needle):
    before = files_under(tmp_path)
    r = CliRunner().invoke(main, ["layer", str(weight_npy), *args, "--cache-dir", str(tmp_path / "cache")])
    refused(r, needle)
    assert files_under(tmp_path) == before


def test_100000_groups_is_refused_at_once(tmp_path):
    path = tmp_path / "dw.npy"
    np.save(path, np.ones((100000, 1, 3, 3), np.float32))
    t = time.perf_counter()
    r = CliRunner().invoke(main, ["layer", str(path), "--input-size", "8", "--groups", "100000",
                                  "--cache-dir", str(tmp_path / "cache")])
    refused(r, "65535")
    assert time.perf_counter() - t < 10 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("args, needle", [
    (["--jobs", "0"], "--jobs"), (["--min-sparsity", "2"], "--min-sparsity"), (["--target", "foo"], "--target"),
    (["--input-size", "99999999999999999999"], "--input-size"), (["--layers", "nomatch*"], "no layer left"),
])
def test_compile_arguments_out_of_range(tmp_path, args, needle):
    model = write_npz(tmp_path / "m.npz")
    before = files_under(tmp_path)
    refused(CliRunner().invoke(main, compile_args(model, tmp_path / "out", tmp_path / "cache", *args)), needle)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("args, needle", [
    (["--batch-size", "0"], "--batch-size"), (["-o", "/nonexistent-folder/y.npy"], "does not exist"),
    (["-o", "y.txt"], "must end in .npy"), (["--input-size", "0"], "--input-size"),
    (["--front-end", "fx"], "--front-end fx chooses how the GPU runs the model; --backend reference runs"),
    (["--front-end", "onnx"], "'onnx' is not one of 'runner', 'fx', 'auto'"),
])
def test_run_arguments_out_of_range(tmp_path, args, needle):
    before = files_under(tmp_path)
    refused(CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--backend", "reference", *args]),
            needle)
    assert files_under(tmp_path) == before


def test_api_arguments_out_of_range(tmp_path):
    w = np.ones((4, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        shape_from_weight(w, 8, groups=2.7)
    with pytest.raises(TypeError, match="stride must be an int or a pair"):
        shape_from_weight(w, 8, stride=1.5)
    with pytest.raises(LimitError, match="32-bit"):
        check_layer(ConvShape(2, 4, 2 ** 31, 1, 3, 1, padding=(1, 0)))
    # 100,000 groups of two input channels: a block each, past the grid's y axis
    with pytest.raises(LimitError, match="65535"):
        check_layer(ConvShape(200000, 100000, 8, 8, 3, 3, padding=(1, 1), groups=100000))
    # 100,000 depthwise groups take 4 a block (25,000 blocks): within the grid, past the body copies
    with pytest.raises(LimitError, match="25000 copies of its body"):
        check_layer(ConvShape(100000, 100000, 8, 8, 3, 3, padding=(1, 1), groups=100000))
    with pytest.raises(LimitError, match=str(MAX_BODY_COPIES)):
        check_layer(ConvShape(512, 4096, 7, 7, 7, 7))  # VGG's fc6 as a conv: 65536 body copies
    with pytest.raises(ValueError, match="layer grouped: .*65535"):
        build_many([LayerJob("grouped", np.ones((100000, 2, 3, 3), np.float32),
                             ConvShape(200000, 100000, 8, 8, 3, 3, padding=(1, 1), groups=100000))],
                   cache_dir=str(tmp_path / "cache"), progress=False)
    model = load_model(write_npz(tmp_path / "m.npz"))
    (tmp_path / "a_file").write_text("x")
    for bad in (tmp_path / "a_file", tmp_path / "a_file" / "under"):
        with pytest.raises(BundleError, match="choose another -o"):
            compile_bundle(model, bad, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    # The largest accepted image: one input element short of 2**31.
    check_layer(ConvShape(1, 1, 46340, 46340, 1, 1))


# --------------------------------------------------------------------------- output folders

@pytest.mark.parametrize("where", ["file", "under_file", "dot", "foreign", "foreign_manifest", "symlink", "proc"])
def test_output_folders_that_cannot_be_replaced(tmp_path, monkeypatch, where):
    model = write_npz(tmp_path / "m.npz")
    (tmp_path / "a_file").write_text("x")
    out = {"file": tmp_path / "a_file", "under_file": tmp_path / "a_file" / "out", "dot": Path("."),
           "foreign": tmp_path / "mine", "foreign_manifest": tmp_path / "mine", "symlink": tmp_path / "link",
           "proc": Path("/proc/sparseconv-out")}[where]
    if where.startswith("foreign"):
        (out / "src").mkdir(parents=True)
        (out / "src" / "index.js").write_text("keep me")
        if where == "foreign_manifest":  # issue 11 defect 1: this folder used to be deleted whole
            (out / "manifest.json").write_text("{}")
    if where == "symlink":
        (tmp_path / "real").mkdir()
        out.symlink_to(tmp_path / "real")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    r = CliRunner().invoke(main, compile_args(model, out, tmp_path / "cache"))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert files_under(tmp_path) == before
    if where.startswith("foreign"):
        assert (out / "src" / "index.js").read_text() == "keep me"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into read-only folders; the /proc case covers an unwritable place")
def test_read_only_parent_folder(tmp_path):
    model = write_npz(tmp_path / "m.npz")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(CliRunner().invoke(main, compile_args(model, ro / "out", tmp_path / "cache")), "cannot write in")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.nvcc
def test_bundle_folder_mode_replacement_and_long_names(tmp_path, session_cache_dir):
    long_name = "block." * 60 + "conv"  # 364 characters: too long for a file name as it is
    w = pruned_weight(np.random.default_rng(0), (4, 3, 3, 3), 0.7)
    spec = [dict(name=long_name, in_h=6, in_w=6, padding=1)]
    model = tmp_path / "m.npz"
    np.savez(model, **{long_name: w}, __spec__=spec_bytes(spec))
    out = tmp_path / "out"
    for _ in range(2):  # the second run replaces the first bundle
        r = CliRunner().invoke(main, compile_args(model, out, session_cache_dir))
        assert r.exit_code == 0, r.output
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers"][0]["name"] == long_name
    assert all(len(p.name) < 200 for p in out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz", "out"]  # no .tmp or .old left
    (out / "notes.txt").write_text("mine now")
    r = CliRunner().invoke(main, compile_args(model, out, session_cache_dir))
    refused(r, "not a sparseconv bundle")
    assert (out / "notes.txt").read_text() == "mine now"


# --------------------------------------------------------------------------- kill the main process

def _slow_model(folder: Path) -> Path:
    """Four depthwise layers with fresh weights: several seconds of nvcc each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(time.time_ns() % 2 ** 32)
    arrays = {f"dw{i}": rng.standard_normal((192, 1, 3, 3)).astype(np.float32) for i in range(4)}
    spec = [dict(name=n, in_h=8, in_w=8, padding=1, groups=192) for n in arrays]
    np.savez(folder / "slow.npz", **arrays, __spec__=spec_bytes(spec))
    return folder / "slow.npz"


def _children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat_line.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sparseconv(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "sparseconv", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.nvcc
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="walks /proc to find the workers")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_main_compile_stops_its_workers(tmp_path, sig):
    model = _slow_model(tmp_path)
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = _sparseconv(*compile_args(model, out, cache)[:-2], "--jobs", "2")
    deadline = time.time() + 60
    workers: list = []
    while time.time() < deadline:  # until the workers run nvcc: mid-compile
        workers = _children(proc.pid)
        if workers and any(_children(w) for w in workers):
            break
        time.sleep(0.05)
    assert workers, "the compile never started its workers"
    os.kill(proc.pid, sig)
    t = time.perf_counter()
    _, err = proc.communicate(timeout=60)
    assert time.perf_counter() - t < 5  # stopped, not waiting for the layers in flight
    assert proc.returncode == (128 + sig if sig == signal.SIGTERM else -sig)
    assert "Traceback" not in err
    deadline = time.time() + 10  # a worker finishing its layer took minutes before the fix
    while time.time() < deadline and any(_running(w) for w in workers):
        time.sleep(0.1)
    assert not [w for w in workers if _running(w)]
    assert not out.exists()
    if sig == signal.SIGTERM:
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["slow.npz"]
    # The next compile completes, and leaves nothing of the killed one behind.
    done = _sparseconv(*compile_args(model, out, cache), "--layers", "dw0")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "slow.npz"]


# --------------------------------------------------------------------------- concurrent writers

@pytest.mark.nvcc
def test_concurrent_compiles_into_one_folder_and_one_cache(tmp_path):
    model = write_npz(tmp_path / "m.npz", seed=int(time.time()) % 1000)  # cold cache: they race in it too
    out, cache = tmp_path / "out", tmp_path / "cache"
    procs = [_sparseconv(*compile_args(model, out, cache), "--json") for _ in range(8)]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    for (stdout, err), rc in results:
        assert rc == 0 and "Traceback" not in err, err
        assert json.loads(stdout)["layers"][0]["name"] == "conv"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "m.npz", "out"]  # no .old-PID, no .tmp
    manifest = json.loads((out / "manifest.json").read_text())
    assert {p.name for p in out.iterdir()} == {"manifest.json", manifest["layers"][0]["ptx"],
                                               manifest["layers"][0]["binary"]}
    r = CliRunner().invoke(main, ["cache", "verify", "--cache-dir", str(cache)])
    assert r.exit_code == 0, r.output


def test_leftovers_of_dead_writers_are_removed(tmp_path):
    """A writer killed between its renames leaves .out.tmp-PID-* / .out.old-PID;
    the next writer to that folder removes them (PID 2**22+1 is never alive)."""
    from sparseconv.bundle import _remove_leftovers

    dead = 2 ** 22 + 1
    (tmp_path / f".out.tmp-{dead}-abc").mkdir()
    (tmp_path / f".out.old-{dead}").mkdir()
    (tmp_path / f".out.old-{os.getpid()}").mkdir()  # alive: left alone
    (tmp_path / ".other.old-1").mkdir()
    _remove_leftovers(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".out.old-{os.getpid()}", ".other.old-1"])
    assert check_output_dir(tmp_path / "out") == tmp_path / "out"


# --------------------------------------------------------------------------- misleading messages

def test_finite_float64_weights_beyond_float32_are_named_as_such(tmp_path):
    spec = [dict(name="conv", in_h=6, in_w=6)]
    path = tmp_path / "m.npz"
    np.savez(path, conv=np.full((2, 1, 3, 3), 1e300), __spec__=spec_bytes(spec))
    r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache"))
    refused(r, "beyond float32")
    assert "NaN" not in r.output


def test_nonfinite_weights_are_refused_unless_allowed(tmp_path):
    w = np.ones((2, 1, 3, 3), np.float32)
    w[0, 0, 0, 0] = np.nan
    path = tmp_path / "m.npz"
    np.savez(path, conv=w, __spec__=spec_bytes([dict(name="conv", in_h=6, in_w=6)]))
    refused(CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache")), "--allow-nonfinite")


@pytest.mark.nvcc
def test_nvcc_failure_is_one_line_without_python_advice(tmp_path, monkeypatch):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake nvcc 0.0; exit 0; }\n"
                    "echo 'fatal error: something broke' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPARSECONV_NVCC", str(fake))
    from sparseconv.compile import tool_identity
    tool_identity.cache_clear()
    try:
        r = CliRunner().invoke(main, compile_args(write_npz(tmp_path / "m.npz"), tmp_path / "out",
                                                  tmp_path / "cache"))
    finally:
        tool_identity.cache_clear()
    refused(r, "something broke", code=1)
    assert ".dump()" not in r.output and not (tmp_path / "out").exists()


def test_cache_clear_on_an_unwritable_cache_does_not_claim_success(tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("root deletes from read-only folders")
    cache = tmp_path / "cache"
    entry = cache / "kernel" / "ab" / ("ab" * 32 + ".ptx")
    entry.parent.mkdir(parents=True)
    entry.write_text("x")
    entry.parent.chmod(0o555)
    try:
        r = CliRunner().invoke(main, ["cache", "clear", "--cache-dir", str(cache)])
        assert r.exit_code == 1 and "left" in r.output, r.output
    finally:
        entry.parent.chmod(0o755)


# --------------------------------------------------------------------------- cache damage

def _cache_files(cache: Path, kind: str, suffix: str) -> list:
    return [p for p in (cache / kind).rglob(f"*{suffix}") if p.is_file()]


@pytest.mark.nvcc
@pytest.mark.parametrize("kind, suffix, damage", [
    ("template", ".ptx", "delete"), ("template", ".ptx", "corrupt"),
    ("kernel", ".cubin", "delete"), ("kernel", ".cubin", "corrupt"),
    ("kernel", ".json", "delete"), ("kernel", ".json", "corrupt"),
    pytest.param("kernel", ".ptx", "delete"),   # issue 11 defect 2
    pytest.param("kernel", ".ptx", "corrupt"),
])
def test_damaged_cache_entries_heal(tmp_path, kind, suffix, damage):
    model = write_npz(tmp_path / "m.npz", seed=7)
    cache = tmp_path / "cache"
    r = CliRunner().invoke(main, compile_args(model, tmp_path / "first", cache))
    assert r.exit_code == 0, r.output
    victims = _cache_files(cache, kind, suffix)
    assert victims, sorted(str(p) for p in cache.rglob("*"))
    for p in victims:
        if damage == "delete":
            p.unlink()
        else:
            p.write_bytes(b"garbage" + p.read_bytes()[7:])
    r = CliRunner().invoke(main, compile_args(model, tmp_path / "second", cache))
    assert r.exit_code == 0, r.output
    first, second = tmp_path / "first", tmp_path / "second"
    for f in first.iterdir():
        if f.name != "manifest.json":
            assert (second / f.name).read_bytes() == f.read_bytes(), f.name


# --------------------------------------------------------------------------- defects 2, 3 and 9

@pytest.mark.nvcc
def test_one_input_channel_1x1_conv_compiles(tmp_path):
    """Issue 11 defect 3: np.ones((64, 1, 1, 1)) at 8x8 raised SpecialiseError."""
    path = tmp_path / "w.npy"
    np.save(path, np.ones((64, 1, 1, 1), np.float32))
    r = CliRunner().invoke(main, ["layer", str(path), "--input-size", "8", "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output


@pytest.mark.nvcc
def test_compile_conv2d_builds_without_a_gpu_when_given_a_target(tmp_path):
    """Issue 11 defect 9: building must not ask the device for its target."""
    import sparseconv

    w = pruned_weight(np.random.default_rng(0), (4, 2, 3, 3), 0.7)
    try:
        sparseconv.compile_conv2d(w, input_size=8, target="sm_90", cache_dir=str(tmp_path / "cache"))
    except Exception:
        pass  # loading may need the GPU; the build must have happened first
    assert _cache_files(tmp_path / "cache", "kernel", ".cubin")


def test_a_layer_over_the_build_limits_is_listed_by_inspect_and_refused_by_compile(tmp_path):
    """Loading stays possible (inspect shows why), building is refused up front, naming the layer."""
    spec = [dict(name="conv", in_h=6, in_w=6, padding=1), dict(name="wide", in_h=1, in_w=1, groups=100000)]
    path = write_npz(tmp_path / "m.npz", spec=spec, wide=np.ones((100000, 1, 1, 1), np.float32))
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert "refused:" in next(line for line in r.output.splitlines() if line.startswith("wide"))
    r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache"))
    refused(r, "layer wide")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    if shutil.which("nvcc"):  # the other layers still compile
        r = CliRunner().invoke(main, compile_args(path, tmp_path / "out", tmp_path / "cache", "--layers", "conv"))
        assert r.exit_code == 0, r.output


def test_the_cli_restores_the_sigterm_handler_it_installs():
    before = signal.getsignal(signal.SIGTERM)
    assert CliRunner().invoke(main, ["cache", "ls", "--help"]).exit_code == 0
    r = CliRunner().invoke(main, ["inspect", str(LENET)])
    assert r.exit_code == 0, r.output
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("verb", ["compile", "layer"])
def test_an_unwritable_cache_is_refused_before_building(tmp_path, weight_npy, verb):
    (tmp_path / "a_file").write_text("x")
    cache = tmp_path / "a_file" / "cache"
    args = (compile_args(write_npz(tmp_path / "m.npz"), tmp_path / "out", cache) if verb == "compile"
            else ["layer", str(weight_npy), "--input-size", "8", "--cache-dir", str(cache)])
    before = files_under(tmp_path)
    t = time.perf_counter()
    refused(CliRunner().invoke(main, args), "is a file, not a folder")
    assert time.perf_counter() - t < 5 and files_under(tmp_path) == before


def test_non_numpy_files_are_not_answered_with_allow_pickle_advice(tmp_path):
    junk = tmp_path / "junk.npy"
    junk.write_text("just some text\n")
    for args in (["layer", str(junk), "--input-size", "8"],
                 ["run", str(LENET), "--data", str(junk), "--backend", "reference"],
                 ["inspect", str(junk), "--format", "npz"]):
        r = CliRunner().invoke(main, args)
        refused(r, "never unpickles")
        assert "allow_pickle" not in r.output


# --------------------------------------------------------------------------- the kernel-family and drop-in arguments

@pytest.mark.parametrize("kwargs, message", [
    (dict(activation="gelu"), "activation must be one of"),
    (dict(activation="clip"), "clip=\\(lo, hi\\) is given with activation='clip'"),
    (dict(activation="relu", clip=(0.0, 1.0)), "clip=\\(lo, hi\\) is given with activation='clip'"),
    (dict(activation="clip", clip=(2.0, 1.0)), "lo <= hi"),
    (dict(residual="yes"), "residual must be a bool"),
    (dict(pool=1), "pool must be a bool"),
    (dict(pool=True, residual=True), "pool=True with residual=True is not fused"),
    (dict(progress="no"), "progress must be True or False, got 'no'"),
])
def test_compile_conv2d_refuses_a_bad_epilogue_before_building(tmp_path, kwargs, message):
    """Refused up front, naming the layer, with nothing built or cached."""
    import sparseconv

    w = pruned_weight(np.random.default_rng(0), (4, 2, 1, 1), 0.5)
    with pytest.raises((ValueError, TypeError), match=message) as info:
        sparseconv.compile_conv2d(w, input_size=8, target="sm_90", cache_dir=str(tmp_path / "cache"), name="l1",
                                  **kwargs)
    assert str(info.value).startswith("l1: ")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.cubin"))


@pytest.mark.parametrize("route_batches", [[0], [1.5], "64", [True], {1, 64}, (b for b in (1, 64))],
                         ids=["zero", "float", "str", "bool", "set", "generator"])
def test_sparsify_refuses_bad_route_batches(route_batches):
    torch = pytest.importorskip("torch")
    import sparseconv.torch as sct

    with pytest.raises(ValueError, match="route_batches must be a list or tuple of positive batch sizes"):
        sct.sparsify(torch.nn.Conv2d(2, 2, 1), torch.zeros(1, 2, 4, 4), route_batches=route_batches)


@pytest.mark.parametrize("route_batches", [None, (1, 64), [8], range(1, 3)])
def test_route_batches_any_sequence_of_positive_ints_passes(route_batches):
    """sparsify and compile_model share one check: a sequence of batch sizes
    (a range too) or None passes it; the refusals are above."""
    from sparseconv.routing import check_route_batches

    check_route_batches(route_batches, "sparsify")


@pytest.mark.parametrize("option", ["pools", "gemv", "table"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_sparsify_refuses_a_pools_gemv_or_table_option_that_is_not_a_bool(option, value):
    torch = pytest.importorskip("torch")
    import sparseconv.torch as sct

    with pytest.raises(TypeError, match=f"sparsify: {option} must be True or False"):
        sct.sparsify(torch.nn.Conv2d(2, 2, 1), torch.zeros(1, 2, 4, 4), **{option: value})


def test_bench_network_option_refuses_bad_input_with_usage_errors():
    """`sparseconv bench --network`: the same checks through the bench command."""
    pytest.importorskip("torch")
    runner = CliRunner()
    for args, message in ((["--network", "alexnet"], "unknown network 'alexnet'"),
                          (["--network", "resnet50", "--sparsity", "1.5"], "one sparsity in [0, 1)"),
                          (["--network", "resnet50", "--sparsity", "abc"], "one sparsity in [0, 1)"),
                          (["--network", "resnet50", "--model", "m.npz"], "leave out --model"),
                          (["--network", "resnet50", "--variants", "eager fp16"], "unknown eager fp16"),
                          (["--network", "resnet50", "--paths", "code"], "leave out --paths")):
        r = runner.invoke(main, ["bench", *args])
        assert r.exit_code == 2 and message in r.output, (args, r.output)


def test_bench_paths_refuses_bad_input():
    """`sparseconv bench --paths`: a name it does not know is a usage error;
    BenchConfig refuses an empty or unknown selection in one line."""
    from sparseconv.benchmark import BenchConfig

    r = CliRunner().invoke(main, ["bench", "--paths", "cudnn"])
    assert r.exit_code == 2 and "'cudnn' is not one of 'both', 'code', 'table'" in r.output, r.output
    for paths in ((), ("code", "gemm")):
        with pytest.raises(ValueError, match="paths must be a non-empty selection of code, table") as err:
            BenchConfig(paths=paths)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("level", [0, 4, 1.0, True, "1"])
def test_a_bad_ptxas_level_is_refused_when_the_tiling_is_made(level):
    """Tiling.ptxas_level reaches ptxas as -O<level>: anything but 1, 2 or 3
    is refused in one line naming the field, before any build starts."""
    with pytest.raises(ValueError, match=r"tiling\.ptxas_level must be") as err:
        Tiling(8, 8, 1, 32, family="pointwise", ptxas_level=level)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields, needle", [
    (dict(slices=2, slice_sum="atomic"), r"tiling\.slice_sum must be one of \('kernel', 'cluster'\)"),
    (dict(slices=1, slice_sum="cluster"), "a cluster sum takes 2 to 16 slices"),
    (dict(slices=32, slice_sum="cluster"), "a cluster sum takes 2 to 16 slices"),
])
def test_a_bad_slice_sum_is_refused_when_the_tiling_is_made(fields, needle):
    """Tiling.slice_sum (session 15): one line naming the field or the limit."""
    with pytest.raises(ValueError, match=needle) as err:
        Tiling(8, 8, 1, 32, family="pointwise", **fields)
    assert "\n" not in str(err.value)


def test_a_cluster_tiling_over_shared_memory_is_refused_before_building(tmp_path):
    """The partial tile (k_block x threads floats) must fit in 48 KB: refused
    with what to lower, naming the layer, nothing cached."""
    import sparseconv

    w = pruned_weight(np.random.default_rng(0), (64, 64, 1, 1), 0.5)
    t = Tiling(64, 8, 1, 256, family="pointwise", slices=2, slice_sum="cluster")
    with pytest.raises(ValueError, match="k_block x threads") as err:
        sparseconv.compile_conv2d(w, input_size=8, tiling=t, target="sm_90", cache_dir=str(tmp_path / "c"), name="l1")
    assert "l1" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.cubin"))


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run a bench/ script from the repository root, as its docs say to."""
    root = Path(__file__).parent.parent
    return subprocess.run([sys.executable, script, *args], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_split_probe_refuses_an_unknown_layer_before_building():
    """bench/split_probe.py: a layer no zoo network has is a usage error naming
    the networks, not a KeyError after the imports."""
    r = _bench("bench/split_probe.py", "--sass", "--layers", "mobilenet_v2:features.99.conv.1.0")
    assert r.returncode == 2 and ("--layers: 'mobilenet_v2:features.99.conv.1.0' is not "
                                  "<vgg16|resnet50|resnext50|mobilenet_v2|mnasnet1_0>:<layer>") in r.stderr, r.stderr


def test_gpu_suite_refuses_an_unknown_part_before_running_anything(tmp_path):
    """bench/gpu_suite.sh 3: exit 2 with the usage, no shard log written."""
    root = Path(__file__).parent.parent
    r = subprocess.run(["bash", "bench/gpu_suite.sh", "3"], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip() == "usage: bash bench/gpu_suite.sh [1|2|all|two-gpus], not '3'"
    assert list(tmp_path.iterdir()) == []


def test_gpu_suite_on_two_gpus_brings_its_logs_back_in_one_tarball(tmp_path):
    """bench/gpu_suite.sh two-gpus runs part 1 and part 2 at once (here every
    test skips: no GPU) and leaves one tarball with each part's shard logs and
    summary, as the device tool brings back at most 8 files (~15 s)."""
    import tarfile

    root = Path(__file__).parent.parent
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "bench/gpu_suite.sh", "two-gpus"], cwd=root, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_logs.tgz"]
    names = set(tarfile.open(tmp_path / "gpu_logs.tgz").getnames())
    part1 = {"conv_a", "conv_b0", "conv_b1", "conv_d", "torch"}
    part2 = {"conv_c0", "conv_c1", "rest", "onnx", "linear", "table", "network"}
    assert {f"part1/gpu_{s}.log" for s in part1} | {f"part2/gpu_{s}.log" for s in part2} | \
        {"part1/summary.txt", "part2/summary.txt"} <= names
    shards = {line.split(":")[0] for line in r.stdout.splitlines() if ":" in line}
    assert shards == part1 | part2, r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--batch", "9"], "--batch must be 1..8 (the kernel's images a launch), got 9"),
    (["--batch", "0"], "--batch must be 1..8 (the kernel's images a launch), got 0"),
    (["--sparsity", "1.0"], "--sparsity must be in [0, 1), got 1.0"),
    (["--out", "/no/such/folder/g.json"], "--out /no/such/folder/g.json: folder /no/such/folder does not exist"),
])
def test_gemv_probe_refuses_bad_arguments_before_any_work(args, needle, tmp_path):
    """bench/gemv_probe.py: exit 2 with one line naming what to fix, before
    it touches a GPU, and no --out file written."""
    out = tmp_path / "g.json"
    argv = ["--out", str(out)] + args if "--out" not in args else args
    r = _bench("bench/gemv_probe.py", *argv)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(needle)
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--cands", "J2W4"], "--cands: 'J2W4' is not JjxWw[s] (e.g. J2xW4, J2xW4s), rule, rule-s or rule-u"),
    (["--cands", "J2xW4t"], "--cands: 'J2xW4t' is not JjxWw[s] (e.g. J2xW4, J2xW4s), rule, rule-s or rule-u"),
    (["--cands", "J0xW4"], "--cands J0xW4: pixels_per_lane must be 1..16, got 0"),
    (["--cands", "J2xW3"], "--cands J2xW3: warps must be 1, 2, 4, 8 or 16, got 3"),
    (["--layers", "resnet50:layer9.conv1"], "--layers: 'resnet50:layer9.conv1' is not <resnet50|vgg16>:<layer>, "
     "e.g. resnet50:layer4.1.conv2"),
    (["--batch", "0"], "--batch must be 1 or more, got 0"),
    (["--out", "/no/such/folder/t.json"], "--out /no/such/folder/t.json: folder /no/such/folder does not exist"),
])
def test_weight_table_probe_refuses_bad_arguments_before_any_work(args, needle, tmp_path):
    """bench/weight_table_probe.py: exit 2 with one line naming what to fix,
    before it builds a kernel or touches a GPU, and no --out file written."""
    _probe_refuses("bench/weight_table_probe.py", "resnet50:layer4.1.conv1", args, needle, tmp_path)


def _probe_refuses(script, layer, args, needle, tmp_path):
    """A layer probe run with `args` (plus --layers `layer` and an --out in
    tmp_path where args name none) exits 2, its last line ending in `needle`,
    and writes no --out file."""
    out = tmp_path / "probe.json"
    argv = (["--layers", layer] if "--layers" not in args else []) \
        + (["--out", str(out)] if "--out" not in args else []) + args
    r = _bench(script, *argv)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(needle), r.stderr
    # argparse's usage and error and nothing else: refused before any build or timing
    assert all(line.startswith(("usage:", " ")) or ": error: " in line for line in r.stderr.strip().splitlines())
    assert not out.exists()


_CAND_FORMS = ("is not default, direct, d<k_block>x<outputs along W>x<threads> or "
               "<k_block>x<threads>x<slices>[x<c_block>]")


@pytest.mark.parametrize("cand, needle", [
    ("default:Sbogus", "--cands default:Sbogus: unknown suffix :Sbogus (use :O<level>, :B<blocks per SM>, :Skernel, "
                       ":Scluster, :C<c_block>, :P<pixels a thread>, :Q, :A or :L)"),
    ("d8x2", f"--cands d8x2: 'd8x2' {_CAND_FORMS}"),
    ("64x256", f"--cands 64x256: '64x256' {_CAND_FORMS}"),
])
def test_split_probe_refuses_a_misspelt_candidate_before_any_build(cand, needle, tmp_path):
    """bench/split_probe.py: a candidate that is not one of its forms is a
    usage error (exit 2, one line), not a tiling skipped for one layer; the
    good candidates before it are not built and no --out file is written."""
    _probe_refuses("bench/split_probe.py", "resnet50:layer4.1.conv1",
                   ["--cands", f"default:Scluster,d16x1x256,32x64x4x8,{cand}"], needle, tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--layers", "vgg16:conv9_9"], "--layers: 'vgg16:conv9_9' is not <resnet50|vgg16>:<layer>, e.g. resnet50:conv1"),
    (["--layers", "alexnet:conv1"], "--layers: 'alexnet:conv1' is not <resnet50|vgg16>:<layer>, e.g. resnet50:conv1"),
    (["--out", "/no/such/folder/p.json"], "--out /no/such/folder/p.json: folder /no/such/folder does not exist"),
])
def test_code_prefetch_probe_refuses_bad_arguments_before_any_work(args, needle, tmp_path):
    """bench/code_prefetch_probe.py: exit 2 with one line naming what to fix,
    before it builds a kernel or touches a GPU, and no --out file written."""
    _probe_refuses("bench/code_prefetch_probe.py", "resnet50:conv1", args, needle, tmp_path)


@pytest.mark.parametrize("args, needle", [
    (["--without", "no-such-rule"], "unknown rule 'no-such-rule'; known: two-wave-splits, direct-cluster, cluster-sum, "
     "wide-direct-chunks, whole-image-split, large-image-blocks, gemv, table, overlap-launches, long-table-channels, "
     "image-layer-blocks, expanding-pointwise-blocks, staged-table-entries, evict-first-weights"),
    (["--batch", "0"], "--batch must be 1 or more, got 0"),
    (["--out", "/no/such/folder/ab.json"], "--out /no/such/folder/ab.json: folder /no/such/folder does not exist"),
])
def test_network_ab_refuses_bad_arguments_before_any_work(args, needle, tmp_path):
    """bench/network_ab.py: exit 2 with one line naming what to fix, before
    it imports torch or compiles anything, and no --out file written."""
    out = tmp_path / "ab.json"
    argv = ["--out", str(out)] + args if "--out" not in args else args
    r = _bench("bench/network_ab.py", "resnet50", *argv)
    assert r.returncode == 2 and needle in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(needle) and not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--weights", "zoo", "--sparsity", "0.95"], "--sparsity draws random weights; it does not apply to --weights zoo"),
    (["--sparsity", "1.5"], "--sparsity must lie in [0, 1], got [1.5]"),
    (["--cands", "default:Cx"], "--cands default:Cx: unknown suffix :Cx"),
])
def test_split_probe_refuses_bad_arguments_before_any_build(args, needle, tmp_path):
    """bench/split_probe.py: exit 2 with one line naming what to fix, before
    any kernel is built, and no --out file written."""
    out = tmp_path / "probe.json"
    r = _bench("bench/split_probe.py", "--layers", "resnet50:layer4.1.conv1", "--sass", "--out", str(out), *args)
    assert r.returncode == 2 and needle in r.stderr and "built" not in r.stderr
    assert not out.exists()


def test_layer_chain_probe_refuses_a_chain_of_one_before_touching_the_gpu():
    """bench/layer_chain_probe.py: a chain needs a boundary to time; exit 2
    with one line, whether or not a GPU is present."""
    r = _bench("bench/layer_chain_probe.py", "--layers", "1")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("--layers must be 2 or more, got 1")


_PROBE_REFUSALS = [  # (script, args, the end of stderr's last line)
    ("bench/icache_probe.py", ["--sizes-kb", "8,a"], "--sizes-kb: comma-separated numbers of KB, got '8,a'"),
    ("bench/icache_probe.py", ["--sizes-kb", "0"], "--sizes-kb: sizes above 0, got '0'"),
    ("bench/icache_probe.py", ["--threads", "33"], "--threads 33: a multiple of 32 from 32 to 1024"),
    ("bench/icache_probe.py", ["--passes", "1"], "--passes 1: at least 2 (one pass is the baseline)"),
    ("bench/icache_probe.py", ["--blocks", "0"], "--blocks and --repeat: 1 or more"),
    ("bench/ptxas_scaling.py", ["--layer", "vgg16:conv9_9"],
     "--layer vgg16:conv9_9: not a layer of the zoo (vgg16:<name> or resnet50:<name>)"),
    ("bench/ptxas_scaling.py", ["--layer", "lenet:conv1"],
     "--layer lenet:conv1: not a layer of the zoo (vgg16:<name> or resnet50:<name>)"),
    ("bench/ptxas_scaling.py", ["--channels", "64,x"], "--channels and --piece-lines take comma-separated integers"),
    ("bench/ptxas_scaling.py", ["--channels", "1024"], "--channels must lie in 1..512 and --piece-lines be positive"),
    ("bench/ptxas_scaling.py", ["--piece-lines", "0"], "--channels must lie in 1..512 and --piece-lines be positive"),
    ("bench/ptxas_scaling.py", ["--out", "/nonexistent-folder/p.json"], "folder /nonexistent-folder does not exist"),
    ("bench/graph_wrapper_probe.py", ["--repeat", "0"], "--repeat and --trials must be 1 or more, got 0 and 3"),
    ("bench/graph_wrapper_probe.py", ["--trials", "-1"], "--repeat and --trials must be 1 or more, got 200 and -1"),
    ("bench/graph_wrapper_probe.py", ["--out", "/nonexistent-folder/w.json"],
     "folder /nonexistent-folder does not exist"),
    ("bench/compile_model.py", ["lenet"],
     "invalid choice: 'lenet' (choose from 'vgg16', 'resnet50', 'resnext50', 'mobilenet_v2', 'mnasnet1_0')"),
    ("bench/compile_model.py", ["vgg16", "--json", "/nonexistent-folder/c.json"],
     "the folder /nonexistent-folder does not exist"),
    ("bench/compile_model.py", ["vgg16", "--json", "c.txt"], "c.txt: the output file must end in .json"),
    ("bench/compile_model.py", ["vgg16", "--sparsity", "1"], "--sparsity must lie in [0, 1), got 1.0"),
    ("bench/compile_model.py", ["vgg16", "--jobs", "0"], "--jobs must be 1 or more, got 0"),
    ("bench/export_network.py", ["lenet", "x.onnx"],
     "'lenet' is not one of 'mnasnet1_0', 'mobilenet_v2', 'resnet50', 'resnext50', 'vgg16'."),
    ("bench/export_network.py", ["vgg16", "/nonexistent-folder/v.onnx"], "folder /nonexistent-folder does not exist"),
    ("bench/export_network.py", ["vgg16", "v.txt"], "v.txt: the output file must end in .onnx"),
    ("bench/front_end_ab.py", ["models/lenet_digits_pruned.onnx", "--out", "/nonexistent-folder/ab.json"],
     "folder /nonexistent-folder does not exist"),
    ("bench/front_end_ab.py", ["models/lenet_digits_pruned.onnx", "--batch", "0"], "0 is not in the range x>=1."),
    ("bench/front_end_ab.py", ["no-such.onnx"], "File 'no-such.onnx' does not exist."),
    ("bench/dense_linear_probe.py", ["--out", "/nonexistent-folder/d.json"],
     "folder /nonexistent-folder does not exist"),
    ("bench/dense_linear_probe.py", ["--out", "d.txt"], "d.txt: the output file must end in .json"),
    ("bench/dense_linear_probe.py", ["--batch", "0"], "0 is not in the range x>=1."),
    ("bench/pool_bench.py", ["--batch", "0"], "--batch: 1 or more, got 0"),
    ("bench/pool_bench.py", ["--out", "/nonexistent-folder/p.json"],
     "--out /nonexistent-folder/p.json: a .json file in a folder that exists"),
    ("bench/pool_bench.py", ["--out", "p.txt"], "--out p.txt: a .json file in a folder that exists"),
    ("bench/eager_forward.py", ["resnet50", "--batch", "0"], "--batch and --repeat must be 1 or more, got [0] and 30"),
    ("bench/eager_forward.py", ["vgg16", "--repeat", "0"], "--batch and --repeat must be 1 or more, got [1, 64] and 0"),
    ("bench/eager_forward.py", ["vgg16", "--out", "/nonexistent-folder/e.json"],
     "--out /nonexistent-folder/e.json: a .json file in a folder that exists"),
    ("bench/eager_forward.py", ["resnet50", "--out", "e.txt"], "--out e.txt: a .json file in a folder that exists"),
    ("bench/eager_host.py", ["--out", "h.json", "--repeat", "0"], "--repeat must be 1 or more, got 0"),
    ("bench/eager_host.py", ["--out", "/nonexistent-folder/h.json"],
     "--out /nonexistent-folder/h.json: a .json file in a folder that exists"),
    ("bench/eager_host.py", ["--out", "h.txt"], "--out h.txt: a .json file in a folder that exists"),
    ("bench/host_load_probe.py", ["mnasnet1_0", "--out", "h.json", "--batch", "0"],
     "--batch, --rounds and --repeat must be 1 or more, got 0, 5 and 30"),
    ("bench/host_load_probe.py", ["mnasnet1_0", "--out", "h.json", "--sleep-us", "50", "0"],
     "--sleep-us: each wait must be positive, got [50.0, 0.0]"),
    ("bench/host_load_probe.py", ["mnasnet1_0", "--out", "/nonexistent-folder/h.json"],
     "--out /nonexistent-folder/h.json: a .json file in a folder that exists"),
    ("bench/host_load_probe.py", ["mnasnet1_0", "--out", "h.txt"], "--out h.txt: a .json file in a folder that exists"),
    ("bench/host_load_probe.py", ["lenet", "--out", "h.json"], "invalid choice: 'lenet' (choose from "
     "'mnasnet1_0', 'mobilenet_v2', 'resnet50', 'resnext50', 'vgg16')"),
    ("bench/ptxas_groups.py", ["/nonexistent-cache", "--workers", "0"], "--workers must be 1 or more, got 0"),
    ("bench/ptxas_groups.py", ["/nonexistent-cache", "--out", "g.txt"],
     "--out g.txt: a .json file in a folder that exists"),
    ("bench/ptxas_groups.py", ["/nonexistent-cache"],
     "/nonexistent-cache: no specialised PTX under kernel/ (is it a sparseconv build cache?)"),
]


@pytest.mark.parametrize("script, args, needle", _PROBE_REFUSALS,
                         ids=[f"{Path(s).stem}:{' '.join(a)}" for s, a, _ in _PROBE_REFUSALS])
def test_probes_refuse_bad_options_in_one_line_before_any_work(script, args, needle):
    """bench/icache_probe.py, ptxas_scaling.py, graph_wrapper_probe.py, compile_model.py,
    export_network.py, front_end_ab.py, dense_linear_probe.py, pool_bench.py, eager_forward.py, eager_host.py,
    ptxas_groups.py, host_load_probe.py:
    exit 2, one line,
    nothing printed, assembled, compiled, exported, timed or written."""
    r = _bench(script, *args)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(needle)
    assert "Traceback" not in r.stderr and r.stdout == ""


def _sweep_doc(sparsities=(0.5, 0.9)):
    """A saved sweep, as `sparseconv bench --sweep --json` writes its rows."""
    rows = [dict(layer="resnet-conv2", batch=64, sparsity=sp, speedup={"cudnn_fp32": 3 * sp, "cudnn_tf32": sp})
            for sp in sparsities]
    return dict(meta=dict(device="Test GPU", date="2026-11-27"), rows=rows)


@pytest.mark.parametrize("case, needle", [
    ("missing", "cannot read a bench result"),
    ("damaged", "cannot read a bench result"),
    ("not bench", "not a result of `sparseconv bench --json`"),
    ("speedup not a table", "not a result of `sparseconv bench --json`"),
    ("one sparsity", "the plot needs a sweep: at least two sparsities"),
    ("out not png", "the plot is a PNG; name it *.png"),
    ("out folder", "folder /nonexistent-folder does not exist"),
])
def test_replot_sweep_refuses_bad_input_and_writes_nothing(case, needle, tmp_path):
    """bench/replot_sweep.py: exit 2 with one line naming the file and what
    was expected; no PNG (nor a temporary one) left behind."""
    results, out = tmp_path / "r.json", tmp_path / "s.png"
    bad_speedup = dict(rows=[dict(layer="a", batch=1, sparsity=0.5, speedup=2.0)])
    doc = {"one sparsity": _sweep_doc((0.9,)), "not bench": {"rows": [{"layer": "a"}]},
           "speedup not a table": bad_speedup}.get(case, _sweep_doc())
    if case == "damaged":
        results.write_text(json.dumps(doc)[:-20])
    elif case != "missing":
        results.write_text(json.dumps(doc))
    out = {"out not png": tmp_path / "s.jpg", "out folder": Path("/nonexistent-folder/s.png")}.get(case, out)
    r = _bench("bench/replot_sweep.py", str(results), "--out", str(out))
    named = str(out) if case.startswith("out") else str(results)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {'--out ' if case.startswith('out') else ''}{named}: ") and needle in r.stderr
    assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if case == "missing" else ["r.json"])


def test_replot_sweep_draws_a_saved_sweep(tmp_path):
    """The good path: the PNG of a saved sweep, fp32 and TF32 named."""
    pytest.importorskip("matplotlib")
    results, out = tmp_path / "r.json", tmp_path / "s.png"
    results.write_text(json.dumps(_sweep_doc()))
    r = _bench("bench/replot_sweep.py", str(results), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out} (speedup over cuDNN fp32 and cuDNN TF32)"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "s.png"]


@pytest.mark.parametrize("args", [["--blocks-per-sm", "0"], ["--threads", "100"], ["--waves", "0"], ["--spin-us", "0"]])
def test_dispatch_probe_refuses_bad_options_before_touching_the_gpu(args):
    """bench/dispatch_probe.py: one line naming every bound, exit 2."""
    r = _bench("bench/dispatch_probe.py", *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--blocks-per-sm 1..32, --waves >= 1, --threads a multiple of 32 "
                                                      "in 32..1024, --spin-us > 0")


@pytest.mark.parametrize("script", ["bench/kernel_floor.py", "bench/classifier_l2_probe.py"])
def test_option_free_probes_refuse_stray_arguments(script):
    """The probes that take no options exit 2 on one, before any GPU work."""
    r = _bench(script, "--layers", "8")
    assert r.returncode == 2 and "unrecognized arguments: --layers 8" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("weight_shape, shape, needle", [
    ((5, 6, 1, 1), ConvShape(6, 5, 7, 7, 3, 3, padding=(1, 1)),
     r"^conv9: weight_table: the weight must have shape \(5, 6, 3, 3\) for C=6 K=5"),
    ((4, 2, 3, 3), ConvShape(4, 4, 5, 5, 3, 3, groups=2),
     "^conv9: weight_table: .*grouped convs are not supported by the table family"),
    ((2, 2, 9, 9), ConvShape(2, 2, 9, 9, 9, 9), "^conv9: weight_table: .*more than 64 taps"),
])
def test_the_table_kernel_refuses_a_layer_it_cannot_take_before_touching_a_gpu(weight_shape, shape, needle):
    """sparseconv.TableConv2d: a ValueError naming the layer's shape and what
    is wrong, raised while building the table, before any GPU work."""
    from sparseconv.table import TableConv2d

    with pytest.raises(ValueError, match=needle):
        TableConv2d(np.ones(weight_shape, np.float32), None, shape, name="conv9")


def test_a_mistyped_overlap_switch_is_refused_at_import_with_what_to_set():
    """SPARSECONV_OVERLAP_LAUNCHES=maybe: the first use of sparseconv's kernels (the import of
    sparseconv.launch) fails naming the variable and its values, instead of leaving the overlap on silently."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SPARSECONV_OVERLAP_LAUNCHES="maybe", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", "import sparseconv; sparseconv.compile_conv2d"], cwd=root, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert ("ValueError: SPARSECONV_OVERLAP_LAUNCHES must be 1 or 0 (true/false, yes/no, on/off), got 'maybe'"
            in r.stderr)
    for value, on in (("OFF", False), ("0", False), ("yes", True), ("", None)):
        env["SPARSECONV_OVERLAP_LAUNCHES"] = value
        r = subprocess.run([sys.executable, "-c", "import sparseconv.launch as l; print(l.OVERLAP_LAUNCHES)"],
                           cwd=root, env=env, capture_output=True, text=True)
        if on is None:  # set but empty: refused too
            assert "got ''" in r.stderr
        else:
            assert r.stdout.strip() == str(on), r.stderr


@pytest.mark.parametrize("case", ["bad-commit", "export-over-a-folder", "old-without-templates", "no-command",
                                  "zero-rounds"])
def test_tree_ab_refuses_bad_input_in_one_line_before_writing_or_running(case, tmp_path):
    """bench/tree_ab.py: exit 2, the last stderr line names what to do; nothing exported, no log written."""
    there = tmp_path / "there"
    there.mkdir()
    out = tmp_path / "ab"
    argv, needle = {
        "bad-commit": (["export", "no-such-commit-xyz", str(tmp_path / "old")],
                       "export: 'no-such-commit-xyz' is not a commit of"),
        "export-over-a-folder": (["export", "HEAD", str(there)], "exists; remove it or name another folder"),
        "old-without-templates": (["run", "--old", str(there), "--out-dir", str(out), "--", "true"],
                                  "has no sparseconv, templates/; make it with `python bench/tree_ab.py export "
                                  f"<commit> {there}`"),
        "no-command": (["run", "--old", str(there), "--out-dir", str(out)], "run: give the command after --"),
        "zero-rounds": (["run", "--old", str(there), "--rounds", "0", "--out-dir", str(out), "--", "true"],
                        "run: --rounds must be 1 or more, got 0"),
    }[case]
    r = _bench("bench/tree_ab.py", *argv)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and not any(there.iterdir())


def test_graph_wrapper_probe_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    out = tmp_path / "w.json"
    r = _bench("bench/graph_wrapper_probe.py", "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("no CUDA device: the probe times CUDA graph replays")
    assert not out.exists()


def _conv_then(tmp_path: Path, name: str, op: str, batch=1) -> Path:
    """A one-conv ONNX file followed by `op` (None: nothing), input (batch, 3, 5, 5)."""
    pytest.importorskip("onnx")
    from onnx import helper
    from onnx_models import save_model

    nodes = [helper.make_node("Conv", ["x", "w"], ["c" if op else "out"], name="conv")]
    inits = {"w": pruned_weight(np.random.default_rng(0), (4, 3, 1, 1), 0.5)}
    if op:
        nodes.append(helper.make_node(op, ["c", "g"], ["out"], name="node2", axis=-1))
        inits["g"] = np.ones(5, np.float32)
    return save_model(tmp_path / name, nodes, inits, [batch, 3, 5, 5])


@pytest.mark.parametrize("case, args, needle", [
    ("missing", ["--network", "{tmp}/missing.onnx"], "missing.onnx: no such ONNX file"),
    ("garbage", ["--network", "{tmp}/garbage.onnx"], "garbage.onnx"),
    ("operator", ["--network", "{tmp}/ln.onnx"], "node node2 has operator LayerNormalization"),
    ("fixed batch", ["--network", "{tmp}/b1.onnx", "--batch", "1", "--batch", "64"],
     "b1.onnx: the file fixes the batch size to 1, asked for 1, 64"),
    ("prune an onnx", ["--network", str(LENET), "--prune-linears"], "an ONNX file is timed with its own weights"),
    ("sparsity of an onnx", ["--network", str(LENET), "--sparsity", "0.5"], "--sparsity prunes a built-in network"),
    ("prune without network", ["--prune-linears"], "use it with --network"),
])
def test_bench_network_refuses_an_onnx_file_it_cannot_time_before_any_work(tmp_path, monkeypatch, case, args, needle):
    """`sparseconv bench --network model.onnx`: the file is converted before
    anything is timed, so what cannot be timed is exit 2 and one line, on a
    machine without a GPU too, and no --json or --plot file is written."""
    pytest.importorskip("torch")
    from sparseconv import onnx_torch

    # every runner operator converts now: one taken out stands for one the runner gains first
    monkeypatch.delitem(onnx_torch.CONVERTERS, "LayerNormalization")
    (tmp_path / "garbage.onnx").write_bytes(b"not a model")
    _conv_then(tmp_path, "ln.onnx", "LayerNormalization")
    _conv_then(tmp_path, "b1.onnx", None)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = CliRunner().invoke(main, ["bench", *argv, "--json", str(tmp_path / "r.json"), "--plot",
                                  str(tmp_path / "r.png")])
    refused(r, needle)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.png").exists()


def test_torchvision_front_end_says_what_it_needs_or_refuses_an_unknown_model():
    """bench/torchvision_front_end.py: without torchvision (CI) it says how to
    get it; with it, an unknown model name exits 2 naming the name and some
    that exist, before any model is built."""
    import importlib.util

    r = _bench("bench/torchvision_front_end.py", "no_such_net")
    if importlib.util.find_spec("torchvision") is None:
        assert r.returncode == 1 and "pip install torchvision" in r.stderr, r.stderr
    else:
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == ("unknown torchvision model 'no_such_net'; e.g. mobilenet_v2, mobilenet_v3_small, "
                                    "densenet121, efficientnet_b0, squeezenet1_1, regnet_y_400mf, convnext_tiny, "
                                    "shufflenet_v2_x0_5, googlenet, resnext50_32x4d, vgg11_bn, alexnet, mnasnet0_5")
    assert "traced=" not in r.stdout
