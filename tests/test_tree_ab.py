"""bench/tree_ab.py: export a commit's package and templates, then run a
command against that tree and this one, alternating, each importing its own."""
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "bench" / "tree_ab.py")


def _tree_ab(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH (which keeps cwd off the import path) is 3.11+")
def test_export_then_run_imports_each_tree_in_turn(tmp_path):
    old = tmp_path / "old"
    r = _tree_ab("export", "HEAD", str(old))
    assert r.returncode == 0, r.stderr
    assert (old / "sparseconv" / "__init__.py").is_file() and list((old / "templates").glob("*.cu.j2"))
    out = tmp_path / "ab"
    probe = "import sparseconv, sys; print(sparseconv.__file__, sys.argv[1])"
    r = _tree_ab("run", "--old", str(old), "--rounds", "2", "--out-dir", str(out), "--",
                 sys.executable, "-c", probe, "{side}-{round}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"round {n} {side}: rc 0, output {out / f'{n}{side}.txt'}"
                                     for n in (1, 2) for side in ("old", "new")]
    for n in (1, 2):
        imported, tag = (out / f"{n}old.txt").read_text().split()
        assert Path(imported).resolve() == (old / "sparseconv" / "__init__.py").resolve() and tag == f"old-{n}"
        imported, tag = (out / f"{n}new.txt").read_text().split()
        assert Path(imported).resolve() == (ROOT / "sparseconv" / "__init__.py").resolve() and tag == f"new-{n}"


def test_a_failing_run_is_reported_and_fails_the_whole(tmp_path):
    old = tmp_path / "old"
    assert _tree_ab("export", "HEAD", str(old)).returncode == 0
    r = _tree_ab("run", "--old", str(old), "--rounds", "1", "--out-dir", str(tmp_path / "ab"), "--",
                 sys.executable, "-c", "import sys; sys.exit(3)")
    assert r.returncode == 1
    assert "round 1 old: rc 3" in r.stdout and "round 1 new: rc 3" in r.stdout



def test_both_trees_build_into_one_compile_cache(tmp_path, monkeypatch):
    old = tmp_path / "old"
    assert _tree_ab("export", "HEAD", str(old)).returncode == 0
    probe = "from sparseconv.cache import default_cache_dir; print(default_cache_dir())"
    out = tmp_path / "ab"
    monkeypatch.delenv("SPARSECONV_CACHE_DIR", raising=False)
    r = _tree_ab("run", "--old", str(old), "--rounds", "1", "--out-dir", str(out), "--", sys.executable, "-c", probe)
    assert r.returncode == 0, r.stderr
    shared = str(Path(tempfile.gettempdir()) / "sparseconv-tree-ab-cache")
    assert (out / "1old.txt").read_text().strip() == (out / "1new.txt").read_text().strip() == shared
    # a folder the caller names is kept
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tmp_path / "mine"))
    r = _tree_ab("run", "--old", str(old), "--rounds", "1", "--out-dir", str(out), "--", sys.executable, "-c", probe)
    assert r.returncode == 0, r.stderr
    assert (out / "1old.txt").read_text().strip() == (out / "1new.txt").read_text().strip() == str(tmp_path / "mine")
    # --separate-caches: each tree's own default
    monkeypatch.delenv("SPARSECONV_CACHE_DIR")
    r = _tree_ab("run", "--old", str(old), "--rounds", "1", "--out-dir", str(out), "--separate-caches", "--",
                 sys.executable, "-c", probe)
    assert r.returncode == 0, r.stderr
    assert (out / "1old.txt").read_text().strip() != (out / "1new.txt").read_text().strip()
