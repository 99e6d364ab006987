"""Kernel time of the benchmark layers: sparseconv vs cuDNN fp32 / TF32 (torch), one GPU, one run.

    python bench/kernel_times.py [--sparsity 0.9] [--batches 1 64] [--json out.json] [--autotune]

Device time is the median of CUDA-event timings of back-to-back launches
(cupyx.profiler.benchmark, `gpu_times`); host call latency is reported
separately (`cpu_times`). Inputs are fresh random normals, never zeros."""
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
import sparseconv  # noqa: E402
from sparseconv.testing import pruned_weight  # noqa: E402
from sparseconv.operators import benchmark_operators  # noqa: E402


def floor_us(op, batch, nnz):
    s = op.shape
    flops = 2 * nnz * batch * s.out_h * s.out_w
    bytes_ = 4 * batch * (s.in_channels * s.in_h * s.in_w + s.out_channels * s.out_h * s.out_w)
    return 1e6 * max(flops / 66.9e12, bytes_ / 3.0e12)


def median_us(fn, n_repeat):
    r = benchmark(fn, n_repeat=n_repeat, n_warmup=10)
    return float(np.median(r.gpu_times[0]) * 1e6), float(np.median(r.cpu_times) * 1e6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--model", choices=["vgg16", "resnet50"], default=None,
                   help="time this model's conv layers instead of the benchmark layers")
    p.add_argument("--kernel-size", type=int, default=None, help="only layers with this R (e.g. 3)")
    p.add_argument("--unique", action="store_true", help="time each distinct layer shape once")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--autotune", action="store_true",
                   help="also time tiling='auto' (tuned at each batch size) beside the default tiling")
    a = p.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    cache = tempfile.mkdtemp(prefix="sparseconv-bench-")
    rows = []
    if a.model:
        from sparseconv.operators import Operator
        from sparseconv.zoo import model_layers
        ops = [Operator(n, sh) for n, sh in model_layers(a.model)]
    else:
        ops = benchmark_operators()
    if a.kernel_size:
        ops = [o for o in ops if o.shape.kernel_h == a.kernel_size]
    if a.unique:
        seen = set()
        ops = [o for o in ops if not (o.shape in seen or seen.add(o.shape))]
    for op in ops:
        s = op.shape
        w = pruned_weight(rng, s.weight_shape, a.sparsity)
        conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding,
                                         cache_dir=cache, name=op.name)
        for batch in a.batches:
            x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
            out = cp.empty(conv.output_shape(batch), cp.float32)
            reps = 200 if batch == 1 else 50
            sc_us, sc_host_us = median_us(lambda: conv(x, out=out), reps)
            row = dict(layer=op.name, batch=batch, sparseconv_us=sc_us, sparseconv_host_us=sc_host_us,
                       floor_us=floor_us(op, batch, int(np.count_nonzero(w))), tiling=conv.layer.tiling.describe())
            if a.autotune:
                tuned = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride,
                                                  padding=s.padding, cache_dir=cache, name=op.name,
                                                  tiling="auto", tune_batch=batch)
                row.update(tuned_us=median_us(lambda: tuned(x, out=out), reps)[0],
                           tuned_tiling=tuned.layer.tiling.describe())
            if torch is not None:
                xt = torch.as_tensor(x, device="cuda")
                wt = torch.as_tensor(cp.asarray(w), device="cuda")
                for label, tf32 in (("cudnn_fp32_us", False), ("cudnn_tf32_us", True)):
                    torch.backends.cudnn.allow_tf32 = tf32
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    with torch.no_grad():
                        f = lambda: torch.nn.functional.conv2d(xt, wt, None, s.stride, s.padding)  # noqa: E731
                        row[label] = median_us(f, reps)[0]
                torch.backends.cudnn.allow_tf32 = True
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {time.strftime('%Y-%m-%d')}, {dev}, sparsity {a.sparsity}, median kernel time in us "
          f"(CUDA events, back-to-back launches)\n")
    print("| layer | N | sparseconv | cuDNN fp32 | cuDNN TF32 | x fp32 | x TF32 | floor | host call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f32, t32 = r.get("cudnn_fp32_us", float("nan")), r.get("cudnn_tf32_us", float("nan"))
        print(f"| {r['layer']} | {r['batch']} | {r['sparseconv_us']:.1f} | {f32:.1f} | {t32:.1f} | "
              f"{f32 / r['sparseconv_us']:.2f} | {t32 / r['sparseconv_us']:.2f} | {r['floor_us']:.1f} | "
              f"{r['sparseconv_host_us']:.1f} |")
    if a.autotune:
        print("\n| layer | N | default | autotuned | default / tuned | tuned tiling |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['layer']} | {r['batch']} | {r['sparseconv_us']:.1f} | {r['tuned_us']:.1f} | "
                  f"{r['sparseconv_us'] / r['tuned_us']:.2f} | {r['tuned_tiling']} |")
        for batch in a.batches:
            sel = [r for r in rows if r["batch"] == batch]
            g = np.exp(np.mean([np.log(r["sparseconv_us"] / r["tuned_us"]) for r in sel]))
            gf = np.exp(np.mean([np.log(r["cudnn_fp32_us"] / r["tuned_us"]) for r in sel if "cudnn_fp32_us" in r]))
            print(f"\nbatch {batch}: autotuned is {g:.2f}x the default tiling's speed (geomean); "
                  f"{gf:.2f}x cuDNN fp32")
    for batch in a.batches:
        sel = [r for r in rows if r["batch"] == batch and "cudnn_fp32_us" in r]
        if sel:
            g32 = np.exp(np.mean([np.log(r["cudnn_fp32_us"] / r["sparseconv_us"]) for r in sel]))
            gt = np.exp(np.mean([np.log(r["cudnn_tf32_us"] / r["sparseconv_us"]) for r in sel]))
            print(f"\nbatch {batch}: geomean speedup over cuDNN fp32 {g32:.2f}x, over cuDNN TF32 {gt:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
