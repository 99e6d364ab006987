"""bench/code_per_block.py refuses bad arguments before it builds anything:
exit 2, one line naming the argument, no JSON written."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "bench" / "code_per_block.py"


@pytest.mark.parametrize("args, says", [
    (["resnet50", "--layers", "layer9.conv1"], "no layer layer9.conv1 in resnet50"),
    (["resnet50", "--batch", "0"], "--batch must be at least 1"),
    (["vgg16", "--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
    (["vgg16", "--workers", "0"], "--workers must be at least 1"),
    (["alexnet"], "invalid choice: 'alexnet'"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, args, says):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True,
                       cwd=SCRIPT.parent.parent)
    assert r.returncode == 2
    error = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and says in error[0], r.stderr
    assert not out.exists()
