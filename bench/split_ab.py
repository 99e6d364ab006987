"""Kernel time of split k-blocks (piece functions, the default) vs the same layer specialised whole.

Whole: one function per k-block. One GPU, one run.

    python bench/split_ab.py [--sparsity 0.9] [--batches 1 64] [--json out.json]

Both variants run the same FMAs in the same order, so their outputs must be
bit-identical; the table gives the median device time of each (CUDA events
around back-to-back launches, cupyx.profiler.benchmark) and split / whole."""
import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np

from sparseconv.testing import pruned_weight
from sparseconv.assemble import assemble_cubin
from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.compile import compile_to_ptx
from sparseconv.runtime import Conv2dKernel
from sparseconv.render import render
from sparseconv.specialise import specialise
from sparseconv.timing import median_us
from sparseconv.zoo import model_layers

LAYERS = [("vgg16", "conv2_2"), ("vgg16", "conv3_2"), ("vgg16", "conv4_2"), ("vgg16", "conv5_1"),
          ("resnet50", "layer3.0.conv2"), ("resnet50", "layer4.0.conv1")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cache = ArtifactCache(tempfile.mkdtemp(prefix="sparseconv-split-ab-"))
    rows = []
    print("| layer | pieces / k-blocks | N | split us | whole us | split / whole | bit-identical |")
    print("|---|---|---|---|---|---|---|")
    for model, name in LAYERS:
        shape = dict(model_layers(model))[name]
        w = pruned_weight(rng, shape.weight_shape, a.sparsity)
        bias = rng.standard_normal(shape.out_channels).astype(np.float32)
        split = build_conv2d(w, shape, cache=cache, name=name)
        r = render(shape, split.tiling)
        t = time.perf_counter()
        ptx, _ = specialise(compile_to_ptx(r.source, split.target), r, w, piece_lines=10 ** 12)
        whole = dataclasses.replace(split, artifact=assemble_cubin(ptx, split.target, name))
        whole_build_s = time.perf_counter() - t
        ks, kw = Conv2dKernel(split, bias), Conv2dKernel(whole, bias)
        for n in a.batches:
            x = cp.asarray(rng.standard_normal((n, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32))
            ys, yw = ks(x), kw(x)
            same = bool(cp.array_equal(ys, yw))
            us_s = median_us(lambda: ks(x, out=ys), repeat=50, warmup=10)
            us_w = median_us(lambda: kw(x, out=yw), repeat=50, warmup=10)
            st = split.stats
            print(f"| {model} {name} | {st['pieces']} / {st['kblocks']} | {n} | {us_s:.1f} | {us_w:.1f} | "
                  f"{us_s / us_w:.3f} | {same} |", flush=True)
            rows.append(dict(model=model, layer=name, batch=n, pieces=st["pieces"], kblocks=st["kblocks"],
                             split_us=us_s, whole_us=us_w, identical=same,
                             split_assemble_s=st["seconds"]["assemble"], whole_build_s=whole_build_s))
    ratios = [r["split_us"] / r["whole_us"] for r in rows]
    print(f"\ngeomean split / whole: {float(np.exp(np.mean(np.log(ratios)))):.3f}; "
          f"all bit-identical: {all(r['identical'] for r in rows)}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
