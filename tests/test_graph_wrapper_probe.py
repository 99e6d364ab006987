"""bench/graph_wrapper_probe.py refuses bad arguments in one line (exit 2)
before it times anything or writes its --out file."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "bench" / "graph_wrapper_probe.py")


def _probe(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("args, says", [
    (["--repeat", "0"], "--repeat and --trials must be 1 or more, got 0 and 3"),
    (["--trials", "-1"], "--repeat and --trials must be 1 or more, got 200 and -1"),
    (["--out", "/nonexistent-folder/w.json"],
     "--out /nonexistent-folder/w.json: folder /nonexistent-folder does not exist"),
])
def test_bad_arguments_are_refused_in_one_line(args, says):
    r = _probe(*args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(says)
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_without_a_gpu_it_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run")
    out = tmp_path / "w.json"
    r = _probe("--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("no CUDA device: the probe times CUDA graph replays")
    assert not out.exists()
