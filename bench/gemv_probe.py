"""torch's F.linear (cuBLAS, TF32 off) against sparseconv.gemv's kernel on the
dense classifiers of VGG-16 and ResNet-50 at small batches, each call timed
alone by CUDA events on torch's stream (median), hot and with L2 flushed
before each call; checks both against float64.

    python bench/gemv_probe.py --batch 1 --batch 8 --out gemv.json

With --sparsity, the same layers pruned by magnitude to that fraction of
zeros (repeat it for several), timed on cuBLAS, on the dense kernel's default
and on the sparse kernel's variants (SPARSE_VARIANTS): where the sparse
kernel starts to win (gemv.MIN_SPARSE_GEMV_SPARSITY) and which variant is its
default.

    python bench/gemv_probe.py --sparsity 0.5 --sparsity 0.7 --sparsity 0.9 --out sparse_gemv.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from sparseconv.gemv import MAX_GEMV_BATCH, GemvVariant, linear_gemv, linear_sparse_gemv, sparse_rows
from sparseconv.runtime import as_cupy_stream
from sparseconv.timing import l2_scratch_floats

# (name, in_features, out_features)
# The default (4 warps a feature, 8 loads a step) and the alternatives it beat.
# Session 20 also timed __ldcs and __ldg weight loads and ptxas -O1 (NVRTC's
# --ptxas-options): none gained over 2 us on any layer (docs/PERFORMANCE.md).
VARIANTS = {"s4u8 (default)": GemvVariant(), "s1u8": GemvVariant(1, 8), "s2u8": GemvVariant(2, 8),
            "s4u4": GemvVariant(4, 4), "s8u4": GemvVariant(8, 4)}
# The sparse kernel's default and the alternatives it is timed against.
# None: the rule (gemv.sparse_gemv_variant) for the layer and batch.
SPARSE_VARIANTS = {"sparse (default rule)": None, "sparse s1u8": GemvVariant(1, 8), "sparse s1u4": GemvVariant(1, 4),
                   "sparse s2u8": GemvVariant(2, 8), "sparse s2u4": GemvVariant(2, 4),
                   "sparse s4u4": GemvVariant(4, 4)}
LAYERS = [("vgg16 fc6", 25088, 4096), ("vgg16 fc7", 4096, 4096), ("vgg16 fc8", 4096, 1000),
          ("resnet50 fc", 2048, 1000)]


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def time_us(fn: Callable[[], Any], flush: Optional[Callable[[], Any]], repeat: int = 30) -> float:
    """Median of `repeat` calls of fn, each bracketed by CUDA events on
    torch's current stream, `flush` (not timed) before each if given."""
    times = []
    for _ in range(repeat + 3):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU spin: the launch below is queued before the start event fires
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(np.median(times[3:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, action="append", help="repeat for several (default 1, 2, 4, 8)")
    ap.add_argument("--sparsity", type=float, action="append",
                    help="prune each layer to this fraction of zeros and time the sparse kernel too (repeat)")
    ap.add_argument("--out", default="gemv_probe.json")
    args = ap.parse_args()
    bad = [b for b in args.batch or [] if not 1 <= b <= MAX_GEMV_BATCH]
    if bad:
        ap.error(f"--batch must be 1..{MAX_GEMV_BATCH} (the kernel's images a launch), got {bad[0]}")
    bad_sparsity = [s for s in args.sparsity or [] if not 0.0 <= s < 1.0]
    if bad_sparsity:
        ap.error(f"--sparsity must be in [0, 1), got {bad_sparsity[0]}")
    if not Path(args.out).resolve().parent.is_dir():  # refused now, not after the timings
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    import cupy
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    scratch = torch.empty(l2_scratch_floats(getattr(props, "L2_cache_size", None)), device="cuda")
    rows = []
    for (name, n_in, n_out), sparsity in ((layer, s) for layer in LAYERS for s in args.sparsity or [None]):
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n_out, n_in, device="cuda", generator=g) / n_in ** 0.5
        b = torch.randn(n_out, device="cuda", generator=g)
        variants = VARIANTS
        if sparsity is not None:  # by magnitude, as a pruned layer is
            cut = torch.kthvalue(w.abs().flatten().cpu(), max(1, int(sparsity * w.numel()))).values.item()
            w = torch.where(w.abs() <= cut, torch.zeros_like(w), w) if sparsity > 0 else w
            rows_ = sparse_rows(w.cpu().numpy())
            entries, row_start = cupy.asarray(rows_.entries), cupy.asarray(rows_.row_start)
            variants = {"dense s4u8 (default)": GemvVariant(), **SPARSE_VARIANTS}
        for batch in args.batch or [1, 2, 4, 8]:
            x = torch.randn(batch, n_in, device="cuda", generator=g)
            y = torch.empty(batch, n_out, device="cuda")

            def theirs() -> torch.Tensor:
                return F.linear(x, w, b)  # what nn.Linear runs (cuBLAS)

            ref = F.linear(x.double(), w.double(), b.double())

            def flush() -> None:
                scratch.fill_(1.0)
                x.max()  # the input comes from the layer before: in L2

            row = dict(layer=name, batch=batch, in_features=n_in, out_features=n_out, weight_MB=w.numel() * 4 / 1e6,
                       sparsity=sparsity, err=dict(torch=rel_l2(theirs(), ref)), hot_us={}, cold_us={})
            row["hot_us"]["torch"] = time_us(theirs, None)
            row["cold_us"]["torch"] = time_us(theirs, flush)
            for label, variant in variants.items():
                cx, cw, cb, cy = (cupy.from_dlpack(t) for t in (x, w, b, y))

                def ours(variant: Optional[GemvVariant] = variant, sparse: bool = label.startswith("sparse")) -> None:
                    with as_cupy_stream(torch.cuda.current_stream(), 0, "gemv_probe"):
                        if sparse:
                            linear_sparse_gemv(0, cx, entries, row_start, cb, cy, variant)
                        else:
                            linear_gemv(0, cx, cw, cb, cy, variant)
                try:
                    y.zero_()
                    ours()
                    torch.cuda.synchronize()
                except Exception as exc:  # e.g. an NVRTC that refuses --ptxas-options
                    print(f"{name} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                row["err"][label] = rel_l2(y, ref)
                row["hot_us"][label] = time_us(ours, None)
                row["cold_us"][label] = time_us(ours, flush)
            rows.append(row)
            cells = ", ".join(f"{k} {row['hot_us'][k]:.1f}/{v:.1f} ({row['weight_MB'] / v:.2f} TB/s, "
                              f"err {row['err'][k]:.0e})" for k, v in row["cold_us"].items() if v > 0)
            at = "" if sparsity is None else f" at {sparsity:.0%} zeros"
            print(f"{name:12s}{at} batch {batch} hot/cold us: {cells}", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
