"""Memory errors and races (under compute-sanitizer) and the relative L2 of every benchmark layer's kernel.

Runs each kernel once (sparsity 0.9, batch 2), for
`compute-sanitizer --tool memcheck --error-exitcode 1 python bench/memcheck_layers.py`
and (shared-memory races of the double-buffered staging, on a few layers, as
racecheck is slow) `compute-sanitizer --tool racecheck --error-exitcode 1
python bench/memcheck_layers.py 'lenet-*,resnet-conv2'`.

Checks results too, so a run that passes memcheck is also known to be right."""
import fnmatch
import sys
import tempfile

import cupy as cp
import numpy as np

import sparseconv
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2
from sparseconv.operators import benchmark_operators


def main() -> int:
    rng = np.random.default_rng()
    patterns = sys.argv[1].split(",") if len(sys.argv) > 1 else ["*"]
    cache = tempfile.mkdtemp()
    worst = 0.0
    for op in benchmark_operators():
        if not any(fnmatch.fnmatch(op.name, p) for p in patterns):
            continue
        s = op.shape
        w = pruned_weight(rng, s.weight_shape, 0.9)
        conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding,
                                         cache_dir=cache, name=op.name)
        x = cp.asarray(rng.standard_normal((2, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
        y = conv(x)
        err = relative_l2(y, conv2d_reference(x, cp.asarray(w), None, s.stride, s.padding, xp=cp), xp=cp)
        worst = max(worst, err)
        print(f"{op.name:16s} rel_l2={err:.2e}", flush=True)
    print(f"worst rel_l2 {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
