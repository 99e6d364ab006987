"""Command line: `layer` builds one pruned layer's kernel, `inspect`/`compile` a model's conv layers,
`run` a whole ONNX model, `cache` manages artifacts.

Exit codes: 0 success, 2 bad input (with a one-line reason on stderr)."""
from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import click
import numpy as np

from .build import build_conv2d
from .bundle import BundleError, check_output_dir, check_writable_folder, specialised_ptx, write_bundle
from .cache import ArtifactCache, CacheError
from .cli_options import (cache_dir_option, check_output_file, format_option, input_size_option, jobs_option,
                          json_option, layers_option, load_model_or_exit, min_sparsity_option, model_argument,
                          parse_size, route_batch_option, route_option, spec_option, target_option)
from .compile import CompileError, ToolNotFoundError
from .limits import MAX_INDEX, check_layer
from .model import ConvLayer, ModelError, PrunedModel, detect_format, numpy_why, read_onnx
from .onnx_fuse import fuse_program, fusion_lines
from .parallel import LayerJob, build_many
from .progress import ptxas_counter
from .routing import RouteChoice
from .onnx_compile import FRONT_ENDS, compile_model
from .runner import linear_layers, load_data, load_program, predict, run_reference
from .shapes import Target, shape_from_weight


def _tool_failure(exc: CompileError) -> str:
    """A CUDA tool's failure for a CLI user: the tool, the layer, the log's first lines."""
    log = [line for line in exc.log.strip().splitlines() if line.strip()]
    shown = "; ".join(log[:3]) + (f" (+{len(log) - 3} more lines)" if len(log) > 3 else "")
    return f"{exc.tool} failed on {exc.what}: {shown or 'no output'}"


@contextlib.contextmanager
def _errors(where: str = "") -> Iterator[None]:
    """Library errors as click errors: bad input exits 2 with one line, a
    missing tool or a damaged cache exits 1, never a traceback."""
    prefix = f"{where}: " if where else ""
    try:
        yield
    except CompileError as exc:
        raise click.ClickException(_tool_failure(exc)) from None
    except (ToolNotFoundError, CacheError) as exc:
        raise click.ClickException(str(exc)) from None
    except (ModelError, BundleError) as exc:
        raise click.UsageError(str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise click.UsageError(prefix + str(exc).splitlines()[0]) from None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write a file through a temporary beside it: a failure leaves nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise click.UsageError(f"{path}: cannot write it ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _load_npy(path: Path, what: str) -> np.ndarray:
    try:
        a = np.load(path, allow_pickle=False)
    except EOFError:  # click would print a bare "Aborted!" for it
        raise click.UsageError(f"{path}: the file is empty or truncated; expected {what} as a .npy array") from None
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"{path}: cannot read {what} as a .npy array ({numpy_why(exc)})") from None
    if not isinstance(a, np.ndarray):
        a.close()
        raise click.UsageError(f"{path}: is an .npz archive; `layer` takes one .npy array ({what}); "
                               "for a model use `sparseconv compile`")
    return a


def _check_cache_dir(cache_dir: Optional[Path]) -> None:
    """Before a build: the cache folder must be writable (it fails late otherwise)."""
    root = ArtifactCache(cache_dir).root
    check_writable_folder(root, f"cache folder {root}: ",
                          "pass --cache-dir or set SPARSECONV_CACHE_DIR to a writable folder")


def _exit_on_sigterm(ctx: click.Context) -> None:
    """For the command's duration, SIGTERM unwinds like Ctrl-C (SystemExit
    143), so temporary folders are removed and pool workers stopped; the
    default action would skip both. The previous handler comes back after."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous or signal.SIG_DFL))


@click.group()
@click.version_option(package_name="sparseconv")
@click.pass_context
def main(ctx: click.Context) -> None:
    """sparseconv: compile pruned conv layers into weight-specialised CUDA kernels."""
    _exit_on_sigterm(ctx)


@main.command()
@click.argument("weight_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--input-size", required=True, help="Input H x W, e.g. 56 or 56x28.")
@click.option("--stride", default="1", show_default=True, help="Stride, e.g. 2 or 2x1.")
@click.option("--padding", default="0", show_default=True, help="Zero padding, e.g. 1 or 1x2.")
@click.option("--dilation", default="1", show_default=True, help="Dilation, e.g. 1 or 2x2.")
@click.option("--groups", default=1, show_default=True, type=click.IntRange(1, MAX_INDEX),
              help="Convolution groups.")
@target_option
@cache_dir_option
@click.option("--emit-ptx", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the specialised PTX here.")
@json_option
def layer(weight_file: Path, input_size: str, stride: str, padding: str, dilation: str, groups: int,
          target: str, cache_dir: Optional[Path], emit_ptx: Optional[Path], as_json: bool) -> None:
    """Build the specialised kernel of one layer from a (K, C/groups, R, S) .npy weight file.

    Needs nvcc and ptxas, no GPU. Example:

        sparseconv layer models/layer3.npy --input-size 56 --padding 1
    """
    name = weight_file.stem
    check_output_file(emit_ptx, "--emit-ptx")
    with _errors():
        _check_cache_dir(cache_dir)
    w = _load_npy(weight_file, "the weights")
    if w.dtype.kind != "f":
        raise click.UsageError(f"{weight_file}: weights must be floating point, got dtype {w.dtype}")
    if w.dtype.itemsize > 4 and np.abs(w[np.isfinite(w)]).max(initial=0) > np.finfo(np.float32).max:
        raise click.UsageError(f"{weight_file}: weights up to {float(np.abs(w).max()):.3g} overflow float32 "
                               f"(largest {float(np.finfo(np.float32).max):.3g})")
    with _errors(str(weight_file)):
        shape = shape_from_weight(w, parse_size(input_size, "--input-size"), parse_size(stride, "--stride"),
                                  parse_size(padding, "--padding", minimum=0), parse_size(dilation, "--dilation"),
                                  groups)
        check_layer(shape)
        cache = ArtifactCache(cache_dir)
        built = build_conv2d(w.astype(np.float32), shape, target=Target(target), cache=cache, name=name,
                             on_function=ptxas_counter(name, not as_json))
        if emit_ptx is not None:
            _write_atomically(emit_ptx, specialised_ptx(cache, built).encode())
    stats = dict(built.stats, layer=name, shape=shape.describe())
    if as_json:
        click.echo(json.dumps(stats, indent=2, default=str))
        return
    s = stats
    secs = s["seconds"]
    click.echo(f"{name}: {shape.describe()}")
    groups = s.get("depthwise_groups_a_block")
    click.echo(f"  tiling {s['tiling']}" + (f", {groups} depthwise groups a block" if groups else "")
               + f", target {s['target']}")
    click.echo(f"  weights {s['weights']}, nonzero {s['nonzero_weights']} "
               f"({100 * (1 - s['nonzero_weights'] / s['weights']):.1f}% sparse)")
    click.echo(f"  FMAs kept {s['fmas_kept']}, deleted {s['fmas_deleted']}; PTX lines {s['ptx_lines']}; "
               f"cubin {s['artifact_bytes']} bytes")
    click.echo("  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items())
               + f"; cache hit: template {s['template_cache_hit']}, kernel {s['kernel_cache_hit']}")


def _select(m: PrunedModel, layer_glob: str, min_sparsity: float) -> Tuple[List[ConvLayer], dict]:
    """The layers to compile, and why each other layer is skipped."""
    chosen, skipped = [], {}
    for layer in m.layers:
        if not fnmatch.fnmatchcase(layer.name, layer_glob):
            skipped[layer.name] = f"does not match --layers {layer_glob}"
        elif layer.sparsity < min_sparsity:
            skipped[layer.name] = f"sparsity {layer.sparsity:.2f} < --min-sparsity {min_sparsity}"
        else:
            chosen.append(layer)
    return chosen, skipped


def _describe(layer: ConvLayer) -> str:
    s = layer.shape
    extra = "".join([f" s{s.stride[0]}" if s.stride != (1, 1) else "", f" g{s.groups}" if s.groups > 1 else "",
                     f" d{s.dilation[0]}" if s.dilation != (1, 1) else ""])
    return f"{s.in_channels}->{s.out_channels} {s.kernel_h}x{s.kernel_w} @{s.in_h}x{s.in_w}{extra}"


@main.command()
@model_argument
@format_option
@spec_option
@input_size_option
@layers_option
@min_sparsity_option
def inspect(model: Path, fmt: Optional[str], spec_path: Optional[Path], input_size: Optional[str], layer_glob: str,
            min_sparsity: float) -> None:
    """List a model's conv layers, their sparsity, and what `compile` would build (kernel family, threads).

    Example: sparseconv inspect models/vgg16_pruned.npz --min-sparsity 0.5
    """
    m = load_model_or_exit(model, fmt, spec_path, input_size)
    chosen, skipped = _select(m, layer_glob, min_sparsity)
    click.echo(f"{m.path} ({m.format}): {len(m.layers)} conv layers, {len(chosen)} to compile")
    click.echo(f"{'layer':32s} {'shape':34s} {'sparsity':>8s} {'nonzero':>10s}  action")
    for layer in m.layers:
        action = "skip: " + skipped.get(layer.name, "")
        if layer.name not in skipped:
            try:
                tiling = check_layer(layer.shape)
            except ValueError as exc:  # compile would refuse it: say so here
                action = "refused: " + str(exc).split(": ", 1)[-1]
            else:  # the kernel family its any-batch variant takes (tilings.default_tiling)
                action = f"compile ({tiling.family}, {tiling.threads} threads)"
        click.echo(f"{layer.name[:32]:32s} {_describe(layer)[:34]:34s} {layer.sparsity:8.3f} "
                   f"{int(np.count_nonzero(layer.weight)):>10d}  {action}")
    if m.format == "onnx":  # what `sparseconv run` folds and fuses (compile builds the layers as they are)
        try:
            program = load_program(model, parse_size(input_size, "--input-size") if input_size else None)
        except ModelError as exc:
            click.echo(f"sparseconv run: cannot run this graph ({str(exc).split(': ', 1)[-1]})")
        else:
            for line in fusion_lines(fuse_program(program).convs):
                click.echo(line if line.startswith(" ") else f"sparseconv run: {line}")
    if m.format == "onnx":  # the Gemm/MatMul layers `run` compiles as Linear kernels (runner.linear_layers)
        linears, dense, gemvs = linear_layers(read_onnx(model, parse_size(input_size, "--input-size")
                                                        if input_size else None))
        for name, layer in linears.items():
            s = layer.shape
            click.echo(f"{name[:32]:32s} {f'Linear {s.in_channels}->{s.out_channels}':34s} {layer.sparsity:8.3f} "
                       f"{int(np.count_nonzero(layer.weight)):>10d}  run: Linear kernel (not in `compile`)")
        for name, why in dense.items():
            gemv = gemvs.get(name)
            how = "dense" if gemv is None else f"{'not compiled' if gemv.sparse else 'dense'} ({gemv.describe()})"
            click.echo(f"{name[:32]:32s} {'Gemm/MatMul':34s} {'':8s} {'':>10s}  run: {how}, {why}")
    if m.format == "onnx":
        click.echo(f"fx front end (`run`, `bench --network`): {_fx_view(model, input_size)}")


def _fx_view(model: Path, input_size: Optional[str]) -> str:
    """Whether onnx_torch converts this ONNX file, so that `bench --network`
    can time it and `run` compiles it through the fx front end, in a line."""
    try:
        from .onnx_torch import onnx_to_torch  # torch: imported only here, inspect runs without it
    except ImportError:
        return "needs torch (pip install torch) to convert the graph; `run` uses the ONNX runner"
    try:
        module, shape = onnx_to_torch(model, parse_size(input_size, "--input-size") if input_size else None)
    except ModelError as exc:
        return (f"cannot convert it ({str(exc).split(': ', 1)[-1].split('; ')[0]}); `run` uses the ONNX runner, "
                "`bench --network` cannot time it")
    convs = sum(type(m).__name__ == "Conv2d" for m in module.modules())
    return (f"converts to a torch.fx graph of {convs} conv{'s' if convs != 1 else ''}, "
            f"input (N, {', '.join(map(str, shape))})")


@main.command()
@model_argument
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (default: <model>_sparseconv next to the model).")
@format_option
@spec_option
@input_size_option
@layers_option
@min_sparsity_option
@jobs_option
@target_option
@cache_dir_option
@click.option("--allow-nonfinite", is_flag=True, help="Accept NaN/Inf weights (refused by default).")
@json_option
def compile(model: Path, output: Optional[Path], fmt: Optional[str], spec_path: Optional[Path],
            input_size: Optional[str], layer_glob: str, min_sparsity: float, jobs: Optional[int], target: str,
            cache_dir: Optional[Path], allow_nonfinite: bool, as_json: bool) -> None:
    """Compile a pruned model's conv layers into specialised kernels.

    Writes one .ptx and one .cubin per layer (plus its bias as .npy) and a
    manifest.json into the output folder; nothing is written if any input is
    bad. An existing output folder is replaced only if it holds a previous
    bundle and nothing else. Needs nvcc and ptxas, no GPU. Example:

        sparseconv compile models/vgg16_pruned.npz -o build/vgg16 --min-sparsity 0.5
    """
    out_dir = output or model.with_name(model.stem + "_sparseconv")
    with _errors():
        check_output_dir(out_dir)  # before the model: a bad -o costs nothing
        _check_cache_dir(cache_dir)
    m = load_model_or_exit(model, fmt, spec_path, input_size)
    chosen, skipped = _select(m, layer_glob, min_sparsity)
    if not chosen:
        raise click.UsageError(f"{model}: no layer left to compile ({len(skipped)} skipped by the filters)")
    for layer in chosen:
        with _errors(f"{model}: layer {layer.name}"):
            check_layer(layer.shape)
        bad = [what for what, a in (("weight", layer.weight), ("bias", layer.bias))
               if a is not None and not np.isfinite(a).all()]
        if bad and not allow_nonfinite:
            raise click.UsageError(f"{model}: layer {layer.name}: {bad[0]} has NaN or Inf values "
                                   "(pass --allow-nonfinite to compile it anyway)")
    with _errors(str(model)):
        cache = ArtifactCache(cache_dir)
        built = build_many([LayerJob(layer.name, layer.weight, layer.shape) for layer in chosen],
                           target=Target(target), cache_dir=str(cache.root), workers=jobs)
        manifest = write_bundle(out_dir, m, chosen, built, target=Target(target), cache=cache, skipped=skipped)
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
        return
    click.echo(f"{'layer':32s} {'shape':30s} {'sparsity':>8s} {'nonzero':>9s} {'FMAs deleted':>13s} "
               f"{'compile s':>9s}  cache")
    for e in manifest["layers"]:
        layer = next(x for x in chosen if x.name == e["name"])
        click.echo(f"{e['name'][:32]:32s} {_describe(layer)[:30]:30s} {e['sparsity']:8.3f} "
                   f"{e['nonzero_weights']:9d} {e['fmas_deleted']:13d} {e['wall_s']:9.2f}  "
                   f"{'hit' if e['cache_hit'] else 'miss'}")
    for name, why in skipped.items():
        click.echo(f"{name[:32]:32s} skipped: {why}")
    click.echo(f"wrote {len(manifest['layers'])} layers to {out_dir}")


@main.command()
@model_argument
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Inputs as .npy, or .npz with an input array and optional labels.")
@click.option("--input-key", default=None, help="Input array in the .npz (default: the graph input's name, "
              "x, image(s), input or data).")
@click.option("--label-key", default=None, help="Label array in the .npz (default: label(s), y or target).")
@input_size_option
@click.option("--batch-size", type=click.IntRange(1), default=256, show_default=True)
@click.option("--backend", type=click.Choice(["sparseconv", "auto", "reference"]), default="sparseconv",
              show_default=True, help="auto: per layer, cuDNN strict fp32 where it measured faster (needs torch); "
              "reference: the dense float64 model on the CPU, no GPU needed.")
@click.option("--autotune", is_flag=True, help="Choose each layer's tiling by timing candidates (cached).")
@route_option
@route_batch_option
@click.option("--table/--no-table", default=True, show_default=True,
              help="With --route, also time each conv through the weight-table family (sparseconv.table) at the "
              "--route-batch sizes of at most 8 images, and run those sizes through it where it is the fastest.")
@click.option("--cuda-graph", is_flag=True, help="Capture the forward once per batch shape as a CUDA graph and "
              "replay it (fewer launch gaps; a shape that cannot be captured runs eagerly, and the output says "
              "why).")
@click.option("--front-end", type=click.Choice(FRONT_ENDS), default="auto", show_default=True,
              help="fx: the graph converted to torch.fx and put through the passes of sparseconv.torch.sparsify "
              "(needs torch with CUDA); runner: the ONNX runner (CuPy operators, more ONNX operators); auto: fx "
              "where torch with CUDA is installed and the conversion takes every node, else the runner.")
@click.option("--check", is_flag=True, help="Also run the dense float64 reference and compare predictions.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the model's first output for every input to this .npy file.")
@jobs_option
@cache_dir_option
@json_option
def run(model: Path, data_path: Path, input_key: Optional[str], label_key: Optional[str], input_size: Optional[str],
        batch_size: int, backend: str, autotune: bool, route: bool, route_batches: Tuple[int, ...], table: bool,
        cuda_graph: bool, front_end: str, check: bool, output: Optional[Path], jobs: Optional[int],
        cache_dir: Optional[Path], as_json: bool) -> None:
    """Run an ONNX model end to end, every Conv a sparseconv kernel on the GPU.

    The graph is converted to torch.fx and compiled by the passes of the
    PyTorch drop-in where torch with CUDA is installed and the conversion
    covers every node; else the ONNX runner runs the other operators as CuPy
    code (sparseconv/runner.py lists them). The output says which. Prints
    accuracy when the data has labels. Example:

        sparseconv run models/lenet_digits_pruned.onnx --data models/digits_test.npz --check
    """
    if autotune and backend == "reference":
        raise click.UsageError("--autotune times GPU kernels; it does not apply to --backend reference")
    if cuda_graph and backend == "reference":
        raise click.UsageError("--cuda-graph replays GPU work; it does not apply to --backend reference")
    if front_end == "fx" and backend == "reference":
        raise click.UsageError("--front-end fx chooses how the GPU runs the model; --backend reference runs the "
                               "ONNX graph as written on the CPU")
    check_output_file(output, "-o", ".npy")
    try:
        if not model.is_file():
            raise ModelError(f"{model}: no such file")
        if detect_format(model) != "onnx":
            raise ModelError(f"{model}: `sparseconv run` needs an ONNX model (it runs the whole graph); for a "
                             "PyTorch model use sparseconv.torch.sparsify(model, example_input)")
        program = load_program(model, parse_size(input_size, "--input-size") if input_size else None)
        x, labels = load_data(data_path, program, input_key, label_key)
    except ModelError as exc:
        raise click.UsageError(str(exc)) from None
    summary: dict = {"model": str(model), "data": str(data_path), "images": len(x), "backend": backend}
    reference = None
    if backend == "reference" or check:
        t = time.perf_counter()
        reference = predict(lambda b: run_reference(program, b)[0], x, batch_size)
        summary["reference_s"] = round(time.perf_counter() - t, 4)
    if backend == "reference":
        y = reference
    else:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() == 0:
                raise RuntimeError("no device found")
        except Exception as exc:
            raise click.ClickException(f"no usable CUDA GPU ({type(exc).__name__}: {exc}); "
                                       "`--backend reference` runs the dense model on the CPU") from None
        try:
            t = time.perf_counter()
            sparse = compile_model(model, front_end=front_end,
                                   input_size=program.input_shape[2:] if input_size else None,
                                   cache_dir=None if cache_dir is None else str(cache_dir), jobs=jobs,
                                   progress=not as_json, tiling="auto" if autotune else None,
                                   backend=backend, tune_batch=batch_size, cuda_graph=cuda_graph,
                                   route_batches=tuple(route_batches) if route else None, table=table)
            summary["compile_s"] = round(time.perf_counter() - t, 4)
        except CompileError as exc:
            raise click.ClickException(_tool_failure(exc)) from None
        except (ToolNotFoundError, CacheError) as exc:
            raise click.ClickException(str(exc)) from None
        except (ModelError, ValueError) as exc:
            raise click.UsageError(str(exc).splitlines()[0]) from None
        predict(sparse, x[:batch_size], batch_size)  # warm-up: first launches load the modules
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        y = predict(sparse, x, batch_size)
        summary["run_s"] = round(time.perf_counter() - t, 4)
        summary["front_end"] = sparse.front_end
        if sparse.front_end_note:
            summary["front_end_note"] = sparse.front_end_note
        summary["conv_layers"] = len(sparse.kernels)
        summary["layers"] = {name: {"backend": k.backend, "tiling": k.stats["tiling"],
                                    "tuning": k.stats.get("tuning"), "route": _route_summary(sparse.routes.get(name)),
                                    "fused": list(sparse.fused(name))}
                             for name, k in sparse.kernels.items()}
        if sparse.route_note:
            summary["routing"] = sparse.route_note
        if cuda_graph:
            summary["cuda_graphs"] = {"x".join(map(str, s)): note for s, note in sparse.graph_notes.items()}
    summary["output_shape"] = list(y.shape)
    if labels is not None and y.ndim == 2:
        summary["accuracy"] = float(np.mean(y.argmax(1) == labels))
    if check and backend != "reference":
        same = int(np.sum(y.argmax(1) == reference.argmax(1))) if y.ndim == 2 else None
        err = float(np.linalg.norm(y - reference) / max(np.linalg.norm(reference), 1e-30))
        summary.update(same_predictions=same, relative_l2_vs_reference=err)
    if output is not None:
        buf = io.BytesIO()
        np.save(buf, y.astype(np.float32))
        _write_atomically(output, buf.getvalue())
        summary["output"] = str(output)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"{model.name}: {len(x)} inputs through {backend}"
               + (f" (front end: {summary['front_end']})" if "front_end" in summary else "")
               + (f" ({summary['conv_layers']} conv layers compiled; compile+load "
                  f"{summary['compile_s']:.2f} s, run {summary['run_s']:.3f} s)" if backend != "reference" else ""))
    if backend != "reference":
        for line in sparse.fusion_lines()[:1]:  # the totals; per conv in --json and the model's plan
            click.echo(line)
        if sparse.front_end_note:
            click.echo(f"front end: {sparse.front_end_note}")
    if backend == "auto" or autotune:
        for name, info in summary["layers"].items():
            times = info["tuning"]["times_us"]
            click.echo(f"  {name}: {info['backend']}, tiling {info['tiling']}; timed (us): "
                       + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    if backend != "reference" and (sparse.routes or sparse.route_note or cuda_graph):
        for line in sparse.plan:
            click.echo(f"  {line}")
    if "accuracy" in summary:
        click.echo(f"accuracy: {summary['accuracy']:.4f} ({int(round(summary['accuracy'] * len(x)))}/{len(x)})")
    if "same_predictions" in summary:
        click.echo(f"vs dense float64 reference: same prediction for {summary['same_predictions']}/{len(x)}, "
                   f"relative L2 of outputs {summary['relative_l2_vs_reference']:.2e}")
    if output is not None:
        click.echo(f"wrote {output}")


def _route_summary(choice: Optional[RouteChoice]) -> Optional[dict]:
    """A layer's measured route for the JSON summary (None: not routed)."""
    if choice is None:
        return None
    table = dict(choice.table_us)  # batch -> the weight table's time, where it was timed
    times = [{"batch": b, "sparseconv": s, **({"table": table[b]} if b in table else {}), "cudnn_fp32": d}
             for b, s, d in choice.times_us]
    return {"action": choice.action, "route": choice.describe_route(), "note": choice.note, "times_us": times}


@main.group()
def cache() -> None:
    """List, verify or clear the artifact cache."""


def _cache(cache_dir: Optional[Path]) -> ArtifactCache:
    try:
        return ArtifactCache(cache_dir)
    except CacheError as exc:
        raise click.ClickException(str(exc)) from None


@cache.command("ls")
@cache_dir_option
def cache_ls(cache_dir: Optional[Path]) -> None:
    """List cache entries. Example: sparseconv cache ls"""
    c = _cache(cache_dir)
    entries = c.entries()
    for e in entries:
        click.echo(f"{e.kind:9s} {e.key[:16]}{e.suffix:7s} {e.size:10d} {'ok' if e.ok else 'CORRUPT'}")
    click.echo(f"{len(entries)} entries in {c.root}")


@cache.command("verify")
@cache_dir_option
def cache_verify(cache_dir: Optional[Path]) -> None:
    """Check every entry's hash; exit 1 if any is corrupt. Example: sparseconv cache verify"""
    c = _cache(cache_dir)
    bad = c.verify()
    for e in bad:
        click.echo(f"corrupt: {e.path}")
    click.echo(f"{len(c.entries())} entries, {len(bad)} corrupt (corrupt entries are rebuilt on next use)")
    sys.exit(1 if bad else 0)


@cache.command("clear")
@cache_dir_option
def cache_clear(cache_dir: Optional[Path]) -> None:
    """Remove every cache entry. Example: sparseconv cache clear"""
    c = _cache(cache_dir)
    removed = c.clear()
    left = len(c.entries())
    if left:  # a read-only cache: say so, not "removed"
        raise click.ClickException(f"removed {removed} files from {c.root}, but {left} entries are left "
                                   "(read-only folder or no permission?)")
    click.echo(f"removed {removed} files from {c.root}")


# `sparseconv bench` lives in its own module (it needs torch/matplotlib only when run).
from .benchmark.cli import bench  # noqa: E402

main.add_command(bench)
