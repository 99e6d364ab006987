"""The split reduction (sparseconv.runtime.reduce_slices) alone, against the
version it replaced (slice count a run-time loop bound), on workspaces of
ResNet-50's batch-1 split layers' sizes, timed by CUDA-graph replays in one
process (the ratio is what counts; whole-network runs vary by ±4% run to run,
more than this kernel's share). Both add the slices in the same order, and
the script checks their outputs are bitwise equal.

    python bench/reduce_probe.py --out reduce_probe.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from sparseconv.runtime import reduce_slices
from sparseconv.timing import cupy_graph, time_gpu

# The version before session 11: one load latency per few slices.
_PREVIOUS_SOURCE = r"""
extern "C" __global__ void sc_reduce_slices(const float* __restrict__ ws, float* __restrict__ y,
        long long total, int slices)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ws[i];
        for (int s = 1; s < slices; ++s) v += ws[s * total + i];
        y[i] = v;
    }
}
"""

# (slices, outputs) of typical batch-1 split layers: K x out_h x out_w
CASES = [(2, 128 * 28 * 28), (4, 256 * 14 * 14), (8, 256 * 14 * 14), (16, 256 * 14 * 14), (16, 512 * 7 * 7),
         (4, 2048 * 7 * 7), (8, 1024 * 14 * 14)]


def main() -> None:
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reduce_probe.json")
    args = ap.parse_args()
    previous = cupy.RawKernel(_PREVIOUS_SOURCE, "sc_reduce_slices")
    dev = cupy.cuda.Device().id
    rows = []
    for slices, total in CASES:
        ws = cupy.random.standard_normal((slices, 1, total), dtype=cupy.float32)
        y_new = cupy.empty((1, total), cupy.float32)
        y_old = cupy.empty_like(y_new)

        def new():
            reduce_slices(dev, ws, y_new)

        def old():
            previous((min(-(-total // 256), 4096),), (256,), (ws, y_old, np.int64(total), np.int32(slices)))
        new(), old()
        assert bool((y_new == y_old).all()), "the two reductions differ"
        t_new = time_gpu(new, repeat=30, max_seconds=0.3, capture=cupy_graph).us
        t_old = time_gpu(old, repeat=30, max_seconds=0.3, capture=cupy_graph).us
        rows.append(dict(slices=slices, outputs=total, previous_us=t_old, new_us=t_new))
        print(f"slices {slices:3d} outputs {total:8d}: previous {t_old:6.2f} us, new {t_new:6.2f} us")
    with open(args.out, "w") as f:
        json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode(),
                       date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
