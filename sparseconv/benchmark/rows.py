"""The record of one measured row of `sparseconv bench` (one layer, sparsity and
batch size, timed by every method), and the performance floor beside it.

A leaf of the benchmark package: the shapes and the timing record only."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from ..shapes import ConvShape
from ..timing import Timing

BASELINES = ("cudnn_fp32", "cudnn_tf32", "cublas_gemm", "cusparse_spmm")
# sparseconv's two kernel families (--paths): "code", the weight-specialised
# kernel (weights in the instruction stream), and "table", the weight table
# (sparseconv.table). A row's "sparseconv" figure is the faster of those timed.
PATHS = ("code", "table")
TORCH_BASELINES = ("cudnn_fp32", "cudnn_tf32")
# The H100 figures of ../shared/DESIGN.md's performance model.
PEAK_FP32_FLOPS = 66.9e12
PEAK_BYTES_PER_S = 3.0e12
MAX_REL_L2 = 1e-4


class BenchError(RuntimeError):
    """The bench cannot run here (no GPU, a missing optional package)."""


def floor_us(shape: ConvShape, batch: int, nnz: int) -> float:
    """DESIGN.md's floor: max(FMA time at fp32 peak, input+output bytes at HBM speed), in us."""
    flops = 2.0 * nnz * batch * shape.out_h * shape.out_w
    nbytes = 4.0 * batch * (shape.in_channels * shape.in_h * shape.in_w
                            + shape.out_channels * shape.out_h * shape.out_w)
    return 1e6 * max(flops / PEAK_FP32_FLOPS, nbytes / PEAK_BYTES_PER_S)


@dataclass(frozen=True)
class Check:
    """One output compared with a reference: relative L2 and whether it is within MAX_REL_L2.
    rel_l2 None with an error: the method could not run."""

    ref: str
    rel_l2: Optional[float]
    ok: bool
    error: str = ""

    @staticmethod
    def of(ref: str, rel_l2: float) -> "Check":
        return Check(ref, rel_l2, bool(rel_l2 <= MAX_REL_L2))

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = dict(ref=self.ref, rel_l2=self.rel_l2, ok=self.ok)
        if self.error:
            d["error"] = self.error
        return d


@dataclass(frozen=True)
class BenchRow:
    """One (layer, sparsity, batch). The identity fields are fixed at creation; the
    per-method measurements fill in through record(), add_check() and fail().
    sparsity None: the model's own weights."""

    layer: str
    shape: ConvShape
    batch: int
    sparsity: Optional[float]
    nnz: int
    weights: int
    tiling: Optional[str]
    floor_us: float
    us: Dict[str, float] = field(default_factory=dict)             # the figure compared: graph, else events
    timing: Dict[str, str] = field(default_factory=dict)           # "graph" or "events"
    events_us: Dict[str, float] = field(default_factory=dict)
    graph_us: Dict[str, Optional[float]] = field(default_factory=dict)
    graph_launches: Dict[str, int] = field(default_factory=dict)
    timing_notes: Dict[str, str] = field(default_factory=dict)
    host_times_us: Dict[str, float] = field(default_factory=dict)  # host-side latency per call
    check: Dict[str, Check] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)
    path: Dict[str, str] = field(default_factory=dict)             # "sparseconv" -> the path its figure is from
    _timings: Dict[str, Timing] = field(default_factory=dict, repr=False)

    @property
    def weight_sparsity(self) -> float:
        return 1.0 - self.nnz / self.weights

    @property
    def host_us(self) -> Optional[float]:
        """Host-side latency of the sparseconv call."""
        return self.host_times_us.get("sparseconv")

    def record(self, method: str, t: Timing) -> None:
        self.us[method] = t.us
        self.timing[method] = t.method
        self.events_us[method] = t.events_us
        self.graph_us[method] = t.graph_us
        self.graph_launches[method] = t.graph_launches
        self.host_times_us[method] = t.host_us
        self._timings[method] = t
        if t.note:
            self.timing_notes[method] = t.note

    def take_fastest(self, paths: Sequence[str] = PATHS) -> Optional[str]:
        """Record the fastest of the `paths` timed in this row as "sparseconv" (what
        routing between the two families runs) and return its name; None if none
        was timed. Compared like with like (pair_us)."""
        timed = [p for p in paths if p in self.us]
        if not timed:
            return None
        best = timed[0]
        for p in timed[1:]:
            pair = self.pair_us(p, best)
            if pair is not None and pair[0] < pair[1]:
                best = p
        self.record("sparseconv", self._timings[best])
        self.path["sparseconv"] = best
        return best

    def add_check(self, method: str, check: Check) -> None:
        self.check[method] = check

    def fail(self, method: str, error: str) -> None:
        self.errors[method] = error

    def pair_us(self, a: str, b: str) -> Optional[Tuple[float, float, str]]:
        """Times of a and b by the same method: graph replays when both have one, else events."""
        if a not in self.us or b not in self.us:
            return None
        ga, gb = self.graph_us.get(a), self.graph_us.get(b)
        if ga is not None and gb is not None:
            return ga, gb, "graph"
        return self.events_us[a], self.events_us[b], "events"

    @property
    def speedup(self) -> Dict[str, float]:
        """baseline time / sparseconv time, per baseline present in the row."""
        out = {}
        for b in self.us:
            if b in BASELINES:
                pair = self.pair_us(b, "sparseconv")
                if pair is not None:
                    out[b] = pair[0] / pair[1]
        return out

    @property
    def checks_ok(self) -> bool:
        return all(c.ok for c in self.check.values())

    def to_dict(self) -> Dict[str, Any]:
        """The JSON row (keys as before the row became a record)."""
        return dict(layer=self.layer, shape=self.shape.describe(), batch=self.batch, sparsity=self.sparsity,
                    weight_sparsity=self.weight_sparsity, nnz=self.nnz, weights=self.weights, tiling=self.tiling,
                    floor_us=self.floor_us, host_us=self.host_us, us=dict(self.us), timing=dict(self.timing),
                    events_us=dict(self.events_us), graph_us=dict(self.graph_us),
                    graph_launches=dict(self.graph_launches), timing_notes=dict(self.timing_notes),
                    speedup=self.speedup, check={m: c.to_dict() for m, c in self.check.items()},
                    errors=dict(self.errors), path=self.path.get("sparseconv"))
