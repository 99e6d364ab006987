"""A sparsified network called eagerly (sparsify's default, cuda_graph=False)
against the same model under a CUDA graph, and against PyTorch eager fp32.

The README's figures are CUDA-graph replays. A user who follows the quick
start without `cuda_graph=True` calls every kernel from Python, and each
sparseconv call has host work (checks, the stream, the launch). Where that
host work is longer than the kernel, the GPU waits on Python. This prints,
per batch size, µs per forward (median of --repeat) for

  sparseconv eager        sparsify(model, x) called as it is
  sparseconv graph        the same model wrapped in CudaGraphModule
  torch eager fp32        the model sparsify was given (same weights), cuDNN, TF32 off

each timed two ways: between CUDA events (`*_us`), and as the wall time
from the call to its result on the host (`*_wall_us`: perf_counter around
the call and a synchronize, what a caller that reads the result waits);
plus `host_enqueue_us`, the Python time of one eager sparseconv forward
without waiting for the GPU; both again in three more rounds
(`*_rounds`), for the spread within the process. (In session 34's runs the
event time came out below the Python time, 3,946 against 7,431 µs: events
can only undercount a host-bound call, so the wall time decides.) It
writes a cProfile of the eager forward (the 25 most expensive functions,
cumulative) next to --out. Session 35 also timed the launch through CuPy
views beside the raw-pointer launch in one process (runs r, s, u); that
path is gone since session 36: compare trees with bench/tree_ab.py.

    python bench/eager_forward.py resnet50 --batch 1 --batch 64 --out eager.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from sparseconv.benchmark.network import time_forward_us
from sparseconv.dense import torch_flags
from sparseconv.torch import CudaGraphModule, sparsify
from sparseconv.zoo_torch import build_network


def host_us(fn, x: torch.Tensor, repeat: int, *, wait: bool) -> float:
    """Median host time of fn(x), the queue drained before each call: until
    its result is on the host (wait) or until fn returns (the Python time)."""
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if wait:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("network", choices=["resnet50", "vgg16"])
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", default=None, help="a .json file in an existing folder")
    args = ap.parse_args()
    batches = args.batch or [1, 64]
    # Refused now, in one line (exit 2), before any build.
    if min(batches) < 1 or args.repeat < 1:
        ap.error(f"--batch and --repeat must be 1 or more, got {batches} and {args.repeat}")
    if args.out and (not args.out.endswith(".json") or not Path(args.out).resolve().parent.is_dir()):
        ap.error(f"--out {args.out}: a .json file in a folder that exists")
    if not torch.cuda.is_available():
        ap.error("no CUDA device: this times forwards on the GPU")

    net = build_network(args.network).cuda().eval()
    x0 = torch.randn(1, 3, 224, 224, device="cuda")
    with torch.no_grad():
        fast = sparsify(net, x0, route_batches=batches)
        graphed = CudaGraphModule(fast)
    results = {"device": torch.cuda.get_device_name(), "network": args.network, "date": time.strftime("%Y-%m-%d"),
               "rows": []}
    for b in batches:
        x = torch.randn(b, 3, 224, 224, device="cuda")
        # cuDNN on, TF32 off. (Runs n and o of session 34 used torch.backends.cudnn.flags(allow_tf32=False),
        # whose default enabled=False turned cuDNN off: their torch column is not cuDNN's.)
        with torch.no_grad(), torch_flags(torch, tf32=False, cudnn_benchmark=torch.backends.cudnn.benchmark):
            row = {"batch": b}
            for name, fn in (("sparseconv_eager", fast), ("sparseconv_graph", graphed), ("torch_eager_fp32", net)):
                row[f"{name}_us"] = time_forward_us(fn, x, repeat=args.repeat)
                row[f"{name}_wall_us"] = host_us(fn, x, args.repeat, wait=True)
            row["host_enqueue_us"] = host_us(fast, x, args.repeat, wait=False)
            rounds: dict = {}
            for _ in range(3):
                for key, wait in (("wall_us", True), ("host_enqueue_us", False)):
                    rounds.setdefault(key, []).append(host_us(fast, x, args.repeat, wait=wait))
            for key, values in rounds.items():
                row[key + "_rounds"] = values
            y = fast(x).double()
            ref = net.double()(x.double())
            net.float()
            row["eager_rel_l2_vs_float64"] = float((y - ref).norm() / ref.norm())
        results["rows"].append(row)
        print(f"{args.network} batch {b}: " + ", ".join(
            f"{k} {v:,.1f}" if k.endswith("_us") else f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
            for k, v in row.items() if k != "batch"), flush=True)
    x = torch.randn(batches[0], 3, 224, 224, device="cuda")
    prof = cProfile.Profile()
    with torch.no_grad():
        fast(x)
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(10):
            fast(x)
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        Path(args.out).with_suffix(".prof.txt").write_text(text.getvalue())
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
