"""bench/ptxas_scaling.py refuses bad arguments in one line (exit 2) before
it compiles anything."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "bench" / "ptxas_scaling.py")


@pytest.mark.parametrize("args, says", [
    (["--layer", "vgg16:conv9_9"], "--layer vgg16:conv9_9: not a layer of the zoo"),
    (["--layer", "lenet:conv1"], "--layer lenet:conv1: not a layer of the zoo"),
    (["--channels", "64,x"], "--channels and --piece-lines take comma-separated integers"),
    (["--channels", "1024"], "--channels must lie in 1..512 and --piece-lines be positive"),
    (["--piece-lines", "0"], "--channels must lie in 1..512 and --piece-lines be positive"),
    (["--out", "/nonexistent-folder/p.json"], "folder /nonexistent-folder does not exist"),
])
def test_bad_arguments_are_refused_in_one_line(args, says):
    r = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and r.stdout == ""
