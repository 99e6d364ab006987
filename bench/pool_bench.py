"""torch's CUDA max pool (which also writes int64 indices) against
sparseconv.pool's (maxima only), on the pools of ResNet-50 and VGG-16, timed
by CUDA-graph replays; checks the outputs are identical.

    python bench/pool_bench.py --batch 64 --out pool.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from sparseconv.fx import IndexFreeMaxPool2d
from sparseconv.timing import time_gpu, torch_graph

# (name, channels, input H = W, kernel, stride, padding)
POOLS = [("resnet50 maxpool", 64, 112, 3, 2, 1), ("vgg16 pool1", 64, 224, 2, 2, 0), ("vgg16 pool2", 128, 112, 2, 2, 0),
         ("vgg16 pool3", 256, 56, 2, 2, 0), ("vgg16 pool4", 512, 28, 2, 2, 0), ("vgg16 pool5", 512, 14, 2, 2, 0)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", help="repeat for several (default 1 and 64)")
    ap.add_argument("--out", default="pool_bench.json")
    args = ap.parse_args()
    rows = []
    for batch in args.batch or [1, 64]:
        for name, c, size, k, s, p in POOLS:
            x = torch.randn(batch, c, size, size, device="cuda")
            theirs = nn.MaxPool2d(k, s, p)
            ours = IndexFreeMaxPool2d(theirs, name)
            with torch.no_grad():
                same = torch.equal(ours(x), theirs(x))
                t_torch = time_gpu(lambda: theirs(x), repeat=50, max_seconds=1.0, capture=torch_graph).us
                t_ours = time_gpu(lambda: ours(x), repeat=50, max_seconds=1.0, capture=torch_graph).us
            out_bytes = x.numel() // (s * s) * 4
            rows.append(dict(pool=name, batch=batch, torch_us=t_torch, sparseconv_us=t_ours, identical=same,
                             floor_us=(x.numel() * 4 + out_bytes) / 3.35e12 * 1e6))
            print(f"{name:18s} batch {batch:3d}: torch {t_torch:8.1f} us, sparseconv {t_ours:8.1f} us "
                  f"(floor {rows[-1]['floor_us']:.1f}); identical: {same}", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
