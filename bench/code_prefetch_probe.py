"""Would fetching a layer's code into L2 ahead of it pay at batch 1?

Inside a network each code kernel runs cold: its straight-line code comes
from DRAM (~1.4 GB/s an SM), and ResNet-50's batch-1 code layers take ~95 us
in the network against ~52 us timed hot (session 24, docs/PERFORMANCE.md).
A kernel's code cannot be addressed as data, but running the kernel itself
fetches it: one block per k-block copy (grid (1, k-blocks, 1)) walks every
line of every k-block's code once. This probe times, per layer, on the
sparseconv kernel that routing would build for batch 1:

    cold        an L2 flush, then the layer (as bench/weight_table_probe.py)
    prefetched  an L2 flush, the one-block-a-k-block run into a scratch
                output, then the layer: the code is in L2, the SMs' own
                instruction caches are cold except those the run used
    hot         the layer back to back (graph replays)
    prefetch    what the one-block-a-k-block run itself takes after a flush

If `prefetched` is near `hot`, a side stream that runs each code layer's
prefetch while the layers before it run would take the difference off the
forward.

    python bench/code_prefetch_probe.py --layers resnet50:conv1,resnet50:layer1.0.conv3 --out prefetch.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from sparseconv.launch import launch
from sparseconv.parallel import LayerJob, build_many
from sparseconv.runtime import Conv2dKernel
from sparseconv.shapes import Epilogue, Target
from sparseconv.tilings import variant_for_batch
from sparseconv.testing import conv2d_reference, relative_l2
from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu
from sparseconv.zoo import find_layer, pruned_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", required=True, help="comma-separated, e.g. resnet50:conv1,vgg16:conv3_2")
    ap.add_argument("--out", default="code_prefetch_probe.json")
    args = ap.parse_args()
    names = args.layers.split(",")
    for lname in names:  # every argument checked before anything is built or touches a GPU
        try:
            find_layer(lname, ("resnet50", "vgg16"))
        except ValueError as e:
            ap.error(f"--layers: {e}, e.g. resnet50:conv1")
    if not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    import cupy

    nets = {net: {name: (shape, w) for name, shape, w in pruned_model(net, 0.9)}
            for net in {lname.split(":")[0] for lname in names}}
    picked = [(lname, *nets[lname.split(":")[0]][lname.split(":")[1]]) for lname in names]
    jobs = [LayerJob(lname, w, shape, variant_for_batch(shape, 1), Epilogue("relu")) for lname, shape, w in picked]
    built = build_many(jobs, target=Target("sm_90"), progress=True)
    rng = np.random.default_rng(0)
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
    rows = []
    for lname, shape, w in picked:
        x = cupy.asarray(rng.standard_normal((1, shape.in_channels, shape.in_h, shape.in_w), dtype=np.float32))
        bias = rng.standard_normal(shape.out_channels).astype(np.float32)
        out = cupy.empty((1, shape.out_channels, shape.out_h, shape.out_w), cupy.float32)
        kernel = Conv2dKernel(built[lname], bias)
        kernel(x, out=out)
        ref = np.maximum(conv2d_reference(cupy.asnumpy(x), w, bias, shape.stride, shape.padding), 0)
        rel = relative_l2(cupy.asnumpy(out), ref)
        _, layer, fn = kernel.variant(1)
        # the prefetch writes where the layer's first launch writes (its output, or its slices' workspace),
        # but into a scratch array of that shape: the layer's own results are untouched
        slices = layer.tiling.slices if layer.tiling.slices > 1 and layer.tiling.slice_sum == "kernel" else 0
        scratch = cupy.empty(((slices,) if slices else ()) + out.shape, cupy.float32)
        scratch_bias = cupy.zeros(shape.out_channels, cupy.float32)
        grid = layer.grid(1)
        prefetch_grid = (1, grid[1], 1)

        def layer_call():
            kernel(x, out=out)

        def prefetch():
            launch(fn, prefetch_grid, (layer.tiling.threads, 1, 1),
                   (x, scratch, scratch_bias, np.uint64(0), np.int32(1), np.int32(layer.chunks)),
                   shared_mem=layer.shared_bytes)

        flush_only = l2_flush(flush, x)

        def flush_then_prefetch():
            flush_only()
            prefetch()

        t = dict(repeat=30, max_seconds=0.3, capture=cupy_graph)
        row = dict(layer=lname, shape=shape.describe(), tiling=layer.tiling.describe(), grid=list(grid),
                   kblock_copies=grid[1], rel_l2=rel, code_bytes=int(layer.stats.get("artifact_bytes", 0)),
                   cold_us=time_cold(layer_call, flush_only, **t).us,
                   prefetched_us=time_cold(layer_call, flush_then_prefetch, **t).us,
                   hot_us=time_gpu(layer_call, **t).us,
                   prefetch_us=time_cold(prefetch, flush_only, **t).us)
        rows.append(row)
        print(f"{lname:28s} cold {row['cold_us']:6.1f}  prefetched {row['prefetched_us']:6.1f}  "
              f"hot {row['hot_us']:6.1f}  (prefetch itself {row['prefetch_us']:6.1f} us on {grid[1]} blocks; "
              f"cubin {row['code_bytes']} B; rel L2 {rel:.1e})", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
