"""Where a whole network's forward spends its time, three ways, per batch size:
  - graph replay: µs per forward of the sparsified network as one CUDA graph
    (as `sparseconv bench --network` times it);
  - kernel sum: every kernel of one eager forward (torch.profiler / CUPTI),
    by category and by kernel name;
  - routed sum: the per-layer times routing measured in isolation (each layer
    alone with L2 overwritten first, the faster of its kernel and cuDNN fp32).
Graph replay minus kernel sum is launch gaps; kernel sum minus routed sum is
what layers lose inside the network. Per layer, the kernel time inside the
network (in_network_us); with --per-layer also each conv alone through both
paths, hot (replayed back to back) and with L2 flushed before each call, and
its code size: do layers lose in the network what they lose cold?
(cold: L2 overwritten, then the layer's inputs read back, before each call)

The kernel sum profiles eager forwards, and an eager forward launches our
kernels one after another (sparseconv/launch.py overlaps them only inside a
CUDA graph). So one graph replay is profiled too ("in the graph"): its span
from the first kernel's start to the last kernel's end, shared out as how
far each kernel moved the latest end (graph_spans, per layer in_graph_us),
plus the gaps where no kernel ran. A kernel that overlaps the one before
counts only for what it adds, so the parts add up to the span.

    python bench/network_profile.py resnet50 --batch 1 --batch 64 --out prof.json
    python bench/network_profile.py resnet50 --batch 1 --per-layer --out prof_b1.json

The GPU's clocks are sampled around each timing (sparseconv.benchmark.clocks;
`gpu_clocks` in the JSON), and a warning is printed where they moved: an
A/B pair is only as good as the runs' clocks.

Categories: "sparseconv" (our conv kernels), "reduce" (split reductions),
"cudnn/cublas" (routed convs, Linear), "other" (pooling, copies, adds).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import cupy
import torch

from sparseconv.benchmark.clocks import ClockWatch
from sparseconv.benchmark.network import QUEUE_AHEAD_US, time_forward_us
from sparseconv.fx import FusedConv2d, _KernelNode
from sparseconv.torch import CudaGraphModule, sparsify
from sparseconv.zoo_torch import NETWORKS, build_network


def category(name: str) -> str:
    if name.startswith("sc_conv2d"):
        return "sparseconv"
    if name.startswith("sc_reduce"):
        return "reduce"
    if name.startswith("sc_table_conv"):
        return "table"
    low = name.lower()
    if any(k in low for k in ("cudnn", "conv", "gemm", "sm90", "cutlass", "xmma", "implicit")):
        return "cudnn/cublas"
    return "other"


def attribute_kernels(kernels: Sequence[Tuple[str, float]], calls: Sequence[Tuple[str, str]]) -> Dict[str, float]:
    """µs of each layer on a path of ours inside the network: `kernels` is one
    forward's (kernel name, µs) in launch order, `calls` the kernel nodes'
    (layer, path) in call order. The i-th sc_conv2d kernel belongs to the i-th
    call on the sparseconv path, the i-th sc_table_conv kernel to the i-th on
    the table path, and an sc_reduce_slices kernel to the sc_conv2d kernel
    before it."""
    kernel_path = {"sc_conv2d": "sparseconv", "sc_table_conv": "table"}
    layers = {path: [name for name, p in calls if p == path] for path in kernel_path.values()}
    for prefix, path in kernel_path.items():
        launched = sum(1 for name, _ in kernels if name.startswith(prefix))
        if launched != len(layers[path]):
            raise ValueError(f"{launched} {prefix} kernels but {len(layers[path])} layers on the {path} path")
    out: Dict[str, float] = {}
    seen = {path: -1 for path in kernel_path.values()}
    last_conv = None
    for name, us in kernels:
        prefix = next((p for p in kernel_path if name.startswith(p)), None)
        if prefix is not None:
            path = kernel_path[prefix]
            seen[path] += 1
            layer = layers[path][seen[path]]
            out[layer] = out.get(layer, 0.0) + us
            last_conv = layer if path == "sparseconv" else None
        elif name.startswith("sc_reduce") and last_conv is not None:
            out[last_conv] += us
    return out


def graph_spans(kernels: Sequence[Tuple[str, float, float]]) -> Tuple[List[Tuple[str, float]], float]:
    """One replayed forward's kernels as (name, start µs, end µs), by start:
    each kernel's share of the forward's span, max(0, end - max(start, the
    latest end before it)), and the gaps where no kernel ran. The shares and
    the gaps add up to the last end minus the first start."""
    shares: List[Tuple[str, float]] = []
    latest, gaps = None, 0.0
    for name, start, end in kernels:
        if latest is not None and start > latest:
            gaps += start - latest
        shares.append((name, max(0.0, end - (start if latest is None else max(start, latest)))))
        latest = end if latest is None else max(latest, end)
    return shares, gaps


def last_call_kernels(call: Callable[[], object], repeat: int = 5
                      ) -> Tuple[Optional[List[Tuple[str, float, float]]], int]:
    """Profile `repeat` calls of `call` (CUPTI through torch.profiler) and
    return the last call's kernels as (name, start µs, end µs), by start, and
    how many kernel events there were; None for the kernels where the calls
    did not launch the same number each (then they cannot be told apart)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            call()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    if not events or len(events) % repeat:
        return None, len(events)
    return [(ev.name, float(ev.time_range.start), float(ev.time_range.end))
            for ev in events[-(len(events) // repeat):]], len(events)


def graph_profile(net: torch.nn.Module, x: torch.Tensor, calls: Sequence[Tuple[str, str]],
                  repeat: int = 5) -> Dict[str, object]:
    """The forward as `sparseconv bench --network` times it, one CUDA graph
    replayed, split by graph_spans; `calls` are one forward's kernel nodes
    (layer, path) in call order, from an eager forward at the same batch."""
    graphed = CudaGraphModule(net)
    for _ in range(3):
        graphed(x)
    last, events = last_call_kernels(lambda: graphed(x), repeat)
    if last is None:
        return {"graph_profile": f"{events} kernel events over {repeat} replays: not split"}
    shares, gaps = graph_spans(last)
    by_cat: Dict[str, float] = defaultdict(float)
    for name, us in shares:
        by_cat[category(name)] += us
    try:
        in_graph = attribute_kernels(shares, calls)
    except ValueError as exc:  # the replay launched other kernels than the eager forward
        in_graph = {"not attributed": str(exc)}
    return {"graph_span_us": max(end for _, _, end in last) - last[0][1], "graph_gaps_us": gaps,
            "graph_kernels_per_forward": len(last), "graph_spans_by_category_us": dict(by_cat),
            "in_graph_us": in_graph}


def profile(net: torch.nn.Module, x: torch.Tensor, repeat: int = 5) -> Dict[str, object]:
    calls: List[Tuple[str, str]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append((m.layer_name, m.path(len(args[0])))))
             for m in net.modules() if isinstance(m, _KernelNode)]
    for _ in range(3):
        net(x)
    torch.cuda.synchronize()
    calls.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            net(x)
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    by_cat: Dict[str, float] = defaultdict(float)
    by_kernel: Dict[str, float] = defaultdict(float)
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    for ev in kernels:
        us = ev.device_time / repeat
        by_cat[category(ev.name)] += us
        by_kernel[ev.name[:80]] += us
    # Per layer: the kernels of the last forward, matched to its calls.
    per_forward = len(kernels) // repeat
    last = [(ev.name, ev.device_time) for ev in kernels[-per_forward:]] if len(kernels) % repeat == 0 else []
    forward_calls = calls[len(calls) - len(calls) // repeat:]
    in_network = attribute_kernels(last, forward_calls) if last else {}
    return {"kernels_per_forward": len(kernels) / repeat, "by_category_us": dict(by_cat),
            "kernel_sum_us": sum(by_cat.values()),
            "top_kernels_us": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]),
            "in_network_us": in_network, **graph_profile(net, x, forward_calls)}


def isolated_us(net: torch.nn.Module, batch: int, device: torch.device) -> Dict[str, Dict[str, float]]:
    """Each conv alone at `batch`, through its kernel and through cuDNN fp32:
    hot (graph replays back to back) and cold (as routing times it: L2
    overwritten, then the inputs read back, before each call; timing.time_cold),
    with its code size (bytes of the variant's cubin)."""
    from sparseconv.tilings import ANY_BATCH
    from sparseconv.timing import l2_flush, l2_scratch_floats, time_cold, time_gpu, torch_graph

    junk = torch.empty(l2_scratch_floats(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)),
                       device=device)
    out: Dict[str, Dict[str, float]] = {}
    for m in net.modules():
        if not isinstance(m, FusedConv2d) or m.kernel is None or m.kernel.backend != "sparseconv":
            continue
        s = m.kernel.shape
        x = torch.randn(batch, s.in_channels, s.in_h, s.in_w, device=device)
        r = torch.randn(batch, s.out_channels, s.out_h, s.out_w, device=device) if m.residual else None

        saved, row = m.route, {"code_bytes": float(len(m.kernel.variant(batch)[1].artifact))}
        for path in ("sparseconv", "dense"):
            m.route = [(ANY_BATCH, path)]
            row[f"{path}_hot"] = time_gpu(lambda: m(x, r), repeat=20, max_seconds=0.1, capture=torch_graph).us
            row[f"{path}_cold"] = time_cold(lambda: m(x, r), l2_flush(junk, x, r), repeat=20, max_seconds=0.1,
                                            capture=torch_graph).us
        m.route = saved
        out[m.layer_name] = row
    return out


def routed_sum_us(plan: List[str], batch: int) -> float:
    """Sum over the compiled convs of the faster path's time at `batch`, as
    routing measured it (the plan's "batch B: sparseconv S us, [table T us, ]cuDNN fp32 D us")."""
    total = 0.0
    for line in plan:
        for b, sparse, table, dense in re.findall(
                r"batch (\d+): sparseconv ([\d.]+) us, (?:table ([\d.]+) us, )?cuDNN fp32 ([\d.]+) us", line):
            if int(b) == batch:
                total += min(float(sparse), float(dense), float(table) if table else float("inf"))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("network", choices=list(NETWORKS))
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--out", default=None)
    ap.add_argument("--per-layer", action="store_true",
                    help="also time every layer alone, hot and with L2 flushed, through both paths")
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
        clocks = ClockWatch(cupy.cuda.Device(torch.cuda.current_device()).pci_bus_id)  # did the GPU keep its speed?
        for b in batches:
            x = torch.randn(b, 3, 224, 224, device=dev)
            graph_us = time_forward_us(CudaGraphModule(fast), x, queue_ahead_us=QUEUE_AHEAD_US)
            clocks.sample()
            prof = profile(fast, x)
            clocks.sample()
            prof["graph_replay_us"] = graph_us
            prof["routed_sum_us"] = routed_sum_us(result["plan"], b)
            result[f"batch{b}"] = prof
            print(f"== {args.network} batch {b}: graph replay {graph_us:,.0f} us, kernel sum "
                  f"{prof['kernel_sum_us']:,.0f} us over {prof['kernels_per_forward']:.0f} kernels, "
                  f"routed sum of the convs {prof['routed_sum_us']:,.0f} us")
            for k, v in sorted(prof["by_category_us"].items(), key=lambda kv: -kv[1]):
                print(f"   {k:14s} {v:10,.1f}")
            if "graph_span_us" in prof:
                print(f"   in the graph: span {prof['graph_span_us']:,.1f} us over "
                      f"{prof['graph_kernels_per_forward']} kernels, gaps {prof['graph_gaps_us']:,.1f} us; by category "
                      + ", ".join(f"{k} {v:,.1f}" for k, v in sorted(prof["graph_spans_by_category_us"].items(),
                                                                     key=lambda kv: -kv[1])))
            else:
                print(f"   in the graph: {prof['graph_profile']}")
            for k, v in list(prof["top_kernels_us"].items())[:12]:
                print(f"   {v:10,.1f}  {k}")
            if args.per_layer:
                alone = isolated_us(fast, b, dev)
                prof["isolated_us"] = alone
                print(f"   {'layer':28s} {'in net':>8s} {'in graph':>9s} {'ours hot':>9s} {'cold':>7s} "
                      f"{'cuDNN hot':>10s} {'cold':>7s} {'code KB':>8s}")
                for name, row in alone.items():
                    net_us = prof["in_network_us"].get(name)
                    replay_share = prof.get("in_graph_us", {}).get(name)
                    print(f"   {name:28s} {'-' if net_us is None else f'{net_us:8.1f}':>8s} "
                          f"{'-' if replay_share is None else f'{replay_share:9.1f}':>9s} "
                          f"{row['sparseconv_hot']:9.1f} {row['sparseconv_cold']:7.1f} {row['dense_hot']:10.1f} "
                          f"{row['dense_cold']:7.1f} {row['code_bytes'] / 1024:8.0f}")
        result["gpu_clocks"] = clocks.summary()
        if clocks.warning():
            print(f"warning: {clocks.warning()}")
    for line in result["plan"]:
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
