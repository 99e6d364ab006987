"""Where a whole network's forward spends its time, three ways, per batch size:
  - graph replay: µs per forward of the sparsified network as one CUDA graph
    (as `sparseconv bench --network` times it);
  - kernel sum: every kernel of one eager forward (torch.profiler / CUPTI),
    by category and by kernel name;
  - routed sum: the per-layer times routing measured in isolation (each layer
    replayed back to back, the faster of its kernel and cuDNN fp32).
Graph replay minus kernel sum is launch gaps; kernel sum minus routed sum is
what a layer loses inside the network (caches no longer hot).

    python bench/network_profile.py resnet50 --batch 1 --batch 64 --out prof.json

Categories: "sparseconv" (our conv kernels), "reduce" (split reductions),
"cudnn/cublas" (routed convs, Linear), "other" (pooling, copies, adds).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from typing import Dict, List

import torch

from sparseconv.benchmark.network import time_forward_us
from sparseconv.torch import CudaGraphModule, sparsify
from sparseconv.zoo_torch import build_network


def category(name: str) -> str:
    if name.startswith("sc_conv2d"):
        return "sparseconv"
    if name.startswith("sc_reduce"):
        return "reduce"
    low = name.lower()
    if any(k in low for k in ("cudnn", "conv", "gemm", "sm90", "cutlass", "xmma", "implicit")):
        return "cudnn/cublas"
    return "other"


def profile(net: torch.nn.Module, x: torch.Tensor, repeat: int = 5) -> Dict[str, object]:
    for _ in range(3):
        net(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            net(x)
        torch.cuda.synchronize()
    by_cat: Dict[str, float] = defaultdict(float)
    by_kernel: Dict[str, float] = defaultdict(float)
    count = 0
    events = prof.events()
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time / repeat if hasattr(ev, "device_time") else ev.cuda_time / repeat
        by_cat[category(ev.name)] += us
        by_kernel[ev.name[:80]] += us
        count += 1
    return {"kernels_per_forward": count / repeat, "by_category_us": dict(by_cat),
            "kernel_sum_us": sum(by_cat.values()),
            "top_kernels_us": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25])}


def routed_sum_us(plan: List[str], batch: int) -> float:
    """Sum over the compiled convs of the faster path's time at `batch`, as
    routing measured it (the plan's "batch B: sparseconv S us, cuDNN fp32 D us")."""
    total = 0.0
    for line in plan:
        for b, sparse, dense in re.findall(r"batch (\d+): sparseconv ([\d.]+) us, cuDNN fp32 ([\d.]+) us", line):
            if int(b) == batch:
                total += min(float(sparse), float(dense))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("network", choices=["resnet50", "vgg16"])
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = args.batch or [1, 64]
    dev = torch.device("cuda")
    net = build_network(args.network, sparsity=0.9, seed=0).to(dev).eval()
    with torch.no_grad():
        x1 = torch.randn(1, 3, 224, 224, device=dev)
        t0 = time.time()
        fast = sparsify(net, x1, progress=False)
        result: Dict[str, object] = {"network": args.network, "device": torch.cuda.get_device_name(),
                                     "date": time.strftime("%Y-%m-%d"), "sparsify_s": time.time() - t0,
                                     "plan": [f"{p.name}: {p.action} {'+'.join(p.fused)} {p.reason}"
                                              for p in fast.sparseconv_plan]}
        for b in batches:
            x = torch.randn(b, 3, 224, 224, device=dev)
            graph_us = time_forward_us(CudaGraphModule(fast), x)
            prof = profile(fast, x)
            prof["graph_replay_us"] = graph_us
            prof["routed_sum_us"] = routed_sum_us(result["plan"], b)
            result[f"batch{b}"] = prof
            print(f"== {args.network} batch {b}: graph replay {graph_us:,.0f} us, kernel sum "
                  f"{prof['kernel_sum_us']:,.0f} us over {prof['kernels_per_forward']:.0f} kernels, "
                  f"routed sum of the convs {prof['routed_sum_us']:,.0f} us")
            for k, v in sorted(prof["by_category_us"].items(), key=lambda kv: -kv[1]):
                print(f"   {k:14s} {v:10,.1f}")
            for k, v in list(prof["top_kernels_us"].items())[:12]:
                print(f"   {v:10,.1f}  {k}")
    for line in result["plan"]:
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
