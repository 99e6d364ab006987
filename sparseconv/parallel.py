"""Build many layers at once: worker processes sized to the cores, biggest
layers first, a progress bar, and per-layer timings.

The workers are fresh Python processes (`python -m sparseconv.build_worker`,
started by subprocess), not forks of the caller: a caller with CUDA or torch
up has threads, and forking it is unsafe (Python 3.12+ warns; a forked
worker once hung on a lock another thread held at the fork); multiprocessing's
spawn and forkserver import the caller's `__main__` again instead, which runs
a script without an `if __name__ == "__main__":` guard a second time. A
worker gets its jobs pickled through its stdin and answers through its
stdout (sparseconv.build_worker). A single worker's build runs in the
caller's process.

Workers die with their parent (build_worker.die_with_parent). Each runs in a
process group of its own, so a Ctrl-C at the terminal reaches the caller
alone: when it is interrupted (Ctrl-C, SIGTERM through the CLI) or a layer
fails, it kills the workers' groups, the nvcc and ptxas they run included,
instead of waiting for the builds in flight."""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import click
import numpy as np

from .build import CompiledLayer, sources_changed_since_import
from .build_worker import build_one
from .cache import ArtifactCache
from .limits import check_layer
from .shapes import ConvShape, Epilogue, Target, Tiling
from .tilings import default_tiling


@dataclass(frozen=True)
class LayerJob:
    name: str
    weight: np.ndarray
    shape: ConvShape
    tiling: Optional[Tiling] = None
    epilogue: Epilogue = Epilogue()


class _Worker:
    """One build_worker process; build() sends it a job and waits for the answer."""

    def __init__(self) -> None:
        # The worker imports the sparseconv this module came from, wherever that is: its folder
        # first on the path, and not the working folder, which `-m` would put before it
        # (PYTHONSAFEPATH, Python 3.11+; 3.10 ignores it), so a folder named sparseconv there cannot shadow it.
        package_root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "sparseconv.build_worker", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONPATH=path, PYTHONSAFEPATH="1"),
                                     start_new_session=os.name == "posix")

    def build(self, job: LayerJob, target: Target, cache_root: str) -> CompiledLayer:
        try:
            pickle.dump((job, target, cache_root), self.proc.stdin)
            self.proc.stdin.flush()  # type: ignore[union-attr]
            ok, value = pickle.load(self.proc.stdout)  # type: ignore[arg-type]
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            try:
                code: Optional[int] = self.proc.wait(timeout=5)  # its pipe closed: it is exiting
            except subprocess.TimeoutExpired:
                code = None
            how = "" if code is None else f" (killed by signal {-code})" if code < 0 else f" (exit code {code})"
            raise RuntimeError(f"the build worker (pid {self.proc.pid}) exited{how} before it answered; its "
                               "messages, if any, are above on stderr") from None
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        """The worker and what it runs (nvcc, ptxas): its whole process group."""
        try:
            if os.name == "posix":
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def close(self) -> None:
        """End of its jobs: the worker exits."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.stdout.close()  # type: ignore[union-attr]


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


def build_order(jobs: Sequence[LayerJob]) -> List[LayerJob]:
    """Big layers first, for a shorter tail; among layers of one size, the
    first of each template (shape, tiling, epilogue) before its repeats. Two
    workers that start repeats of one template at once both run nvcc on it
    (the cache has no entry yet): VGG-16's conv5_1 and conv5_2 each spent
    7.5 s on the same template (session 47); a repeat started after the first
    finds the template cached."""
    seen: Dict[Tuple[ConvShape, Tiling, Epilogue], int] = {}
    repeat: Dict[str, int] = {}
    for j in sorted(jobs, key=lambda j: -j.weight.size):
        template = (j.shape, j.tiling or default_tiling(j.shape), j.epilogue)
        repeat[j.name] = seen.get(template, 0)
        seen[template] = repeat[j.name] + 1
    return sorted(jobs, key=lambda j: (-j.weight.size, repeat[j.name]))


def build_many(jobs: Sequence[LayerJob], *, target: Optional[Target] = None, cache_dir: Optional[str] = None,
               workers: Optional[int] = None, progress: bool = True) -> Dict[str, CompiledLayer]:
    """Build every job; returns name -> CompiledLayer in the jobs' order. Each
    layer's stats['seconds'] has its per-stage times and stats['wall_s'] the
    time its build took, from the moment a worker took it (not the time it
    waited for one). Raises the first layer's error, naming the layer."""
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
    changed = sources_changed_since_import()
    if changed:
        warnings.warn(f"sparseconv's {', '.join(changed)} under {Path(__file__).resolve().parent} changed after "
                      "this process imported it: layers built in this process are cached under the imported "
                      "code, those built by worker processes under the code on disk, and neither finds the "
                      "other's. Restart Python to build with one.", RuntimeWarning, stacklevel=2)
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if not sys.executable:  # an embedded Python that cannot start another: build here
        workers = 1
    order = build_order(jobs)
    done: Dict[str, CompiledLayer] = {}
    if not jobs:
        return done
    label = f"compiling {len(jobs)} layers on {workers} worker{'s' if workers > 1 else ''}"
    with open(os.devnull, "w") as devnull, \
            click.progressbar(length=len(jobs), label=label, file=sys.stderr if progress else devnull,
                              item_show_func=lambda n: n or "") as bar:
        if workers == 1:  # no process to start: the build runs here
            for j in order:
                t0 = time.perf_counter()
                try:
                    layer = build_one(j, target, root)
                except Exception as exc:
                    raise _naming_layer(exc, j.name) from None
                _done(done, j.name, layer, time.perf_counter() - t0, bar)
        else:
            _build_in_workers(order, target, root, workers, done, bar)
    return {n: done[n] for n in names}


def _done(done: Dict[str, CompiledLayer], name: str, layer: CompiledLayer, seconds: float, bar: object) -> None:
    layer.stats["wall_s"] = seconds
    done[name] = layer
    bar.update(1, name)  # type: ignore[attr-defined]


def _build_in_workers(order: Sequence[LayerJob], target: Target, root: str, workers: int,
                      done: Dict[str, CompiledLayer], bar: object) -> None:
    """Each job on the first free worker process, one thread a worker waiting for its answer."""
    # Started from this thread: a worker's death signal goes with the thread that started it.
    procs: List[_Worker] = []
    try:
        procs.extend(_Worker() for _ in range(workers))
        idle: "queue.Queue[_Worker]" = queue.Queue()
        for w in procs:
            idle.put(w)

        def build(job: LayerJob) -> Tuple[CompiledLayer, float]:
            """The layer and its build's seconds, timed once a worker is free."""
            w = idle.get()
            try:
                t0 = time.perf_counter()
                return w.build(job, target, root), time.perf_counter() - t0
            finally:
                idle.put(w)

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sparseconv-build") as threads:
            started: Dict[Future, str] = {}
            try:
                for j in order:
                    started[threads.submit(build, j)] = j.name
                for fut in as_completed(started):
                    name = started[fut]
                    try:
                        layer, seconds = fut.result()
                    except Exception as exc:
                        raise _naming_layer(exc, name) from None
                    _done(done, name, layer, seconds, bar)
            except BaseException:
                # Stop at once: the threads waiting on a killed worker get its end of file.
                for fut in started:
                    fut.cancel()
                for w in procs:
                    w.kill()
                raise
    finally:
        for w in procs:
            w.close()
