"""`sparseconv bench`, the library part: time sparseconv kernels beside the
dense and sparse libraries a user would pick instead, on one GPU, in one run.

For each layer, sparsity and batch size it times:
  * sparseconv       the weight-specialised kernel (`compile_conv2d`);
  * cudnn_fp32       torch.nn.functional.conv2d, TF32 off (exact fp32);
  * cudnn_tf32       the same with TF32 on (PyTorch's default for convs);
  * cublas_gemm      im2col + cupy.matmul (cuBLAS SGEMM), im2col included;
  * cusparse_spmm    im2col + cuSPARSE SpMM with the weight as CSR, im2col included.

Each figure is the median of CUDA-event timings (`cupyx.profiler.benchmark`).
Where the work can be captured, it is a CUDA graph of k back-to-back launches
replayed and divided by k ("graph": launch overhead excluded); otherwise the
events bracket each Python call ("events": the host's launch gap included).
Each row says which. The host-side latency of the sparseconv call is reported
separately, and the performance floor of ../shared/DESIGN.md beside it.

Inputs are fresh random normals. The sparseconv output is checked against
cuDNN fp32 (or a float64 im2col reference without torch) at every batch, and
the im2col baselines against the float64 reference once per layer and
weights, so a wrong kernel or baseline cannot produce a flattering ratio.

torch and matplotlib are optional: without torch the cuDNN columns are absent,
and only the PNG plot needs matplotlib."""
from __future__ import annotations

import contextlib
import datetime
import fnmatch
import math
import os
import platform
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__
from .dense import columns_to_nchw, conv2d_im2col, im2col, torch_flags  # noqa: F401 (re-exported)
from .shapes import ConvShape
from .timing import Capture, Launch, Timing, cupy_graph, one_line, time_gpu, torch_graph  # noqa: F401

SWEEP = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
BASELINES = ("cudnn_fp32", "cudnn_tf32", "cublas_gemm", "cusparse_spmm")
TORCH_BASELINES = ("cudnn_fp32", "cudnn_tf32")
LABELS = {"sparseconv": "sparseconv", "cudnn_fp32": "cuDNN fp32", "cudnn_tf32": "cuDNN TF32",
          "cublas_gemm": "cuBLAS im2col+GEMM", "cusparse_spmm": "cuSPARSE im2col+SpMM"}
SHORT = {"sparseconv": "sparseconv", "cudnn_fp32": "fp32", "cudnn_tf32": "TF32", "cublas_gemm": "GEMM",
         "cusparse_spmm": "SpMM"}
# The H100 figures of ../shared/DESIGN.md's performance model.
PEAK_FP32_FLOPS = 66.9e12
PEAK_BYTES_PER_S = 3.0e12
MAX_REL_L2 = 1e-4
CHECK_BATCH = 2  # the im2col baselines are checked on this many images (exercises the batch index)



class BenchError(RuntimeError):
    """The bench cannot run here (no GPU, a missing optional package)."""


@dataclass(frozen=True)
class BenchLayer:
    """A layer to time. weight None: random unstructured masks at each requested
    sparsity; otherwise a model's own weights (and bias), timed as they are."""

    name: str
    shape: ConvShape
    weight: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None


@dataclass
class BenchConfig:
    batches: Sequence[int] = (1, 64)
    sparsities: Sequence[float] = (0.9,)
    baselines: Sequence[str] = BASELINES
    repeat: int = 50                # timed launches (or graph replays) per figure
    max_seconds: float = 1.0        # cap on each figure's timing loop
    seed: int = 0
    cache_dir: Optional[str] = None
    graphs: bool = True             # also time CUDA graph replays
    cudnn_benchmark: bool = True    # let cuDNN autotune: the strongest dense baseline
    jobs: Optional[int] = None      # parallel kernel builds


@dataclass
class BenchResult:
    meta: Dict[str, Any]
    rows: List[Dict[str, Any]]
    notes: List[str] = field(default_factory=list)

    @property
    def geomeans(self) -> List[Dict[str, Any]]:
        return geomean_speedups(self.rows)

    def to_dict(self) -> Dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "geomeans": self.geomeans, "notes": self.notes}


# --------------------------------------------------------------------------- pure helpers (CPU-tested)

def floor_us(shape: ConvShape, batch: int, nnz: int) -> float:
    """DESIGN.md's floor: max(FMA time at fp32 peak, input+output bytes at HBM speed), in us."""
    flops = 2.0 * nnz * batch * shape.out_h * shape.out_w
    nbytes = 4.0 * batch * (shape.in_channels * shape.in_h * shape.in_w
                            + shape.out_channels * shape.out_h * shape.out_w)
    return 1e6 * max(flops / PEAK_FP32_FLOPS, nbytes / PEAK_BYTES_PER_S)


def geomean(values: Sequence[float]) -> float:
    vals = [float(v) for v in values]
    if not vals or any(not v > 0 for v in vals):
        raise ValueError(f"geomean needs positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def pruned_weight(rng: np.random.Generator, shape: Tuple[int, ...], sparsity: float) -> np.ndarray:
    """Random normal weights with a `sparsity` fraction set to exactly 0 (unstructured)."""
    w = rng.standard_normal(shape).astype(np.float32)
    w[rng.random(shape) < sparsity] = 0.0
    return w


def layer_weight(layer: BenchLayer, sparsity: Optional[float], seed: int) -> np.ndarray:
    """The layer's own weight, or a random pruned one seeded by (seed, name, sparsity),
    so a layer gets the same weights whichever other layers are selected."""
    if layer.weight is not None:
        return np.ascontiguousarray(layer.weight, dtype=np.float32)
    assert sparsity is not None
    rng = np.random.default_rng([seed, zlib.crc32(layer.name.encode()), int(round(sparsity * 10000))])
    return pruned_weight(rng, layer.shape.weight_shape, sparsity)


def parse_sparsities(text: str) -> Tuple[float, ...]:
    """'0.9' or '0.5,0.9' -> floats in [0, 1)."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"sparsity must be a number or a comma list like 0.5,0.9, got {text!r}") from None
    if not values or any(not 0.0 <= v < 1.0 for v in values):
        raise ValueError(f"each sparsity must be in [0, 1), got {text!r}")
    return tuple(sorted(set(values)))


def parse_baselines(text: str) -> Tuple[str, ...]:
    """'cudnn_fp32,cublas_gemm', 'all' or 'none' -> names in BASELINES order."""
    if text.strip() == "all":
        return BASELINES
    names = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise ValueError(f"unknown baseline(s) {', '.join(bad)}; choose from {', '.join(BASELINES)}, all or none")
    return tuple(b for b in BASELINES if b in names)


def select_layers(layers: Sequence[BenchLayer], globs: str) -> List[BenchLayer]:
    """The layers whose name matches one of the comma-separated globs."""
    patterns = [g.strip() for g in globs.split(",") if g.strip()] or ["*"]
    chosen = [layer for layer in layers if any(fnmatch.fnmatchcase(layer.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(layer.name for layer in layers)
        raise ValueError(f"--layers {globs!r} matches no layer; the layers are: {names}")
    return chosen


def benchmark_layers() -> List[BenchLayer]:
    """The 10 benchmark layers (sparseconv/data/operators.json)."""
    from .operators import benchmark_operators

    return [BenchLayer(op.name, op.shape) for op in benchmark_operators()]


def model_bench_layers(model: Any) -> List[BenchLayer]:
    """A loaded model's conv layers (sparseconv.model.PrunedModel), with their own weights."""
    return [BenchLayer(layer.name, layer.shape, layer.weight, layer.bias) for layer in model.layers]


def rel_l2(y: Any, ref: Any, xp: Any = np) -> float:
    diff = float(xp.linalg.norm((xp.asarray(y, dtype=xp.float64) - ref).ravel()))
    den = float(xp.linalg.norm(xp.asarray(ref, dtype=xp.float64).ravel()))
    return (0.0 if diff == 0.0 else float("inf")) if den == 0.0 else diff / den


def _pair_us(row: Dict[str, Any], a: str, b: str) -> Optional[Tuple[float, float, str]]:
    """Times of a and b by the same method: graph replays when both have one, else events."""
    if a not in row["us"] or b not in row["us"]:
        return None
    ga, gb = row["graph_us"].get(a), row["graph_us"].get(b)
    if ga is not None and gb is not None:
        return ga, gb, "graph"
    return row["events_us"][a], row["events_us"][b], "events"


def speedups(row: Dict[str, Any]) -> Dict[str, float]:
    """baseline time / sparseconv time, per baseline present in the row."""
    out = {}
    for b in row["us"]:
        if b != "sparseconv":
            pair = _pair_us(row, b, "sparseconv")
            if pair is not None:
                out[b] = pair[0] / pair[1]
    return out


def geomean_speedups(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Geomean speedup over each baseline per (sparsity, batch)."""
    groups: Dict[Tuple[Any, int], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["sparsity"], r["batch"]), []).append(r)
    out = []
    for (sparsity, batch) in sorted(groups, key=lambda k: (-1.0 if k[0] is None else k[0], k[1])):
        sel = groups[(sparsity, batch)]
        for b in BASELINES:
            vals = [r["speedup"][b] for r in sel if b in r["speedup"]]
            if vals:
                out.append(dict(sparsity=sparsity, batch=batch, baseline=b, geomean=geomean(vals),
                                layers=len(vals), slower_layers=sum(v < 1.0 for v in vals)))
    return out


# --------------------------------------------------------------------------- formatting

def _fmt_us(row: Dict[str, Any], method: str) -> str:
    if method not in row["us"]:
        return "err" if method in row.get("errors", {}) else "-"
    return f"{row['us'][method]:.1f}" + ("" if row["timing"][method] == "graph" else "*")


def _check_cell(row: Dict[str, Any]) -> str:
    bad = [f"{m} {c['rel_l2']:.1e}" if c["rel_l2"] is not None else f"{m} error"
           for m, c in row["check"].items() if not c["ok"]]
    if bad:
        return "FAIL " + "; ".join(bad)
    return "ok" if "sparseconv" in row["check"] else "sparseconv unchecked"


def format_table(result: BenchResult) -> str:
    """Markdown: environment line, one row per (layer, sparsity, batch), geomeans, notes."""
    meta, rows = result.meta, result.rows
    baselines = [b for b in BASELINES if any(b in r["us"] or b in r.get("errors", {}) for r in rows)]
    lines = [f"# {meta.get('device', '?')}, {meta.get('date', '?')}: median kernel time in us; "
             f"x = baseline time / sparseconv time (above 1: sparseconv faster)", ""]
    head = (["layer", "N", "sparsity", "sparseconv"] + [LABELS[b] for b in baselines]
            + [f"x {SHORT[b]}" for b in baselines] + ["floor", "/floor", "host call", "check"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = "model" if r["sparsity"] is None else f"{r['sparsity']:g}"
        cells = [r["layer"], str(r["batch"]), sp, _fmt_us(r, "sparseconv")]
        cells += [_fmt_us(r, b) for b in baselines]
        cells += [f"{r['speedup'][b]:.2f}" if b in r["speedup"] else "-" for b in baselines]
        sc = r["us"].get("sparseconv")
        cells += [f"{r['floor_us']:.1f}", f"{sc / r['floor_us']:.1f}" if sc else "-",
                  f"{r['host_us']:.1f}" if r.get("host_us") is not None else "-", _check_cell(r)]
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
    lines.append("Times without * are CUDA-graph replays (launch overhead excluded); * marks calls timed "
                 "one by one with CUDA events (host launch gap included). Each x compares like with like: "
                 "graph replays when both sides have one, else events for both. floor: DESIGN.md's "
                 "performance model; host call: host-side latency of the sparseconv call.")
    lines += [f"Note: {n}" for n in result.notes]
    return "\n".join(lines)


def plot_sweep(result: BenchResult, path: str, baseline: str = "cudnn_fp32") -> str:
    """PNG like the paper's Fig. 11: speedup over `baseline` against sparsity, one
    line per layer, one subplot per batch. Falls back to another baseline when
    the run has none of `baseline`; returns the baseline plotted."""
    mpl = require_matplotlib()
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = [r for r in result.rows if r["sparsity"] is not None]
    if len({r["sparsity"] for r in rows}) < 2:
        raise ValueError("the plot needs a sweep: at least two sparsities of random masks")
    present = [b for b in BASELINES if any(b in r["speedup"] for r in rows)]
    if not present:
        raise ValueError("the plot needs at least one baseline timed next to sparseconv")
    if baseline not in present:
        baseline = present[0]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    for ax, batch in zip(axes[0], batches):
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
        ax.set_ylabel(f"speedup over {LABELS[baseline]}")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"sparseconv vs {LABELS[baseline]}: {result.meta.get('device', '?')}, "
                 f"{result.meta.get('date', '?')[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return baseline


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise BenchError("the PNG plot needs matplotlib: pip install 'sparseconv[bench]' "
                         "(or pip install matplotlib)") from None
    return matplotlib


# --------------------------------------------------------------------------- GPU side

def require_gpu() -> str:
    """The current CUDA device's name; BenchError when there is none."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no libcuda, CuPy not built for this CUDA
        raise BenchError(f"no CUDA GPU found ({one_line(exc)}); sparseconv bench times kernels on a GPU") \
            from None
    if count < 1:
        raise BenchError("no CUDA GPU found; sparseconv bench times kernels on a GPU")
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def import_torch() -> Tuple[Any, str]:
    """(torch, '') when torch with CUDA is importable, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed, so the cuDNN columns are absent (pip install 'sparseconv[bench]')"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA here, so the cuDNN columns are absent"
    return torch, ""


def environment(torch: Any, device: str) -> Dict[str, Any]:
    import cupy

    def safe(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None

    def cusparse_version() -> Any:
        import cupyx.cusparse

        return cupyx.cusparse.getVersion()

    rt = cupy.cuda.runtime
    env = dict(device=device, compute_capability=cupy.cuda.Device().compute_capability,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               cuda_runtime=safe(rt.runtimeGetVersion), cuda_driver=safe(rt.driverGetVersion),
               cusparse=safe(cusparse_version), cupy=cupy.__version__, sparseconv=__version__,
               python=platform.python_version(), cupy_tf32=os.environ.get("CUPY_TF32", "0"),
               torch=None, torch_cuda=None, cudnn=None)
    if torch is not None:
        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cudnn=safe(torch.backends.cudnn.version))
    return env


_IM2COL_SOURCE = r"""
IDX ii = (IDX)i;
IDX crs = C * R * S;
IDX row, q;
if (fortran) { row = ii % crs; q = ii / crs; } else { row = ii / M; q = ii % M; }
IDX wo = q % Wo, t = q / Wo, ho = t % Ho, n = t / Ho;
IDX s = row % S, r = (row / S) % R, c = row / (R * S);
IDX h = ho * sh - ph + r * dh, w = wo * sw - pw + s * dw;
cols[ii] = (h >= 0 && h < H && w >= 0 && w < W) ? x[((n * C + c) * H + h) * W + w] : (T)0;
"""
_IM2COL_PARAMS = ("C", "H", "W", "R", "S", "Ho", "Wo", "M", "sh", "sw", "ph", "pw", "dh", "dw")
_im2col_kernels: Dict[str, Any] = {}


def _im2col_kernel(index_type: str) -> Any:
    """The im2col ElementwiseKernel with int32 or int64 index math. Scalars do
    not decide CuPy type placeholders, so the index type is spelled out."""
    import cupy

    if index_type not in _im2col_kernels:
        ctype = {"int32": "int", "int64": "long long"}[index_type]
        params = "raw T x, " + ", ".join(f"{index_type} {p}" for p in _IM2COL_PARAMS) + ", bool fortran"
        _im2col_kernels[index_type] = cupy.ElementwiseKernel(
            params, "raw T cols", _IM2COL_SOURCE, f"sparseconv_im2col_{index_type}",
            preamble=f"typedef {ctype} IDX;")
    return _im2col_kernels[index_type]


def gpu_im2col(x: Any, shape: ConvShape, cols: Any) -> None:
    """im2col in one launch into a preallocated (C*R*S, N*Ho*Wo) float32 array,
    C- or F-ordered (cuSPARSE wants F). 32-bit index math when it fits."""
    s = shape
    index_type = "int64" if max(cols.size, x.size) >= 2 ** 31 - 1 else "int32"
    args = [s.in_channels, s.in_h, s.in_w, s.kernel_h, s.kernel_w, s.out_h, s.out_w, cols.shape[1],
            *s.stride, *s.padding, *s.dilation]
    fortran = not cols.flags.c_contiguous
    flat = cols.T.ravel() if fortran else cols.ravel()  # a 1-D view in memory order: cols[i] is offset i
    _im2col_kernel(index_type)(x, *args, fortran, flat, size=cols.size)


def _im2col_runners(shape: ConvShape, w: np.ndarray, x: Any, names: Sequence[str]) -> Dict[str, Tuple[Launch, Launch]]:
    """name -> (launch, NCHW output) for the im2col baselines. Buffers are
    allocated here, outside the timed launch, so the launch is capturable. The
    final (K, N*Ho*Wo) -> NCHW transpose is left out of both (it favours them)."""
    import cupy

    s, n = shape, x.shape[0]
    crs, m = s.c_per_group * s.kernel_h * s.kernel_w * s.groups, n * s.out_h * s.out_w
    out: Dict[str, Tuple[Launch, Launch]] = {}
    if "cublas_gemm" in names:
        cols_c = cupy.empty((crs, m), cupy.float32)
        y_c = cupy.empty((s.groups, s.k_per_group, m), cupy.float32)
        wg = cupy.asarray(w.reshape(s.groups, s.k_per_group, -1))
        if s.groups == 1:  # a plain SGEMM rather than a batch of one
            wg, y_c, cols_view = wg[0], y_c[0], cols_c
        else:
            cols_view = cols_c.reshape(s.groups, -1, m)

        def gemm() -> None:
            gpu_im2col(x, s, cols_c)
            cupy.matmul(wg, cols_view, out=y_c)

        out["cublas_gemm"] = (gemm, lambda: columns_to_nchw(y_c.reshape(s.out_channels, m), n, s))
    if "cusparse_spmm" in names:
        import cupyx.cusparse
        import cupyx.scipy.sparse

        # The grouped weight as one block-diagonal (K, C*R*S) matrix; the CSR skips the zeros.
        dense = np.zeros((s.out_channels, crs), np.float32)
        kg, cg = s.k_per_group, s.c_per_group * s.kernel_h * s.kernel_w
        for g in range(s.groups):
            dense[g * kg:(g + 1) * kg, g * cg:(g + 1) * cg] = w[g * kg:(g + 1) * kg].reshape(kg, cg)
        csr = cupyx.scipy.sparse.csr_matrix(cupy.asarray(dense))
        csr.sum_duplicates()  # spmm wants canonical CSR (sorted, no duplicates)
        cols_f = cupy.empty((crs, m), cupy.float32, order="F")
        y_f = cupy.empty((s.out_channels, m), cupy.float32, order="F")

        def spmm() -> None:
            gpu_im2col(x, s, cols_f)
            cupyx.cusparse.spmm(csr, cols_f, c=y_f)  # what csr @ cols runs, minus its copies and zero fill

        out["cusparse_spmm"] = (spmm, lambda: columns_to_nchw(y_f, n, s))
    return out


def _cudnn_launch(torch: Any, shape: ConvShape, w: np.ndarray, bias: Optional[np.ndarray], x: Any) -> Launch:
    import torch.nn.functional as F

    s = shape
    xt = torch.as_tensor(x, device="cuda")
    wt = torch.tensor(w, device="cuda")  # a copy: a model's weights may be read-only arrays
    bt = torch.tensor(bias, device="cuda") if bias is not None else None
    return lambda: F.conv2d(xt, wt, bt, s.stride, s.padding, s.dilation, s.groups)


def _record(row: Dict[str, Any], method: str, t: Timing) -> None:
    row["us"][method] = t.us
    row["timing"][method] = t.method
    row["events_us"][method] = t.events_us
    row["graph_us"][method] = t.graph_us
    row["graph_launches"][method] = t.graph_launches
    if t.note:
        row["timing_notes"][method] = t.note


def _check(row: Dict[str, Any], method: str, ref_name: str, err: float) -> None:
    row["check"][method] = dict(ref=ref_name, rel_l2=err, ok=bool(err <= MAX_REL_L2))


def _free_gpu(torch: Any) -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _prebuild(layers: Sequence[BenchLayer], weights: Dict[Tuple[str, Any], np.ndarray], config: BenchConfig,
              log: Callable[[str], None]) -> None:
    """Build every kernel in a process pool first (CPU only), so the timing loop
    only loads cached cubins."""
    from .runtime import device_target
    from .parallel import LayerJob, build_many

    shapes = {layer.name: layer.shape for layer in layers}
    jobs = [LayerJob(f"{name}@{sp}", w, shapes[name]) for (name, sp), w in weights.items()]
    log(f"building {len(jobs)} kernels (cached ones are loaded)")
    build_many(jobs, target=device_target(), cache_dir=config.cache_dir, workers=config.jobs, progress=True)


def run_bench(layers: Sequence[BenchLayer], config: BenchConfig, command: str = "",
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> BenchResult:
    """Time every (layer, sparsity, batch) by every method on the current GPU; see the module doc."""
    device = require_gpu()
    import cupy

    from .api import compile_conv2d

    weights: Dict[Tuple[str, Any], np.ndarray] = {}
    for layer in layers:
        for sp in ([None] if layer.weight is not None else config.sparsities):
            weights[(layer.name, sp)] = layer_weight(layer, sp, config.seed)
    _prebuild(layers, weights, config, log)  # before torch starts its threads: the pool forks

    torch, why_not = import_torch()
    notes: List[str] = []
    baselines = list(config.baselines)
    if torch is None:
        if any(b in baselines for b in TORCH_BASELINES):
            notes.append(why_not)
        baselines = [b for b in baselines if b not in TORCH_BASELINES]
    if "cusparse_spmm" in baselines:
        try:
            import cupyx.cusparse  # noqa: F401
        except ImportError as exc:
            notes.append(f"cuSPARSE is not loadable ({one_line(exc)}), so the SpMM column is absent")
            baselines.remove("cusparse_spmm")

    meta = environment(torch, device)
    meta.update(command=command, batches=list(config.batches), baselines=baselines, repeat=config.repeat,
                max_seconds=config.max_seconds, seed=config.seed, cudnn_benchmark=config.cudnn_benchmark,
                graphs=config.graphs, max_rel_l2=MAX_REL_L2,
                sparsities=None if all(layer.weight is not None for layer in layers) else list(config.sparsities),
                timing=("median of cupyx.profiler.benchmark gpu_times (CUDA events); 'graph': a CUDA graph of "
                        "k launches replayed and divided by k; 'events': one Python call between two events"),
                speedups=("baseline / sparseconv, on graph replays when both have one, else on events for both "
                          "(CuPy refuses cuBLAS/cuSPARSE calls during stream capture, so the im2col baselines "
                          "are events-timed)"),
                layouts=("cuBLAS: im2col C-order (CRS, N*Ho*Wo), out (K, N*Ho*Wo); cuSPARSE: im2col F-order, "
                         "out F-order (K, N*Ho*Wo); the transpose to NCHW is not timed"))

    by_name = {layer.name: layer for layer in layers}
    rng = cupy.random.default_rng(config.seed)
    cupy_capture = cupy_graph if config.graphs else None
    torch_capture = torch_graph if config.graphs else None
    rows: List[Dict[str, Any]] = []
    nograd = torch.no_grad() if torch is not None else contextlib.nullcontext()
    with nograd:
        for (name, sp), w in weights.items():
            layer, s = by_name[name], by_name[name].shape
            conv = compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=layer.bias, stride=s.stride,
                                  padding=s.padding, dilation=s.dilation, groups=s.groups,
                                  cache_dir=config.cache_dir, name=name)
            nnz = int(np.count_nonzero(w))
            base_check = _check_baselines(s, w, baselines, rng)
            for batch in config.batches:
                row: Dict[str, Any] = dict(
                    layer=name, shape=s.describe(), batch=batch, sparsity=sp,
                    weight_sparsity=1.0 - nnz / w.size, nnz=nnz, weights=int(w.size),
                    tiling=conv.stats.get("tiling"), floor_us=floor_us(s, batch, nnz), host_us=None,
                    us={}, timing={}, events_us={}, graph_us={}, graph_launches={}, timing_notes={},
                    speedup={}, check={}, errors={})
                _time_row(row, conv, layer, w, batch, baselines, torch, config, rng, cupy_capture, torch_capture)
                for b, c in base_check.items():
                    row["check"][b] = c
                row["speedup"] = speedups(row)
                rows.append(row)
                log(_progress_line(row))
                _free_gpu(torch)
    return BenchResult(meta, rows, notes)


def _check_baselines(shape: ConvShape, w: np.ndarray, baselines: Sequence[str], rng: Any) -> Dict[str, Any]:
    """Run the im2col baselines once on CHECK_BATCH fresh images against the float64 reference."""
    import cupy

    names = [b for b in baselines if b in ("cublas_gemm", "cusparse_spmm")]
    if not names:
        return {}
    x = rng.standard_normal((CHECK_BATCH, shape.in_channels, shape.in_h, shape.in_w), dtype=cupy.float32)
    ref = conv2d_im2col(x, w, shape, None, cupy)
    out: Dict[str, Any] = {}
    for name in names:
        try:
            launch, output = _im2col_runners(shape, w, x, [name])[name]
            launch()
            err = rel_l2(output(), ref, cupy)
            out[name] = dict(ref="float64 im2col", rel_l2=err, ok=bool(err <= MAX_REL_L2))
        except Exception as exc:  # a baseline that cannot run is a failed check, not a crashed bench
            out[name] = dict(ref="float64 im2col", rel_l2=None, ok=False, error=one_line(exc))
    return out


def _time_row(row: Dict[str, Any], conv: Any, layer: BenchLayer, w: np.ndarray, batch: int,
              baselines: Sequence[str], torch: Any, config: BenchConfig, rng: Any,
              cupy_capture: Optional[Capture], torch_capture: Optional[Capture]) -> None:
    import cupy

    s = layer.shape
    timed = dict(repeat=config.repeat, max_seconds=config.max_seconds)
    x = rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w), dtype=cupy.float32)
    out = cupy.empty(conv.output_shape(batch), cupy.float32)
    try:
        t = time_gpu(lambda: conv(x, out=out), capture=cupy_capture, **timed)
        _record(row, "sparseconv", t)
        row["host_us"] = t.host_us
        conv(x, out=out)
    except Exception as exc:  # recorded, and the baselines still run; the row shows no speedup
        row["errors"]["sparseconv"] = one_line(exc)

    if torch is not None:
        run = _cudnn_launch(torch, s, w, layer.bias, x)
        for name, tf32 in (("cudnn_fp32", False), ("cudnn_tf32", True)):
            try:
                with torch_flags(torch, tf32, config.cudnn_benchmark):
                    if name in baselines:
                        _record(row, name, time_gpu(run, capture=torch_capture, **timed))
                    if name == "cudnn_fp32":  # the correctness check runs even when it is not timed
                        _check(row, "sparseconv", "cudnn_fp32", rel_l2(out, cupy.asarray(run()), cupy))
            except Exception as exc:
                row["errors"][name] = one_line(exc)
    else:
        try:
            ref = conv2d_im2col(x, w, s, layer.bias, cupy)
            _check(row, "sparseconv", "float64 im2col", rel_l2(out, ref, cupy))
            del ref
        except cupy.cuda.memory.OutOfMemoryError as exc:
            row["errors"]["check"] = one_line(exc)

    names = [b for b in baselines if b in ("cublas_gemm", "cusparse_spmm")]
    for name in names:
        try:
            launch, _ = _im2col_runners(s, w, x, [name])[name]
            _record(row, name, time_gpu(launch, capture=cupy_capture, **timed))
        except Exception as exc:
            row["errors"][name] = one_line(exc)
        _free_gpu(None)


def _progress_line(row: Dict[str, Any]) -> str:
    sp = "model" if row["sparsity"] is None else f"{row['sparsity']:g}"
    times = ", ".join(f"{SHORT[m]} {v:.1f}" for m, v in row["us"].items())
    errs = f"; errors: {row['errors']}" if row["errors"] else ""
    return f"{row['layer']} sparsity {sp} batch {row['batch']}: {times} us; check {_check_cell(row)}{errs}"
