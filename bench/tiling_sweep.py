"""Kernel time of candidate tilings of the benchmark layers, all in one run on one GPU.

    python bench/tiling_sweep.py [--sparsity 0.9] [--json out.json]
    python bench/tiling_sweep.py --grid --kblocks 16 32 --thread-w 2 4 --thread-h 1 2 --threads 128 256 512 \
        --min-blocks 1 2

Builds every (layer, tiling) in parallel first, then times each at batch 1 and
64 (median of CUDA events over back-to-back launches), so ratios come from the
same run."""
import argparse
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
import json
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np

from sparseconv.testing import pruned_weight
from sparseconv.parallel import LayerJob
from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.runtime import Conv2dKernel
from sparseconv.operators import benchmark_operators
from sparseconv.shapes import check_tiling
from sparseconv.tilings import candidate_tilings, default_tiling, tiling_for
from sparseconv.timing import median_us


def grid_tilings(shape, a):
    """Every tiling_for() combination of the --grid options that serves the layer."""
    out = []
    for k in a.kblocks:
        for tw in a.thread_w:
            for th in a.thread_h:
                for n, mb in ((n, mb) for n in a.threads for mb in a.min_blocks):
                    try:
                        t = tiling_for(shape, k, tw, th, n, mb)
                        check_tiling(shape, t)
                    except ValueError:
                        continue
                    if min(t.k_block, shape.k_per_group) * t.thread_h * t.thread_w <= 64 and t not in out:
                        out.append(t)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--grid", action="store_true", help="candidates from the options below, not candidate_tilings")
    p.add_argument("--kblocks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--thread-w", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--thread-h", type=int, nargs="+", default=[1])
    p.add_argument("--threads", type=int, nargs="+", default=[128])
    p.add_argument("--min-blocks", type=int, nargs="+", default=[1],
                   help="blocks per SM the register cap must allow (Tiling.min_blocks)")
    p.add_argument("--layers", nargs="+", default=None, help="only these benchmark layers")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    a = p.parse_args()
    rng = np.random.default_rng(0)
    jobs, meta = [], {}
    ops = [op for op in benchmark_operators() if a.layers is None or op.name in a.layers]
    for op in ops:
        w = pruned_weight(rng, op.shape.weight_shape, a.sparsity)
        more = grid_tilings(op.shape, a) if a.grid else candidate_tilings(op.shape)
        tilings = [default_tiling(op.shape)] + [t for t in more if t != default_tiling(op.shape)]
        for i, t in enumerate(tilings):
            name = f"{op.name}#{i}"
            jobs.append(LayerJob(name, w, op.shape, t))
            meta[name] = (op, t, i == 0)
    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="sparseconv-sweep-")
    built = {}
    # One pool, each build on its own: a tiling that fails to build is reported and skipped.
    with ProcessPoolExecutor(max_workers=a.workers) as pool:
        futures = {pool.submit(build_conv2d, j.weight, j.shape, tiling=j.tiling, cache=ArtifactCache(cache),
                               name=j.name): j.name for j in sorted(jobs, key=lambda j: -j.weight.size)}
        for fut in as_completed(futures):
            try:
                built[futures[fut]] = fut.result()
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"FAILED {futures[fut]} {meta[futures[fut]][1].describe()}: {str(exc)[:300]}",
                      file=sys.stderr)
    built = {j.name: built[j.name] for j in jobs if j.name in built}
    print(f"built {len(built)}/{len(jobs)} kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for name, layer in built.items():
        op, t, is_default = meta[name]
        k = Conv2dKernel(layer, None)
        s = op.shape
        for batch in a.batches:
            x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
            out = cp.empty(k.output_shape(batch), cp.float32)
            us = median_us(lambda: k(x, out=out), repeat=100 if batch == 1 else 30, warmup=5)
            rows.append(dict(layer=op.name, tiling=t.describe(), default=is_default, batch=batch, us=us))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"# {time.strftime('%Y-%m-%d')}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"sparsity {a.sparsity}: best tiling per layer vs the default\n")
    print("| layer | N | default us | best us | best / default | best tiling |")
    print("|---|---|---|---|---|---|")
    for op in ops:
        for batch in a.batches:
            sel = [r for r in rows if r["layer"] == op.name and r["batch"] == batch]
            if not any(r["default"] for r in sel):
                continue
            d = next(r for r in sel if r["default"])
            b = min(sel, key=lambda r: r["us"])
            print(f"| {op.name} | {batch} | {d['us']:.1f} | {b['us']:.1f} | {b['us'] / d['us']:.2f} | {b['tiling']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
