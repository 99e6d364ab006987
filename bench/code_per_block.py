"""Code bytes per k-block copy of each layer's variant at one batch size, built
on the CPU (no GPU): what a block streams from DRAM when it runs cold inside a
network (docs/PERFORMANCE.md, session 8: about 6 us + 0.42 us per KB at
batch 1, at most one block per SM). Also each build's PTX lines and ptxas
seconds: what a tiling rule costs the build (session 49: `git apply` the rule
between two runs, --workers 1 so that each layer's ptxas has the cores).

    python bench/code_per_block.py resnet50 --layers layer3.1.conv1,layer3.1.conv3 [--batch 1] [--json out.json]
    python bench/code_per_block.py vgg16 --layers conv5_1 --batch 64 --workers 1 --json cost.json

Without --layers, every layer of the model. Builds go to a cache of their own
(--cache-dir, default a fresh temporary directory)."""
import argparse
import json
import tempfile

import numpy as np

from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import Target, launch_grid, n_kblocks
from sparseconv.tilings import variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.zoo import MODELS, model_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=list(MODELS))
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=None, help="build processes (default: one a core)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, not {args.batch}")
    if not 0 <= args.sparsity < 1:
        ap.error(f"--sparsity must be in [0, 1), not {args.sparsity}")
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be at least 1, not {args.workers}")
    layers = dict(model_layers(args.model))
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
    built = build_many(jobs, target=Target("sm_90"), cache_dir=args.cache_dir or tempfile.mkdtemp(),
                       workers=args.workers, progress=True)
    rows = []
    print(f"| layer | tiling (batch {args.batch}) | blocks | k-block copies | code KB | KB per copy | PTX lines "
          f"| ptxas s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        layer = built[name]
        gx, gy, gz = launch_grid(layer.shape, layer.tiling, args.batch)
        copies = n_kblocks(layer.shape, layer.tiling)
        kb = layer.stats["artifact_bytes"] / 1024
        ptxas_s = layer.stats["seconds"]["assemble"]
        rows.append(dict(layer=name, tiling=layer.tiling.describe(), blocks=gx * gy * gz, copies=copies,
                         code_kb=kb, kb_per_copy=kb / copies, ptx_lines=layer.stats["ptx_lines"],
                         ptxas_s=round(ptxas_s, 1)))
        print(f"| {name} | {layer.tiling.describe()} | {gx * gy * gz} | {copies} | {kb:.0f} | {kb / copies:.1f} "
              f"| {layer.stats['ptx_lines']} | {ptxas_s:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, sparsity=args.sparsity, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
