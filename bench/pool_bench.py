"""torch's CUDA max pool (which also writes int64 indices) against
sparseconv.pool's (maxima only), on the pools of ResNet-50 and VGG-16, timed
by CUDA-graph replays; checks the outputs are identical. sparseconv's is
timed as IndexFreeMaxPool2d runs it and through each of its two kernels: a
block per plane (sc_max_pool2d), and one loop over the whole tensor
(sc_max_pool2d_flat, the default below 2^31 outputs).

    python bench/pool_bench.py --batch 64 --out pool.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from sparseconv.fx import IndexFreeMaxPool2d
from sparseconv.pool import MaxPoolShape, launch_max_pool
from sparseconv.runtime import as_cupy_stream
from sparseconv.timing import time_gpu, torch_graph

# (name, channels, input H = W, kernel, stride, padding)
POOLS = [("resnet50 maxpool", 64, 112, 3, 2, 1), ("vgg16 pool1", 64, 224, 2, 2, 0), ("vgg16 pool2", 128, 112, 2, 2, 0),
         ("vgg16 pool3", 256, 56, 2, 2, 0), ("vgg16 pool4", 512, 28, 2, 2, 0), ("vgg16 pool5", 512, 14, 2, 2, 0),
         ("3x3/2 to 7x7", 512, 14, 3, 2, 1), ("2x2/2 to 4x4", 64, 8, 2, 2, 0)]


def kernel_pool(x: torch.Tensor, s: MaxPoolShape, flat: bool) -> torch.Tensor:
    """x's max pool through one of sparseconv.pool's kernels, on torch's stream."""
    import cupy

    out = torch.empty(x.shape[:2] + s.output_size(x.shape[2], x.shape[3]), device=x.device)
    index = x.device.index
    with cupy.cuda.Device(index), as_cupy_stream(torch.cuda.current_stream(), index, "pool_bench"):
        launch_max_pool(index, cupy.from_dlpack(x), cupy.from_dlpack(out), s.kernel, s.stride, s.padding,
                        s.dilation, flat=flat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", help="repeat for several (default 1 and 64)")
    ap.add_argument("--out", default="pool_bench.json")
    args = ap.parse_args()
    # before any pool is timed
    if any(b < 1 for b in args.batch or []):
        ap.error(f"--batch: 1 or more, got {min(args.batch)}")
    out = Path(args.out)
    if out.suffix != ".json" or not (out.parent if str(out.parent) else Path(".")).is_dir() or out.is_dir():
        ap.error(f"--out {out}: a .json file in a folder that exists")
    rows = []
    for batch in args.batch or [1, 64]:
        for name, c, size, k, s, p in POOLS:
            x = torch.randn(batch, c, size, size, device="cuda")
            theirs = nn.MaxPool2d(k, s, p)
            ours = IndexFreeMaxPool2d(theirs, name)
            shape = MaxPoolShape.of(k, s, p)

            def timed(fn):
                return time_gpu(fn, repeat=50, max_seconds=1.0, capture=torch_graph).us

            with torch.no_grad():
                want = theirs(x)
                same = all(torch.equal(y, want) for y in (ours(x), kernel_pool(x, shape, False),
                                                           kernel_pool(x, shape, True)))
                t_torch, t_ours = timed(lambda: theirs(x)), timed(lambda: ours(x))
                t_planes = timed(lambda: kernel_pool(x, shape, False))
                t_small = timed(lambda: kernel_pool(x, shape, True))
            out_bytes = want.numel() * 4
            rows.append(dict(pool=name, batch=batch, torch_us=t_torch, sparseconv_us=t_ours, planes_kernel_us=t_planes,
                             small_kernel_us=t_small, identical=same,
                             floor_us=(x.numel() * 4 + out_bytes) / 3.35e12 * 1e6))
            print(f"{name:18s} batch {batch:3d}: torch {t_torch:8.1f} us, sparseconv {t_ours:8.1f} us (a block a "
                  f"plane {t_planes:8.1f}, one loop {t_small:8.1f}; floor {rows[-1]['floor_us']:.1f}); "
                  f"identical: {same}", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
