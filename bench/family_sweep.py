"""Kernel families on the layer classes of real networks: each distinct conv
shape of ResNet-50 (and VGG-16's deep layers) with candidate tilings of the
pointwise and direct families, split-K slices included, at batch 1 and 64,
against cuDNN fp32 and TF32, all timed by CUDA-graph replays in one run.
Used to choose the default tiling rules (sparseconv.tilings.default_tiling).

    python bench/family_sweep.py --out results.json [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from sparseconv.runtime import Conv2dKernel
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import ConvShape, Target, Tiling, check_tiling
from sparseconv.tilings import blocks_per_image, default_tiling, pointwise_tiling
from sparseconv.testing import pruned_weight
from sparseconv.timing import cupy_graph, time_gpu, torch_graph
from sparseconv.zoo import resnet50, vgg16




def unique_shapes():
    seen, out = set(), []
    for net, layers in (("resnet50", resnet50()), ("vgg16", vgg16())):
        for name, s in layers:
            if s not in seen and not (net == "vgg16" and s.in_h > 28):
                seen.add(s)
                out.append((f"{net}:{name}", s))
    return out


POINTWISE = ((128, 1, 64), (64, 2, 64), (64, 1, 128), (32, 2, 128))  # (k_block, pixels, threads)


def candidates(shape: ConvShape, batch: int, pointwise=POINTWISE, split=True, wide=()):
    """pointwise: (k_block, pixels, threads) for 1x1 layers; wide: the same
    for the pointwise family on larger kernels, timed beside the default."""
    cands = []
    if (shape.kernel_h, shape.kernel_w) == (1, 1):
        for kb, pix, threads in pointwise:
            cands.append(pointwise_tiling(shape, kb, pix, threads))
    else:
        cands.append(default_tiling(shape))
        for kb, pix, threads in wide:
            cands.append(pointwise_tiling(shape, kb, pix, threads))
    out = []
    for t in cands:
        # split the reduction at small batch so blocks * slices reaches ~2 waves of 132 SMs
        blocks = math.ceil(blocks_per_image(shape, t) * batch)  # the same count the default rule uses
        nch = math.ceil(shape.c_per_group / t.c_block)
        variants = [t]
        if split and blocks < 264:
            s = min(nch, max(2, 2 ** round(math.log2(264 / blocks))))
            if s > 1:
                variants.append(Tiling(**{**t.__dict__, "slices": s}))
        for v in variants:
            try:
                check_tiling(shape, v)
                out.append(v)
            except ValueError:
                pass
    return list(dict.fromkeys(out))


def main() -> None:
    import cupy
    import torch
    import torch.nn.functional as F

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="family_sweep.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--pointwise", default=None,
                    help="k_block x pixels x threads candidates, e.g. 64x1x128,64x1x256 (default: POINTWISE)")
    ap.add_argument("--wide", default="",
                    help="k_block x pixels x threads candidates of the pointwise family for kernels above 1x1")
    ap.add_argument("--only", choices=("1x1", "wide"), default=None, help="only 1x1 layers, or only larger kernels")
    ap.add_argument("--no-split", action="store_true")
    ap.add_argument("--layers", default="", help="only these layers (comma-separated, e.g. resnet50:layer3.1.conv2)")
    args = ap.parse_args()
    pointwise = POINTWISE if args.pointwise is None else \
        tuple(tuple(int(v) for v in c.split("x")) for c in args.pointwise.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    shapes = unique_shapes()
    wide = tuple(tuple(int(v) for v in c.split("x")) for c in args.wide.split(",") if c)
    if args.only:
        shapes = [(n, s) for n, s in shapes if ((s.kernel_h, s.kernel_w) == (1, 1)) == (args.only == "1x1")]
    if args.layers:
        shapes = [(n, s) for n, s in shapes if n in args.layers.split(",")]
    if args.quick:
        shapes = shapes[:4]
    jobs, plan = [], []
    for lname, shape in shapes:
        w = pruned_weight(rng, shape.weight_shape, 0.9)
        for batch in batches:
            for t in candidates(shape, batch, pointwise, not args.no_split, wide):
                key = f"{lname}|{t.describe()}"
                if key not in {j.name for j in jobs}:
                    jobs.append(LayerJob(key, w, shape, t))
                plan.append((lname, shape, w, batch, key))
    t0 = time.time()
    built = build_many(jobs, target=Target("sm_90"), progress=True)
    print(f"built {len(jobs)} kernels in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    done_base = {}
    torch.backends.cudnn.benchmark = True
    for lname, shape, w, batch, key in plan:
        layer = built[key]
        x = cupy.asarray(rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w), dtype=np.float32))
        out = cupy.empty((batch, shape.out_channels, shape.out_h, shape.out_w), cupy.float32)
        bias = rng.standard_normal(shape.out_channels).astype(np.float32)
        k = Conv2dKernel(layer, bias)
        k(x, out=out)
        xt = torch.as_tensor(x, device="cuda")
        wt = torch.as_tensor(w, device="cuda")
        bt = torch.as_tensor(bias, device="cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ref = F.conv2d(xt.double(), wt.double(), bt.double(), shape.stride, shape.padding, shape.dilation, shape.groups)
        yt = torch.as_tensor(out, device="cuda")
        err = float((yt.double() - ref).norm() / ref.norm())
        t = time_gpu(lambda: k(x, out=out), repeat=30, max_seconds=0.3, capture=cupy_graph)
        row = dict(layer=lname, shape=shape.describe(), batch=batch, tiling=layer.tiling.describe(),
                   us=t.us, rel_l2=err, nnz=int(np.count_nonzero(w)))
        bk = (lname, batch)
        if bk not in done_base:
            base = {}
            for tf32 in (False, True):
                torch.backends.cudnn.allow_tf32 = tf32

                def run():
                    F.conv2d(xt, wt, bt, shape.stride, shape.padding, shape.dilation, shape.groups)
                run()
                base["tf32" if tf32 else "fp32"] = time_gpu(run, repeat=30, max_seconds=0.3, capture=torch_graph).us
            torch.backends.cudnn.allow_tf32 = False
            flops = 2 * row["nnz"] * batch * shape.out_h * shape.out_w
            by = 4 * batch * (shape.in_channels * shape.in_h * shape.in_w + shape.out_channels * shape.out_h * shape.out_w)
            base["floor"] = max(flops / 66.9e12, by / 3.0e12) * 1e6
            done_base[bk] = base
        row.update(done_base[bk])
        rows.append(row)
        print(f"{lname:28s} b{batch:<3d} {layer.tiling.describe():60s} {t.us:9.1f} us  fp32 {row['fp32']:8.1f} "
              f"tf32 {row['tf32']:8.1f} floor {row['floor']:7.1f}  err {err:.1e}", flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)
    # best per (layer, batch)
    print("\nbest per layer and batch")
    best = {}
    for r in rows:
        b = best.get((r["layer"], r["batch"]))
        if b is None or r["us"] < b["us"]:
            best[(r["layer"], r["batch"])] = r
    for (ln, b), r in best.items():
        print(f"{ln:28s} b{b:<3d} {r['us']:9.1f} fp32x {r['fp32'] / r['us']:5.2f} tf32x {r['tf32'] / r['us']:5.2f} "
              f"floor {r['floor']:7.1f}  {r['tiling']}")


if __name__ == "__main__":
    main()
