"""Routing by measurement, shared by sparsify (torch.py) and the ONNX runner.

A layer is timed through its sparseconv kernel and through cuDNN strict fp32
at the batch sizes the user names, and at small batches through the weight
table (sparseconv.table) where the caller has one; each batch size then runs
the fastest path.
A route is [(up to batch, path), ...] ascending, the last entry for any batch.
The timing itself belongs to the caller (torch graphs for FusedConv2d, CuPy
graphs for the runner's kernels): here only the choice and its text.
"""
from __future__ import annotations

import math
from collections import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from .tilings import ANY_BATCH

SPARSE, DENSE, TABLE = "sparseconv", "dense", "table"
Route = List[Tuple[int, str]]


def route_from_choices(choices: Sequence[Tuple[int, str]]) -> Route:
    """[(measured batch, faster path), ...] ascending -> a route [(up to batch,
    path), ...]: a batch between two measured ones takes the path of the
    nearer one (geometric midpoint), the last entry serves any larger batch,
    neighbours with the same path merge."""
    route: Route = []
    for j, (b, path) in enumerate(choices):
        up_to = ANY_BATCH if j == len(choices) - 1 else int(math.sqrt(b * choices[j + 1][0]))
        if route and route[-1][1] == path:
            route[-1] = (up_to, path)
        else:
            route.append((up_to, path))
    return route


def path_for(route: Sequence[Tuple[int, str]], batch: int) -> str:
    """The path a batch of this size takes; an empty route: the kernel."""
    for up_to, path in route:
        if batch <= up_to:
            return path
    return SPARSE


@dataclass(frozen=True)
class RouteChoice:
    """One layer's measured route: the times behind it, and the route."""

    route: Tuple[Tuple[int, str], ...]
    times_us: Tuple[Tuple[int, float, float], ...]  # (batch, sparseconv us, cuDNN fp32 us)
    note: str = ""  # how it was timed, where that differs from the usual
    table_us: Tuple[Tuple[int, float], ...] = ()  # (batch, weight table us) where it was timed

    def path(self, batch: int) -> str:
        return path_for(self.route, batch)

    @property
    def action(self) -> str:
        """"sparseconv", "dense", or "mixed" (the path depends on the batch)."""
        paths = {p for _, p in self.route}
        return "mixed" if len(paths) > 1 else paths.pop()

    def describe(self) -> str:
        table = dict(self.table_us)
        text = "; ".join(f"batch {b}: sparseconv {s:.1f} us, "
                         + (f"table {table[b]:.1f} us, " if b in table else "")
                         + f"cuDNN fp32 {d:.1f} us" for b, s, d in self.times_us)
        return f"{text} ({self.note})" if self.note else text

    def describe_route(self) -> str:
        return ", ".join(f"<={u}: {p}" if u < ANY_BATCH else f"else {p}" for u, p in self.route)


def choose_route(time_both: Callable[[int], Tuple[float, float]], batches: Sequence[int],
                 note: str = "", time_table: Optional[Callable[[int], Optional[float]]] = None) -> RouteChoice:
    """Time both paths at each batch size (time_both(batch) -> (sparseconv us,
    cuDNN fp32 us), measured alike), and the weight table where time_table
    (batch) gives a time (None: not timed at that batch); route each batch
    to the fastest. A tie keeps the kernel, then the table."""
    times, table_times = [], []
    choices = []
    for b in sorted(set(int(b) for b in batches)):
        sparse, dense = time_both(b)
        times.append((b, sparse, dense))
        candidates = [(sparse, SPARSE), (dense, DENSE)]
        table = time_table(b) if time_table is not None else None
        if table is not None:
            table_times.append((b, table))
            candidates.insert(1, (table, TABLE))
        best = min(t for t, _ in candidates)
        choices.append((b, next(path for t, path in candidates if t == best)))
    return RouteChoice(tuple(route_from_choices(choices)), tuple(times), note, tuple(table_times))


def timing_label(table: bool) -> str:
    """What routing times, as its progress line says (sparseconv.progress)."""
    return f"timing {'sparseconv, table' if table else 'sparseconv'} vs cuDNN fp32"


def check_route_batches(route_batches: object, who: str) -> None:
    """None, or a sequence (list, tuple, range) of positive int batch sizes; a
    ValueError that says so otherwise. A one-shot iterable is refused: the
    check would use it up before the routing reads it."""
    if route_batches is not None and not (
            isinstance(route_batches, abc.Sequence) and not isinstance(route_batches, (str, bytes)) and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in route_batches)):
        raise ValueError(f"{who}: route_batches must be a list or tuple of positive batch sizes "
                         f"(e.g. (1, 64)) or None, got {route_batches!r}")
