"""What a batch-1 layer's kernel costs before any FMA: hand-written CUDA
kernels shaped like a split 1x1 block (224 threads, one pixel a thread, 64
input channels loaded, 32 output channels stored), timed hot and cold
(timing.time_cold: L2 overwritten first) in CUDA-graph replays.

    python bench/kernel_floor.py > kernel_floor.txt

Set beside `bench/split_probe.py --sparsity 1` (the same layer's kernel with
every weight zero, so no FMA left): the gap between the two is what the
kernel's own structure (bias, partial sums, reduction) costs, and the floor
here is what any kernel of that shape pays (docs/PERFORMANCE.md, session 17).
"""
from __future__ import annotations

import argparse
import cupy
import numpy as np

from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu

SOURCE = r"""
extern "C" __global__ void empty_kernel(float* out) {}

extern "C" __global__ void store_32(float* out, int pixels) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    #pragma unroll
    for (int k = 0; k < 32; ++k) if (i < pixels) out[k * pixels + i] = 0.f;
}

extern "C" __global__ void load_64_store_32(const float* x, float* out, int pixels) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pixels) return;
    float s = 0.f;
    #pragma unroll
    for (int c = 0; c < 64; ++c) s += x[(blockIdx.y * 64 + c) * pixels + i];
    #pragma unroll
    for (int k = 0; k < 32; ++k) out[(blockIdx.y * 32 + k) * pixels + i] = s + k;
}
"""


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: refuse stray ones
    module = cupy.RawModule(code=SOURCE)
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
    out = cupy.zeros(1 << 22, cupy.float32)
    x = cupy.ones(1 << 22, cupy.float32)
    pixels = np.int32(196)  # a 14x14 output, ResNet-50 layer3
    empty, store, load_store = (module.get_function(n) for n in ("empty_kernel", "store_32", "load_64_store_32"))
    cases = {
        "empty, 112 blocks of 224": lambda: empty((112,), (224,), (out,)),
        "store 32 channels, 1 block of 224": lambda: store((1,), (224,), (out, pixels)),
        "load 64 + store 32 channels, 16 blocks of 224": lambda: load_store((1, 16), (224,), (x, out, pixels)),
        "load 64 + store 32 channels, 112 blocks of 224": lambda: load_store((1, 112), (224,), (x, out, pixels)),
    }
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for name, launch in cases.items():
        launch()
        cupy.cuda.Device().synchronize()
        hot = time_gpu(launch, repeat=30, max_seconds=0.3, capture=cupy_graph).us
        cold = time_cold(launch, l2_flush(flush, x[:1 << 18]), repeat=30, max_seconds=0.3, capture=cupy_graph).us
        print(f"{name:50s} hot {hot:6.2f} cold {cold:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
