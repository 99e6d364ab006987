"""run_bench: time every (layer, sparsity, batch) by every method on the
current GPU, and check every output; see the package doc for the method."""
from __future__ import annotations

import contextlib
import datetime
import fnmatch
import os
import platform
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import __version__
from ..runtime import device_target
from ..dense import conv2d_im2col, torch_flags
from ..api import compile_conv2d
from ..operators import benchmark_operators
from ..parallel import LayerJob, build_many
from ..shapes import ConvShape
from ..tilings import batch_variants, default_tiling
from ..table import MAX_TABLE_BATCH, TableConv2d, table_supported
from ..testing import pruned_weight, relative_l2
from ..timing import Capture, cupy_graph, one_line, time_gpu, torch_graph
from .baselines import IM2COL_BASELINES, check_baselines, cudnn_launch, im2col_runners, import_torch
from .clocks import ClockWatch
from .report import SHORT, BenchResult, check_cell
from .rows import BASELINES, MAX_REL_L2, PATHS, TORCH_BASELINES, BenchError, BenchRow, Check, floor_us


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
    # sparseconv's families to time (rows.PATHS): with both, the table at batch
    # sizes up to MAX_TABLE_BATCH only, as routing does; with ("table",) alone, at every batch.
    paths: Sequence[str] = PATHS

    def __post_init__(self) -> None:
        if not self.paths or any(p not in PATHS for p in self.paths):
            raise ValueError(f"paths must be a non-empty selection of {', '.join(PATHS)}, got {self.paths!r}")

    def times_table(self, shape: ConvShape, batch: int) -> bool:
        """Whether this run times `shape` at `batch` through the weight table."""
        if "table" not in self.paths or table_supported(shape) is not None:
            return False
        return batch <= MAX_TABLE_BATCH or "code" not in self.paths


# --------------------------------------------------------------------------- layers and weights (CPU)

def layer_weight(layer: BenchLayer, sparsity: Optional[float], seed: int) -> np.ndarray:
    """The layer's own weight, or a random pruned one seeded by (seed, name, sparsity),
    so a layer gets the same weights whichever other layers are selected."""
    if layer.weight is not None:
        return np.ascontiguousarray(layer.weight, dtype=np.float32)
    assert sparsity is not None
    rng = np.random.default_rng([seed, zlib.crc32(layer.name.encode()), int(round(sparsity * 10000))])
    return pruned_weight(rng, layer.shape.weight_shape, sparsity)


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
    return [BenchLayer(op.name, op.shape) for op in benchmark_operators()]


def model_bench_layers(model: Any) -> List[BenchLayer]:
    """A loaded model's conv layers (sparseconv.model.PrunedModel), with their own weights."""
    return [BenchLayer(layer.name, layer.shape, layer.weight, layer.bias) for layer in model.layers]


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


def _free_gpu(torch: Any) -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _prebuild(layers: Sequence[BenchLayer], weights: Dict[Tuple[str, Any], np.ndarray], config: BenchConfig,
              log: Callable[[str], None]) -> None:
    """Build every kernel, each batch variant of it too (tilings.batch_variants),
    in a process pool first (CPU only), so the timing loop only loads cached
    cubins."""
    if "code" not in config.paths:  # the table is compiled by NVRTC as each layer is timed
        return
    shapes = {layer.name: layer.shape for layer in layers}
    jobs = [LayerJob(f"{name}@{sp}#{i}", w, shapes[name], t)
            for (name, sp), w in weights.items()
            for i, (_, t) in enumerate(batch_variants(shapes[name], default_tiling(shapes[name])))]
    log(f"building {len(jobs)} kernels (cached ones are loaded)")
    build_many(jobs, target=device_target(), cache_dir=config.cache_dir, workers=config.jobs, progress=True)


def run_bench(layers: Sequence[BenchLayer], config: BenchConfig, command: str = "",
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> BenchResult:
    """Time every (layer, sparsity, batch) by every method on the current GPU; see the package doc."""
    device = require_gpu()
    import cupy

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
            import cupyx.cusparse  # noqa: F401  (probe: is cuSPARSE loadable here?)
        except ImportError as exc:
            notes.append(f"cuSPARSE is not loadable ({one_line(exc)}), so the SpMM column is absent")
            baselines.remove("cusparse_spmm")

    meta = environment(torch, device)
    meta.update(command=command, batches=list(config.batches), baselines=baselines, repeat=config.repeat,
                max_seconds=config.max_seconds, seed=config.seed, cudnn_benchmark=config.cudnn_benchmark,
                graphs=config.graphs, max_rel_l2=MAX_REL_L2, paths=list(config.paths),
                sparseconv_figure=("the faster of the paths timed in the row: code (the weight-specialised "
                                   f"kernel) and table (the weight table, at batch <= {MAX_TABLE_BATCH} when "
                                   "both are timed); 'path' says which"),
                sparsities=None if all(layer.weight is not None for layer in layers) else list(config.sparsities),
                timing=("median of cupyx.profiler.benchmark gpu_times (CUDA events); 'graph': a CUDA graph of "
                        "k launches replayed and divided by k; 'events': one Python call between two events"),
                speedups=("baseline / sparseconv, on graph replays when both have one, else on events for both "
                          "(CuPy refuses cuBLAS/cuSPARSE calls during stream capture, so the im2col baselines "
                          "are events-timed)"),
                layouts=("cuBLAS: im2col C-order (CRS, N*Ho*Wo), out (K, N*Ho*Wo); cuSPARSE: im2col F-order, "
                         "out F-order (K, N*Ho*Wo); the transpose to NCHW is not timed"))

    by_name = {layer.name: layer for layer in layers}
    clocks = ClockWatch(cupy.cuda.Device().pci_bus_id)  # sampled after each row: did the GPU's clocks hold?
    rng = cupy.random.default_rng(config.seed)
    cupy_capture = cupy_graph if config.graphs else None
    torch_capture = torch_graph if config.graphs else None
    rows: List[BenchRow] = []
    nograd = torch.no_grad() if torch is not None else contextlib.nullcontext()
    with nograd:
        for (name, sp), w in weights.items():
            layer, s = by_name[name], by_name[name].shape
            kernels = _sparseconv_kernels(layer, w, config)
            nnz = int(np.count_nonzero(w))
            base_check = check_baselines(s, w, baselines, rng)
            for batch in config.batches:
                timed = {p: k for p, k in kernels.items() if p == "code" or config.times_table(s, batch)}
                tilings = "; ".join(f"{p}: {k.stats.get('tiling')}" if len(timed) > 1 else str(k.stats.get("tiling"))
                                    for p, k in timed.items())
                row = BenchRow(layer=name, shape=s, batch=batch, sparsity=sp, nnz=nnz, weights=int(w.size),
                               tiling=tilings or None, floor_us=floor_us(s, batch, nnz))
                if not timed:
                    row.fail("sparseconv", f"table: {table_supported(s)}; time it with --paths code or both")
                _time_row(row, timed, layer, w, baselines, torch, config, rng, cupy_capture, torch_capture)
                for b, c in base_check.items():
                    row.add_check(b, c)
                clocks.sample()
                rows.append(row)
                log(_progress_line(row))
                _free_gpu(torch)
    meta["gpu_clocks"] = clocks.summary()
    warning = clocks.warning()
    if warning:
        notes.append(warning)
        log(f"warning: {warning}")
    return BenchResult(meta, rows, notes)


def _sparseconv_kernels(layer: BenchLayer, w: np.ndarray, config: BenchConfig) -> Dict[str, Any]:
    """The layer's kernel per path of config.paths that could time it at some batch."""
    s = layer.shape
    kernels: Dict[str, Any] = {}
    if "code" in config.paths:
        kernels["code"] = compile_conv2d(w, input_size=(s.in_h, s.in_w), bias=layer.bias, stride=s.stride,
                                         padding=s.padding, dilation=s.dilation, groups=s.groups,
                                         cache_dir=config.cache_dir, name=layer.name)
    if any(config.times_table(s, b) for b in config.batches):
        kernels["table"] = TableConv2d(w, layer.bias, s, name=layer.name)  # routing's tiling (the rule)
    return kernels


# The check key of each path's output ("sparseconv": the code's, as before the table was timed).
_CHECK_KEY = {"code": "sparseconv", "table": "table"}


def _time_row(row: BenchRow, kernels: Dict[str, Any], layer: BenchLayer, w: np.ndarray, baselines: Sequence[str],
              torch: Any, config: BenchConfig, rng: Any, cupy_capture: Optional[Capture],
              torch_capture: Optional[Capture]) -> None:
    import cupy

    s, batch = layer.shape, row.batch
    timed = dict(repeat=config.repeat, max_seconds=config.max_seconds)
    x = rng.standard_normal((batch, s.in_channels, s.in_h, s.in_w), dtype=cupy.float32)
    outs = {}  # the outputs of the paths that ran, to check
    for path, kernel in kernels.items():
        out = cupy.empty(kernel.output_shape(batch), cupy.float32)
        try:
            row.record(path, time_gpu(lambda: kernel(x, out=out), capture=cupy_capture, **timed))
            kernel(x, out=out)
            outs[path] = out
        except Exception as exc:  # recorded, and the baselines still run; the row shows no speedup
            row.fail(path, one_line(exc))
    row.take_fastest()

    def check_outputs(ref_name: str, ref: Any) -> None:
        for path, out in outs.items():
            row.add_check(_CHECK_KEY[path], Check.of(ref_name, relative_l2(out, ref, cupy)))

    if torch is not None:
        run = cudnn_launch(torch, s, w, layer.bias, x)
        for name, tf32 in (("cudnn_fp32", False), ("cudnn_tf32", True)):
            try:
                with torch_flags(torch, tf32, config.cudnn_benchmark):
                    if name in baselines:
                        row.record(name, time_gpu(run, capture=torch_capture, **timed))
                    if name == "cudnn_fp32":  # the correctness check runs even when it is not timed
                        check_outputs("cudnn_fp32", cupy.asarray(run()))
            except Exception as exc:
                row.fail(name, one_line(exc))
    else:
        try:
            ref = conv2d_im2col(x, w, s, layer.bias, cupy)
            check_outputs("float64 im2col", ref)
            del ref
        except cupy.cuda.memory.OutOfMemoryError as exc:
            row.fail("check", one_line(exc))

    for name in [b for b in baselines if b in IM2COL_BASELINES]:
        try:
            launch, _ = im2col_runners(s, w, x, [name])[name]
            row.record(name, time_gpu(launch, capture=cupy_capture, **timed))
        except Exception as exc:
            row.fail(name, one_line(exc))
        _free_gpu(None)


def _progress_line(row: BenchRow) -> str:
    sp = "model" if row.sparsity is None else f"{row.sparsity:g}"
    times = ", ".join(f"{SHORT[m]} {v:.1f}" for m, v in row.us.items())
    errs = f"; errors: {row.errors}" if row.errors else ""
    return f"{row.layer} sparsity {sp} batch {row.batch}: {times} us; check {check_cell(row)}{errs}"
