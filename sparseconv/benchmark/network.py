"""Whole-network bench: time per forward of a pruned network through sparseconv
(sparsify, fused, one CUDA graph, each conv routed by measurement at the batch
sizes timed) and through PyTorch eager and torch.compile, in strict fp32 and
in TF32, same weights, same inputs, in one run.

Every variant is timed the same way: wrapped in sparseconv.torch.CudaGraphModule
(one CUDA graph per input shape), so a timed call is copy input in + graph
replay + clone of the output, measured with CUDA events, median of `repeat`.
Each call is queued behind a short GPU wait before its start event, so the
figure is the GPU's time for a forward, as a stream of calls sees it, and not
the host's submit time, which other processes on the host move
(QUEUE_AHEAD_US).
Exactness: relative L2 and top-1 agreement of each variant's output against
the float64 evaluation of the ORIGINAL network (BN unfolded).

    sparseconv bench --network resnet50 --batch 1,64 --plot net.png
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import click

from ..cli_options import invoked_command, parse_size
from .clocks import ClockWatch
from .output import write_atomically

VARIANTS = ("sparseconv", "eager fp32", "eager TF32", "compile fp32", "compile TF32")
TF32 = {"sparseconv": False, "eager fp32": False, "eager TF32": True, "compile fp32": False, "compile TF32": True}
EXACT_REL_L2 = 1e-5  # the sparseconv output must be this close to float64, or the run fails
# The built-in networks (zoo_torch.NETWORKS) by their names in tables
NAMES = {"resnet50": "ResNet-50", "vgg16": "VGG-16", "resnext50": "ResNeXt-50 32x4d", "mobilenet_v2": "MobileNetV2",
         "mnasnet1_0": "MNASNet 1.0"}


class NetworkBenchError(Exception):
    """A run that cannot go on (no GPU, bad argument); the CLI prints one line."""


@dataclass(frozen=True)
class NetworkTiming:
    network: str
    batch: int
    variant: str
    us: Optional[float]          # median µs per forward; None when the variant failed
    rel_l2: Optional[float]      # vs the float64 original
    top1: Optional[float]        # fraction of images whose top-1 class equals float64's
    note: str = ""


@dataclass
class NetworkReport:
    network: str
    device: str
    date: str
    command: str
    sparsity: Optional[float]
    input_size: Tuple[int, int]
    timings: List[NetworkTiming] = field(default_factory=list)
    plan: Dict[str, int] = field(default_factory=dict)   # "bn+add+relu" -> how many convs, "kept" -> ...
    # Each conv's path and why: the routing's times for "dense" and "mixed"
    plan_layers: List[Dict[str, str]] = field(default_factory=list)
    # The GPU's SM clock, temperature, power and slowdowns over the timings (benchmark.clocks)
    gpu_clocks: Dict[str, Any] = field(default_factory=dict)
    run_warnings: List[str] = field(default_factory=list)  # e.g. the GPU's clocks moved during the run

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def failures(self) -> List[str]:
        """Exactness failures of the sparseconv variant (the one that must be exact)."""
        return [f"{t.network} batch {t.batch}: sparseconv relative L2 {t.rel_l2:.2e} > {EXACT_REL_L2:g}"
                for t in self.timings if t.variant == "sparseconv" and t.rel_l2 is not None
                and t.rel_l2 > EXACT_REL_L2]


@contextlib.contextmanager
def precision(tf32: bool) -> Iterator[None]:
    """cuBLAS and cuDNN in TF32 or strict fp32 for the block (the legacy flags,
    as sparseconv/dense.py sets them: torch refuses a mix of old and new API)."""
    import torch

    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = (flags[0].allow_tf32, flags[1].allow_tf32)
        flags[0].allow_tf32 = flags[1].allow_tf32 = tf32
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flags[0].allow_tf32, flags[1].allow_tf32 = saved


# A GPU wait this long is queued before each timed call of the network bench,
# so the host has submitted the call's work (~23 µs for a CUDA-graph call at
# batch 1, 29-45 with every core busy) before the start event fires. Without
# it MNASNet at batch 1 measured 151-160 µs in three processes on an idle
# host and 154-159 in one with every core busy; with it 140.5-141.3 in one
# process idle or busy, and 142.6-143.9 in four processes while the other
# GPU's bench built and compiled (bench/host_load_probe.py;
# docs/PERFORMANCE.md, session 46).
QUEUE_AHEAD_US = 200.0


def _sm_clock_khz(device: int) -> int:
    """The SM's top clock, which torch.cuda._sleep counts its cycles in."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["clockRate"])


def time_forward_us(fn: Callable[[Any], Any], x: Any, *, warmup: int = 3, repeat: int = 30,
                    queue_ahead_us: float = 0.0) -> float:
    """Median CUDA-event time of one call fn(x), in µs. queue_ahead_us > 0
    keeps the GPU busy that long before each start event, so the call's work
    is queued when the clock starts: the GPU's time, not the host's submit
    time (QUEUE_AHEAD_US). 0: from an idle GPU, the host's time included (a
    caller that waits for each result, as an eager forward is timed)."""
    import torch

    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    wait_cycles = int(queue_ahead_us * _sm_clock_khz(torch.cuda.current_device()) / 1e3) if queue_ahead_us > 0 else 0
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if wait_cycles:
            torch.cuda._sleep(wait_cycles)  # a spin on the GPU; the wait is before the start event
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def exactness(y: Any, ref: Any) -> Tuple[float, float]:
    """(relative L2, top-1 agreement) of y against the float64 reference."""
    y64, r = y.detach().double(), ref.detach().double()
    rel = float((y64 - r).norm() / r.norm())
    top1 = float((y64.reshape(len(y64), -1).argmax(1) == r.reshape(len(r), -1).argmax(1)).double().mean())
    return rel, top1


def is_onnx(network: Any) -> bool:
    return isinstance(network, (str, Path)) and str(network).lower().endswith(".onnx")


def check_network_name(network: Union[str, Path]) -> None:
    if is_onnx(network):
        if not Path(network).is_file():
            raise NetworkBenchError(f"{network}: no such ONNX file")
        return
    if network not in NAMES:
        raise NetworkBenchError(f"unknown network {network!r}; built in: {', '.join(NAMES)}, or an ONNX file "
                                "(*.onnx)")


# How a built-in network built with prune_linears=True is named in tables and charts.
PRUNED_LINEARS = " (Linears pruned too)"


def check_prune_linears(network: Any, prune_linears: bool) -> None:
    if prune_linears and not (isinstance(network, str) and network in NAMES):
        raise NetworkBenchError("prune_linears prunes a built-in network; a module or an ONNX file is timed as given")


@dataclass(frozen=True)
class LoadedNetwork:
    """A network ready to time: its name in tables, the module in eval mode,
    its input shape without the batch (C, H, W), and the sparsity it was
    pruned to here (None: timed as given)."""

    name: str
    module: Any
    input_shape: Tuple[int, ...]
    sparsity: Optional[float] = None


def load_network(network: Union[str, Path, Any], *, sparsity: float = 0.9, seed: int = 0,
                 prune_linears: bool = False, input_size: Optional[Tuple[int, int]] = None) -> LoadedNetwork:
    """Build a built-in network, convert an ONNX file (onnx_torch) or take an
    nn.Module. Built-in networks and modules take 3 x input_size (224 x 224
    by default); an ONNX file its own input shape, H x W replaced by
    input_size if given. Raises NetworkBenchError for what cannot be timed."""
    from torch import nn

    from ..zoo_torch import build_network  # torch: imported when a network is built

    size = tuple(input_size or (224, 224))
    check_prune_linears(network, prune_linears)
    if isinstance(network, nn.Module):
        return LoadedNetwork(type(network).__name__, network.eval(), (3,) + size)
    check_network_name(network)
    if is_onnx(network):
        from ..model import ModelError
        from ..onnx_torch import onnx_to_torch

        try:
            module, shape = onnx_to_torch(Path(network), input_size)
        except ModelError as exc:
            raise NetworkBenchError(str(exc)) from None
        return LoadedNetwork(Path(network).name, module, shape)
    return LoadedNetwork(NAMES[network] + (PRUNED_LINEARS if prune_linears else ""),
                         build_network(network, sparsity=sparsity, seed=seed, prune_linears=prune_linears),
                         (3,) + size, sparsity)


def check_onnx_batches(network: LoadedNetwork, batches: Sequence[int]) -> None:
    """An ONNX file that fixes its batch size runs at that size only: its
    exporter may have folded it into constants (a Reshape to (1, -1))."""
    fixed = getattr(network.module, "onnx_batch", None)
    if fixed is not None and any(b != fixed for b in batches):
        raise NetworkBenchError(f"{network.name}: the file fixes the batch size to {fixed}, asked for "
                                f"{', '.join(map(str, batches))}; export it with a dynamic batch axis "
                                f"(torch.onnx.export(..., dynamic_axes={{'x': {{0: 'N'}}}})) or pass --batch {fixed}")


def _plan_summary(plans: Sequence[Any]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for p in plans:
        key = p.action if p.action != "sparseconv" else "+".join(p.fused) or "plain"
        out[key] = out.get(key, 0) + 1
    return out


def plan_layers(plans: Sequence[Any]) -> List[Dict[str, str]]:
    """One record per conv of a sparsify plan (fx.ConvPlan): its name, path,
    what was fused into it and the reason, which holds the routing's times."""
    return [dict(name=p.name, kind=p.kind, action=p.action, fused="+".join(p.fused), reason=p.reason)
            for p in plans]


def run_network_bench(network: Union[str, Path, Any, LoadedNetwork] = "resnet50",
                      batches: Sequence[int] = (1, 64), *, sparsity: float = 0.9,
                      input_size: Optional[Tuple[int, int]] = None, seed: int = 0,
                      variants: Sequence[str] = VARIANTS, repeat: int = 30, cache_dir: Optional[str] = None,
                      progress: bool = True, command: str = "", prune_linears: bool = False) -> NetworkReport:
    """Time `network` (a built-in one, NAMES, with every conv pruned to
    `sparsity`, and every nn.Linear too with prune_linears; an ONNX file,
    converted by onnx_torch, or an nn.Module, each timed as given; or one
    load_network loaded) per forward at each batch size (input_size: H x W,
    default 224 x 224 or the ONNX file's), for each variant, on the current
    CUDA device. A variant that fails (e.g.
    torch.compile without a working inductor) is reported with its error, not
    raised; sparseconv's own failures are raised."""
    import torch

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise NetworkBenchError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if not batches or any(b < 1 for b in batches):
        raise NetworkBenchError(f"batch sizes must be positive, got {list(batches)}")
    if isinstance(network, (str, Path)):
        check_network_name(network)
    check_prune_linears(network, prune_linears)
    if not torch.cuda.is_available():
        raise NetworkBenchError("no CUDA device: the network bench times on the GPU")
    import torch._inductor.config as inductor_config

    freezing = inductor_config.freezing
    try:
        return _run(network, batches, sparsity, input_size, seed, variants, repeat, cache_dir, progress, command,
                    prune_linears)
    finally:
        inductor_config.freezing = freezing


def _run(network: Union[str, Path, Any, LoadedNetwork], batches: Sequence[int], sparsity: float,
         input_size: Optional[Tuple[int, int]], seed: int,
         variants: Sequence[str], repeat: int, cache_dir: Optional[str], progress: bool,
         command: str, prune_linears: bool) -> NetworkReport:
    import cupy
    import torch

    from ..torch import CudaGraphModule, sparsify  # torch: imported when timed

    loaded = network if isinstance(network, LoadedNetwork) else load_network(
        network, sparsity=sparsity, seed=seed, prune_linears=prune_linears, input_size=input_size)
    check_onnx_batches(loaded, batches)
    name, in_shape = loaded.name, loaded.input_shape
    device = torch.device("cuda", torch.cuda.current_device())
    net = loaded.module.to(device).eval()
    report = NetworkReport(name, torch.cuda.get_device_name(device), time.strftime("%Y-%m-%d"), command,
                           loaded.sparsity, tuple(in_shape[1:]))
    clocks = ClockWatch(cupy.cuda.Device(device.index).pci_bus_id)  # sampled after each timing
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    inputs = {b: torch.randn(b, *in_shape, generator=gen).to(device) for b in batches}
    with torch.no_grad():
        ref64 = copy.deepcopy(net).double()
        refs = {b: ref64(x.double()) for b, x in inputs.items()}
        del ref64
    torch.cuda.empty_cache()

    for variant in variants:
        def say(msg: str) -> None:
            if progress:
                click.echo(f"[{name} {variant}] {msg}", err=True)

        with precision(TF32[variant]), torch.no_grad():
            model, error = None, ""
            try:
                if variant == "sparseconv":
                    # routed at the batch sizes timed here, as a user who runs them would name them
                    model = sparsify(net, inputs[batches[0]][:1], cuda_graph=True, cache_dir=cache_dir,
                                     route_batches=tuple(batches), progress=progress)
                    report.plan = _plan_summary(model.sparseconv_plan)
                    report.plan_layers = plan_layers(model.sparseconv_plan)
                else:
                    module = copy.deepcopy(net)
                    if variant.startswith("compile"):
                        import torch._dynamo
                        import torch._inductor.config as inductor_config

                        torch._dynamo.reset()
                        inductor_config.freezing = True  # folds BN into the convs, as sparseconv does
                        module = torch.compile(module, dynamic=False)
                    model = CudaGraphModule(module)
            except Exception as exc:  # noqa: BLE001 -- a baseline that cannot run is reported, not fatal
                if variant == "sparseconv":
                    raise
                error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            for b in batches:
                if model is None:
                    report.timings.append(NetworkTiming(name, b, variant, None, None, None, error))
                    continue
                try:
                    say(f"batch {b}")
                    y = model(inputs[b])
                    rel, top1 = exactness(y, refs[b])
                    us = time_forward_us(model, inputs[b], repeat=repeat, queue_ahead_us=QUEUE_AHEAD_US)
                    clocks.sample()
                    report.timings.append(NetworkTiming(name, b, variant, us, rel, top1))
                except Exception as exc:  # noqa: BLE001
                    if variant == "sparseconv":
                        raise
                    report.timings.append(NetworkTiming(name, b, variant, None, None, None,
                                                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))
            del model
            torch.cuda.empty_cache()
    report.gpu_clocks = clocks.summary()
    warning = clocks.warning()
    if warning:
        report.run_warnings.append(warning)
    return report


# -- report -----------------------------------------------------------------------------------------------------------

def _fmt_us(us: Optional[float]) -> str:
    return "–" if us is None else f"{us:,.0f}"


def format_table(reports: Sequence[NetworkReport]) -> str:
    """Markdown: µs per forward per variant (and sparseconv's speed-up over
    each), then the exactness of every variant."""
    cols = [v for v in VARIANTS if any(t.variant == v for r in reports for t in r.timings)]
    lines = ["| network, batch | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    rows: Dict[Tuple[str, int], Dict[str, NetworkTiming]] = {}
    for r in reports:
        for t in r.timings:
            rows.setdefault((t.network, t.batch), {})[t.variant] = t
    for (net, batch), by in rows.items():
        ours = by.get("sparseconv")
        cells = []
        for v in cols:
            t = by.get(v)
            cell = _fmt_us(t.us if t else None)
            if v != "sparseconv" and t and t.us and ours and ours.us:
                cell += f" ({t.us / ours.us:.2f}×)"
            cells.append(cell)
        lines.append(f"| {net}, {batch} | " + " | ".join(cells) + " |")
    lines += ["", "µs per forward (CUDA-graph replays, median); (n×): that time over sparseconv's, above 1 "
              "means sparseconv is faster.", "",
              "| network, batch | " + " | ".join(f"{v} rel. L2 / top-1" for v in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for (net, batch), by in rows.items():
        cells = []
        for v in cols:
            t = by.get(v)
            cells.append("–" if t is None or t.rel_l2 is None else f"{t.rel_l2:.1e} / {100 * (t.top1 or 0):.0f}%")
        lines.append(f"| {net}, {batch} | " + " | ".join(cells) + " |")
    notes = [f"- {t.network} batch {t.batch} {t.variant}: {t.note}" for r in reports for t in r.timings if t.note]
    notes += [f"- warning, {r.network}: {w}" for r in reports for w in r.run_warnings]
    return "\n".join(lines + ([""] + notes if notes else []))


def plot_report(report: NetworkReport, path: Union[str, Path]) -> Path:
    """A PNG bar chart, one panel per batch size: µs per forward of each
    variant (linear axis), each fp32 bar with its TF32 twin beside it."""
    import matplotlib.pyplot as plt

    fig = report_figure(report)
    try:
        return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120))
    finally:
        plt.close(fig)


def report_figure(report: NetworkReport) -> Any:
    """plot_report's matplotlib figure (Agg backend)."""
    try:
        import matplotlib
    except ImportError:
        raise NetworkBenchError("the PNG plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({t.batch for t in report.timings})
    variants = [v for v in VARIANTS if any(t.variant == v for t in report.timings)]
    colors = {"sparseconv": "#2b8a3e", "eager fp32": "#1864ab", "eager TF32": "#74c0fc",
              "compile fp32": "#c92a2a", "compile TF32": "#ffa8a8"}
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.4), squeeze=False,
                             constrained_layout=True)
    for ax, batch in zip(axes[0], batches):
        by = {t.variant: t for t in report.timings if t.batch == batch}
        heights = [by[v].us if v in by and by[v].us is not None else 0.0 for v in variants]
        bars = ax.bar(range(len(variants)), heights, color=[colors[v] for v in variants],
                      hatch=None, edgecolor="black", linewidth=0.5)
        for bar, v, h in zip(bars, variants, heights):
            if "TF32" in v:
                bar.set_hatch("//")
            ax.annotate("failed" if h == 0 else f"{h:,.0f}", (bar.get_x() + bar.get_width() / 2, h),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels([v.replace(" ", "\n") for v in variants], fontsize=8)
        ax.set_title(f"{report.network}, batch {batch}", fontsize=10)
        ax.set_ylabel("µs per forward (lower is better)")
        ax.set_ylim(0, max(heights + [1.0]) * 1.15)
    sparsity = "" if report.sparsity is None else f", {report.sparsity:.0%} unstructured sparsity"
    # two lines: one panel (a single batch size) is too narrow for the device name on the same line
    fig.suptitle(f"{report.network}{sparsity}\n{report.device}, {report.date}", fontsize=10)
    return fig


# -- CLI -------------------------------------------------------------------------------------------------------------

def parse_batches(text: str) -> Tuple[int, ...]:
    try:
        out = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise click.BadParameter(f"must be comma-separated positive ints like 1,64, got {text!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"must be comma-separated positive ints like 1,64, got {text!r}")
    return out


@click.command("network")
@click.option("--network", "network", default="resnet50", show_default=True,
              help="Built-in network (resnet50, vgg16, resnext50, mobilenet_v2 or mnasnet1_0, pruned here), or an "
                   "ONNX file (timed with its own weights).")
@click.option("--batch", "batch_text", default="1,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--sparsity", type=click.FloatRange(0, 1, max_open=True), default=0.9, show_default=True,
              help="Every conv is pruned to this fraction of zeros (by magnitude).")
@click.option("--prune-linears", is_flag=True,
              help="Prune every nn.Linear (the classifier) to --sparsity too, as a pruned network often is; "
                   "the default prunes the convs only.")
@click.option("--input-size", "input_text", default=None,
              help="Input H x W, e.g. 224 or 224x192 (default: 224, or the ONNX file's).")
@click.option("--variants", "variant_text", default=",".join(VARIANTS), show_default=True,
              help="Comma-separated subset of the variants to time.")
@click.option("--repeat", type=click.IntRange(1), default=30, show_default=True, help="Timed calls per variant.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG bar chart here (needs matplotlib).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Artifact cache (default: $SPARSECONV_CACHE_DIR or ptx_cache/).")
def network_command(network: str, batch_text: str, sparsity: float, prune_linears: bool, input_text: Optional[str],
                    variant_text: str, repeat: int, json_path: Optional[Path], plot_path: Optional[Path],
                    cache_dir: Optional[Path]) -> None:
    """Time a whole pruned network per forward: sparseconv vs PyTorch eager and torch.compile (fp32, TF32)."""

    batches = parse_batches(batch_text)
    size = parse_size(input_text, "--input-size") if input_text else None
    variants = [v.strip() for v in variant_text.split(",") if v.strip()]
    try:
        check_network_name(network)
    except NetworkBenchError as exc:
        raise click.BadParameter(str(exc), param_hint="--network") from None
    if prune_linears and is_onnx(network):
        raise click.UsageError("--prune-linears prunes a built-in network's classifier; an ONNX file is timed with "
                               "its own weights")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise click.BadParameter(f"unknown {', '.join(bad)}; known: {', '.join(VARIANTS)}", param_hint="--variants")
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install matplotlib") from None
    target: Union[str, LoadedNetwork] = network
    if is_onnx(network):  # converted now: a file that cannot be timed is refused before any work
        try:
            target = load_network(network, input_size=size)
            check_onnx_batches(target, batches)
        except NetworkBenchError as exc:
            raise click.BadParameter(str(exc), param_hint="--network") from None
    command = invoked_command()
    try:
        report = run_network_bench(target, batches, sparsity=sparsity, input_size=size, variants=variants,
                                   repeat=repeat, cache_dir=None if cache_dir is None else str(cache_dir),
                                   command=command, prune_linears=prune_linears)
    except NetworkBenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(format_table([report]))
    if json_path is not None:
        write_atomically(json_path, lambda tmp: tmp.write_text(report.to_json()))
    if plot_path is not None:
        plot_report(report, plot_path)
        click.echo(f"plot: {plot_path}")
    failures = report.failures()
    if failures:
        for f in failures:
            click.echo(f"error: {f}", err=True)
        sys.exit(1)
