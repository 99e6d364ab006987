"""Host time of sparseconv.torch.CudaGraphModule per forward, on a graph too
short to hide it: two kernels (x * 2, then a mean over the image), batch 1,
3 x 224 x 224. Prints µs per call between two CUDA events (the median of
`--repeat`, `--trials` times) for:

  replay         graph.replay() alone
  copy+replay    the input's copy_ into the static buffer, then the replay
  module         the whole CudaGraphModule(x) call, as `sparseconv bench
                 --network` times it (copy, replay, the output's clone)
  module, before session 27's forward as it was before session 27 (a tuple key
                 with a membership test, then tree_map for the clone), on
                 the same graph: the two forwards alternate in one process,
                 so the host's state, which moved run bj's figures by 4-8 us
                 between processes, is the same for both

and the graph replayed back to back (its GPU time). On a long graph the
part of `module` after replay() runs while the graph does; the part before
it delays the forward.

    python bench/graph_wrapper_probe.py --out wrapper.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparseconv.benchmark.network import time_forward_us
from sparseconv.torch import CudaGraphModule


class TwoKernels(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).mean(dim=(2, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # Refused now, in one line (exit 2), not after the timing or with a traceback.
    if args.repeat < 1 or args.trials < 1:
        ap.error(f"--repeat and --trials must be 1 or more, got {args.repeat} and {args.trials}")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    if not torch.cuda.is_available():
        ap.error("no CUDA device: the probe times CUDA graph replays")
    x = torch.randn(1, 3, 224, 224, device="cuda")
    with torch.no_grad():
        model = CudaGraphModule(TwoKernels())
        model(x)  # captures
        graph, static_in, _ = model._graphs[(x.shape, x.dtype, x.device)]

        def replay(_: torch.Tensor) -> None:
            graph.replay()

        def copy_replay(t: torch.Tensor) -> None:
            static_in.copy_(t)
            graph.replay()

        def module_before_27(t: torch.Tensor):  # CudaGraphModule.forward before c565147
            if not t.is_cuda:
                return model.module(t)
            if t.requires_grad and torch.is_grad_enabled():
                raise RuntimeError("inference only")
            key = (tuple(t.shape), t.dtype, t.device)
            if key not in model._graphs:
                model._graphs[key] = model._capture(t)
            g, s_in, s_out = model._graphs[key]
            s_in.copy_(t)
            g.replay()
            return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, s_out)

        cases = (("replay", replay), ("copy+replay", copy_replay), ("module", model),
                 ("module, before session 27", module_before_27))
        result = {name: [] for name, _ in cases}
        for _ in range(args.trials):  # the cases alternate, trial by trial
            for name, fn in cases:
                result[name].append(round(time_forward_us(fn, x, repeat=args.repeat), 2))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeat):
            graph.replay()
        end.record()
        end.synchronize()
        result["back to back, per replay"] = round(start.elapsed_time(end) * 1000.0 / args.repeat, 2)
    for name, v in result.items():
        print(f"{name:>26}: {v if isinstance(v, float) else ', '.join(map(str, v))} us"
              + ("" if isinstance(v, float) else f" (median {statistics.median(v)})"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
