"""Weights as a table in memory instead of in the instruction stream, at
small batch: is the data path faster than instruction fetch for deep layers?

At batch 1 a deep layer's straight-line code (16 B an FFMA, one FFMA a
nonzero weight) is fetched at ~1.4 GB/s an SM from DRAM (docs/PERFORMANCE.md,
sessions 17-18). This probe times, on the same layers, weights and inputs,
the sparseconv default against a throwaway kernel that reads each nonzero
weight as an 8-byte table entry (byte offset of its input channel, value), sorted by (out-channel, tap,
input channel). A warp loads each entry once (one address for all lanes)
and applies it to J pixels a lane; the WS warps of a block split each tap's
entries and sum their partial results in shared memory, in a fixed order.
Bias and ReLU are applied at the store. Each output is checked against a
float64 reference.

    python bench/weight_table_probe.py --layers resnet50:layer4.1.conv2,resnet50:layer3.1.conv1 \
        --cands J2xW4,J4xW4 --out table.json

A candidate JjxWw sets J (pixels a lane; a block covers 32*J pixels of one
image and one output channel) and WS (warps a block).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Tuple

import numpy as np

from sparseconv.parallel import LayerJob, build_many
from sparseconv.runtime import Conv2dKernel
from sparseconv.shapes import ConvShape, Epilogue, Target, variant_for_batch
from sparseconv.testing import conv2d_reference, relative_l2
from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu
from sparseconv.zoo import pruned_model

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(32 * WS)
wt_conv(const float* __restrict__ x, const int2* __restrict__ ent, const int* __restrict__ starts,
        const float* __restrict__ bias, float* __restrict__ out)
{
    const int k = blockIdx.y, n = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int pix0 = blockIdx.x * 32 * J;
    const float* xn = x + (size_t)n * C * H * W;
    float acc[J];
    int oy[J], ox[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        acc[j] = 0.0f;
        const int p = pix0 + lane + 32 * j;
        oy[j] = p < OH * OW ? p / OW : -100000;
        ox[j] = p % OW;
    }
    const int* st = starts + k * (KH * KW + 1);
    for (int t = 0; t < KH * KW; ++t) {
        const int r = t / KW, s = t % KW;
        const char* xp[J];  // this tap's input pixel of each of the thread's outputs, channel 0
        bool ok[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int iy = oy[j] * SH - PH + r, ix = ox[j] * SW - PW + s;
            ok[j] = iy >= 0 && iy < H && ix >= 0 && ix < W;
            xp[j] = (const char*)(xn + (ok[j] ? iy * W + ix : 0));
        }
        const int b = st[t], len = st[t + 1] - b;
        const int lo = b + (len * w) / WS, hi = b + (len * (w + 1)) / WS;
#pragma unroll 4
        for (int i = lo; i < hi; ++i) {
            const int2 e = __ldg(ent + i);
            const float v = __int_as_float(e.y);
#pragma unroll
            for (int j = 0; j < J; ++j)
                if (ok[j]) acc[j] = fmaf(v, __ldg((const float*)(xp[j] + (unsigned)e.x)), acc[j]);
        }
    }
    __shared__ float part[WS][32 * J];
#pragma unroll
    for (int j = 0; j < J; ++j) part[w][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int q = threadIdx.x; q < 32 * J; q += 32 * WS) {
        const int p = pix0 + q;
        if (p >= OH * OW) continue;
        float sum = part[0][q];
#pragma unroll
        for (int u = 1; u < WS; ++u) sum += part[u][q];
        sum += bias[k];
        out[((size_t)n * K + k) * OH * OW + p] = fmaxf(sum, 0.0f);
    }
}
"""


def weight_table(w: np.ndarray, shape: ConvShape) -> Tuple[np.ndarray, np.ndarray]:
    """(entries, starts): entries int32 (E, 2) of (4*c*H*W, float bits), sorted by
    (k, tap, c); starts (K, taps+1), entry ranges of each (k, tap)."""
    k_, c_, r_, s_ = w.shape
    kk, cc, rr, ss = np.nonzero(w)
    tap = rr * s_ + ss
    order = np.lexsort((cc, tap, kk))
    kk, cc, tap = kk[order], cc[order], tap[order]
    vals = w[np.nonzero(w)][order].astype(np.float32)
    ent = np.empty((len(kk), 2), np.int32)
    ent[:, 0] = cc * shape.in_h * shape.in_w * 4  # byte offset of channel c
    ent[:, 1] = vals.view(np.int32)
    counts = np.zeros((k_, r_ * s_), np.int64)
    np.add.at(counts, (kk, tap), 1)
    starts = np.zeros((k_, r_ * s_ + 1), np.int32)
    starts[:, 1:] = np.cumsum(counts, axis=1)
    starts += (np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]]))[:, None].astype(np.int32)
    return ent, starts


def table_kernel(shape: ConvShape, j: int, ws: int):
    import cupy
    defs = dict(C=shape.in_channels, H=shape.in_h, W=shape.in_w, K=shape.out_channels, OH=shape.out_h,
                OW=shape.out_w, KH=shape.kernel_h, KW=shape.kernel_w, SH=shape.stride[0], SW=shape.stride[1],
                PH=shape.padding[0], PW=shape.padding[1], J=j, WS=ws)
    src = "".join(f"#define {k} {v}\n" for k, v in defs.items()) + KERNEL
    return cupy.RawKernel(src, "wt_conv", options=("-std=c++17",))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", required=True, help="comma-separated, e.g. resnet50:layer4.1.conv2")
    ap.add_argument("--cands", default="J2xW4", help="comma-separated JjxWw")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="weight_table_probe.json")
    args = ap.parse_args()
    cands: List[Tuple[int, int]] = []
    for c in args.cands.split(","):
        try:
            js, wsn = c.split("x")
            cands.append((int(js.lstrip("J")), int(wsn.lstrip("W"))))
        except ValueError:
            ap.error(f"--cands: {c!r} is not JjxWw, e.g. J2xW4")
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
        ent, starts = weight_table(w, shape)
        d_ent, d_starts, d_bias = cupy.asarray(ent), cupy.asarray(starts), cupy.asarray(bias)
        print(f"{lname:26s} sparseconv {row['sparseconv']['tiling']:60s} hot {row['sparseconv']['hot_us']:6.1f} "
              f"cold {row['sparseconv']['cold_us']:6.1f} us  rel L2 {row['sparseconv']['rel_l2']:.1e}", flush=True)
        for j, ws in cands:
            fn = table_kernel(shape, j, ws)
            grid = (-(-shape.out_h * shape.out_w // (32 * j)), shape.out_channels, n)
            out2 = cupy.full(out.shape, np.nan, cupy.float32)

            def launch():
                fn(grid, (32 * ws, 1, 1), (x, d_ent, d_starts, d_bias, out2))
            launch()
            rel = relative_l2(cupy.asnumpy(out2), ref)
            r = dict(cand=f"J{j}xW{ws}", grid=list(grid), registers=fn.attributes["num_regs"], rel_l2=rel,
                     hot_us=time_gpu(launch, repeat=30, max_seconds=0.3, capture=cupy_graph).us,
                     cold_us=time_cold(launch, l2_flush(flush, x), repeat=30, max_seconds=0.3,
                                       capture=cupy_graph).us)
            row.setdefault("table", []).append(r)
            print(f"{'':26s} table {r['cand']:10s} grid {grid} regs {r['registers']:3d} hot {r['hot_us']:6.1f} "
                  f"cold {r['cold_us']:6.1f} us  rel L2 {rel:.1e}", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
