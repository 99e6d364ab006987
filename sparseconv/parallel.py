"""Build many layers at once: a process pool sized to the cores, biggest layers
first, a progress bar, and per-layer timings."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import click
import numpy as np

from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache
from .shapes import ConvShape, Epilogue, Target, Tiling


@dataclass(frozen=True)
class LayerJob:
    name: str
    weight: np.ndarray
    shape: ConvShape
    tiling: Optional[Tiling] = None
    epilogue: Epilogue = Epilogue()


def _build_one(job: LayerJob, target: Target, cache_root: str) -> CompiledLayer:
    return build_conv2d(job.weight, job.shape, tiling=job.tiling, target=target,
                        cache=ArtifactCache(cache_root), name=job.name, epilogue=job.epilogue)


def _naming_layer(exc: BaseException, name: str) -> BaseException:
    """exc with the layer's name in front of its message, same type. As it is
    when its type cannot be rebuilt from a message alone (CompileError carries
    its tool, log and source, and names the layer already)."""
    if not isinstance(exc, (ValueError, RuntimeError)):
        return exc
    try:
        return type(exc)(f"layer {name}: {exc}")
    except TypeError:
        return exc


def build_many(jobs: Sequence[LayerJob], *, target: Optional[Target] = None, cache_dir: Optional[str] = None,
               workers: Optional[int] = None, progress: bool = True) -> Dict[str, CompiledLayer]:
    """Build every job; returns name -> CompiledLayer in the jobs' order. Each
    layer's stats['seconds'] has its per-stage times and stats['wall_s'] its
    time in the pool. Raises the first layer's error, naming the layer."""
    target = target or Target()
    root = str(ArtifactCache(cache_dir).root)
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    order = sorted(jobs, key=lambda j: -j.weight.size)  # big layers first: shorter tail
    done: Dict[str, CompiledLayer] = {}
    if not jobs:
        return done
    with ProcessPoolExecutor(max_workers=workers) as pool, \
            click.progressbar(length=len(jobs), label=f"compiling {len(jobs)} layers on {workers} workers",
                              file=sys.stderr if progress else open(os.devnull, "w"),
                              item_show_func=lambda n: n or "") as bar:
        started = {pool.submit(_build_one, j, target, root): (j.name, time.perf_counter()) for j in order}
        for fut in as_completed(started):
            name, t0 = started[fut]
            try:
                layer = fut.result()
            except Exception as exc:
                for other in started:
                    other.cancel()
                raise _naming_layer(exc, name)
            layer.stats["wall_s"] = time.perf_counter() - t0
            done[name] = layer
            bar.update(1, name)
    return {n: done[n] for n in names}
