"""Compile time of VGG-16's classifier (fc6 25088->4096, fc7 4096->4096, fc8
4096->1000) as pruned Linear layers: cold, then warm, one layer at a time.

    python bench/compile_linear.py [--sparsity 0.9] [--jobs N] [--layers fc8,fc7] [--json out.json]

He-initialised random weights, magnitude-pruned per layer (sparseconv.testing,
as models/make_pruned_zoo.py prunes the convs). Each layer builds every
variant compile_linear builds (api.linear_variants), its variants in one pool
of --jobs workers. A layer over the build limits (sparseconv.limits) is
reported as refused, with the copies of the kernel body it would need.
Prints a Markdown table."""
import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from sparseconv.api import linear_shape, linear_variants
from sparseconv.limits import LimitError, check_layer
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import n_chunks, n_kblocks
from sparseconv.tilings import ANY_BATCH
from sparseconv.testing import magnitude_prune

CLASSIFIER = {"fc6": (25088, 4096), "fc7": (4096, 4096), "fc8": (4096, 1000)}


def pruned_linear(rng: np.random.Generator, in_features: int, out_features: int, sparsity: float) -> np.ndarray:
    """(out, in, 1, 1) He-initialised float32 weights, magnitude-pruned to `sparsity`."""
    w = (rng.standard_normal((out_features, in_features)) * np.sqrt(2.0 / in_features)).astype(np.float32)
    return magnitude_prune(w, sparsity).reshape(out_features, in_features, 1, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--layers", default="fc8,fc7,fc6")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"# VGG-16 classifier as Linear layers, sparsity {a.sparsity}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{platform.node()} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start)\n")
    print("| layer | shape | variants | body copies | nonzero | cold s | nvcc s | specialise s | ptxas s | "
          "warm s | cubin MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in a.layers.split(","):
        cin, cout = CLASSIFIER[name]
        shape = linear_shape(cin, cout)
        variants = linear_variants(shape)
        copies = sum(n_kblocks(shape, t) * n_chunks(shape, t) for _, t in variants)
        try:
            for _, t in variants:
                check_layer(shape, t)
        except LimitError as exc:
            print(f"| {name} | {cin}->{cout} | {len(variants)} | {copies} | - | refused | | | | | |  \n"
                  f"  ({exc})", flush=True)
            rows.append(dict(layer=name, refused=str(exc), copies=copies))
            continue
        w = pruned_linear(rng, cin, cout, a.sparsity)
        jobs = [LayerJob(name if up_to == ANY_BATCH else f"{name}#split", w, shape, t) for up_to, t in variants]
        cache = tempfile.mkdtemp(prefix=f"sparseconv-{name}-")
        t0 = time.perf_counter()
        cold = build_many(jobs, cache_dir=cache, workers=a.jobs, progress=False)
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = build_many(jobs, cache_dir=cache, workers=a.jobs, progress=False)
        warm_s = time.perf_counter() - t0
        assert all(layer.stats["kernel_cache_hit"] for layer in warm.values())
        sec = {k: sum(layer.stats["seconds"][k] for layer in cold.values()) for k in ("compile", "specialise",
                                                                                       "assemble")}
        mb = sum(layer.stats["artifact_bytes"] for layer in cold.values()) / 1e6
        nnz = int(np.count_nonzero(w))
        print(f"| {name} | {cin}->{cout} | {len(variants)} | {copies} | {nnz} | {cold_s:.1f} | "
              f"{sec['compile']:.1f} | {sec['specialise']:.1f} | {sec['assemble']:.1f} | {warm_s:.2f} | "
              f"{mb:.1f} |", flush=True)
        rows.append(dict(layer=name, in_features=cin, out_features=cout, copies=copies, nonzero=nnz, cold_s=cold_s,
                         warm_s=warm_s, seconds=sec, cubin_mb=mb,
                         variants=[t.describe() for _, t in variants]))
    print(f"\nload at end {os.getloadavg()[0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps(dict(rows=rows, sparsity=a.sparsity, date=time.strftime("%Y-%m-%d"),
                                          host=platform.node(), cpus=os.cpu_count()), indent=2))


if __name__ == "__main__":
    main()
