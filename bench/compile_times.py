"""Cold-cache build of the benchmark layers: seconds per stage, PTX lines, cubin bytes.

    python bench/compile_times.py [--sparsity 0.9] [--json out.json]

Runs on the CPU (nvcc + ptxas, no GPU). Prints a Markdown table."""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from sparseconv.testing import pruned_weight
from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.operators import benchmark_operators


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cache = ArtifactCache(tempfile.mkdtemp(prefix="sparseconv-bench-"))
    rows, weights = [], {}
    t_all = time.perf_counter()
    for op in benchmark_operators():
        w = weights[op.name] = pruned_weight(rng, op.shape.weight_shape, a.sparsity)
        t = time.perf_counter()
        layer = build_conv2d(w, op.shape, cache=cache, name=op.name)
        total = time.perf_counter() - t
        s = layer.stats
        rows.append(dict(layer=op.name, total_s=total, **s["seconds"], weights=s["weights"],
                         nonzero=s["nonzero_weights"], fmas_kept=s["fmas_kept"], fmas_deleted=s["fmas_deleted"],
                         loads_dropped=s["loads_dropped"], ptx_lines=s["ptx_lines"],
                         template_ptx_lines=s["ptx_lines_template"], cubin_bytes=s["artifact_bytes"],
                         tiling=s["tiling"]))
        print(f"{op.name}: {total:.1f}s", file=sys.stderr, flush=True)
    t_all = time.perf_counter() - t_all
    t = time.perf_counter()
    for op in benchmark_operators():
        assert build_conv2d(weights[op.name], op.shape, cache=cache, name=op.name).stats["kernel_cache_hit"]
    warm = time.perf_counter() - t
    print(f"# {time.strftime('%Y-%m-%d')} on {platform.node()} ({os.cpu_count()} cores), sparsity {a.sparsity}, "
          f"cold cache: {t_all:.1f} s for {len(rows)} layers\n")
    print("| layer | render s | nvcc s | specialise s | ptxas+nvlink s | total s | nonzero / weights | "
          "FMAs kept | FMAs deleted | loads dropped | template PTX lines | PTX lines | cubin bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['render']:.2f} | {r['compile']:.2f} | {r['specialise']:.2f} | "
              f"{r['assemble']:.2f} | {r['total_s']:.2f} | {r['nonzero']} / {r['weights']} | {r['fmas_kept']} | "
              f"{r['fmas_deleted']} | {r['loads_dropped']} | {r['template_ptx_lines']} | {r['ptx_lines']} | "
              f"{r['cubin_bytes']} |")
    print(f"\nWarm cache (same weights, every layer a hit): {warm:.2f} s for all {len(rows)} layers")
    if a.json:
        a.json.write_text(json.dumps(dict(rows=rows, cold_total_s=t_all, warm_total_s=warm), indent=2))


if __name__ == "__main__":
    main()
