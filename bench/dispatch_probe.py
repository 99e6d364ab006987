"""Which blocks share an SM at once? A grid's blocks are handed to SMs in
launch order (x fastest), and a kernel whose co-resident blocks run the same
code fetches it once an SM (docs/PERFORMANCE.md, session 18: an SM keeps
~16 KB of code). Where in launch order do a block's neighbours on its SM
come from?

A kernel of --blocks-per-sm blocks an SM (capped by dynamic shared memory)
and --waves waves records each block's SM (%smid) and start and end times
(%globaltimer); each block spins for a time that varies a little with its
index, as real blocks do. Printed: how often a block runs on the same SM as
the block `d` before it in launch order, for the distances that matter, and
the launch-order distances between blocks that overlap in time on one SM.

    python bench/dispatch_probe.py [--blocks-per-sm 4] [--waves 4]
"""
from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

SOURCE = r"""
extern "C" __global__ void record(unsigned* smid, unsigned long long* start, unsigned long long* end,
                                  unsigned long long spin_ns)
{
    extern __shared__ float pad[];  // only to cap the blocks an SM
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const unsigned b = blockIdx.x;
    const unsigned long long until = t0 + spin_ns + (b * 2654435761u % 1000u) * spin_ns / 4000u;  // +0..25%
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t < until);
    if (threadIdx.x == 0) {
        unsigned s;
        asm("mov.u32 %0, %%smid;" : "=r"(s));
        smid[b] = s; start[b] = t0; end[b] = t;
        pad[0] = 0.0f;
    }
}
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks-per-sm", type=int, default=4, help="blocks an SM holds at once (default 4)")
    ap.add_argument("--waves", type=int, default=4, help="grid = SMs x blocks-per-sm x waves (default 4)")
    ap.add_argument("--threads", type=int, default=128, help="threads a block (default 128)")
    ap.add_argument("--spin-us", type=float, default=20.0, help="how long a block runs, µs (default 20)")
    args = ap.parse_args(argv)
    if not 1 <= args.blocks_per_sm <= 32 or args.waves < 1 or not 32 <= args.threads <= 1024 \
            or args.threads % 32 or args.spin_us <= 0:
        ap.error("--blocks-per-sm 1..32, --waves >= 1, --threads a multiple of 32 in 32..1024, --spin-us > 0")
    return args


def main() -> None:
    args = parse_args()
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    sms = props["multiProcessorCount"]
    smem = props["sharedMemPerMultiprocessor"] // args.blocks_per_sm - 1024  # - the per-block reserve
    kernel = cp.RawKernel(SOURCE, "record")
    kernel.max_dynamic_shared_size_bytes = smem
    n = sms * args.blocks_per_sm * args.waves
    smid = cp.zeros(n, dtype=cp.uint32)
    start = cp.zeros(n, dtype=cp.uint64)
    end = cp.zeros(n, dtype=cp.uint64)
    for _ in range(2):  # the second launch is the one read
        kernel((n,), (args.threads,), (smid, start, end, np.uint64(args.spin_us * 1e3)), shared_mem=smem)
    cp.cuda.runtime.deviceSynchronize()
    s, t0, t1 = smid.get(), start.get().astype(np.int64), end.get().astype(np.int64)
    print(f"device: {props['name'].decode()}, {sms} SMs; {n} blocks of {args.threads} threads, "
          f"{args.blocks_per_sm} an SM ({smem} B of shared memory each), ~{args.spin_us} µs each")
    per_sm = Counter(s.tolist())
    print(f"blocks an SM: min {min(per_sm.values())}, max {max(per_sm.values())} over {len(per_sm)} SMs")
    for d in sorted({1, args.blocks_per_sm, sms // 2, sms, 2 * sms, sms * args.blocks_per_sm}):
        if d < n:
            same = float(np.mean(s[d:] == s[:-d]))
            print(f"block L on the SM of block L - {d}: {same:.1%}")
    # launch-order distances between blocks that run on one SM at the same time
    distances: Counter = Counter()
    order = np.argsort(t0)
    for sm in per_sm:
        blocks = [b for b in order if s[b] == sm]
        for i, a in enumerate(blocks):
            for b in blocks[i + 1:]:
                if t0[b] >= t1[a]:
                    break
                distances[abs(int(b) - int(a))] += 1
    total = sum(distances.values())
    print(f"pairs of blocks overlapping on one SM: {total}; most common launch-order distances:")
    for d, c in distances.most_common(8):
        print(f"  {d}: {c / total:.1%}")


if __name__ == "__main__":
    main()
