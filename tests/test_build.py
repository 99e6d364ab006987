"""CPU: the whole build pipeline with its cache (no GPU needed)."""
import multiprocessing as mp
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.shapes import ConvShape, Tiling

from sparseconv.testing import pruned_weight

pytestmark = pytest.mark.nvcc

SHAPE = ConvShape(5, 6, 9, 13, 3, 5, (2, 1), (0, 2))
TILING = Tiling(3, 2, 4, 8, 1, 2)


def weight(seed=0, sparsity=0.8):
    return pruned_weight(np.random.default_rng(seed), SHAPE.weight_shape, sparsity)


def test_second_build_is_a_cache_hit(tmp_path):
    cache = ArtifactCache(tmp_path)
    a = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache, name="l1")
    assert not a.stats["template_cache_hit"] and not a.stats["kernel_cache_hit"]
    assert set(a.stats["seconds"]) == {"render", "compile", "specialise", "assemble"}
    b = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache, name="l1")
    assert b.stats["template_cache_hit"] and b.stats["kernel_cache_hit"]
    assert b.artifact == a.artifact and b.ptx_sha256 == a.ptx_sha256
    assert b.stats["fmas_deleted"] == a.stats["fmas_deleted"]
    # Other weights of the same shape reuse the template, not the kernel.
    c = build_conv2d(weight(seed=1), SHAPE, tiling=TILING, cache=cache)
    assert c.stats["template_cache_hit"] and not c.stats["kernel_cache_hit"]
    assert c.ptx_sha256 != a.ptx_sha256


def test_specialised_artifacts_are_named_by_content_hash(tmp_path):
    cache = ArtifactCache(tmp_path)
    a = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    assert cache.get("kernel", a.stats["artifact_key"], ".cubin") == a.artifact
    import hashlib
    ptx = cache.get_text("kernel", a.ptx_sha256, ".ptx")
    assert hashlib.sha256(ptx.encode()).hexdigest() == a.ptx_sha256


def test_tilings_that_differ_only_in_ptxas_level_keep_their_own_cubins(tmp_path):
    """Same PTX, other ptxas -O level: each build, cold and warm, returns the
    cubin of its own level (keyed by the PTX alone, the second build's cubin
    overwrote the first's and warm loads of either got it)."""
    from dataclasses import replace
    cache = ArtifactCache(tmp_path)
    o3 = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    o1 = build_conv2d(weight(), SHAPE, tiling=replace(TILING, ptxas_level=1), cache=cache)
    assert o1.ptx_sha256 == o3.ptx_sha256 and o1.stats["artifact_key"] != o3.stats["artifact_key"]
    assert o1.artifact != o3.artifact
    for level, cold in ((3, o3), (1, o1)):
        warm = build_conv2d(weight(), SHAPE, tiling=replace(TILING, ptxas_level=level), cache=cache)
        assert warm.stats["kernel_cache_hit"] and warm.artifact == cold.artifact
    assert cache.verify() == []


@pytest.mark.parametrize("victim", [".cubin", ".ptx-template"])
def test_corrupted_cache_entries_are_rebuilt(tmp_path, victim):
    cache = ArtifactCache(tmp_path)
    a = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    if victim == ".cubin":
        path = cache.path_for("kernel", a.stats["artifact_key"], ".cubin")
    else:
        path = cache.path_for("template", a.stats["template_key"], ".ptx")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data[: len(data) - 7]))  # altered and truncated
    b = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    assert b.artifact == a.artifact
    if victim == ".cubin":
        assert not b.stats["kernel_cache_hit"]
    else:
        assert not b.stats["template_cache_hit"]
    assert cache.verify() == []


def _build_in_child(root, queue):
    try:
        layer = build_conv2d(weight(), SHAPE, tiling=TILING, cache=ArtifactCache(root))
        queue.put(layer.ptx_sha256)
    except Exception as exc:  # pragma: no cover - reported to the parent
        queue.put(f"error: {exc!r}")


def test_two_processes_building_the_same_layer_both_succeed(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] and not results[0].startswith("error")
    assert ArtifactCache(tmp_path).verify() == []


def test_bad_weight_names_the_layer(tmp_path):
    with pytest.raises(ValueError, match="layer conv7: weight shape"):
        build_conv2d(np.ones((2, 2, 2, 2), np.float32), SHAPE, tiling=TILING, cache=ArtifactCache(tmp_path),
                     name="conv7")
    assert ArtifactCache(tmp_path).entries() == []


def test_build_many_builds_in_parallel_and_keeps_order(tmp_path):
    from sparseconv.parallel import LayerJob, build_many

    rng = np.random.default_rng(3)
    shapes = [ConvShape(4, 6, 7, 7, 3, 3, (1, 1), (1, 1)), ConvShape(8, 4, 6, 5, 1, 1), SHAPE]
    jobs = [LayerJob(f"l{i}", pruned_weight(rng, s.weight_shape, 0.7), s) for i, s in enumerate(shapes)]
    built = build_many(jobs, cache_dir=str(tmp_path), workers=2, progress=False)
    assert list(built) == ["l0", "l1", "l2"]
    for job in jobs:
        layer = built[job.name]
        assert layer.shape == job.shape and layer.name == job.name
        assert layer.stats["wall_s"] > 0 and not layer.stats["kernel_cache_hit"]
        assert layer.stats["nonzero_weights"] == np.count_nonzero(job.weight)
    again = build_many(jobs, cache_dir=str(tmp_path), workers=2, progress=False)
    assert all(layer.stats["kernel_cache_hit"] for layer in again.values())
    with pytest.raises(ValueError, match="unique"):
        build_many([jobs[0], jobs[0]], cache_dir=str(tmp_path), progress=False)


def test_build_order_puts_each_template_before_its_repeats():
    """Big layers first; among one size, the first layer of each template
    (shape, tiling, epilogue) before the repeats, so two workers do not run
    nvcc on one template at once (parallel.build_order)."""
    from sparseconv.parallel import LayerJob, build_order
    from sparseconv.shapes import Epilogue
    from sparseconv.tilings import default_tiling

    deep, narrow = ConvShape(512, 512, 14, 14, 3, 3, (1, 1), (1, 1)), ConvShape(64, 64, 7, 7, 1, 1)
    w, small = np.ones(deep.weight_shape, np.float32), np.ones(narrow.weight_shape, np.float32)
    split = replace(default_tiling(deep), slices=2)
    jobs = [LayerJob("tiny", small, narrow), LayerJob("a", w, deep), LayerJob("a#split", w, deep, split),
            LayerJob("b", w, deep), LayerJob("b#split", w, deep, split), LayerJob("c", w, deep),
            LayerJob("relu", w, deep, epilogue=Epilogue(activation="relu"))]
    assert [j.name for j in build_order(jobs)] == ["a", "a#split", "relu", "b", "b#split", "c", "tiny"]


UNGUARDED_SCRIPT = """
import multiprocessing, sys, threading, time
import numpy as np
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import ConvShape

print("script top ran")  # no __name__ guard: a worker that imported this script would print it again
multiprocessing.set_start_method(sys.argv[2], force=True)  # forkserver: Python 3.14's default on Linux
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a caller with threads, as CUDA's
s = ConvShape(4, 6, 7, 7, 3, 3, (1, 1), (1, 1))
w = np.arange(np.prod(s.weight_shape), dtype=np.float32).reshape(s.weight_shape) % 3  # a third zeros
print("built", len(build_many([LayerJob(f"l{i}", w, s) for i in range(2)], cache_dir=sys.argv[1], workers=2,
                              progress=False)))
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_build_many_builds_from_an_unguarded_threaded_script(tmp_path, start_method):
    """The workers are fresh processes, not forks: a caller with threads (CUDA,
    torch) is not forked (Python 3.12+ warns; under -W error it drops the
    warning silently, so it is shown here and looked for), and the
    caller's script, which has no __name__ guard, runs once whatever
    multiprocessing's start method (under forkserver, the pool of session 36
    and before stopped every worker at once). The workers import the
    caller's sparseconv, not a folder of that name in the working folder."""
    import subprocess
    import sys

    script, work = tmp_path / "scripts" / "build.py", tmp_path / "work"
    script.parent.mkdir()
    script.write_text(UNGUARDED_SCRIPT)
    work.mkdir()
    if sys.version_info >= (3, 11):  # PYTHONSAFEPATH keeps the working folder off the workers' path from 3.11 on
        (work / "sparseconv").mkdir()
        (work / "sparseconv" / "__init__.py").write_text("raise ImportError('the shadow sparseconv in the working "
                                                         "folder')")
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", str(script), str(tmp_path / "cache"),
                           start_method], capture_output=True, text=True, timeout=300, cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["script top ran", "built 2"]
    assert "fork" not in done.stderr, done.stderr[-2000:]



EDITED_UNDER_IT_SCRIPT = """
import sys, warnings
import numpy as np
from sparseconv.build import sources_changed_since_import
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import ConvShape

assert sources_changed_since_import() == []
with open(sys.argv[2], "a") as f:  # an edit of the installed sources while this process runs
    f.write("# edited\\n")
s = ConvShape(4, 6, 7, 7, 3, 3, (1, 1), (1, 1))
w = np.arange(np.prod(s.weight_shape), dtype=np.float32).reshape(s.weight_shape) % 3
jobs = [LayerJob(f"l{i}", w * (i + 1), s) for i in range(2)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build_many(jobs, cache_dir=sys.argv[1], workers=2, progress=False)  # in workers: the code on disk
    again = build_many(jobs[:1], cache_dir=sys.argv[1], progress=False)  # here: the code imported
print(sources_changed_since_import())
print([str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)])
print("hit" if again["l0"].stats["kernel_cache_hit"] else "miss")
"""


def test_build_many_warns_when_its_sources_changed_after_import(tmp_path):
    """Sessions 42 and 46 saw a warm rebuild miss the cache: the sources had
    been edited after the caller imported them, so its own builds and its
    workers' (fresh processes) keyed by different code. build_many says so."""
    import shutil
    import subprocess
    import sys

    import sparseconv

    package = Path(sparseconv.__file__).resolve().parent
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy / "sparseconv", ignore=shutil.ignore_patterns("__pycache__"))
    if (package.parent / "templates").is_dir():  # a source checkout: the templates sit beside the package
        shutil.copytree(package.parent / "templates", copy / "templates")
    script = tmp_path / "edit.py"
    script.write_text(EDITED_UNDER_IT_SCRIPT)
    edited = copy / "sparseconv" / "shapes.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), str(edited)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(copy)))
    assert done.returncode == 0, done.stderr[-2000:]
    changed, messages, again = done.stdout.splitlines()
    assert changed == "['shapes.py']"
    assert "sparseconv's shapes.py under" in messages and "Restart Python" in messages
    assert messages.count("changed after this process imported it") == 2  # each call says it
    assert again == "miss"  # what the warning explains


def test_build_many_times_each_build_not_its_wait_for_a_worker(tmp_path):
    """stats['wall_s'] (the CLI's "compile s") is the build's own time: four
    layers on two workers, two of them queued, add up to no more than two
    workers' time; counted from submission they would add up to ~1.5x that."""
    from sparseconv.parallel import LayerJob, build_many

    rng = np.random.default_rng(6)
    jobs = [LayerJob(f"l{i}", pruned_weight(rng, SHAPE.weight_shape, 0.7), SHAPE) for i in range(4)]
    t0 = time.perf_counter()
    built = build_many(jobs, cache_dir=str(tmp_path), workers=2, progress=False)
    elapsed = time.perf_counter() - t0
    walls = [layer.stats["wall_s"] for layer in built.values()]
    assert all(w >= sum(layer.stats["seconds"].values()) for w, layer in zip(walls, built.values()))
    assert sum(walls) <= 2 * elapsed

def _fake_ptxas(folder, body: str):
    tool = folder / "ptxas"
    tool.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'fake ptxas' && exit 0\n" + body)
    tool.chmod(0o755)
    return tool


def _child_pids() -> set:
    """This process's live children (Linux: /proc/self/task/*/children)."""
    from pathlib import Path

    pids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except FileNotFoundError:  # a thread that ended after the listing has no children to report
            continue
    return pids


@pytest.mark.parametrize("workers", [1, 2])
def test_build_many_reports_a_tool_failure(tmp_path, monkeypatch, workers):
    """A CompileError raised in the caller (one worker) or in a worker process
    reaches the caller intact and names the layer; the other worker is
    stopped, and no process or thread of the build is left."""
    from sparseconv.parallel import LayerJob, build_many
    from sparseconv.compile import CompileError

    before = _child_pids()
    monkeypatch.setenv("SPARSECONV_PTXAS", str(_fake_ptxas(tmp_path, "echo 'ptxas fatal: out of registers' >&2\n"
                                                                     "exit 1\n")))  # inherited by the workers
    rng = np.random.default_rng(4)
    jobs = [LayerJob(f"l{i}", pruned_weight(rng, SHAPE.weight_shape, 0.7), SHAPE) for i in range(workers)]
    with pytest.raises(CompileError, match="out of registers") as info:
        build_many(jobs, cache_dir=str(tmp_path / "cache"), workers=workers, progress=False)
    assert "layer l" in str(info.value)
    assert _child_pids() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("sparseconv-build")]


def test_build_many_names_a_worker_that_died(tmp_path, monkeypatch):
    """A worker killed mid-build (here by the ptxas it ran) is an error that
    names the layer and says the worker exited, not a hang."""
    from sparseconv.parallel import LayerJob, build_many

    monkeypatch.setenv("SPARSECONV_PTXAS", str(_fake_ptxas(tmp_path, "kill -9 $PPID\nsleep 5\n")))
    rng = np.random.default_rng(5)
    jobs = [LayerJob(f"l{i}", pruned_weight(rng, SHAPE.weight_shape, 0.7), SHAPE) for i in range(2)]
    with pytest.raises(RuntimeError, match=r"layer l\d: the build worker \(pid \d+\) exited \(killed by signal 9\)"):
        build_many(jobs, cache_dir=str(tmp_path / "cache"), workers=2, progress=False)


def test_compile_error_survives_pickling():
    """A build in a worker process reports its CompileError intact (it used to
    break the process pool instead)."""
    import pickle

    from sparseconv.compile import CompileError

    e = pickle.loads(pickle.dumps(CompileError("ptxas", "error: bad", "line 1\nline 2", "layer x")))
    assert isinstance(e, CompileError) and "ptxas failed on layer x" in str(e) and "    2  line 2" in e.dump()


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
@pytest.mark.parametrize("victim", [".ptx", ".cubin"])
def test_a_damaged_specialised_artifact_heals(tmp_path, victim, damage):
    """Issue 11, defect 2: a deleted or corrupted specialised .ptx (or .cubin)
    is reported by verify() and rebuilt by the next build, which then returns
    the same artifacts and leaves the cache whole."""
    cache = ArtifactCache(tmp_path)
    a = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    path = cache.path_for("kernel", a.ptx_sha256 if victim == ".ptx" else a.stats["artifact_key"], victim)
    if damage == "delete":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    bad = cache.verify()
    index = cache.path_for("kernel", a.stats["kernel_key"], ".json")
    assert index in {e.path for e in bad}, "verify() must report the index naming the damaged artifact"
    assert all(e.problem for e in bad)
    b = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    assert not b.stats["kernel_cache_hit"]
    assert b.artifact == a.artifact and b.ptx_sha256 == a.ptx_sha256
    assert cache.get_text("kernel", a.ptx_sha256, ".ptx") is not None
    assert cache.verify() == []
    assert build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache).stats["kernel_cache_hit"]


def test_kernel_keys_follow_the_code_that_makes_the_artifacts(tmp_path, monkeypatch):
    """The kernel key holds a hash of the specialiser's sources, not a
    hand-bumped version: an edit to them changes the fingerprint, and a new
    fingerprint misses the old kernels (the template is still reused)."""
    from sparseconv import build

    src = tmp_path / "src"
    (src / "specialise").mkdir(parents=True)
    (src / "specialise" / "emit.py").write_text("x = 1\n")
    (src / "ptx.py").write_text("y = 2\n")
    before = build.code_fingerprint(("specialise/*.py", "ptx.py"), root=src)
    (src / "specialise" / "emit.py").write_text("x = 2\n")
    assert build.code_fingerprint(("specialise/*.py", "ptx.py"), root=src) != before
    with pytest.raises(RuntimeError, match="source files are missing"):
        build.code_fingerprint(("nothing/*.py",), root=src)
    # the fingerprint the keys carry is the package's, read once at import
    assert build.SPECIALISER_FINGERPRINT == build.code_fingerprint(build._ARTIFACT_SOURCES)

    cache = ArtifactCache(tmp_path / "cache")
    build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    monkeypatch.setattr(build, "SPECIALISER_FINGERPRINT", "another specialiser")
    again = build_conv2d(weight(), SHAPE, tiling=TILING, cache=cache)
    assert again.stats["template_cache_hit"] and not again.stats["kernel_cache_hit"]


def test_compile_conv2d_builds_for_an_explicit_target_without_a_gpu(tmp_path):
    """Issue 11, defect 9: with target= compile_conv2d asks the GPU for nothing
    until it loads the kernel. Without a GPU the load fails (a CuPy error),
    after the layer was built and cached for that target."""
    from sparseconv import Target, compile_conv2d

    w = weight()
    try:
        compile_conv2d(w, input_size=(SHAPE.in_h, SHAPE.in_w), stride=SHAPE.stride, padding=SHAPE.padding,
                       tiling=TILING, target=Target("sm_90"), cache_dir=str(tmp_path))
    except Exception as exc:  # no GPU here: only loading may fail
        assert type(exc).__module__.startswith("cupy"), repr(exc)
    layer = build_conv2d(w, SHAPE, tiling=TILING, target=Target("sm_90"), cache=ArtifactCache(tmp_path))
    assert layer.stats["kernel_cache_hit"] and layer.target.arch == "sm_90"
    with pytest.raises(TypeError, match="target must be a sparseconv.Target or a string"):
        compile_conv2d(w, input_size=(SHAPE.in_h, SHAPE.in_w), target=90, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="target arch must look like"):
        compile_conv2d(w, input_size=(SHAPE.in_h, SHAPE.in_w), target="hopper", cache_dir=str(tmp_path))


def test_building_imports_no_run_time_code():
    """Compile time and run time in separate rooms: importing the build side
    loads neither the launch module nor CuPy."""
    import subprocess
    import sys

    code = ("import sys, sparseconv.build, sparseconv.parallel; "
            "print(sorted(m for m in ('cupy', 'sparseconv.runtime', 'sparseconv.api', 'sparseconv.tune') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_ptxas_level_is_part_of_the_tiling_and_of_the_cache_key(tmp_path):
    """Tiling.ptxas_level reaches ptxas (-O1 keeps a pointwise chunk's loads
    together) and names a cache entry of its own."""
    shape = ConvShape(16, 8, 5, 5, 1, 1)
    w = pruned_weight(np.random.default_rng(3), shape.weight_shape, 0.7)
    cache = ArtifactCache(tmp_path)
    t3 = Tiling(8, 8, 1, 32, family="pointwise", slices=2)
    t1 = Tiling(8, 8, 1, 32, family="pointwise", slices=2, ptxas_level=1)
    o3, o1 = build_conv2d(w, shape, tiling=t3, cache=cache), build_conv2d(w, shape, tiling=t1, cache=cache)
    assert o1.stats["kernel_key"] != o3.stats["kernel_key"] and not o1.stats["kernel_cache_hit"]
    assert o1.ptx_sha256 == o3.ptx_sha256                  # the same specialised PTX ...
    if o1.artifact_suffix == ".cubin":
        assert o1.artifact[:4] == b"\x7fELF" and o1.artifact != o3.artifact  # ... assembled differently
    assert "ptxas -O1" in t1.describe() and "ptxas" not in t3.describe()
    assert build_conv2d(w, shape, tiling=t1, cache=cache).stats["kernel_cache_hit"]


def test_a_pooled_layer_walks_quads_where_its_kernel_pools_and_builds_the_plain_kernel_elsewhere(tmp_path):
    """Epilogue.pool: a pointwise, unsplit tiling is built walking 2x2 windows
    with the pool in its kernel; a split one is built exactly as without the
    pool (a cache hit on the plain build), the runtime pooling after it."""
    from sparseconv.shapes import Epilogue
    from sparseconv.tilings import pools_in_kernel

    shape = ConvShape(6, 8, 8, 12, 3, 3, padding=(1, 1))
    w = pruned_weight(np.random.default_rng(3), shape.weight_shape, 0.7)
    cache = ArtifactCache(tmp_path)
    pooled = Epilogue("relu", pool=True)
    whole = Tiling(8, 3, 1, 32, 1, 1, family="pointwise")
    layer = build_conv2d(w, shape, tiling=whole, cache=cache, epilogue=pooled)
    assert layer.tiling == replace(whole, pixel_order="quads") and pools_in_kernel(shape, layer.tiling)
    assert layer.epilogue == pooled and "max pool 2x2" in layer.stats["epilogue"]
    split = Tiling(8, 3, 1, 32, 1, 1, family="pointwise", slices=2)
    plain = build_conv2d(w, shape, tiling=split, cache=cache, epilogue=Epilogue("relu"))
    again = build_conv2d(w, shape, tiling=split, cache=cache, epilogue=pooled)
    assert again.tiling == split and not pools_in_kernel(shape, again.tiling)
    assert again.stats["kernel_cache_hit"] and again.ptx_sha256 == plain.ptx_sha256
    assert again.epilogue == pooled and "max pool" not in again.stats["epilogue"]
