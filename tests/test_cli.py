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
