"""Autotuning: choose a layer's tiling, and optionally sparse vs dense, by timing
on the GPU. The choice is cached (cache kind "tuning") under the layer's weights,
shape, device and batch, so compiling the same layer again does not tune again.

    kernel = compile_conv2d(w, input_size=(56, 56), padding=1, tiling="auto")
    kernel = compile_conv2d(w, input_size=(56, 56), padding=1, backend="auto")
    kernel.stats["tuning"]   # what was measured and chosen

Timing, on a fresh random input of `batch` images: tilings are ranked by their
cold time, as a layer runs inside a network: CUDA-graph replays (launch
overhead excluded, which at small batches is larger than the kernel) with L2
overwritten and the input read back before each call (timing.time_cold, as
routing times). Hot and cold rankings differ: ResNet-50's layer4.x.conv2 at
batch 64 ran 112 us hot and 273 cold with 256 threads, 157 and 158 with 512
(docs/PERFORMANCE.md, session 11). The best of TUNING_ROUNDS interleaved
rounds counts, so one noisy measurement does not decide. The dense candidate is torch.nn.functional.conv2d
(cuDNN) in strict fp32 (TF32 off), since sparseconv promises exact fp32 either
way; it is compared with the best tiling by CUDA events around back-to-back
launches, the same method for both.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .parallel import LayerJob, build_many
from .build import SPECIALISER_FINGERPRINT, CompiledLayer, build_conv2d
from .cache import ArtifactCache, cache_key
from .dense import dense_conv2d
from .runtime import Conv2dKernel
from .shapes import ConvShape, Epilogue, Target, Tiling
from .tilings import candidate_tilings, default_tiling
from .timing import cupy_graph, l2_flush, l2_scratch_floats, median_us, time_cold

SPARSE, DENSE = "sparseconv", "dense"


@dataclass(frozen=True)
class TuningResult:
    tiling: Tiling                   # the fastest tiling (also kept when dense wins)
    backend: str                     # SPARSE or DENSE
    batch: int                       # the batch size it was timed at
    times_us: Dict[str, float]       # tiling.describe() or "dense" -> median microseconds
    device: str
    cache_hit: bool
    note: str = ""                   # e.g. why the dense path was not timed

    def as_dict(self) -> Dict[str, Any]:
        return dict(tiling=self.tiling.describe(), backend=self.backend, batch=self.batch,
                    times_us=self.times_us, device=self.device, cache_hit=self.cache_hit, note=self.note)


# Rounds over all candidate tilings; each keeps its best round.
TUNING_ROUNDS = 3
# times_us key of the best tiling timed like the dense candidate (events).
SPARSE_EVENTS = "sparseconv (events)"


def tune_conv2d(weight: np.ndarray, shape: ConvShape, bias: Optional[np.ndarray], *, target: Target,
                cache: ArtifactCache, name: str, batch: int = 64, tilings: Optional[List[Tiling]] = None,
                consider_dense: bool = False, jobs: Optional[int] = None,
                epilogue: Epilogue = Epilogue(), progress: bool = False) -> Tuple[CompiledLayer, TuningResult]:
    """Time each candidate tiling (default: tilings.candidate_tilings plus the
    default) and, with consider_dense, cuDNN strict fp32; return the fastest
    sparse build and the choice. Needs a GPU (the current CuPy device).
    progress: the candidates' build bar on stderr."""
    import cupy

    if not tilings:
        tilings = [default_tiling(shape)] + [t for t in candidate_tilings(shape) if t != default_tiling(shape)]
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    dense = dense_conv2d(weight, bias, shape) if consider_dense else None
    key = cache_key("tuning", SPECIALISER_FINGERPRINT, weight.tobytes(), repr(shape), target.arch, device, str(batch),
                    repr(sorted(t.describe() for t in tilings)), str(dense is not None), epilogue.describe(),
                    "cold")  # tunings timed hot (before session 11) are not reused
    note = "dense not timed: needs torch with CUDA" if consider_dense and dense is None else ""
    hit = cache.get_json("tuning", key)
    if hit is not None:
        tiling = Tiling(**hit["tiling"])
        layer = build_conv2d(weight, shape, tiling=tiling, target=target, cache=cache, name=name, epilogue=epilogue)
        return layer, TuningResult(tiling, hit["backend"], batch, hit["times_us"], device, True, note)

    t0 = time.perf_counter()
    built = build_many([LayerJob(f"{name}#{i}", weight, shape, t, epilogue) for i, t in enumerate(tilings)],
                       target=target, cache_dir=str(cache.root), workers=jobs, progress=progress)
    rng = np.random.default_rng()
    x = cupy.asarray(rng.standard_normal((batch, shape.in_channels, shape.in_h, shape.in_w), dtype=np.float32))
    out = cupy.empty((batch, shape.out_channels) + epilogue.output_hw(shape), cupy.float32)  # pooled, with a pool
    res = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32)) if epilogue.residual else None
    layers = {layer.tiling.describe(): layer for layer in built.values()}
    kernels = {d: Conv2dKernel(layer, bias) for d, layer in layers.items()}
    flush = l2_flush(cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32),
                     x, res)
    times: Dict[str, float] = {d: float("inf") for d in layers}
    for _ in range(TUNING_ROUNDS):  # interleaved: a slow spell of the GPU hits every candidate
        for d, kernel in kernels.items():
            cold = time_cold(lambda: kernel(x, out=out, residual=res), flush, repeat=20, max_seconds=0.2,
                             capture=cupy_graph)
            times[d] = min(times[d], cold.us)
    best = min(layers, key=lambda d: times[d])
    backend = SPARSE
    if dense is not None:  # like with like: both by events around launches
        dense_out = cupy.empty((batch, shape.out_channels, shape.out_h, shape.out_w), cupy.float32)  # unpooled
        times[DENSE] = median_us(lambda: dense(x, dense_out), batch)
        times[SPARSE_EVENTS] = median_us(lambda: kernels[best](x, out=out, residual=res), batch)
        backend = DENSE if times[DENSE] < times[SPARSE_EVENTS] else SPARSE
    chosen = replace(layers[best], name=name)
    cache.put_json("tuning", key, {"tiling": asdict(chosen.tiling), "backend": backend, "times_us": times,
                                   "batch": batch, "device": device, "layer": name,
                                   "seconds": time.perf_counter() - t0})
    return chosen, TuningResult(chosen.tiling, backend, batch, times, device, False, note)
