"""GPU timing, a leaf module: CUDA-event and CUDA-graph timing, medians.

Used by the tuner, the bench and the scripts in bench/. Imports nothing of
sparseconv's; cupy and torch are imported inside the functions that use them,
so importing this module needs no GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional

import numpy as np

# A graph holds enough launches to run about this long, so the replay's own
# launch gap is a small fraction of it.
GRAPH_TARGET_US = 2000.0
MAX_GRAPH_LAUNCHES = 100

Launch = Callable[[], Any]
Capture = Callable[[Launch, int], Launch]


@dataclass
class Timing:
    us: float                       # the figure used: the graph replay if captured, else events
    method: str                     # "graph" or "events"
    events_us: float
    host_us: float
    graph_us: Optional[float] = None
    graph_launches: int = 0
    note: str = ""


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def median_us(fn: Launch, batch: int = 64, *, repeat: Optional[int] = None, warmup: int = 3) -> float:
    """Median device time of fn in microseconds (CUDA events, back-to-back
    launches). `repeat` timed calls; by default more for small batches, whose
    launches are short."""
    from cupyx.profiler import benchmark

    n = repeat if repeat is not None else (100 if batch <= 4 else 20)
    r = benchmark(fn, n_repeat=n, n_warmup=warmup)
    return float(np.median(r.gpu_times[0]) * 1e6)


def replay_us(fn: Launch) -> float:
    """Device time of one call of fn, from CUDA-graph replays (events if capture fails)."""
    return time_gpu(fn, repeat=20, max_seconds=0.1, capture=cupy_graph).us


def time_gpu(launch: Launch, *, repeat: int, max_seconds: float, capture: Optional[Capture]) -> Timing:
    """Median CUDA-event time of `launch` (cupyx.profiler.benchmark), and of a
    CUDA graph of k launches replayed (divided by k) when `capture` is given."""
    from cupyx.profiler import benchmark

    r = benchmark(launch, n_repeat=repeat, n_warmup=min(10, repeat), max_duration=max_seconds, name="launch")
    events_us = float(np.median(r.gpu_times[0]) * 1e6)
    host_us = float(np.median(r.cpu_times) * 1e6)
    timing = Timing(events_us, "events", events_us, host_us)
    if capture is None:
        return timing
    k = max(1, min(MAX_GRAPH_LAUNCHES, math.ceil(GRAPH_TARGET_US / max(events_us, 1e-3))))
    try:
        replay = capture(launch, k)
        g = benchmark(replay, n_repeat=repeat, n_warmup=2, max_duration=max_seconds, name="replay")
    except Exception as exc:
        timing.note = f"graph capture failed: {one_line(exc)}"
        return timing
    graph_us = float(np.median(g.gpu_times[0]) * 1e6) / k
    return Timing(graph_us, "graph", events_us, host_us, graph_us, k)


def time_cold(launch: Launch, prepare: Launch, *, repeat: int, max_seconds: float,
              capture: Optional[Capture]) -> Timing:
    """time_gpu of `launch` with `prepare` run before every call (an L2 flush,
    say), net of `prepare`'s own time: [prepare, launch] minus [prepare].
    Where that difference is not positive (a kernel of a few us under the
    spread of a ~50 us flush), the launch's hot time stands in: a lower bound
    on the cold one, where 0 would make it every tuner's pick."""
    both = time_gpu(lambda: (prepare(), launch()), repeat=repeat, max_seconds=max_seconds, capture=capture)
    alone = time_gpu(prepare, repeat=repeat, max_seconds=max_seconds, capture=capture)
    if both.us <= alone.us:
        hot = time_gpu(launch, repeat=repeat, max_seconds=max_seconds, capture=capture)
        note = f"cold time lost in the preparation's spread ({both.us:.1f} - {alone.us:.1f} us): hot time given"
        return replace(hot, note="; ".join(n for n in (hot.note, note) if n))
    return replace(both, us=max(both.us - alone.us, 0.0), events_us=max(both.events_us - alone.events_us, 0.0),
                   graph_us=None if both.graph_us is None or alone.graph_us is None
                   else max(both.graph_us - alone.graph_us, 0.0),
                   note="; ".join(n for n in (both.note, alone.note) if n))


def l2_scratch_floats(l2_bytes: Optional[int]) -> int:
    """float32 elements of a scratch buffer for l2_flush: twice the device's L2
    (`l2_bytes`; 64 MB assumed where the device does not say)."""
    return 2 * (l2_bytes or 64 << 20) // 4


def l2_flush(scratch: Any, *inputs: Any) -> Launch:
    """A `prepare` for time_cold that sets a layer up as a network would:
    `scratch` (a CuPy array or torch tensor of l2_scratch_floats floats) is
    overwritten, which evicts the layer's code and weights, then each input
    (None skipped) is read back, as the layer before would have left it."""
    def prepare() -> None:
        if hasattr(scratch, "fill_"):  # torch
            scratch.fill_(1.0)
        else:                          # CuPy (or NumPy)
            scratch.fill(1.0)
        for t in inputs:
            if t is not None:
                t.max()
    return prepare


def cupy_graph(launch: Launch, k: int) -> Launch:
    """Capture k launches on a CuPy stream. Every allocation made during the
    capture is kept alive with the graph, whose replays reuse those addresses."""
    import cupy

    pool = cupy.get_default_memory_pool()
    held: List[Any] = []

    def alloc(size: int) -> Any:
        mem = pool.malloc(size)
        held.append(mem)
        return mem

    stream = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(alloc), stream:
        stream.begin_capture()
        try:
            for _ in range(k):
                launch()
        finally:
            graph = stream.end_capture()

    def replay() -> None:
        graph.launch()

    replay.held = held  # type: ignore[attr-defined]
    return replay


def torch_graph(launch: Launch, k: int) -> Launch:
    """Capture k launches with torch.cuda.CUDAGraph (its own memory pool)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs ask before capture
        for _ in range(3):
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            launch()
    return graph.replay
