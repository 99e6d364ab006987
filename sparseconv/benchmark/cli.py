"""The `sparseconv bench` command (click), registered by sparseconv/cli.py.

Exit codes: 0 success, 1 no GPU / a build failed / a correctness check failed,
2 bad input (with a one-line reason)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import click

from ..cli_options import (cache_dir_option, format_option, input_size_option, invoked_command, load_model_or_exit,
                           spec_option)
from ..compile import CompileError, ToolNotFoundError
from .network import VARIANTS as NETWORK_VARIANTS
from .network import network_command
from .output import write_atomically
from .report import LABELS, BenchResult, format_table, plot_sweep, require_matplotlib
from ..table import MAX_TABLE_BATCH
from .rows import BASELINES, PATHS, BenchError
from .run import BenchConfig, BenchLayer, benchmark_layers, model_bench_layers, run_bench, select_layers

SWEEP = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


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


def _layers(model_path: Optional[Path], fmt: Optional[str], spec_path: Optional[Path], input_size: Optional[str],
            layer_globs: str) -> List[BenchLayer]:
    if model_path is None:
        layers = benchmark_layers()
    else:
        layers = model_bench_layers(load_model_or_exit(model_path, fmt, spec_path, input_size))
    try:
        return select_layers(layers, layer_globs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _sparsities(model_path: Optional[Path], sparsity: Optional[str], sweep: bool) -> Tuple[float, ...]:
    if model_path is not None and (sparsity is not None or sweep):
        raise click.UsageError("--sparsity/--sweep do not apply with --model: the model's own weights are timed")
    if sparsity is not None and sweep:
        raise click.UsageError("give --sparsity or --sweep, not both")
    if sweep:
        return SWEEP
    try:
        return parse_sparsities(sparsity if sparsity is not None else "0.9")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sparsity") from None


@click.command()
@click.option("--network", default=None,
              help="Time a whole pruned network per forward instead (resnet50, vgg16 or an ONNX file): sparseconv "
                   "vs PyTorch eager and torch.compile, fp32 and TF32 (see sparseconv/benchmark/network.py).")
@click.option("--variants", "variant_text", default=",".join(NETWORK_VARIANTS), show_default=True,
              help="With --network: which of " + ", ".join(NETWORK_VARIANTS) + " to time.")
@click.option("--prune-linears", is_flag=True,
              help="With --network: prune every nn.Linear (the classifier) to --sparsity too; the default prunes "
                   "the convs only.")
@click.option("--model", "model_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Time this model's conv layers, with its own weights, instead of the 10 benchmark layers.")
@format_option
@spec_option
@input_size_option
@click.option("--layers", "layer_globs", default="*", show_default=True,
              help="Only layers whose name matches one of these comma-separated globs, e.g. 'vgg-*,resnet-conv1'.")
@click.option("--sparsity", default=None,
              help="Sparsity of the random unstructured masks [default: 0.9]; a comma list times several.")
@click.option("--sweep", is_flag=True, help="Sparsities " + ",".join(f"{s:g}" for s in SWEEP) + ".")
@click.option("--batch", "batches", type=click.IntRange(1), multiple=True,
              help="Batch size; repeat the option for several [default: 1 and 64].")
@click.option("--baselines", "baselines_text", default="all", show_default=True,
              help="Comma list among cudnn_fp32, cudnn_tf32, cublas_gemm, cusparse_spmm; or all, or none.")
@click.option("--paths", "paths_text", type=click.Choice(["both", "code", "table"]), default="both",
              show_default=True,
              help="sparseconv's kernels to time: code (weights in the instructions), table (the weight table, "
                   f"sparseconv.table), or both (the table at batch <= {MAX_TABLE_BATCH}, as routing does); the "
                   "sparseconv column is the faster.")
@click.option("--repeat", type=click.IntRange(1), default=50, show_default=True,
              help="Timed calls (and graph replays) per figure.")
@click.option("--max-seconds", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Cap on the timing loop of each figure; fewer repeats are taken past it.")
@click.option("--graphs/--no-graphs", default=True, show_default=True,
              help="Also time CUDA graph replays (launch overhead excluded).")
@click.option("--cudnn-benchmark/--no-cudnn-benchmark", default=True, show_default=True,
              help="Let cuDNN pick its fastest algorithm by measurement (the strongest dense baseline).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights and inputs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the environment, every row and the geomeans to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG of speedup against sparsity, over cuDNN fp32 and TF32 side by side "
                   "(needs a sweep and matplotlib); with --network, a bar chart of every variant.")
@cache_dir_option
@click.option("--jobs", type=click.IntRange(1), default=None, help="Parallel kernel builds (default: CPU count).")
@click.pass_context
def bench(ctx: click.Context, network: Optional[str], variant_text: str, prune_linears: bool, model_path: Optional[Path],
          fmt: Optional[str], spec_path: Optional[Path], input_size: Optional[str],
          layer_globs: str, sparsity: Optional[str], sweep: bool, batches: Tuple[int, ...], baselines_text: str,
          paths_text: str, repeat: int, max_seconds: float, graphs: bool, cudnn_benchmark: bool, seed: int,
          json_path: Optional[Path], plot_path: Optional[Path], cache_dir: Optional[Path],
          jobs: Optional[int]) -> None:
    """Time sparseconv kernels against cuDNN fp32 and TF32 (torch), cuBLAS
    im2col+GEMM and cuSPARSE im2col+SpMM, on one GPU in one run.

    Prints a markdown table with the performance floor and the host call
    latency beside each row, and the geomean speedups per batch. Every
    output is checked against a reference. Examples:

    \b
        sparseconv bench --batch 64 --json bench.json
        sparseconv bench --sweep --layers 'resnet-*,vgg-conv1' --plot sweep.png
        sparseconv bench --model models/lenet_digits_pruned.onnx --batch 256
        sparseconv bench --network resnet50 --batch 1 --batch 64 --plot resnet50.png
    """
    if prune_linears and network is None:
        raise click.UsageError("--prune-linears prunes a built-in network's classifier: use it with --network")
    if network is not None:
        if sparsity is not None and str(network).lower().endswith(".onnx"):
            raise click.UsageError("--sparsity prunes a built-in network; an ONNX file is timed with its own weights")
        if model_path is not None or sweep:
            raise click.UsageError("--network times a whole network: leave out --model and --sweep")
        if paths_text != "both":
            raise click.UsageError("--paths picks the kernels of a layer timing; --network routes each layer as "
                                   "sparsify does (code, table or cuDNN fp32): leave out --paths")
        try:
            sparsity_value = float(sparsity) if sparsity is not None else 0.9
        except ValueError:
            sparsity_value = float("nan")
        if not 0.0 <= sparsity_value < 1.0:
            raise click.BadParameter(f"one sparsity in [0, 1) with --network, got {sparsity!r}",
                                     param_hint="--sparsity")
        ctx.invoke(network_command, network=network, batch_text=",".join(map(str, batches or (1, 64))),
                   sparsity=sparsity_value, prune_linears=prune_linears, input_text=input_size,
                   variant_text=variant_text,
                   repeat=min(repeat, 30), json_path=json_path, plot_path=plot_path, cache_dir=cache_dir)
        return
    sparsities = _sparsities(model_path, sparsity, sweep)
    try:
        baselines = parse_baselines(baselines_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--baselines") from None
    if plot_path is not None:
        if plot_path.suffix.lower() != ".png":
            raise click.BadParameter(f"{plot_path}: the plot is a PNG; name it *.png", param_hint="--plot")
        if model_path is not None or len(sparsities) < 2:
            raise click.UsageError("--plot needs a sweep: --sweep or several --sparsity values")
        try:
            require_matplotlib()
        except BenchError as exc:
            raise click.UsageError(str(exc)) from None
    layers = _layers(model_path, fmt, spec_path, input_size, layer_globs)
    config = BenchConfig(batches=tuple(dict.fromkeys(batches)) or (1, 64), sparsities=sparsities,
                         baselines=baselines, repeat=repeat, max_seconds=max_seconds, seed=seed,
                         cache_dir=str(cache_dir) if cache_dir else None, graphs=graphs,
                         cudnn_benchmark=cudnn_benchmark, jobs=jobs,
                         paths=PATHS if paths_text == "both" else (paths_text,))
    result = _run(layers, config, invoked_command())
    click.echo(format_table(result))
    if json_path is not None:
        write_atomically(json_path, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=1) + "\n"))
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        plotted = plot_sweep(result, str(plot_path))
        click.echo(f"wrote {plot_path} (speedup over {' and '.join(LABELS[b] for b in plotted)})", err=True)
    failed = [r for r in result.rows if not r.checks_ok]
    if failed:
        click.echo(f"error: {len(failed)} rows failed a correctness check (rel. L2 above the limit); "
                   "see the check column", err=True)
        sys.exit(1)


def _run(layers: List[BenchLayer], config: BenchConfig, command: str) -> BenchResult:
    try:
        return run_bench(layers, config, command, log=lambda s: click.echo(s, err=True))
    except (BenchError, ToolNotFoundError, CompileError) as exc:
        raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
