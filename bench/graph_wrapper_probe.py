"""Host time of sparseconv.torch.CudaGraphModule per forward, on a graph too
short to hide it: two kernels (x * 2, then a mean over the image), batch 1,
3 x 224 x 224. Prints µs per call between two CUDA events (the median of
`--repeat`, `--trials` times) for:

  replay         graph.replay() alone
  copy+replay    the input's copy_ into the static buffer, then the replay
  module         the whole CudaGraphModule(x) call, as `sparseconv bench
                 --network` times it (copy, replay, the output's clone)

and the graph replayed back to back (its GPU time). On a long graph the
part of `module` after replay() runs while the graph does; the part before
it delays the forward.

    python bench/graph_wrapper_probe.py --out wrapper.json
"""
from __future__ import annotations

import argparse
import json
import statistics

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

        result = {}
        for name, fn in (("replay", replay), ("copy+replay", copy_replay), ("module", model)):
            result[name] = [round(time_forward_us(fn, x, repeat=args.repeat), 2) for _ in range(args.trials)]
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
