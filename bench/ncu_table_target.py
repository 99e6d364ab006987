"""A target for Nsight Compute: the weight-table kernel (sparseconv.table) of
named ResNet-50 zoo layers at batch 1, each called three times, with the
tiling table_tiling's rule gives it (session 23, run g).

    ncu --clock-control none --kernel-name regex:sc_table_conv \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats \\
        --section InstructionStats \\
        python bench/ncu_table_target.py layer4.1.conv2,layer3.1.conv1
"""
import sys

import cupy as cp

from sparseconv.shapes import Epilogue
from sparseconv.table import TableConv2d
from sparseconv.zoo import pruned_model


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/ncu_table_target.py <layer>[,<layer>...], e.g. layer4.1.conv2")
    layers = {name: (shape, w) for name, shape, w in pruned_model("resnet50", 0.9)}
    names = sys.argv[1].split(",")
    unknown = [n for n in names if n not in layers]
    if unknown:
        sys.exit(f"not a ResNet-50 conv: {unknown[0]!r}, e.g. layer4.1.conv2")
    for name in names:
        shape, w = layers[name]
        k = TableConv2d(w, None, shape, Epilogue("relu"), name=name)
        print(name, k.tiling.describe(), k.stats, flush=True)
        x = cp.random.standard_normal((1, shape.in_channels, shape.in_h, shape.in_w), dtype=cp.float32)
        for _ in range(3):
            k(x)
        cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
