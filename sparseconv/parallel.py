"""Build many layers at once: a process pool sized to the cores, biggest layers
first, a progress bar, and per-layer timings.

Workers die with their parent: each asks the kernel for SIGKILL when its
parent exits (Linux prctl PR_SET_PDEATHSIG), and a watcher thread in each
checks the parent every second (other systems, and the moment before prctl).
When the caller is interrupted (Ctrl-C, SIGTERM through the CLI), running
builds are killed instead of waited for."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import click
import numpy as np

from .build import CompiledLayer, build_conv2d
from .cache import ArtifactCache
from .limits import check_layer
from .shapes import ConvShape, Epilogue, Target, Tiling

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LayerJob:
    name: str
    weight: np.ndarray
    shape: ConvShape
    tiling: Optional[Tiling] = None
    epilogue: Epilogue = Epilogue()


def _watch_parent(parent: int) -> None:
    """Pool initializer: exit when the process that started this worker is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watcher below still catches it, within a second
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="sparseconv-parent-watch", daemon=True).start()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and kill what has: used when the caller is
    interrupted or a layer failed, so that no worker goes on building for a
    caller that left."""
    # The processes first: shutdown() forgets them. (_processes is private, but
    # the executor offers no public way to stop a running task.)
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.kill()
    # Wait for the pool's manager thread (quick: its workers are dead). Left
    # running, it may hold the pool's shutdown lock when the next build_many
    # forks its workers; a worker that then garbage-collects this pool blocks
    # on that lock forever (seen in CI: a failed compile, then the next one hung).
    pool.shutdown(wait=True, cancel_futures=True)


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it, whatever the default. Python 3.14 makes
    forkserver Linux's default, and there a worker's parent is the server, not
    the caller (_watch_parent would end every worker at once); forkserver and
    spawn also import the caller's __main__ again, which runs a script without
    an `if __name__ == "__main__":` guard a second time. Our workers run only
    Python and the CUDA tools (nvcc, ptxas), never CUDA itself, so a caller
    that has initialised CUDA may fork them. spawn where there is no fork."""
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


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
    for j in jobs:  # refuse what cannot be built before starting any process
        try:
            check_layer(j.shape, j.tiling)
        except ValueError as exc:
            raise _naming_layer(exc, j.name) from None
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    order = sorted(jobs, key=lambda j: -j.weight.size)  # big layers first: shorter tail
    done: Dict[str, CompiledLayer] = {}
    if not jobs:
        return done
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=_watch_parent,
                               initargs=(os.getpid(),))
    try:
        with open(os.devnull, "w") as devnull, \
                click.progressbar(length=len(jobs), label=f"compiling {len(jobs)} layers on {workers} workers",
                                  file=sys.stderr if progress else devnull,
                                  item_show_func=lambda n: n or "") as bar:
            started = {pool.submit(_build_one, j, target, root): (j.name, time.perf_counter()) for j in order}
            for fut in as_completed(started):
                name, t0 = started[fut]
                try:
                    layer = fut.result()
                except Exception as exc:
                    raise _naming_layer(exc, name) from None
                layer.stats["wall_s"] = time.perf_counter() - t0
                done[name] = layer
                bar.update(1, name)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)
    return {n: done[n] for n in names}
