"""A target for Nsight Compute: one benchmark layer (90% sparse) called three times at batch 64.

    ncu --kernel-name regex:sc_conv2d --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section InstructionStats --section ComputeWorkloadAnalysis \\
        python bench/profile_layer.py vgg-conv3
"""
import sys

import cupy as cp
import numpy as np

import sparseconv
from sparseconv.testing import pruned_weight
from sparseconv.operators import benchmark_operators

op = next(o for o in benchmark_operators() if o.name == sys.argv[1])
s = op.shape
w = pruned_weight(np.random.default_rng(0), s.weight_shape, 0.9)
conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding)
x = cp.random.standard_normal((64, s.in_channels, s.in_h, s.in_w), dtype=cp.float32)
for _ in range(3):
    conv(x)
cp.cuda.Device().synchronize()
