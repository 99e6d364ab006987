"""Host time of an eager sparsified forward at batch 1, on a small network
that builds in seconds: the drop-in's per-call Python, without ResNet-50's
minutes of build and routing.

At batch 1 an eager forward is bound by the host (bench/eager_forward.py,
sessions 34-36), so what a change to the drop-in's call path saves shows
here as the Python time a forward (host_enqueue_us: from the call until it
returns, the GPU drained before each), divided by the network's kernel
calls for a figure a layer. The network: a 1x1 stem, six bottleneck blocks at
14x14 (1x1 256->64, 3x3 64->64, 1x1 64->256 with the identity added: the
residual epilogue), a 2x2 max pool, then average pool and a Linear layer;
every conv and the Linear pruned to 90% zeros, BN folded. Routing at batch
1 decides each conv's path (code, weight table or cuDNN) as sparsify does.

    python bench/eager_host.py --out eager_host.json [--repeat 300]

Compare trees with bench/tree_ab.py (alternate processes: hosts differ).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from sparseconv.torch import sparsify


class Bottleneck(nn.Module):
    def __init__(self, width: int = 256, inner: int = 64) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, inner, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv2, self.bn2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False), nn.BatchNorm2d(inner)
        self.conv3, self.bn3 = nn.Conv2d(inner, width, 1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + x)


def small_network(blocks: int = 6) -> nn.Module:
    net = nn.Sequential(nn.Conv2d(64, 256, 1), nn.ReLU(), *[Bottleneck() for _ in range(blocks)],
                        nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (torch.rand(m.weight.shape, generator=g)
                                                                             < 0.1) * 0.2)
            elif isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return net.eval()


def host_us(fn, x: torch.Tensor, repeat: int) -> list:
    """fn(x)'s Python time, each call from a drained GPU: µs a call."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=300, help="timed forwards a round (three rounds)")
    p.add_argument("--out", type=Path, required=True, help="a .json file in an existing folder")
    a = p.parse_args()
    if a.repeat < 1:
        p.error(f"--repeat must be 1 or more, got {a.repeat}")
    if a.out.suffix != ".json" or not a.out.resolve().parent.is_dir():
        p.error(f"--out {a.out}: a .json file in a folder that exists")
    if not torch.cuda.is_available():
        p.error("no CUDA device: this times forwards on the GPU")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    net = small_network().cuda()
    x = torch.randn(1, 64, 14, 14, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(net).double()(x.double())
        fast = sparsify(net, x, route_batches=(1,), progress=False)
        got = fast(x)
        rel = float((got.double() - want).norm() / want.norm())
        paths = [n.path(1) for n in fast.modules() if hasattr(n, "path") and getattr(n, "kernel", None) is not None]
        for _ in range(20):  # warm: allocator, launches prepared
            fast(x)
        rounds = [statistics.median(host_us(fast, x, a.repeat)) for _ in range(3)]
    calls = len(paths) + 1  # the kernels plus the max pool's
    row = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "batch": 1,
           "host_enqueue_us_rounds": rounds, "host_enqueue_us": statistics.median(rounds),
           "kernel_calls": calls, "host_us_a_call": statistics.median(rounds) / calls,
           "paths": {p: paths.count(p) for p in sorted(set(paths))}, "rel_l2_vs_float64": rel}
    a.out.write_text(json.dumps(row, indent=1))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
