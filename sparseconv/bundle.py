"""A compiled bundle: one folder holding each layer's specialised .ptx, its
.cubin (or .ptx when no ptxas was found), its bias as .npy, and a
manifest.json describing them. Written whole or not at all.

    model = load_model("models/vgg16_pruned.npz")
    manifest = compile_bundle(model, "build/vgg16")   # or: check_output_dir,
                                                      # build_many, write_bundle

Safety rules, checked before anything is compiled (check_output_dir) and again
at the swap:
  * an existing folder is replaced only when it holds a previous bundle and
    nothing else (manifest.json and the files it names), so a user's folder
    that merely contains a manifest.json is never deleted;
  * the new folder is filled under a temporary name next to the target and
    renamed into place, so readers see the old bundle or the new one, and a
    failure or SIGTERM leaves the old one (or nothing);
  * concurrent writers to one folder take turns (an flock on the parent folder)
    and leftovers of killed writers are removed by the next one.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import numpy as np

from .build import CompiledLayer
from .cache import ArtifactCache, CacheError
from .model import ConvLayer, PrunedModel, slug
from .parallel import LayerJob, build_many
from .shapes import Target

MANIFEST = "manifest.json"
# Layer names can be long (ONNX paths); file names stay well under the 255-byte limit.
MAX_STEM = 100


class BundleError(ValueError):
    """The output folder cannot be written: says which folder and what to do."""


def layer_stem(index: int, name: str) -> str:
    """File stem of layer `index`: its position keeps stems unique even when
    long names are cut short."""
    return f"{index:03d}_{slug(name)[:MAX_STEM]}"


def specialised_ptx(cache: ArtifactCache, built: CompiledLayer) -> str:
    ptx = cache.get_text("kernel", built.ptx_sha256, ".ptx")
    if ptx is None:
        raise CacheError(f"layer {built.name}: its specialised PTX {built.ptx_sha256[:12]} vanished "
                         "from the cache; run again")
    return ptx


def _bundle_files(folder: Path) -> Optional[set]:
    """The file names a previous bundle in `folder` consists of, or None when
    the folder does not hold exactly one (a foreign manifest.json, other files)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        names = {MANIFEST}
        for e in manifest["layers"]:
            names.update(v for k, v in e.items() if k in ("ptx", "binary", "bias") and v is not None)
        present = {p.name for p in folder.iterdir()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(isinstance(n, str) for n in names) or not present <= names:
        return None
    if not all((folder / n).is_file() and not (folder / n).is_symlink() for n in present):
        return None
    return names


def check_output_dir(out_dir: Path) -> Path:
    """Raise BundleError unless `out_dir` can take a bundle: missing (under a
    writable folder), empty, or holding a previous bundle and nothing else.
    Returns the absolute path. Leaves nothing behind (it makes and removes
    one empty folder to see that it can)."""
    out = Path(os.path.abspath(out_dir))
    if out.is_symlink():
        raise BundleError(f"{out_dir}: is a symbolic link; give the folder itself as -o")
    if out.exists() and not out.is_dir():
        raise BundleError(f"{out_dir}: exists and is not a folder; choose another -o")
    cwd = Path(os.path.abspath(os.getcwd()))
    if out == cwd or out in cwd.parents:
        raise BundleError(f"{out_dir}: is the current folder (or holds it); choose a folder of its own as -o")
    if out.is_dir():
        # Under the writers' lock (see _swap_in): a concurrent writer swapping its
        # bundle in between iterdir and the manifest read made this refuse a bundle.
        with _locked(out.parent):
            foreign = out.is_dir() and any(out.iterdir()) and _bundle_files(out) is None
        if foreign:
            raise BundleError(f"{out_dir}: exists and holds files that are not a sparseconv bundle; refusing to "
                              "write into it (choose another -o, or empty the folder)")
    # The parent, where the new bundle is made: a probe inside `out` itself
    # would show a concurrent writer a folder that is not only a bundle.
    check_writable_folder(out.parent, f"{out_dir}: ", "choose another -o")
    return out


def check_writable_folder(folder: Path, prefix: str = "", advice: str = "choose another folder") -> None:
    """Raise BundleError unless `folder` exists as a writable folder or can be
    made: the real question, asked before a long build rather than after. It
    makes and removes one empty folder in the nearest existing ancestor."""
    existing = Path(os.path.abspath(folder))
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BundleError(f"{prefix}{existing} is a file, not a folder; {advice}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".sparseconv.probe-{os.getpid()}-", dir=existing))
    except OSError as exc:
        raise BundleError(f"{prefix}cannot write in {existing} ({exc.strerror or exc}); {advice}") from None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Exclusive flock on a folder: writers to bundles in it take turns at the
    swap. (Linux/macOS; elsewhere the swap still retries, see _swap_in.)"""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(out: Path) -> None:
    """Temporary and old folders of writers that died (SIGKILL) before cleaning up."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)(?:-|$)")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _swap_in(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    with _locked(out.parent):
        _remove_leftovers(out)
        moved = False
        if out.is_dir() and not out.is_symlink():
            if any(out.iterdir()) and _bundle_files(out) is None:  # changed since check_output_dir
                raise BundleError(f"{out}: now holds files that are not a sparseconv bundle; left untouched")
            os.replace(out, old)
            moved = True
        elif out.exists() or out.is_symlink():
            raise BundleError(f"{out}: exists and is not a folder; left untouched")
        try:
            os.replace(tmp, out)
        except OSError:
            if moved:
                os.replace(old, out)  # put the previous bundle back
            raise
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def manifest_entry(layer: ConvLayer, built: CompiledLayer, stem: str) -> Dict[str, Any]:
    st = built.stats
    return {
        "name": layer.name, "ptx": f"{stem}.ptx", "binary": f"{stem}{built.artifact_suffix}",
        "bias": f"{stem}.bias.npy" if layer.bias is not None else None,
        "shape": layer.shape.as_dict(), "tiling": st["tiling"], "sparsity": layer.sparsity,
        "nonzero_weights": st["nonzero_weights"], "weights": st["weights"],
        "fmas_deleted": st["fmas_deleted"], "fmas_kept": st["fmas_kept"], "ptx_lines": st["ptx_lines"],
        "seconds": st["seconds"], "wall_s": st["wall_s"], "cache_hit": st["kernel_cache_hit"],
        "ptx_sha256": built.ptx_sha256, "template_key": st["template_key"], "kernel_key": st["kernel_key"]}


def write_bundle(out_dir: Path, model: PrunedModel, layers: Sequence[ConvLayer],
                 built: Mapping[str, CompiledLayer], *, target: Target, cache: ArtifactCache,
                 skipped: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Write the bundle of `layers` (built: layer name -> CompiledLayer, as
    build_many returns) into out_dir, replacing a previous bundle there.
    Returns the manifest. Raises BundleError (folder problems) or CacheError."""
    out = check_output_dir(out_dir)
    manifest: Dict[str, Any] = {"model": str(model.path), "format": model.format, "target": target.arch,
                                "layers": [], "skipped": dict(skipped or {})}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as exc:
        raise BundleError(f"{out_dir}: cannot create the output folder ({exc.strerror or exc})") from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a bundle gets the usual folder mode
        for i, layer in enumerate(layers):
            b = built[layer.name]
            stem = layer_stem(i, layer.name)
            (tmp / f"{stem}.ptx").write_text(specialised_ptx(cache, b))
            (tmp / f"{stem}{b.artifact_suffix}").write_bytes(b.artifact)
            if layer.bias is not None:
                np.save(tmp / f"{stem}.bias.npy", layer.bias)
            manifest["layers"].append(manifest_entry(layer, b, stem))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _swap_in(tmp, out)
    except OSError as exc:
        raise BundleError(f"{out_dir}: cannot write the bundle ({exc.strerror or exc}); nothing was "
                          "changed") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def compile_bundle(model: PrunedModel, out_dir: Path, *, layers: Optional[Sequence[ConvLayer]] = None,
                   target: Optional[Target] = None, cache_dir: Optional[str] = None, jobs: Optional[int] = None,
                   progress: bool = True, skipped: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Build `layers` (default: all of the model's) in parallel and write
    them as a bundle into out_dir; the Python form of `sparseconv compile`.
    The folder is checked before anything is built. progress (default on):
    the build's bar on stderr; progress=False is silent."""
    target = target or Target()
    check_output_dir(out_dir)
    layers = list(model.layers if layers is None else layers)
    cache = ArtifactCache(cache_dir)
    built = build_many([LayerJob(x.name, x.weight, x.shape) for x in layers], target=target,
                       cache_dir=str(cache.root), workers=jobs, progress=progress)
    return write_bundle(out_dir, model, layers, built, target=target, cache=cache, skipped=skipped)
