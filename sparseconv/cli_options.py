"""Command-line pieces shared by every command (cli.py, the bench CLI):
option declarations and argument parsing that turn bad input into a click
usage error (exit 2, one line)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional, Tuple

import click

from .limits import MAX_INDEX
from .model import FORMATS, ModelError, PrunedModel, load_model
from .shapes import Target


def invoked_command(argv: Optional[list] = None) -> str:
    """The command line as a user would type it again, for result files:
    `sparseconv ...` from the console script or `python -m sparseconv`,
    `python script.py ...` from a script."""
    argv = sys.argv if argv is None else argv
    name = Path(argv[0]).name
    prefix = ["sparseconv"] if name in ("sparseconv", "__main__.py") else \
        ["python", argv[0]] if name.endswith(".py") else [name]
    return " ".join(shlex.quote(a) for a in prefix + list(argv[1:]))


def parse_size(text: str, what: str, minimum: int = 1) -> Tuple[int, int]:
    """'56' -> (56, 56); '56x28' -> (56, 28). Each part from `minimum` to
    2**31-1 (the kernels index in 32-bit ints; see sparseconv.limits)."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        raise click.BadParameter(f"{what} must look like 56 or 56x28, got {text!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise click.BadParameter(f"{what} must look like 56 or 56x28, got {text!r}")
    if not all(minimum <= p <= MAX_INDEX for p in parts):
        raise click.BadParameter(f"{what} must be between {minimum} and {MAX_INDEX}, got {text!r}")
    return parts[0], parts[1]


def check_output_file(path: Optional[Path], what: str, suffix: Optional[str] = None) -> None:
    """Before any work: an output file's folder must exist and not be a file,
    and the path itself must not be a folder."""
    if path is None:
        return
    if suffix is not None and path.suffix != suffix:
        raise click.BadParameter(f"{path}: the output file must end in {suffix}", param_hint=what)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise click.BadParameter(f"{path}: the folder {parent} does not exist", param_hint=what)
    if path.is_dir():
        raise click.BadParameter(f"{path}: is a folder; give a file name", param_hint=what)


def _target(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        Target(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


model_argument = click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
format_option = click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
                             help="Model format (default: from the extension or the first bytes).")
spec_option = click.option("--spec", "spec_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                           help="Layer spec JSON for .npz models without a __spec__ entry.")
input_size_option = click.option("--input-size", default=None,
                                 help="Input H x W when the model does not fix it, e.g. 224 or 224x224.")
layers_option = click.option("--layers", "layer_glob", default="*", show_default=True,
                             help="Only layers whose name matches this glob.")
min_sparsity_option = click.option("--min-sparsity", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                                   help="Skip layers less sparse than this (they are better left to cuDNN).")


def load_model_or_exit(model: Path, fmt: Optional[str], spec_path: Optional[Path], input_size: Optional[str]) -> PrunedModel:
    try:
        return load_model(model, fmt, spec_path, parse_size(input_size, "--input-size") if input_size else None)
    except ModelError as exc:
        raise click.UsageError(str(exc)) from None


cache_dir_option = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                                help="Artifact cache (default: $SPARSECONV_CACHE_DIR or ptx_cache/).")
jobs_option = click.option("--jobs", type=click.IntRange(1, 1024), default=None,
                           help="Parallel layer builds (default: CPU count).")
target_option = click.option("--target", default="sm_90", show_default=True, callback=_target,
                             help="GPU architecture to build for, as nvcc spells it.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
route_option = click.option("--route/--no-route", default=True, show_default=True,
                            help="Time each compiled conv against cuDNN strict fp32 at the --route-batch sizes and "
                            "run each batch size through the faster path (needs torch with CUDA; without it every "
                            "conv keeps its kernel, and the output says so).")
route_batch_option = click.option("--route-batch", "route_batches", type=click.IntRange(1), multiple=True,
                                  default=(1, 64), show_default=True,
                                  help="A batch size to time both paths at for --route; repeat for several.")
