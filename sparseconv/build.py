"""The pipeline, CPU side: render -> compile (cached) -> specialise -> assemble (cached).

Needs nvcc (and ptxas for a cubin) but no GPU, so the CLI and CI can build
artifacts anywhere. Loading and calling happen in sparseconv.runtime; nothing
here imports it (or CuPy).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from . import __version__
from .assemble import assemble_cubin, have_ptxas
from .cache import ArtifactCache, cache_key
from .compile import NVCC_FLAGS, compile_to_ptx, tool_identity
from .render import ENTRY_NAME, render
from .shapes import (ConvShape, Epilogue, Target, Tiling, launch_grid, max_batch_per_launch, dynamic_shared_bytes,
                     kernel_shape, n_chunks, n_kblocks, staged_input_bytes)
from .tilings import default_tiling, pooled_tiling, pools_in_kernel
from .specialise import analyse_template, specialise

# The source files whose code decides a kernel artifact beyond what its key
# already names (the rendered template, the tools and their flags): the pass,
# the PTX parser it uses, the placeholder -> weight mapping (render.py), the
# block/chunk arithmetic (shapes.py) and ptxas's driver (assemble.py).
_ARTIFACT_SOURCES = ("specialise/*.py", "ptx.py", "render.py", "shapes.py", "assemble.py")


def code_fingerprint(patterns: Tuple[str, ...], root: Optional[Path] = None) -> str:
    """sha256 over the package's source files matching `patterns` (names and
    contents, in sorted order): any edit to the code that produces an artifact
    changes the keys it is cached under, as Triton hashes its compiler sources."""
    root = root or Path(__file__).resolve().parent
    return _fingerprint(_source_files(patterns, root), root)


def _source_files(patterns: Tuple[str, ...], root: Path) -> List[Tuple[str, bytes]]:
    """(path relative to root, contents) of each file matching `patterns`, sorted by path."""
    files = sorted({f for pattern in patterns for f in root.glob(pattern)})
    return [(f.relative_to(root).as_posix(), f.read_bytes()) for f in files]


def _fingerprint(sources: List[Tuple[str, bytes]], root: Path) -> str:
    if not sources:
        raise RuntimeError(f"sparseconv's source files are missing under {root}; reinstall sparseconv")
    return cache_key("code", *[part for name, data in sources for part in (name, data)])


def _digests(sources: List[Tuple[str, bytes]]) -> Dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in sources}


# The artifact sources as this process imported them, read once: the
# fingerprint every kernel and tuning key carries, and the digests that tell
# when the files change under the process (sources_changed_since_import).
_PACKAGE_ROOT = Path(__file__).resolve().parent
_IMPORTED_SOURCES = _source_files(_ARTIFACT_SOURCES, _PACKAGE_ROOT)
SPECIALISER_FINGERPRINT = _fingerprint(_IMPORTED_SOURCES, _PACKAGE_ROOT)
_IMPORTED_SOURCE_DIGESTS = _digests(_IMPORTED_SOURCES)


def sources_changed_since_import() -> List[str]:
    """The artifact sources (_ARTIFACT_SOURCES) whose files on disk differ from
    what this process imported (an edit of an editable install, an upgrade).
    Builds in this process then key by the imported code and build workers,
    fresh processes, by the code on disk, so neither finds the other's cache
    entries: a warm rebuild misses (seen in sessions 42 and 46)."""
    now = _digests(_source_files(_ARTIFACT_SOURCES, _PACKAGE_ROOT))
    return sorted(f for f in now.keys() | _IMPORTED_SOURCE_DIGESTS.keys()
                  if now.get(f) != _IMPORTED_SOURCE_DIGESTS.get(f))


@dataclass(frozen=True)
class CompiledLayer:
    """Everything needed to launch one specialised layer."""

    name: str
    shape: ConvShape
    tiling: Tiling
    target: Target
    entry: str
    artifact: bytes            # cubin, or PTX when no ptxas was found
    artifact_suffix: str       # '.cubin' or '.ptx'
    ptx_sha256: str            # content hash naming the cached specialised PTX
    stats: Dict[str, object] = field(hash=False, compare=False)
    epilogue: Epilogue = Epilogue()

    @property
    def grid_tiles(self) -> int:
        return -(-self.shape.out_h // self.tiling.tile_h) * -(-self.shape.out_w // self.tiling.tile_w)

    def grid(self, batch: int) -> Tuple[int, int, int]:
        """The launch grid for `batch` images (shapes.launch_grid)."""
        return launch_grid(self.shape, self.tiling, batch)

    @property
    def max_batch_per_launch(self) -> int:
        """Images one launch may take (shapes.max_batch_per_launch)."""
        return max_batch_per_launch(self.shape, self.tiling)

    @property
    def kblocks(self) -> int:
        return n_kblocks(self.shape, self.tiling)

    @property
    def chunks(self) -> int:
        return n_chunks(self.shape, self.tiling)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory to launch with: the input patch, and a split
        k-block's loop state where it did not fit in static shared memory
        (specialise.pieces.PieceState)."""
        return int(self.stats.get("launch_shared_bytes", dynamic_shared_bytes(self.shape, self.tiling)))


def template_cache_key(source: str, target: Target) -> str:
    return cache_key("template", __version__, source, target.arch, tool_identity("nvcc"), " ".join(NVCC_FLAGS))


def artifact_key(ptx_sha: str, assembler: str, tiling: Tiling) -> str:
    """The cache key of a cubin: its PTX's hash and the ptxas flags that made
    it. Tilings that differ only in Tiling.ptxas_level share their PTX but not
    their cubin; keyed by the PTX alone, one would be served the other's."""
    return cache_key("cubin", ptx_sha, assembler, f"-O{tiling.ptxas_level}", f"-maxrregcount={tiling.max_registers}")


def _cached_artifact(cache: ArtifactCache, index: dict, suffix: str, assembler: str,
                     tiling: Tiling) -> Optional[bytes]:
    """The artifact a kernel index names, if its specialised PTX (which the CLI
    writes out and `compile` bundles) and the artifact are both in the cache
    and intact; None (so the caller rebuilds both) otherwise."""
    sha = index.get("ptx_sha256")
    if not isinstance(sha, str) or not isinstance(index.get("stats"), dict):
        return None
    try:
        ptx = cache.get("kernel", sha, ".ptx")
    except ValueError:  # not a key at all
        return None
    if ptx is None or hashlib.sha256(ptx).hexdigest() != sha:
        return None
    return ptx if suffix == ".ptx" else cache.get("kernel", artifact_key(sha, assembler, tiling), suffix)


def build_conv2d(weight: np.ndarray, shape: ConvShape, *, tiling: Optional[Tiling] = None,
                 target: Optional[Target] = None, cache: Optional[ArtifactCache] = None,
                 name: str = "conv", epilogue: Epilogue = Epilogue(),
                 on_function: Optional[Callable[[int, int], None]] = None) -> CompiledLayer:
    """Specialise `weight` (K, C/groups, R, S float32) for `shape`; cached at every stage.
    `epilogue` is applied at the store (residual add, activation). on_function:
    assemble_cubin's progress callback, for a build that is not in the cache."""
    tiling = tiling or default_tiling(shape)
    target = target or Target()
    if tiling.slice_sum == "cluster" and not target.has_clusters:
        tiling = replace(tiling, slice_sum="kernel")  # clusters need sm_90; the workspace sum serves any GPU
    if epilogue.pool:
        tiling = pooled_tiling(shape, tiling)  # pixels by 2x2 windows, where the kernel can then pool
    # What the kernel itself applies: a variant that cannot take the pool is
    # built without it (the same kernel as an unpooled layer's) and
    # runtime.Conv2dKernel pools its output after; CompiledLayer keeps the
    # layer's whole epilogue.
    in_kernel = replace(epilogue, pool=False) if epilogue.pool and not pools_in_kernel(shape, tiling) else epilogue
    staged = staged_input_bytes(shape, tiling)
    if staged > target.max_shared_bytes:
        raise ValueError(f"layer {name}: tiling {tiling.describe()} stages {staged} bytes of input a block, more "
                         f"than {target.arch} lets a block use ({target.max_shared_bytes}); lower c_block, the "
                         "pixels a thread or the threads, or use input_loads 'registers'")
    cache = cache or ArtifactCache()
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.shape != shape.weight_shape:
        raise ValueError(f"layer {name}: weight shape {weight.shape}, expected {shape.weight_shape}")
    seconds: Dict[str, float] = {}
    what = f"layer {name} ({shape.describe()})"

    t = time.perf_counter()
    rendered = render(shape, tiling, in_kernel)
    seconds["render"] = time.perf_counter() - t

    t = time.perf_counter()
    tkey = template_cache_key(rendered.source, target)
    template_ptx = cache.get_text("template", tkey, ".ptx")
    template_hit = template_ptx is not None
    if template_ptx is None:
        template_ptx = compile_to_ptx(rendered.source, target, what)
        cache.put_text("template", tkey, ".ptx", template_ptx)
    seconds["compile"] = time.perf_counter() - t

    use_ptxas = have_ptxas()
    suffix = ".cubin" if use_ptxas else ".ptx"
    assembler = tool_identity("ptxas") if use_ptxas else "driver-jit"  # its -O level is in repr(tiling)
    kkey = cache_key("kernel", tkey, SPECIALISER_FINGERPRINT, weight.tobytes(), repr(shape), repr(tiling), assembler)

    # Warm path: the index names the specialised PTX and artifact by the PTX's
    # content hash; both must still be there intact, or the layer is rebuilt.
    index = cache.get_json("kernel", kkey)
    warm = _cached_artifact(cache, index, suffix, assembler, tiling) if index is not None else None
    if warm is not None:
        stats = dict(index["stats"], seconds={**seconds, "specialise": 0.0, "assemble": 0.0},
                     template_cache_hit=template_hit, kernel_cache_hit=True)
        return CompiledLayer(name, shape, tiling, target, ENTRY_NAME, warm, suffix, index["ptx_sha256"], stats,
                             epilogue)

    t = time.perf_counter()
    layout = analyse_template(template_ptx, rendered)
    ptx, spec = specialise(template_ptx, rendered, weight, layout, max_shared_bytes=target.max_shared_bytes)
    seconds["specialise"] = time.perf_counter() - t
    ptx_sha = hashlib.sha256(ptx.encode()).hexdigest()

    t = time.perf_counter()
    artifact = assemble_cubin(ptx, target, what, max_registers=tiling.max_registers,
                              opt_level=tiling.ptxas_level, on_function=on_function) if use_ptxas else ptx.encode()
    seconds["assemble"] = time.perf_counter() - t

    akey = artifact_key(ptx_sha, assembler, tiling) if use_ptxas else ptx_sha
    stats: Dict[str, object] = dict(spec.as_dict(), tiling=tiling.describe(), epilogue=in_kernel.describe(),
                                    target=target.arch, artifact_bytes=len(artifact), artifact_key=akey,
                                    template_key=tkey, kernel_key=kkey)
    merged = kernel_shape(shape, tiling)
    if merged != shape:  # the tiling's c_block reads as groups here, not input channels (shapes.kernel_shape)
        stats["depthwise_groups_a_block"] = shape.groups // merged.groups
    cache.put_text("kernel", ptx_sha, ".ptx", ptx)
    if use_ptxas:
        cache.put("kernel", akey, ".cubin", artifact)
    # The index last; "refs" lets `cache verify` report it when what it names is gone.
    refs = [["kernel", ptx_sha, ".ptx"]] + ([["kernel", akey, ".cubin"]] if use_ptxas else [])
    cache.put_json("kernel", kkey, {"ptx_sha256": ptx_sha, "stats": stats, "refs": refs})
    stats = dict(stats, seconds=seconds, template_cache_hit=template_hit, kernel_cache_hit=False)
    return CompiledLayer(name, shape, tiling, target, ENTRY_NAME, artifact, suffix, ptx_sha, stats, epilogue)
