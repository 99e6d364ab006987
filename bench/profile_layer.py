"""Build one benchmark layer (90% sparse) and call it three times at batch 64: a
target for Nsight Compute.

    ncu --kernel-name regex:sc_conv2d --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section InstructionStats --section ComputeWorkloadAnalysis \\
        python bench/profile_layer.py vgg-conv3
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import sparseconv  # noqa: E402
from sparseconv.testing import pruned_weight  # noqa: E402
from sparseconv.operators import benchmark_operators  # noqa: E402

op = next(o for o in benchmark_operators() if o.name == sys.argv[1])
s = op.shape
w = pruned_weight(np.random.default_rng(0), s.weight_shape, 0.9)
conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding)
x = cp.random.standard_normal((64, s.in_channels, s.in_h, s.in_w), dtype=cp.float32)
for _ in range(3):
    conv(x)
cp.cuda.Device().synchronize()
