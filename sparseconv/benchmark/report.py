"""What `sparseconv bench` prints and writes: the result record, geomean
speedups, the summary by layer class, the markdown table and the sweep plot.
Pure (CPU-tested); matplotlib only for the plot."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..shapes import ConvShape
from .output import write_atomically
from .rows import BASELINES, PATHS, BenchError, BenchRow

LABELS = {"sparseconv": "sparseconv", "code": "code", "table": "table", "cudnn_fp32": "cuDNN fp32",
          "cudnn_tf32": "cuDNN TF32", "cublas_gemm": "cuBLAS im2col+GEMM", "cusparse_spmm": "cuSPARSE im2col+SpMM"}
SHORT = {"sparseconv": "sparseconv", "code": "code", "table": "table", "cudnn_fp32": "fp32", "cudnn_tf32": "TF32",
         "cublas_gemm": "GEMM", "cusparse_spmm": "SpMM"}
# The layer classes of the --model summary, in print order (issue 12: each class calls for its own kernel).
# The order of the summary; every class layer_class returns is here, so no layer drops out of it
LAYER_CLASSES = ("stem", "3x3", "strided 3x3", "1x1", "strided 1x1", "depthwise", "grouped", "other")
CLASS_METHODS = ("sparseconv", "cudnn_fp32", "cudnn_tf32")


@dataclass
class BenchResult:
    meta: Dict[str, Any]
    rows: List[BenchRow]
    notes: List[str] = field(default_factory=list)

    @property
    def geomeans(self) -> List[Dict[str, Any]]:
        return geomean_speedups(self.rows)

    @property
    def classes(self) -> List[Dict[str, Any]]:
        """The summary by layer class, for a model's own weights (--model); empty otherwise."""
        if not self.rows or any(r.sparsity is not None for r in self.rows):
            return []
        return class_summary(self.rows)

    def to_dict(self) -> Dict[str, Any]:
        doc = {"meta": self.meta, "rows": [r.to_dict() for r in self.rows], "geomeans": self.geomeans,
               "notes": self.notes}
        classes = self.classes
        if classes:
            doc["classes"] = classes
        return doc


# --------------------------------------------------------------------------- aggregates

def geomean(values: Sequence[float]) -> float:
    vals = [float(v) for v in values]
    if not vals or any(not v > 0 for v in vals):
        raise ValueError(f"geomean needs positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def geomean_speedups(rows: Sequence[BenchRow]) -> List[Dict[str, Any]]:
    """Geomean speedup over each baseline per (sparsity, batch)."""
    groups: Dict[Tuple[Any, int], List[BenchRow]] = {}
    for r in rows:
        groups.setdefault((r.sparsity, r.batch), []).append(r)
    out = []
    for (sparsity, batch) in sorted(groups, key=lambda k: (-1.0 if k[0] is None else k[0], k[1])):
        sel = [r.speedup for r in groups[(sparsity, batch)]]
        for b in BASELINES:
            vals = [s[b] for s in sel if b in s]
            if vals:
                out.append(dict(sparsity=sparsity, batch=batch, baseline=b, geomean=geomean(vals),
                                layers=len(vals), slower_layers=sum(v < 1.0 for v in vals)))
    return out


def layer_class(shape: ConvShape, first: bool) -> str:
    """stem: the model's first conv or one reading <= 4 channels; depthwise:
    one input channel a group (MobileNet's), any kernel or stride; grouped:
    other convs of several groups (ResNeXt's); 3x3: any square k x k > 1 at
    stride 1; strided 3x3: the same at a larger stride; 1x1 at stride 1;
    strided 1x1 (downsample); other (e.g. 1 x k)."""
    if first or shape.in_channels <= 4:
        return "stem"
    if shape.groups > 1:
        return "depthwise" if shape.c_per_group == 1 else "grouped"
    if shape.kernel_h == shape.kernel_w == 1:
        return "1x1" if shape.stride == (1, 1) else "strided 1x1"
    if shape.kernel_h == shape.kernel_w:
        return "3x3" if shape.stride == (1, 1) else "strided 3x3"
    return "other"


def class_summary(rows: Sequence[BenchRow]) -> List[Dict[str, Any]]:
    """Per (batch, layer class): summed sparseconv, cuDNN fp32, cuDNN TF32 and
    floor times, and the ratios of the sums. A method's sum is None when a layer
    of the class lacks its time (not timed, or failed), so no sum is partial.
    The first row's layer is the model's first conv (rows keep the model order)."""
    if not rows:
        return []
    first = rows[0].layer
    groups: Dict[Tuple[int, str], List[BenchRow]] = {}
    for r in rows:
        groups.setdefault((r.batch, layer_class(r.shape, r.layer == first)), []).append(r)
    out = []
    for batch in sorted({b for b, _ in groups}):
        for cls in LAYER_CLASSES:
            sel = groups.get((batch, cls))
            if not sel:
                continue
            sums: Dict[str, Optional[float]] = {
                m: sum(r.us[m] for r in sel) if all(m in r.us for r in sel) else None for m in CLASS_METHODS}
            floor = sum(r.floor_us for r in sel)
            sc = sums["sparseconv"]
            out.append(dict(batch=batch, layer_class=cls, layers=len(sel),
                            on_table=sum(r.path.get("sparseconv") == "table" for r in sel), sparseconv_us=sc,
                            cudnn_fp32_us=sums["cudnn_fp32"], cudnn_tf32_us=sums["cudnn_tf32"], floor_us=floor,
                            x_cudnn_fp32=_ratio(sums["cudnn_fp32"], sc), x_cudnn_tf32=_ratio(sums["cudnn_tf32"], sc),
                            per_floor=_ratio(sc, floor)))
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------- formatting

def _fmt_us(row: BenchRow, method: str) -> str:
    if method not in row.us:
        return "err" if method in row.errors else "-"
    return f"{row.us[method]:.1f}" + ("" if row.timing[method] == "graph" else "*")


def check_cell(row: BenchRow) -> str:
    bad = [f"{m} {c.rel_l2:.1e}" if c.rel_l2 is not None else f"{m} error"
           for m, c in row.check.items() if not c.ok]
    if bad:
        return "FAIL " + "; ".join(bad)
    return "ok" if "sparseconv" in row.check or "table" in row.check else "sparseconv unchecked"


def format_table(result: BenchResult) -> str:
    """Markdown: environment line, one row per (layer, sparsity, batch), geomeans,
    the summary by layer class (--model), notes."""
    meta, rows = result.meta, result.rows
    baselines = [b for b in BASELINES if any(b in r.us or b in r.errors for r in rows)]
    # Both paths' own columns only when the table was timed: else "sparseconv" is the code's time.
    paths = list(PATHS) if any("table" in r.us or "table" in r.errors for r in rows) else []
    lines = [f"# {meta.get('device', '?')}, {meta.get('date', '?')}: median kernel time in us; "
             f"x = baseline time / sparseconv time (above 1: sparseconv faster)", ""]
    head = (["layer", "N", "sparsity", "sparseconv"] + [LABELS[p] for p in paths] + [LABELS[b] for b in baselines]
            + [f"x {SHORT[b]}" for b in baselines] + ["floor", "/floor", "host call", "check"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = "model" if r.sparsity is None else f"{r.sparsity:g}"
        speedup = r.speedup
        cells = [r.layer, str(r.batch), sp, _fmt_us(r, "sparseconv")]
        cells += [_fmt_us(r, p) for p in paths]
        cells += [_fmt_us(r, b) for b in baselines]
        cells += [f"{speedup[b]:.2f}" if b in speedup else "-" for b in baselines]
        sc = r.us.get("sparseconv")
        cells += [f"{r.floor_us:.1f}", f"{sc / r.floor_us:.1f}" if sc else "-",
                  f"{r.host_us:.1f}" if r.host_us is not None else "-", check_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    by_group: Dict[Tuple[Any, int], List[str]] = {}
    for g in result.geomeans:
        by_group.setdefault((g["sparsity"], g["batch"]), []).append(
            f"{LABELS[g['baseline']]} {g['geomean']:.2f}x ({g['slower_layers']} of {g['layers']} layers slower)")
    for (sparsity, batch), parts in by_group.items():
        sp = "model weights" if sparsity is None else f"sparsity {sparsity:g}"
        lines.append(f"batch {batch}, {sp}: geomean speedup over " + ", ".join(parts))
    lines.append("")
    classes = result.classes
    if classes:
        lines += format_classes(classes) + [""]
    if paths:
        lines.append("sparseconv: the faster of its two paths in the row, code (weights in the instructions) "
                     "and table (the weight table, sparseconv.table), as routing picks between them.")
    lines.append("Times without * are CUDA-graph replays (launch overhead excluded); * marks calls timed "
                 "one by one with CUDA events (host launch gap included). Each x compares like with like: "
                 "graph replays when both sides have one, else events for both. floor: DESIGN.md's "
                 "performance model; host call: host-side latency of the sparseconv call.")
    lines += [f"Note: {n}" for n in result.notes]
    return "\n".join(lines)


def format_classes(classes: Sequence[Dict[str, Any]]) -> List[str]:
    """The summary by layer class as markdown lines."""
    def us(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1f}"

    def x(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["Summed by layer class (us; x = summed cuDNN time / summed sparseconv time; stem: the first conv "
             "or C <= 4; 3x3: any k x k > 1 at stride 1, strided 3x3 at a larger one; - : a layer of the class "
             "has no time for it):", "",
             "| class | N | layers (on the table) | sparseconv | cuDNN fp32 | cuDNN TF32 | floor | x fp32 | x TF32 "
             "| /floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in classes:
        on_table = f" ({c['on_table']})" if c.get("on_table") else ""
        lines.append(f"| {c['layer_class']} | {c['batch']} | {c['layers']}{on_table} | {us(c['sparseconv_us'])} | "
                     f"{us(c['cudnn_fp32_us'])} | {us(c['cudnn_tf32_us'])} | {c['floor_us']:.1f} | "
                     f"{x(c['x_cudnn_fp32'])} | {x(c['x_cudnn_tf32'])} | {x(c['per_floor'])} |")
    return lines


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise BenchError("the PNG plot needs matplotlib: pip install 'sparseconv[bench]' "
                         "(or pip install matplotlib)") from None
    return matplotlib


# The sweep plot puts these side by side when the run timed them: exact cuDNN and what PyTorch runs by default.
SWEEP_BASELINES = ("cudnn_fp32", "cudnn_tf32")


def plot_sweep(result: BenchResult, path: str) -> Tuple[str, ...]:
    """PNG like the paper's Fig. 11 (sweep_figure); returns the baselines plotted."""
    fig, baselines = sweep_figure(result.to_dict())  # first: it says so when matplotlib is missing
    import matplotlib.pyplot as plt

    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)
    return baselines


def sweep_figure(doc: Mapping[str, Any]) -> Tuple[Any, Tuple[str, ...]]:
    """Speedup against sparsity, one line per layer: a row of panels per batch
    size, cuDNN fp32 and cuDNN TF32 side by side in each row on one y scale
    (whichever of them the run timed; else the first baseline it has).
    `doc` is a result as `bench --json` writes it (BenchResult.to_dict), so a
    saved run can be drawn again (bench/replot_sweep.py). Returns the
    matplotlib figure (Agg backend) and the baselines plotted."""
    mpl = require_matplotlib()
    mpl.use("Agg")
    import matplotlib.pyplot as plt  # optional extra: imported only when a plot is asked for
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = [r for r in doc["rows"] if r["sparsity"] is not None]
    if len({r["sparsity"] for r in rows}) < 2:
        raise ValueError("the plot needs a sweep: at least two sparsities of random masks")
    present = [b for b in BASELINES if any(b in r["speedup"] for r in rows)]
    if not present:
        raise ValueError("the plot needs at least one baseline timed next to sparseconv")
    baselines = tuple(b for b in SWEEP_BASELINES if b in present) or (present[0],)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(batches), len(baselines), figsize=(5.2 * len(baselines), 3.9 * len(batches)),
                             squeeze=False, sharey="row", constrained_layout=True)
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    for row_axes, batch in zip(axes, batches):
        for ax, baseline in zip(row_axes, baselines):
            for name in layers:
                pts = sorted((r["sparsity"], r["speedup"][baseline]) for r in rows
                             if r["layer"] == name and r["batch"] == batch and baseline in r["speedup"])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("weight sparsity")
            ax.set_ylabel("speedup (higher is better)")
            ax.set_title(f"over {LABELS[baseline]}, batch {batch}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="best")
    # two short lines: a long one is cut off when the figure has a single column
    meta = doc.get("meta", {})
    fig.suptitle(f"sparseconv speedup against weight sparsity\n{meta.get('device', '?')}, "
                 f"{str(meta.get('date', '?'))[:10]}", fontsize=10)
    return fig, baselines
