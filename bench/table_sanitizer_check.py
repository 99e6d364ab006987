"""The weight-table kernel (sparseconv.table) under compute-sanitizer, with
its results checked against float64: a padded 3x3 with a residual and ReLU
(ResNet-50 layer4's shape), a strided 1x1 (layer4.0.downsample) and a 7x7
stride-2 stem (49 taps: the 64-bit tap mask), and two convs whose epilogue
pools (2x2 max, stride 2: even sides, and odd ones the pool drops a row and
column of), each at batch 1 and 3.

    compute-sanitizer --tool memcheck --error-exitcode 1 python bench/table_sanitizer_check.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python bench/table_sanitizer_check.py
"""
import cupy as cp
import numpy as np

from sparseconv.dense import epilogue_reference
from sparseconv.shapes import ConvShape, Epilogue
from sparseconv.table import TableConv2d
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

LAYERS = [
    (ConvShape(512, 512, 7, 7, 3, 3, padding=(1, 1)), Epilogue("relu", residual=True)),
    (ConvShape(1024, 2048, 14, 14, 1, 1, stride=(2, 2)), Epilogue()),
    (ConvShape(3, 8, 20, 20, 7, 7, stride=(2, 2), padding=(3, 3)), Epilogue("relu6")),
    (ConvShape(64, 64, 14, 14, 3, 3, padding=(1, 1)), Epilogue("relu", pool=True)),
    (ConvShape(16, 24, 7, 9, 3, 3, padding=(1, 1)), Epilogue(pool=True)),
]


def main() -> None:
    rng = np.random.default_rng(0)
    for shape, ep in LAYERS:
        w = pruned_weight(rng, shape.weight_shape, 0.9)
        b = rng.standard_normal(shape.out_channels).astype(np.float32)
        k = TableConv2d(w, b, shape, ep)
        for n in (1, 3):
            x = rng.standard_normal((n, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32)
            res = rng.standard_normal((n, shape.out_channels, shape.out_h, shape.out_w)).astype(np.float32) \
                if ep.residual else None
            y = k(cp.asarray(x), **({} if res is None else {"residual": cp.asarray(res)})).get()
            ref = epilogue_reference(conv2d_reference(x, w, b, shape.stride, shape.padding), ep, res)
            print(shape.describe(), n, k.tiling.describe(), f"rel L2 {relative_l2(y, ref):.1e}")


if __name__ == "__main__":
    main()
