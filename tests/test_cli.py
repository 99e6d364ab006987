"""CPU: the command line."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.cli import main

from sparseconv.testing import pruned_weight


@pytest.fixture
def weight_file(tmp_path):
    path = tmp_path / "conv_a.npy"
    np.save(path, pruned_weight(np.random.default_rng(0), (6, 5, 3, 3), 0.8))
    return path


@pytest.mark.nvcc
def test_layer_builds_and_reports(tmp_path, weight_file):
    cache = tmp_path / "cache"
    ptx = tmp_path / "out.ptx"
    r = CliRunner().invoke(main, ["layer", str(weight_file), "--input-size", "9x13", "--padding", "1",
                                  "--stride", "2x1", "--cache-dir", str(cache), "--emit-ptx", str(ptx), "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output)
    w = np.load(weight_file)
    assert stats["nonzero_weights"] == np.count_nonzero(w)
    assert stats["fmas_kept"] == np.count_nonzero(w) * stats["fmas_per_weight"]
    assert ".entry sc_conv2d" in ptx.read_text()
    r2 = CliRunner().invoke(main, ["layer", str(weight_file), "--input-size", "9x13", "--padding", "1",
                                   "--stride", "2x1", "--cache-dir", str(cache)])
    assert r2.exit_code == 0 and "kernel True" in r2.output
    r3 = CliRunner().invoke(main, ["cache", "ls", "--cache-dir", str(cache)])
    assert r3.exit_code == 0 and "entries in" in r3.output and "CORRUPT" not in r3.output
    assert CliRunner().invoke(main, ["cache", "verify", "--cache-dir", str(cache)]).exit_code == 0
    r4 = CliRunner().invoke(main, ["cache", "clear", "--cache-dir", str(cache)])
    assert r4.exit_code == 0 and "removed" in r4.output
    assert "0 entries" in CliRunner().invoke(main, ["cache", "ls", "--cache-dir", str(cache)]).output


@pytest.mark.nvcc
def test_layer_counts_a_split_modules_ptxas_functions(tmp_path):
    """A layer of several k-blocks is assembled function by function; the
    command counts them on stderr, and --json keeps stderr quiet."""
    path = tmp_path / "wide.npy"
    np.save(path, pruned_weight(np.random.default_rng(1), (160, 4, 3, 3), 0.8))
    args = ["layer", str(path), "--input-size", "8", "--padding", "1", "--cache-dir"]
    r = CliRunner().invoke(main, args + [str(tmp_path / "cache")])
    assert r.exit_code == 0, r.output
    counts = [part for part in r.stderr.split("\r") if part]
    assert counts[0] == "wide: ptxas, functions assembled: 0/" + counts[-1].split("/")[1].strip()
    done, total = counts[-1].rsplit(": ", 1)[1].strip().split("/")
    assert done == total and int(total) > 2 and counts[-1].endswith("\n")
    quiet = CliRunner().invoke(main, args + [str(tmp_path / "cache2"), "--json"])  # assembles again, quietly
    assert quiet.exit_code == 0 and quiet.stderr == ""


@pytest.mark.nvcc
def test_layer_says_how_many_depthwise_groups_a_block(tmp_path):
    """A depthwise layer's default builds four groups into a block
    (shapes.kernel_shape): its tiling's c_block of 4 is groups there, not
    input channels, and the report says so; a plain conv's does not."""
    path = tmp_path / "dw.npy"
    np.save(path, pruned_weight(np.random.default_rng(2), (8, 1, 3, 3), 0.5))
    args = ["layer", str(path), "--input-size", "7", "--padding", "1", "--groups", "8", "--cache-dir",
            str(tmp_path / "cache")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "k_block=4 c_block=4" in r.output and ", 4 depthwise groups a block, target" in r.output
    stats = json.loads(CliRunner().invoke(main, args + ["--json"]).output)
    assert stats["depthwise_groups_a_block"] == 4
    plain = tmp_path / "plain.npy"
    np.save(plain, pruned_weight(np.random.default_rng(3), (8, 4, 3, 3), 0.5))
    r = CliRunner().invoke(main, ["layer", str(plain), "--input-size", "7", "--padding", "1", "--cache-dir",
                                  str(tmp_path / "cache"), "--json"])
    assert r.exit_code == 0 and "depthwise_groups_a_block" not in json.loads(r.output)


@pytest.mark.parametrize("args, message", [
    (["--input-size", "abc"], "--input-size"),
    (["--input-size", "2"], "output would be empty"),
    (["--input-size", "9", "--groups", "4"], "divisible by groups"),
])
def test_layer_bad_input_exits_2_and_writes_nothing(tmp_path, weight_file, args, message):
    cache = tmp_path / "cache"
    r = CliRunner().invoke(main, ["layer", str(weight_file), *args, "--cache-dir", str(cache)])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert not cache.exists() or not any(p.is_file() and p.suffix != "" for p in cache.rglob("*"))


def test_unreadable_weight_file_exits_2(tmp_path):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY garbage")
    r = CliRunner().invoke(main, ["layer", str(bad), "--input-size", "8", "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and "cannot read" in r.output


def test_help_has_examples():
    for verb in (["layer"], ["compile"], ["inspect"], ["cache", "ls"], ["cache", "verify"], ["cache", "clear"]):
        r = CliRunner().invoke(main, [*verb, "--help"])
        assert r.exit_code == 0 and "Example" in r.output
