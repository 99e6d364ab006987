"""Throwaway (session 28): is the pieces' loss at batch 64 the shared-memory carveout?"""
import sys
import tempfile

import cupy
import numpy as np

import sparseconv.shapes as shapes
from sparseconv.parallel import LayerJob, build_many
from sparseconv.runtime import Conv2dKernel, allow_shared_bytes
from sparseconv.shapes import Epilogue, Target, default_tiling
from sparseconv.timing import cupy_graph, time_gpu
from sparseconv.zoo import pruned_model

names = sys.argv[1].split(",")
n = 64
zoo = {name: (s, w) for name, s, w in pruned_model("vgg16", 0.9)}
jobs = [LayerJob(name, zoo[name][1], zoo[name][0], default_tiling(zoo[name][0]), Epilogue("relu")) for name in names]
split = build_many(jobs, target=Target("sm_90"), cache_dir=tempfile.mkdtemp(), progress=False)
real = shapes.Target.max_shared_bytes
shapes.Target.max_shared_bytes = property(lambda self: 48 * 1024)
whole = build_many(jobs, target=Target("sm_90"), cache_dir=tempfile.mkdtemp(), progress=False)
shapes.Target.max_shared_bytes = real
rng = np.random.default_rng(0)
for name in names:
    s = zoo[name][0]
    x = cupy.asarray(rng.standard_normal((n, s.in_channels, s.in_h, s.in_w), dtype=np.float32))
    out = cupy.empty((n, s.out_channels, s.out_h, s.out_w), cupy.float32)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    ks, kw = Conv2dKernel(split[name], bias), Conv2dKernel(whole[name], bias)
    extra = split[name].shared_bytes
    _, lw, fw = kw.variant(n)
    allow_shared_bytes(fw, extra)

    def whole_with(smem):
        return lambda: fw(lw.grid(n), (lw.tiling.threads, 1, 1),
                          (x, out, kw._bias, np.uint64(0), np.int32(n), np.int32(lw.chunks)), shared_mem=smem)
    res = {}
    for rnd in range(2):
        for label, fn in [("whole", whole_with(lw.shared_bytes)), (f"whole+{extra}B smem", whole_with(extra)),
                          ("pieces", lambda: ks(x, out=out))]:
            res.setdefault(label, []).append(time_gpu(fn, repeat=30, max_seconds=0.3, capture=cupy_graph).us)
    print(name, split[name].stats["pieces"], "pieces;", "; ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in res.items()),
          flush=True)
