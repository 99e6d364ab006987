"""Weights as a table in memory instead of in the instruction stream, at
small batch: is the data path faster than instruction fetch for deep layers?

At batch 1 a deep layer's straight-line code (16 B an FFMA, one FFMA a
nonzero weight) is fetched at ~1.4 GB/s an SM from DRAM (docs/PERFORMANCE.md,
sessions 17-18). This probe times, on the same layers, weights and inputs,
the sparseconv default against the weight-table family (sparseconv.table)
at each candidate tiling, and checks each output against float64. (Run x of
session 21 timed this probe's first kernel, which looped over the taps; it
is in git history, commit fdd0ee1.)

    python bench/weight_table_probe.py --layers resnet50:layer4.1.conv2,resnet50:layer3.1.conv1 \
        --cands J2xW4,J2xW8 --out table.json

A candidate JjxWw sets J (pixels a lane; a block covers 32*J pixels of one
image and one output channel) and WS (warps a block); "rule" is
table.table_tiling's choice, as TableConv2d makes it for the layer's nonzeros.
A suffix "s" (J2xW8s, rule-s) stages the entries in shared memory
(TableTiling.staged_entries); "-u" (rule-u) does not.

--floor also times the rule's tiling on an all-zero weight: an empty table,
so the launch, the tap masks, the warps' sum and the store and nothing else.
What a layer's time exceeds it by is what walking its entries costs.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Tuple

import numpy as np

from sparseconv.parallel import LayerJob, build_many
from sparseconv.runtime import Conv2dKernel
from sparseconv.shapes import Epilogue, Target
from sparseconv.tilings import variant_for_batch
from sparseconv.table import TableConv2d, TableTiling, table_tiling
from sparseconv.testing import conv2d_reference, relative_l2
from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu
from sparseconv.zoo import find_layer, pruned_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", required=True, help="comma-separated, e.g. resnet50:layer4.1.conv2")
    ap.add_argument("--cands", default="rule", help="comma-separated JjxWw or rule (table.table_tiling's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--floor", action="store_true", help="also time the rule's tiling with an empty table")
    ap.add_argument("--out", default="weight_table_probe.json")
    args = ap.parse_args()
    # every argument checked before anything is built or touches a GPU
    cands: List[Tuple[str, object]] = []
    for c in args.cands.split(","):
        if c in ("rule", "rule-s", "rule-u"):
            cands.append((c, None if c == "rule" else c == "rule-s"))
            continue
        m = re.fullmatch(r"J(\d+)xW(\d+)(s?)", c)
        if not m:
            ap.error(f"--cands: {c!r} is not JjxWw[s] (e.g. J2xW4, J2xW4s), rule, rule-s or rule-u")
        try:
            cands.append((c, TableTiling(int(m[1]), int(m[2]), staged_entries=bool(m[3]))))
        except ValueError as e:
            ap.error(f"--cands {c}: {e}")
    for lname in args.layers.split(","):
        try:
            find_layer(lname, ("resnet50", "vgg16"))
        except ValueError as e:
            ap.error(f"--layers: {e}, e.g. resnet50:layer4.1.conv2")
    if args.batch < 1:
        ap.error(f"--batch must be 1 or more, got {args.batch}")
    if not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    import cupy
    nets = {}
    for lname in args.layers.split(","):
        net = lname.split(":")[0]
        if net not in nets:
            nets[net] = {name: (shape, w) for name, shape, w in pruned_model(net, 0.9)}
    picked = [(lname, *nets[lname.split(":")[0]][lname.split(":")[1]]) for lname in args.layers.split(",")]
    jobs = [LayerJob(lname, w, shape, variant_for_batch(shape, args.batch), Epilogue("relu"))
            for lname, shape, w in picked]
    t0 = time.time()
    built = build_many(jobs, target=Target("sm_90"), progress=True)
    print(f"built {len(jobs)} sparseconv kernels in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    n = args.batch
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
    rows = []
    for lname, shape, w in picked:
        x = cupy.asarray(rng.standard_normal((n, shape.in_channels, shape.in_h, shape.in_w), dtype=np.float32))
        bias = rng.standard_normal(shape.out_channels).astype(np.float32)
        ref = np.maximum(conv2d_reference(cupy.asnumpy(x), w, bias, shape.stride, shape.padding), 0)
        out = cupy.empty((n, shape.out_channels, shape.out_h, shape.out_w), cupy.float32)
        k = Conv2dKernel(built[lname], bias)
        k(x, out=out)
        row = dict(layer=lname, shape=shape.describe(), batch=n, nnz=int(np.count_nonzero(w)),
                   sparseconv=dict(tiling=built[lname].tiling.describe(),
                                   rel_l2=relative_l2(cupy.asnumpy(out), ref),
                                   hot_us=time_gpu(lambda: k(x, out=out), repeat=30, max_seconds=0.3,
                                                   capture=cupy_graph).us,
                                   cold_us=time_cold(lambda: k(x, out=out), l2_flush(flush, x), repeat=30,
                                                     max_seconds=0.3, capture=cupy_graph).us))
        print(f"{lname:26s} sparseconv {row['sparseconv']['tiling']:60s} hot {row['sparseconv']['hot_us']:6.1f} "
              f"cold {row['sparseconv']['cold_us']:6.1f} us  rel L2 {row['sparseconv']['rel_l2']:.1e}", flush=True)
        nnz = int(np.count_nonzero(w))
        rule = table_tiling(shape, n, nnz)
        runs = [(label, tiling if isinstance(tiling, TableTiling)
                 else rule if tiling is None else replace(rule, staged_entries=tiling), w, ref)
                for label, tiling in cands]
        if args.floor:  # an empty table: the output is relu(bias) everywhere
            floor_ref = np.broadcast_to(np.maximum(bias, 0)[None, :, None, None], ref.shape)
            runs.append(("floor", rule, np.zeros_like(w), floor_ref))
        for label, tiling, weight, want in runs:
            table = TableConv2d(weight, bias, shape, Epilogue("relu"), tiling, name=lname)
            out2 = cupy.full(out.shape, np.nan, cupy.float32)

            def launch():
                table(x, out=out2)
            launch()
            rel = relative_l2(cupy.asnumpy(out2), want)
            r = dict(cand=label, tiling=tiling.describe(), registers=table._fn.attributes["num_regs"], rel_l2=rel,
                     hot_us=time_gpu(launch, repeat=30, max_seconds=0.3, capture=cupy_graph).us,
                     cold_us=time_cold(launch, l2_flush(flush, x), repeat=30, max_seconds=0.3,
                                       capture=cupy_graph).us)
            row.setdefault("table", []).append(r)
            print(f"{'':26s} table {label:6s} {tiling.describe():40s} regs {r['registers']:3d} "
                  f"hot {r['hot_us']:6.1f} cold {r['cold_us']:6.1f} us  rel L2 {rel:.1e}", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
