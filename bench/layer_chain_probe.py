"""What a kernel boundary costs at batch 1, against a grid-wide barrier inside
one kernel: the question behind fusing layers (docs/pending/README.md, "fewer
kernels"). A chain of L stand-in layers, each shaped like a split 1x1 block
of ResNet-50's layer3 (112 blocks of 224 threads, one pixel of a 14x14 image
a thread, 64 input channels loaded and 32 output channels stored, no FMA
code), runs either as L kernels in a CUDA graph or as one kernel with a
grid-wide barrier between its L phases. Timed hot and cold (timing.time_cold:
L2 overwritten first), per layer.

    python bench/layer_chain_probe.py [--layers 8] > layer_chain.txt

The barrier is a counter and a generation word in global memory: all 112
blocks are resident at once (one wave on the H100's 132 SMs), so spinning is
safe; the kernel refuses to run on a GPU with fewer SMs than blocks.
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np

from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu

BLOCKS, THREADS, PIXELS, CHANNELS_OUT = 112, 224, 196, 112 * 32

SOURCE = r"""
#define PIXELS 196
#define CHANNELS_OUT (112 * 32)

__device__ __forceinline__ void one_layer(const float* src, float* dst) {
    int i = threadIdx.x;
    if (i >= PIXELS) return;
    float s = 0.f;
    #pragma unroll
    for (int c = 0; c < 64; ++c) s += src[((blockIdx.x * 64 + c) % CHANNELS_OUT) * PIXELS + i];
    #pragma unroll
    for (int k = 0; k < 32; ++k) dst[(blockIdx.x * 32 + k) * PIXELS + i] = s + k;
}

// Sense by generation: a block reads the generation before it arrives, the
// last to arrive resets the count and moves the generation on.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* generation) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g = *(volatile unsigned*)generation;
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            *count = 0;
            __threadfence();
            atomicAdd(generation, 1u);
        } else {
            while (*(volatile unsigned*)generation == g) {}
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void chain_layer(const float* src, float* dst) { one_layer(src, dst); }

extern "C" __global__ void chain_fused(const float* x, float* a, float* b, int layers, unsigned* sync) {
    for (int l = 0; l < layers; ++l) {
        one_layer(l == 0 ? x : (l & 1 ? a : b), l & 1 ? b : a);
        if (l + 1 < layers) grid_barrier(sync, sync + 1);
    }
}

extern "C" __global__ void chain_empty(float* out) {}

extern "C" __global__ void chain_barriers(int layers, unsigned* sync) {
    for (int l = 0; l + 1 < layers; ++l) grid_barrier(sync, sync + 1);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="layers in the chain (default 8)")
    args = ap.parse_args()
    if args.layers < 2:
        ap.error(f"--layers must be 2 or more, got {args.layers}")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if sms < BLOCKS:
        raise SystemExit(f"{BLOCKS} blocks must all be resident for the grid barrier; this GPU has {sms} SMs")
    module = cupy.RawModule(code=SOURCE)
    layer, fused, empty, barriers = (module.get_function(n) for n in
                                     ("chain_layer", "chain_fused", "chain_empty", "chain_barriers"))
    n = args.layers
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal(CHANNELS_OUT * PIXELS, dtype=np.float32))
    a, b = cupy.zeros_like(x), cupy.zeros_like(x)
    sync = cupy.zeros(2, cupy.uint32)
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)

    def separate() -> None:
        for i in range(n):
            layer((BLOCKS,), (THREADS,), (x if i == 0 else (a if i & 1 else b), b if i & 1 else a))

    cases = {
        f"{n} layers, {n} kernels": separate,
        f"{n} layers, 1 kernel, {n - 1} grid barriers": lambda: fused((BLOCKS,), (THREADS,),
                                                                       (x, a, b, np.int32(n), sync)),
        f"{n} empty kernels": lambda: [empty((BLOCKS,), (THREADS,), (a,)) for _ in range(n)],
        f"1 kernel, {n - 1} grid barriers, no work": lambda: barriers((BLOCKS,), (THREADS,), (np.int32(n), sync)),
    }
    separate()
    fused((BLOCKS,), (THREADS,), (x, a, b, np.int32(n), sync))
    last = b if (n - 1) & 1 else a
    want = last.copy()
    separate()
    cupy.cuda.Device().synchronize()
    if not bool(cupy.array_equal(want, b if (n - 1) & 1 else a)):
        raise SystemExit("the fused chain and the separate kernels disagree")
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; the fused and separate chains "
          f"agree bit for bit")
    for name, launch in cases.items():
        launch()
        cupy.cuda.Device().synchronize()
        hot = time_gpu(launch, repeat=30, max_seconds=0.3, capture=cupy_graph).us
        cold = time_cold(launch, l2_flush(flush, x), repeat=30, max_seconds=0.3, capture=cupy_graph).us
        print(f"{name:44s} hot {hot:7.2f} cold {cold:7.2f} us; per layer hot {hot / n:5.2f} cold {cold / n:5.2f}",
              flush=True)


if __name__ == "__main__":
    main()
