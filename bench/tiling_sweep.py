"""Time candidate tilings of the benchmark layers, all in one run on one GPU.

    python bench/tiling_sweep.py [--sparsity 0.9] [--kblocks 8 16 32] [--json out.json]

Builds every (layer, tiling) in parallel first, then times each at batch 1 and
64 (median of CUDA events over back-to-back launches), so ratios come from the
same run."""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference import pruned_weight  # noqa: E402
from sparseconv.batch import LayerJob, build_many  # noqa: E402
from sparseconv.kernel import Conv2dKernel  # noqa: E402
from sparseconv.operators import benchmark_operators  # noqa: E402
from sparseconv.shapes import candidate_tilings, default_tiling  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    jobs, meta = [], {}
    for op in benchmark_operators():
        w = pruned_weight(rng, op.shape.weight_shape, a.sparsity)
        tilings = [default_tiling(op.shape)] + [t for t in candidate_tilings(op.shape) if t != default_tiling(op.shape)]
        for i, t in enumerate(tilings):
            name = f"{op.name}#{i}"
            jobs.append(LayerJob(name, w, op.shape, t))
            meta[name] = (op, t, i == 0)
    t0 = time.perf_counter()
    built = build_many(jobs, cache_dir=tempfile.mkdtemp(prefix="sparseconv-sweep-"))
    print(f"built {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for name, layer in built.items():
        op, t, is_default = meta[name]
        k = Conv2dKernel(layer, None)
        s = op.shape
        for batch in a.batches:
            x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
            out = cp.empty(k.output_shape(batch), cp.float32)
            r = benchmark(lambda: k(x, out=out), n_repeat=100 if batch == 1 else 30, n_warmup=5)
            rows.append(dict(layer=op.name, tiling=t.describe(), default=is_default, batch=batch,
                             us=float(np.median(r.gpu_times[0]) * 1e6)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"# {time.strftime('%Y-%m-%d')}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"sparsity {a.sparsity}: best tiling per layer vs the default\n")
    print("| layer | N | default us | best us | best / default | best tiling |")
    print("|---|---|---|---|---|---|")
    for op in benchmark_operators():
        for batch in a.batches:
            sel = [r for r in rows if r["layer"] == op.name and r["batch"] == batch]
            d = next(r for r in sel if r["default"])
            b = min(sel, key=lambda r: r["us"])
            print(f"| {op.name} | {batch} | {d['us']:.1f} | {b['us']:.1f} | {b['us'] / d['us']:.2f} | {b['tiling']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
