"""Does host CPU load move `bench --network`'s batch-1 figure? (docs/pending,
"Batch-1 spread of bench --network")

`time_forward_us` without queue_ahead_us records its start event on an idle
GPU, then the host submits the forward (input copy, graph replay, output
clone). Whatever the host takes to submit the head of that work is in the
figure, so a host busy with other processes (the other GPU's builds,
torch.compile) would show as a slower forward. This probe times one sparsified network in one process, two
ways, alternating, first with the host idle, then with a busy loop on every
core, then idle again:
  - "event": time_forward_us as `bench --network` called it up to session 45;
  - "queued": the same with queue_ahead_us, a GPU wait enqueued before the
    start event, so the forward is already queued when the clock starts (the
    GPU time of a forward, as a steady stream of calls sees it; what `bench
    --network` has done since session 46).

    python bench/host_load_probe.py mnasnet1_0 --batch 1 --out probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from sparseconv.benchmark.network import time_forward_us
from sparseconv.benchmark.output import write_atomically
from sparseconv.torch import sparsify
from sparseconv.zoo_torch import NETWORKS, build_network

BUSY_LOOP = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def host_submit_us(fn: Callable, x, repeat: int) -> float:
    """Median host time of one call (the submit, not the GPU's work)."""
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    out.sort()
    return out[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("network", choices=sorted(NETWORKS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--sleep-us", type=float, nargs="+", default=[50.0, 200.0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # Refused now, in one line (exit 2), before any build.
    if min(args.batch, args.rounds, args.repeat) < 1:
        ap.error(f"--batch, --rounds and --repeat must be 1 or more, got {args.batch}, {args.rounds} "
                 f"and {args.repeat}")
    if min(args.sleep_us) <= 0:
        ap.error(f"--sleep-us: each wait must be positive, got {args.sleep_us}")
    if not args.out.endswith(".json") or not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: a .json file in a folder that exists")
    if not torch.cuda.is_available():
        ap.error("no CUDA device: this times forwards on the GPU")

    dev = torch.device("cuda", 0)
    net = build_network(args.network, sparsity=0.9, seed=0).to(dev).eval()
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        fast = sparsify(net, x[:1], cuda_graph=True, progress=False)
        fast(x)
        methods: Dict[str, Callable[[], float]] = {"event": lambda: time_forward_us(fast, x, repeat=args.repeat)}
        for s in args.sleep_us:
            methods[f"queued{s:g}"] = (lambda s=s: time_forward_us(fast, x, repeat=args.repeat, queue_ahead_us=s))
        result: Dict[str, object] = {"network": args.network, "batch": args.batch, "cores": os.cpu_count(),
                                     "device": torch.cuda.get_device_name(dev)}
        for phase in ("idle", "loaded", "idle_again"):
            burners: List[subprocess.Popen] = []
            if phase == "loaded":
                burners = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=600)])
                           for _ in range(os.cpu_count() or 1)]
                time.sleep(1.0)
            try:
                rows: Dict[str, List[float]] = {m: [] for m in methods}
                rows["host_submit"] = []
                for _ in range(args.rounds):
                    for m, f in methods.items():
                        rows[m].append(round(f(), 2))
                    rows["host_submit"].append(round(host_submit_us(fast, x, args.repeat), 2))
            finally:
                for p in burners:
                    p.kill()
                for p in burners:
                    p.wait()
            result[phase] = rows
            print(phase, json.dumps(rows), flush=True)
    write_atomically(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))


if __name__ == "__main__":
    main()
