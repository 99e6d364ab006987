"""Code bytes per k-block copy of each layer's variant at one batch size, built
on the CPU (no GPU): what a block streams from DRAM when it runs cold inside a
network (docs/PERFORMANCE.md, session 8: about 6 us + 0.42 us per KB at
batch 1, at most one block per SM).

    python bench/code_per_block.py resnet50 --layers layer3.1.conv1,layer3.1.conv3 [--batch 1] [--json out.json]

Without --layers, every layer of the model. Builds go to a cache of their own
(--cache-dir, default a fresh temporary directory)."""
import argparse
import json
import tempfile

import numpy as np

from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import Target, launch_grid, n_kblocks, variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.zoo import resnet50, vgg16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["resnet50", "vgg16"])
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layers = dict(resnet50() if args.model == "resnet50" else vgg16())
    names = [n for n in args.layers.split(",") if n] or list(layers)
    unknown = [n for n in names if n not in layers]
    if unknown:
        ap.error(f"no layer {', '.join(unknown)} in {args.model}; its layers: {', '.join(layers)}")
    rng = np.random.default_rng(0)
    jobs = []
    for name in names:
        shape = layers[name]
        jobs.append(LayerJob(name, pruned_weight(rng, shape.weight_shape, args.sparsity), shape,
                             variant_for_batch(shape, args.batch)))
    built = build_many(jobs, target=Target("sm_90"), cache_dir=args.cache_dir or tempfile.mkdtemp(), progress=True)
    rows = []
    print(f"| layer | tiling (batch {args.batch}) | blocks | k-block copies | code KB | KB per copy |")
    print("|---|---|---|---|---|---|")
    for name in names:
        layer = built[name]
        gx, gy, gz = launch_grid(layer.shape, layer.tiling, args.batch)
        copies = n_kblocks(layer.shape, layer.tiling)
        kb = layer.stats["artifact_bytes"] / 1024
        rows.append(dict(layer=name, tiling=layer.tiling.describe(), blocks=gx * gy * gz, copies=copies,
                         code_kb=kb, kb_per_copy=kb / copies))
        print(f"| {name} | {layer.tiling.describe()} | {gx * gy * gz} | {copies} | {kb:.0f} | {kb / copies:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, sparsity=args.sparsity, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
