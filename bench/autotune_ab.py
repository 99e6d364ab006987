"""Kernel time of the default tiling against tiling="auto" (tuned at each batch size), per layer.

    python bench/autotune_ab.py [--sparsity 0.9] [--batches 1 64] [--model resnet50 --kernel-size 3 --unique]
        [--json out.json]

The one measurement of the former bench/kernel_times.py that `sparseconv bench`
does not make (its cuDNN columns are the bench's now). Layers: the 10
benchmark layers, or a zoo model's by name (random pruned weights, no file
needed). Device time is the median of CUDA events around back-to-back launches
(sparseconv.timing.median_us); inputs are fresh random normals."""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np

import sparseconv
from sparseconv.benchmark import geomean
from sparseconv.operators import Operator, benchmark_operators
from sparseconv.testing import pruned_weight
from sparseconv.timing import median_us
from sparseconv.zoo import model_layers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--model", choices=["vgg16", "resnet50"], default=None,
                   help="time this model's conv layers instead of the benchmark layers")
    p.add_argument("--kernel-size", type=int, default=None, help="only layers with this R (e.g. 3)")
    p.add_argument("--unique", action="store_true", help="time each distinct layer shape once")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cache = tempfile.mkdtemp(prefix="sparseconv-autotune-")
    ops = [Operator(n, sh) for n, sh in model_layers(a.model)] if a.model else benchmark_operators()
    if a.kernel_size:
        ops = [o for o in ops if o.shape.kernel_h == a.kernel_size]
    if a.unique:
        seen = set()
        ops = [o for o in ops if not (o.shape in seen or seen.add(o.shape))]
    rows = []
    for op in ops:
        s = op.shape
        w = pruned_weight(rng, s.weight_shape, a.sparsity)
        conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding,
                                         cache_dir=cache, name=op.name)
        for batch in a.batches:
            x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
            out = cp.empty(conv.output_shape(batch), cp.float32)
            reps = 200 if batch == 1 else 50
            tuned = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding,
                                              cache_dir=cache, name=op.name, tiling="auto", tune_batch=batch)
            row = dict(layer=op.name, batch=batch, tiling=conv.layer.tiling.describe(),
                       default_us=median_us(lambda: conv(x, out=out), repeat=reps, warmup=10),
                       tuned_us=median_us(lambda: tuned(x, out=out), repeat=reps, warmup=10),
                       tuned_tiling=tuned.layer.tiling.describe())
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {time.strftime('%Y-%m-%d')}, {dev}, sparsity {a.sparsity}, median kernel time in us "
          f"(CUDA events, back-to-back launches)\n")
    print("| layer | N | default | autotuned | default / tuned | default tiling | tuned tiling |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['batch']} | {r['default_us']:.1f} | {r['tuned_us']:.1f} | "
              f"{r['default_us'] / r['tuned_us']:.2f} | {r['tiling']} | {r['tuned_tiling']} |")
    for batch in a.batches:
        sel = [r["default_us"] / r["tuned_us"] for r in rows if r["batch"] == batch]
        if sel:
            print(f"\nbatch {batch}: autotuned is {geomean(sel):.2f}x the default tiling's speed (geomean)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
