"""Memory errors and races (under compute-sanitizer) and the relative L2 of every benchmark layer's kernel.

Runs each kernel once (sparsity 0.9, batch 2), for
`compute-sanitizer --tool memcheck --error-exitcode 1 python bench/memcheck_layers.py`
and (shared-memory races of the double-buffered staging, on a few layers, as
racecheck is slow) `compute-sanitizer --tool racecheck --error-exitcode 1
python bench/memcheck_layers.py 'lenet-*,resnet-conv2'`.

The kernel families (pointwise 1x1, split-K variants, fused residual + ReLU
epilogue) are the layers named family-*, each run at batch 1 (the split
variant) and 20 (unsplit): `... python bench/memcheck_layers.py 'family-*'`.
memcheck takes one layer per process: compute-sanitizer (CUDA 13.0) segfaulted
itself partway through all five in one process (docs/DESIGN.md), so
`for l in $(python bench/memcheck_layers.py --list 'family-*'); do
compute-sanitizer --tool memcheck --error-exitcode 1 python bench/memcheck_layers.py "$l" || break; done`.

Checks results too, so a run that passes memcheck is also known to be right."""
import fnmatch
import sys
import tempfile

import cupy as cp
import numpy as np

import sparseconv
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2
from sparseconv.operators import benchmark_operators
from sparseconv.shapes import ConvShape

# Layers of every kernel family, small enough for racecheck: name -> shape.
FAMILY_LAYERS = {
    "family-pointwise-deep": ConvShape(512, 256, 7, 7, 1, 1),              # split at batch 1
    "family-pointwise-odd": ConvShape(37, 19, 11, 13, 1, 1, (2, 2), (1, 1)),  # padded chunks, stride, padding
    "family-pointwise-3x3": ConvShape(128, 64, 7, 7, 3, 3, (1, 1), (1, 1)),  # padding taps read the zero array
    "family-direct-split": ConvShape(64, 64, 56, 56, 3, 3, (1, 1), (1, 1)),  # split at batch 1
    "family-mixed": ConvShape(128, 128, 28, 28, 3, 3, (1, 1), (1, 1)),  # split direct at batch 1, pointwise at 20
    # direct, two outputs along W a thread (the per-channel branch kept for the stores' order)
    "family-direct-wide": ConvShape(3, 64, 32, 32, 3, 3, (1, 1), (1, 1)),
    # batch 20: 7 pixel blocks in 2 groups of 4 (shapes.launch_grid), one block past the batch
    "family-pointwise-grouped": ConvShape(1024, 256, 13, 13, 1, 1),
    # 32 channels x 128 threads capped at 4 blocks per SM (a widening 1x1, tilings.default_pointwise_tiling)
    "family-pointwise-capped": ConvShape(128, 512, 7, 7, 1, 1),
    # batch 1: 8 slices summed inside thread-block clusters (distributed shared memory)
    "family-pointwise-cluster": ConvShape(2048, 512, 7, 7, 1, 1),
    # batch 1: a direct split of 256 input channels, 4 staged a chunk
    # (tilings.SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS), 16 slices (64x64: smaller
    # images take tilings.whole_image_split)
    "family-direct-wide-chunk": ConvShape(256, 32, 64, 64, 3, 3, (1, 1), (1, 1)),
    # split at batch 1 as one 800-thread pointwise block over the image (tilings.whole_image_split)
    "family-pointwise-whole-image": ConvShape(256, 32, 28, 28, 3, 3, (1, 1), (1, 1)),
    # ... and as four such blocks over a 56x56 image
    "family-pointwise-whole-image-4": ConvShape(256, 32, 56, 56, 3, 3, (1, 1), (1, 1)),
    # ... and with 128 input channels, in 2 slices (not yet run under compute-sanitizer)
    "family-pointwise-whole-image-mid": ConvShape(128, 32, 56, 56, 3, 3, (1, 1), (1, 1)),
    # batch 1 in unsplit 800-thread blocks of 16 channels (tilings.large_image_blocks)
    "family-pointwise-large-image": ConvShape(64, 32, 112, 112, 3, 3, (1, 1), (1, 1)),
}


def main() -> int:
    args = sys.argv[1:]
    list_only = args[:1] == ["--list"]  # the matching names, one a line, nothing run
    args = args[1:] if list_only else args
    patterns = args[0].split(",") if args else ["*"]
    layers = [(op.name, op.shape) for op in benchmark_operators()] + list(FAMILY_LAYERS.items())
    layers = [(name, s) for name, s in layers if any(fnmatch.fnmatch(name, p) for p in patterns)]
    if list_only or not layers:
        print("\n".join(name for name, _ in layers) if layers else f"no layer matches {','.join(patterns)}")
        return 0 if layers else 2
    rng = np.random.default_rng()
    cache = tempfile.mkdtemp()
    worst = 0.0
    for name, s in layers:
        family = name.startswith("family-")
        w = pruned_weight(rng, s.weight_shape, 0.9)
        conv = sparseconv.compile_conv2d(w, input_size=(s.in_h, s.in_w), stride=s.stride, padding=s.padding,
                                         activation="relu" if family else "none", residual=family,
                                         cache_dir=cache, name=name)
        for batch in ((1, 20) if family else (2,)):
            x = cp.asarray(rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
            ref = conv2d_reference(x, cp.asarray(w), None, s.stride, s.padding, xp=cp)
            if family:
                r = cp.asarray(rng.standard_normal(conv.output_shape(batch)).astype(np.float32))
                y, ref = conv(x, residual=r), cp.maximum(ref + r, 0)
            else:
                y = conv(x)
            err = relative_l2(y, ref, xp=cp)
            worst = max(worst, err)
            print(f"{name:24s} batch {batch:2d} {conv.variant(batch)[1].tiling.describe():60s} rel_l2={err:.2e}",
                  flush=True)
    print(f"worst rel_l2 {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
