"""Command line: `sparseconv layer` builds one pruned layer's kernel; `sparseconv cache` manages artifacts.

Exit codes: 0 success, 2 bad input (with a one-line reason on stderr)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Tuple

import click
import numpy as np

from .build import build_conv2d
from .cache import ArtifactCache, CacheError
from .compile import CompileError, ToolNotFoundError
from .kernel import shape_from_weight
from .shapes import Target


def _size(text: str, what: str) -> Tuple[int, int]:
    """'56' -> (56, 56); '56x28' -> (56, 28)."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        raise click.BadParameter(f"{what} must look like 56 or 56x28, got {text!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise click.BadParameter(f"{what} must look like 56 or 56x28, got {text!r}")
    return parts[0], parts[1]


def _load_npy(path: Path, what: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"{path}: cannot read {what} as a .npy array ({exc})") from None


@click.group()
@click.version_option(package_name="sparseconv")
def main() -> None:
    """sparseconv: compile pruned conv layers into weight-specialised CUDA kernels."""


@main.command()
@click.argument("weight_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--input-size", required=True, help="Input H x W, e.g. 56 or 56x28.")
@click.option("--stride", default="1", show_default=True, help="Stride, e.g. 2 or 2x1.")
@click.option("--padding", default="0", show_default=True, help="Zero padding, e.g. 1 or 1x2.")
@click.option("--dilation", default="1", show_default=True, help="Dilation, e.g. 1 or 2x2.")
@click.option("--groups", default=1, show_default=True, type=int, help="Convolution groups.")
@click.option("--target", default="sm_90", show_default=True, help="GPU architecture to build for.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Artifact cache (default: $SPARSECONV_CACHE_DIR or ptx_cache/).")
@click.option("--emit-ptx", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the specialised PTX here.")
@click.option("--json", "as_json", is_flag=True, help="Print the stats as JSON.")
def layer(weight_file: Path, input_size: str, stride: str, padding: str, dilation: str, groups: int,
          target: str, cache_dir: Optional[Path], emit_ptx: Optional[Path], as_json: bool) -> None:
    """Build the specialised kernel of one layer from a (K, C/groups, R, S) .npy weight file.

    Needs nvcc and ptxas, no GPU. Example:

        sparseconv layer models/layer3.npy --input-size 56 --padding 1
    """
    name = weight_file.stem
    w = _load_npy(weight_file, "the weights")
    if w.dtype.kind != "f":
        raise click.UsageError(f"{weight_file}: weights must be floating point, got dtype {w.dtype}")
    try:
        shape = shape_from_weight(w, _size(input_size, "--input-size"), _size(stride, "--stride"),
                                  _size(padding, "--padding"), _size(dilation, "--dilation"), groups)
        built = build_conv2d(w.astype(np.float32), shape, target=Target(target),
                             cache=ArtifactCache(cache_dir), name=name)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(f"{weight_file}: {exc}") from None
    except (ToolNotFoundError, CacheError) as exc:
        raise click.ClickException(str(exc)) from None
    except CompileError as exc:
        raise click.ClickException(f"{weight_file}: {exc}") from None
    if emit_ptx is not None:
        cache = ArtifactCache(cache_dir)
        ptx = cache.get_text("kernel", built.ptx_sha256, ".ptx")
        if ptx is None:
            raise click.ClickException(f"specialised PTX {built.ptx_sha256} vanished from the cache; run again")
        emit_ptx.write_text(ptx)
    stats = dict(built.stats, layer=name, shape=shape.describe())
    if as_json:
        click.echo(json.dumps(stats, indent=2, default=str))
        return
    s = stats
    secs = s["seconds"]
    click.echo(f"{name}: {shape.describe()}")
    click.echo(f"  tiling {s['tiling']}, target {s['target']}")
    click.echo(f"  weights {s['weights']}, nonzero {s['nonzero_weights']} "
               f"({100 * (1 - s['nonzero_weights'] / s['weights']):.1f}% sparse)")
    click.echo(f"  FMAs kept {s['fmas_kept']}, deleted {s['fmas_deleted']}; PTX lines {s['ptx_lines']}; "
               f"cubin {s['artifact_bytes']} bytes")
    click.echo("  seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items())
               + f"; cache hit: template {s['template_cache_hit']}, kernel {s['kernel_cache_hit']}")


@main.group()
def cache() -> None:
    """List, verify or clear the artifact cache."""


def _cache(cache_dir: Optional[Path]) -> ArtifactCache:
    try:
        return ArtifactCache(cache_dir)
    except CacheError as exc:
        raise click.ClickException(str(exc)) from None


cache_dir_option = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                                help="Cache folder (default: $SPARSECONV_CACHE_DIR or ptx_cache/).")


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
    click.echo(f"removed {c.clear()} files from {c.root}")
