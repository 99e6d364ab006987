"""Tests for sparseconv.cache (CPU only)."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from sparseconv import cache as cache_mod
from sparseconv.cache import (
    CACHE_FORMAT_VERSION,
    ArtifactCache,
    CacheError,
    cache_key,
    default_cache_dir,
)

KEY = cache_key("conv", "layer1")
PAYLOAD = b"\x00\x01binary cubin\xff" * 100


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in _files(root) if p.name.startswith(".sc-tmp-")]


# ---------------------------------------------------------------- round trips
def test_bytes_round_trip_and_layout(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    assert c.get("kernel", KEY, ".cubin") is None
    path = c.put("kernel", KEY, ".cubin", PAYLOAD)
    assert path == tmp_path / "kernel" / KEY[:2] / f"{KEY}.cubin"
    assert path == c.path_for("kernel", KEY, ".cubin")
    raw = path.read_bytes()
    header = f"SPARSECONV-CACHE v1 sha256={hashlib.sha256(PAYLOAD).hexdigest()} size={len(PAYLOAD)}\n"
    assert raw == header.encode() + PAYLOAD
    assert c.get("kernel", KEY, ".cubin") == PAYLOAD
    # the same key with another suffix or kind is a different entry
    assert c.get("kernel", KEY, ".ptx") is None
    assert c.get("template", KEY, ".cubin") is None


def test_empty_payload_round_trip(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    c.put("kernel", KEY, ".ptx", b"")
    assert c.get("kernel", KEY, ".ptx") == b""


def test_text_round_trip(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    text = ".version 8.0\n// ünïcode comment\n.target sm_90\n"
    c.put_text("template", KEY, ".ptx", text)
    assert c.get_text("template", KEY, ".ptx") == text
    assert c.get("template", KEY, ".ptx") == text.encode("utf-8")


def test_json_round_trip(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    record = {"shape": [64, 3, 3, 3], "name": "conv1", "sparsity": 0.75, "nested": {"a": None}}
    path = c.put_json("kernel", KEY, record)
    assert path.name == f"{KEY}.json"
    assert c.get_json("kernel", KEY) == record
    assert c.get_json("template", KEY) is None


def test_overwrite_replaces_payload(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    c.put("kernel", KEY, ".ptx", b"old")
    c.put("kernel", KEY, ".ptx", b"new")
    assert c.get("kernel", KEY, ".ptx") == b"new"
    assert _tmp_files(tmp_path) == []


# ------------------------------------------------------------------ cache_key
def test_cache_key_is_stable() -> None:
    # Pinned: if this changes, old entries become unreachable -> bump CACHE_FORMAT_VERSION.
    assert CACHE_FORMAT_VERSION == 1
    assert cache_key("ab", "c") == "740ac33f1571e869ea83d85981d2831bf32c5f35d2c47816c7f626cb3485e4c4"
    assert cache_key("ab", "c") == cache_key("ab", "c")
    assert len(cache_key()) == 64 and int(cache_key(), 16) >= 0


def test_cache_key_is_length_prefixed() -> None:
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert cache_key("abc") != cache_key("ab", "c")
    assert cache_key("a", "") != cache_key("a")
    assert cache_key("", "a") != cache_key("a", "")
    assert cache_key("x") != cache_key("y")


def test_cache_key_str_and_bytes() -> None:
    assert cache_key("é") == cache_key("é".encode("utf-8"))
    with pytest.raises(TypeError):
        cache_key(1)  # type: ignore[arg-type]


def test_cache_key_mixes_in_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cache_key("ab", "c")
    monkeypatch.setattr(cache_mod, "CACHE_FORMAT_VERSION", 2)
    assert cache_key("ab", "c") != before


# ---------------------------------------------------------------- self-check
def _corrupt_and_check(tmp_path: Path, mutate) -> None:
    c = ArtifactCache(tmp_path)
    path = c.put("kernel", KEY, ".cubin", PAYLOAD)
    path.write_bytes(mutate(path.read_bytes()))
    assert c.get("kernel", KEY, ".cubin") is None
    assert not path.exists(), "a bad file must be removed"
    # ... and it can be rebuilt
    c.put("kernel", KEY, ".cubin", PAYLOAD)
    assert c.get("kernel", KEY, ".cubin") == PAYLOAD


def test_truncated_file_is_miss_and_removed(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: raw[:-1])


def test_truncated_inside_header_is_miss(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: raw[:20])


def test_empty_file_is_miss(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: b"")


def test_altered_byte_is_miss(tmp_path: Path) -> None:
    def flip_last(raw: bytes) -> bytes:
        return raw[:-1] + bytes([raw[-1] ^ 0x01])

    _corrupt_and_check(tmp_path, flip_last)


def test_extra_trailing_bytes_is_miss(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: raw + b"\n")


def test_header_garbage_is_miss(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: b"garbage\n" + raw.split(b"\n", 1)[1])
    _corrupt_and_check(tmp_path, lambda raw: os.urandom(500))
    _corrupt_and_check(tmp_path, lambda raw: b"x" * 10_000)  # no newline at all


def test_wrong_version_in_header_is_miss(tmp_path: Path) -> None:
    _corrupt_and_check(tmp_path, lambda raw: raw.replace(b" v1 ", b" v9 ", 1))


def test_wrong_size_is_miss(tmp_path: Path) -> None:
    n = len(PAYLOAD)
    # correct hash, wrong size (both directions)
    _corrupt_and_check(tmp_path, lambda raw: raw.replace(f"size={n}\n".encode(), f"size={n + 1}\n".encode(), 1))
    _corrupt_and_check(tmp_path, lambda raw: raw.replace(f"size={n}\n".encode(), f"size={n - 1}\n".encode(), 1))


def test_corrupt_json_and_text_are_misses(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    path = c.put_json("kernel", KEY, {"a": 1})
    path.write_bytes(path.read_bytes()[:-3])
    assert c.get_json("kernel", KEY) is None
    assert not path.exists()
    # a valid entry whose payload is not a JSON object is also a miss
    c.put("kernel", KEY, ".json", b"[1, 2]")
    assert c.get_json("kernel", KEY) is None
    c.put("kernel", KEY, ".json", b"{not json")
    assert c.get_json("kernel", KEY) is None
    c.put("kernel", KEY, ".ptx", b"\xff\xfe")
    assert c.get_text("kernel", KEY, ".ptx") is None


def test_unreadable_entry_is_a_miss(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    path = c.path_for("kernel", KEY, ".ptx")
    path.mkdir(parents=True)  # a folder where the file should be
    assert c.get("kernel", KEY, ".ptx") is None


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kind,key,suffix",
    [
        ("bogus", KEY, ".ptx"),
        ("../kernel", KEY, ".ptx"),
        ("", KEY, ".ptx"),
        ("kernel", "abc", ".ptx"),
        ("kernel", KEY.upper(), ".ptx"),
        ("kernel", KEY[:-1] + "g", ".ptx"),
        ("kernel", KEY + "0", ".ptx"),
        ("kernel", "../" + KEY[3:], ".ptx"),
        ("kernel", KEY, "ptx"),
        ("kernel", KEY, "./../x"),
        ("kernel", KEY, ".tmp/x"),
        ("kernel", KEY, ""),
    ],
)
def test_invalid_kind_key_suffix(tmp_path: Path, kind: str, key: str, suffix: str) -> None:
    c = ArtifactCache(tmp_path)
    with pytest.raises(ValueError):
        c.path_for(kind, key, suffix)
    with pytest.raises(ValueError):
        c.put(kind, key, suffix, b"x")
    with pytest.raises(ValueError):
        c.get(kind, key, suffix)
    assert _files(tmp_path) == []


def test_bad_input_writes_nothing(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    with pytest.raises(TypeError):
        c.put("kernel", KEY, ".ptx", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        c.put_text("kernel", KEY, ".ptx", b"not str")  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        c.put_text("kernel", KEY, ".ptx", "lone surrogate \ud800")
    with pytest.raises(TypeError):
        c.put_json("kernel", KEY, {"x": object()})
    with pytest.raises(ValueError):
        c.put_json("kernel", KEY, {"x": float("nan")})
    with pytest.raises(TypeError):
        c.put_json("kernel", KEY, [1, 2])  # type: ignore[arg-type]
    assert _files(tmp_path) == []


# ---------------------------------------------------------------- atomicity
def test_failed_replace_leaves_no_temp_and_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ArtifactCache(tmp_path)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", boom)
    with pytest.raises(CacheError):
        c.put("kernel", KEY, ".cubin", PAYLOAD)
    monkeypatch.undo()
    assert _files(tmp_path) == []
    assert c.get("kernel", KEY, ".cubin") is None


def test_failed_put_keeps_previous_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ArtifactCache(tmp_path)
    c.put("kernel", KEY, ".cubin", b"old complete")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_mod.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):  # non-OSError exceptions propagate unchanged
        c.put("kernel", KEY, ".cubin", b"new")
    monkeypatch.undo()
    assert _tmp_files(tmp_path) == []
    assert len(_files(tmp_path)) == 1
    assert c.get("kernel", KEY, ".cubin") == b"old complete"


def _put_many(root: str, payload: bytes, n: int, check: bool = True) -> str:
    c = ArtifactCache(root)
    path = None
    for _ in range(n):
        path = c.put("kernel", KEY, ".cubin", payload)
        if check:  # all writers store the same payload, so every read must return it
            assert c.get("kernel", KEY, ".cubin") == payload
    return str(path)


def test_concurrent_writers_same_key(tmp_path: Path) -> None:
    payload = os.urandom(1 << 20)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_put_many, [(str(tmp_path), payload, 20)] * 4)
    c = ArtifactCache(tmp_path)
    expected = c.path_for("kernel", KEY, ".cubin")
    assert results == [str(expected)] * 4
    assert c.get("kernel", KEY, ".cubin") == payload
    assert _files(tmp_path) == [expected]  # no temp files left behind


def _read_until_done(root: str, allowed: list[bytes], stop, out) -> None:
    c = ArtifactCache(root)
    seen = {"hit": 0, "miss": 0, "bad": 0}
    while not stop.is_set():
        got = c.get("kernel", KEY, ".cubin")
        if got is None:
            seen["miss"] += 1
        elif got in allowed:
            seen["hit"] += 1
        else:
            seen["bad"] += 1
    out.put(seen)


def test_readers_never_see_partial_files(tmp_path: Path) -> None:
    a, b = os.urandom(1 << 20), os.urandom(1 << 20)
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_read_until_done, args=(str(tmp_path), [a, b], stop, out)) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        with ctx.Pool(2) as pool:
            pool.starmap(_put_many, [(str(tmp_path), a, 30, False), (str(tmp_path), b, 30, False)])
    finally:
        stop.set()
    stats = [out.get(timeout=60) for _ in readers]
    for r in readers:
        r.join(timeout=60)
        assert r.exitcode == 0
    assert all(s["bad"] == 0 for s in stats), stats
    assert sum(s["hit"] for s in stats) > 0, stats
    assert ArtifactCache(tmp_path).get("kernel", KEY, ".cubin") in (a, b)


# ---------------------------------------------------------------- maintenance
def test_entries_and_verify(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    k2 = cache_key("other")
    good = c.put("kernel", KEY, ".cubin", PAYLOAD)
    c.put_json("template", k2, {"a": 1})
    bad = c.put("template", KEY, ".ptx", b"ptx text")
    bad.write_bytes(bad.read_bytes()[:-2])
    (tmp_path / "README").write_text("not an entry")
    (good.parent / "notes.txt").write_text("not an entry either")

    entries = c.entries()
    by_path = {e.path: e for e in entries}
    assert len(entries) == 3
    assert by_path[good].ok and by_path[good].kind == "kernel" and by_path[good].suffix == ".cubin"
    assert by_path[good].key == KEY and by_path[good].size == good.stat().st_size
    assert by_path[good].mtime == pytest.approx(good.stat().st_mtime)
    assert not by_path[bad].ok

    broken = c.verify()
    assert [e.path for e in broken] == [bad]
    assert bad.exists(), "verify() must not delete"


def test_verify_reports_an_entry_whose_refs_are_gone(tmp_path: Path) -> None:
    """A JSON entry lists the entries it names under "refs" (a kernel index:
    its specialised PTX and cubin); verify() reports it when one is missing or
    corrupt, and not while they are whole."""
    c = ArtifactCache(tmp_path)
    ptx_key, index_key = cache_key("ptx"), cache_key("index")
    ptx = c.put_text("kernel", ptx_key, ".ptx", "// ptx")
    index = c.put_json("kernel", index_key, {"refs": [["kernel", ptx_key, ".ptx"]]})
    c.put_json("tuning", cache_key("t"), {"refs": "not a list"})  # ignored, not an error
    assert c.verify() == []
    ptx.write_bytes(ptx.read_bytes()[:-1])
    assert {e.path for e in c.verify()} == {ptx, index}
    ptx.unlink()
    [e] = c.verify()
    assert e.path == index and not e.ok and ptx_key[:16] in e.problem


def test_entries_of_missing_root(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "nope")
    assert c.entries() == [] and c.verify() == [] and c.clear() == 0


def test_clear_keeps_non_entries(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path)
    p1 = c.put("kernel", KEY, ".cubin", PAYLOAD)
    c.put("kernel", KEY, ".ptx", b"ptx")
    c.put_json("template", cache_key("t"), {"t": 1})
    stale = p1.parent / ".sc-tmp-abc123.tmp"
    stale.write_bytes(b"half written")
    old = time.time() - 2 * cache_mod.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    fresh = p1.parent / ".sc-tmp-live.tmp"  # a put() in progress elsewhere
    fresh.write_bytes(b"being written")
    keep = [tmp_path / "README.md", tmp_path / ".gitignore", tmp_path / "kernel" / "README", p1.parent / "keep.txt"]
    for k in keep:
        k.write_text("keep me")

    assert c.clear() == 4  # three entries + the stale temp file
    assert c.entries() == []
    assert all(k.read_text() == "keep me" for k in keep)
    assert fresh.exists() and not stale.exists()
    assert c.clear() == 0
    # still usable afterwards
    c.put("kernel", KEY, ".cubin", PAYLOAD)
    assert c.get("kernel", KEY, ".cubin") == PAYLOAD


def test_export_writes_headerless_payload(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "cache")
    dest_dir = tmp_path / "load"
    assert c.export("kernel", KEY, ".cubin", dest_dir) is None
    c.put("kernel", KEY, ".cubin", PAYLOAD)
    out = c.export("kernel", KEY, ".cubin", dest_dir)
    assert out == dest_dir / f"{KEY}.cubin"
    assert out.read_bytes() == PAYLOAD
    assert _tmp_files(dest_dir) == []
    # a corrupt entry is not exported
    entry = c.path_for("kernel", KEY, ".cubin")
    entry.write_bytes(entry.read_bytes()[:-1])
    out.unlink()
    assert c.export("kernel", KEY, ".cubin", dest_dir) is None
    assert not out.exists()


# ---------------------------------------------------------------- locations and errors
def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPARSECONV_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    c = ArtifactCache()
    assert c.root == tmp_path / "env"
    c.put("kernel", KEY, ".ptx", b"x")
    assert (tmp_path / "env" / "kernel" / KEY[:2] / f"{KEY}.ptx").is_file()


def test_default_cache_dir_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPARSECONV_CACHE_DIR", raising=False)
    repo_cache = tmp_path / "ptx_cache"
    repo_cache.mkdir()
    monkeypatch.setattr(cache_mod, "_REPO_CACHE_DIR", repo_cache)
    assert default_cache_dir() == repo_cache


def test_default_cache_dir_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPARSECONV_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache_mod, "_REPO_CACHE_DIR", tmp_path / "no_checkout" / "ptx_cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "sparseconv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "sparseconv"


def test_uncreatable_root_raises_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    c = ArtifactCache(blocker / "cache")  # cannot mkdir under a regular file, even as root
    with pytest.raises(CacheError) as info:
        c.put("kernel", KEY, ".ptx", b"x")
    msg = str(info.value)
    assert str(blocker / "cache") in msg and "SPARSECONV_CACHE_DIR" in msg
    assert blocker.read_text() == "x"


def test_unwritable_root_raises_cache_error(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("chmod cannot make a folder unwritable here (running as root?)")
        c = ArtifactCache(root)
        with pytest.raises(CacheError) as info:
            c.put("kernel", KEY, ".ptx", b"x")
        assert str(root) in str(info.value) and "SPARSECONV_CACHE_DIR" in str(info.value)
        assert c.get("kernel", KEY, ".ptx") is None
    finally:
        root.chmod(0o700)


def test_permission_denied_raises_cache_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs even as root: simulate a folder that exists but refuses new files.
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(cache_mod.tempfile, "mkstemp", denied)
    c = ArtifactCache(tmp_path)
    with pytest.raises(CacheError) as info:
        c.put("kernel", KEY, ".ptx", b"x")
    assert str(tmp_path) in str(info.value) and "SPARSECONV_CACHE_DIR" in str(info.value)
    assert isinstance(info.value.__cause__, PermissionError)
    monkeypatch.undo()
    assert _files(tmp_path) == []
