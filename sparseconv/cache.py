"""Content-addressed, self-checking on-disk cache for compiled artifacts.

On-disk layout (CACHE_FORMAT_VERSION = 1)
-----------------------------------------
    <root>/<kind>/<key[:2]>/<key><suffix>

  root    default_cache_dir(): $SPARSECONV_CACHE_DIR, else <checkout>/ptx_cache,
          else $XDG_CACHE_HOME/sparseconv (~/.cache/sparseconv).
  kind    one of KINDS ("template", "kernel", "tuning").
  key     cache_key(...): 64 lowercase hex digits (sha256 over length-prefixed
          parts, with CACHE_FORMAT_VERSION mixed in).
  suffix  e.g. ".ptx", ".cubin", ".json".

Every stored file is one header line followed by the payload:

    b"SPARSECONV-CACHE v1 sha256=<64 hex of payload> size=<payload bytes>\\n" + payload

A file whose header, size or hash does not match is a miss: get() deletes it
and the caller rebuilds. Files are written to a temp file in the same folder
(".sc-tmp-*.tmp"), fsync'ed and os.replace'd into place, so readers see the old
complete file, the new complete file, or nothing.

Bump CACHE_FORMAT_VERSION whenever this layout, the header, or the meaning of
a key changes: it is part of every key and of the header, so old entries are
simply never found again (`sparseconv cache clear` removes them).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

CACHE_FORMAT_VERSION = 1

# tuning: the tiling (and backend) an autotune run chose for a layer on a device.
KINDS: tuple[str, ...] = ("template", "kernel", "tuning")

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SUFFIX_RE = re.compile(r"\.[a-z0-9]{1,16}")
_ENTRY_NAME_RE = re.compile(r"([0-9a-f]{64})(\.[a-z0-9]{1,16})")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_TMP_PREFIX = ".sc-tmp-"
_TMP_SUFFIX = ".tmp"
# A temp file younger than this may belong to a put() in progress; clear() leaves it.
STALE_TEMP_SECONDS = 600.0
_MAX_HEADER = 128  # the real header is ~100 bytes

# Where a source checkout keeps its cache (module-level so tests can redirect it).
_REPO_CACHE_DIR = Path(__file__).resolve().parent.parent / "ptx_cache"


class CacheError(Exception):
    """The cache folder cannot be created or written."""


@dataclass(frozen=True)
class CacheEntry:
    """One stored file, as listed by ArtifactCache.entries()."""

    kind: str
    key: str
    suffix: str
    path: Path
    size: int  # bytes on disk, header included
    mtime: float
    ok: bool  # the self-check passes (verify(): and every entry it refers to is there and passes)
    problem: str = ""  # why verify() reports it


def default_cache_dir() -> Path:
    """$SPARSECONV_CACHE_DIR if set; else the repository's ptx_cache/ folder when
    sparseconv runs from a source checkout (it exists and is writable); else
    $XDG_CACHE_HOME/sparseconv, defaulting to ~/.cache/sparseconv."""
    env = os.environ.get("SPARSECONV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if _REPO_CACHE_DIR.is_dir() and os.access(_REPO_CACHE_DIR, os.W_OK | os.X_OK):
        return _REPO_CACHE_DIR
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "sparseconv"


def cache_key(*parts: str | bytes) -> str:
    """sha256 hex over the parts, each length-prefixed (so ('ab', 'c') != ('a', 'bc')),
    with CACHE_FORMAT_VERSION mixed in. A str part is hashed as its UTF-8 bytes."""
    h = hashlib.sha256(b"sparseconv-cache\0" + CACHE_FORMAT_VERSION.to_bytes(4, "big"))
    for part in parts:
        if isinstance(part, str):
            data = part.encode("utf-8")
        elif isinstance(part, (bytes, bytearray, memoryview)):
            data = bytes(part)
        else:
            raise TypeError(f"cache_key parts must be str or bytes, not {type(part).__name__}")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def _header(payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).hexdigest()
    return f"SPARSECONV-CACHE v{CACHE_FORMAT_VERSION} sha256={digest} size={len(payload)}\n".encode()


def _unwrap(data: bytes) -> bytes | None:
    """The payload of a stored file, or None when its self-check fails."""
    end = data.find(b"\n", 0, _MAX_HEADER)
    if end < 0:
        return None
    m = re.fullmatch(
        rb"SPARSECONV-CACHE v(\d+) sha256=([0-9a-f]{64}) size=(0|[1-9][0-9]{0,18})",
        data[:end],
    )
    if m is None or int(m.group(1)) != CACHE_FORMAT_VERSION:
        return None
    payload = data[end + 1:]
    if len(payload) != int(m.group(3)):
        return None
    if hashlib.sha256(payload).hexdigest().encode() != m.group(2):
        return None
    return payload


def _atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write chunks to path via a temp file in the same folder + fsync + os.replace.
    On any exception the temp file is removed and path is left untouched."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cached artifacts are not secret
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _as_bytes(payload: bytes) -> bytes:
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    if not isinstance(payload, bytes):
        raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
    return payload


class ArtifactCache:
    """Self-checking artifact store under root (see the module docstring for the layout)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root: Path = default_cache_dir() if root is None else Path(root).expanduser()

    def __repr__(self) -> str:
        return f"ArtifactCache({str(self.root)!r})"

    # ------------------------------------------------------------------ paths
    def path_for(self, kind: str, key: str, suffix: str) -> Path:
        """root/<kind>/<key[:2]>/<key><suffix>; ValueError for a bad kind, key or suffix."""
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; expected one of {KINDS}")
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"cache key must be 64 lowercase hex digits, got {key!r}")
        if not isinstance(suffix, str) or not _SUFFIX_RE.fullmatch(suffix):
            raise ValueError(f"cache suffix must look like '.ptx' (lowercase, 1-16 chars), got {suffix!r}")
        return self.root / kind / key[:2] / f"{key}{suffix}"

    # ------------------------------------------------------------- read/write
    def get(self, kind: str, key: str, suffix: str) -> bytes | None:
        """The stored payload, or None when missing or when the self-check fails
        (the bad file is then deleted). Never raises for a corrupt file."""
        path = self.path_for(kind, key, suffix)
        try:
            with open(path, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
        except OSError:
            return None
        payload = _unwrap(data)
        if payload is None:
            self._discard(path, st)
        return payload

    def put(self, kind: str, key: str, suffix: str, payload: bytes) -> Path:
        """Store payload atomically; return the final path. Raises CacheError when
        the cache folder cannot be created or written."""
        path = self.path_for(kind, key, suffix)
        payload = _as_bytes(payload)
        header = _header(payload)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, (header, payload))
        except OSError as exc:
            raise CacheError(
                f"cannot write to sparseconv cache folder {self.root} ({exc}); "
                "set SPARSECONV_CACHE_DIR to a writable folder"
            ) from exc
        return path

    def get_text(self, kind: str, key: str, suffix: str) -> str | None:
        """get() decoded as UTF-8; an entry that does not decode is a miss (and deleted)."""
        payload = self.get(kind, key, suffix)
        if payload is None:
            return None
        try:
            return payload.decode("utf-8")
        except UnicodeDecodeError:
            self._discard(self.path_for(kind, key, suffix))
            return None

    def put_text(self, kind: str, key: str, suffix: str, text: str) -> Path:
        """put() of text encoded as UTF-8."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        return self.put(kind, key, suffix, text.encode("utf-8"))

    def get_json(self, kind: str, key: str) -> dict | None:
        """The JSON object stored under <key>.json, or None (a non-object is a miss)."""
        text = self.get_text(kind, key, ".json")
        if text is None:
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self._discard(self.path_for(kind, key, ".json"))
            return None
        return obj

    def put_json(self, kind: str, key: str, obj: dict) -> Path:
        """Store a JSON object under <key>.json. Serialisation happens before any
        file is touched, so bad input (TypeError/ValueError) writes nothing."""
        if not isinstance(obj, dict):
            raise TypeError(f"put_json stores a dict, not {type(obj).__name__}")
        text = json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n"
        return self.put_text(kind, key, ".json", text)

    def export(self, kind: str, key: str, suffix: str, dest_dir: Path | str) -> Path | None:
        """Write the verified payload, without header, atomically to
        dest_dir/<key><suffix> (for loaders that take a path, e.g.
        cupy.RawModule(path=...)); return that path, or None on a miss."""
        payload = self.get(kind, key, suffix)
        if payload is None:
            return None
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f"{key}{suffix}"
        _atomic_write(dest, (payload,))
        return dest

    # ------------------------------------------------------------ maintenance
    def entries(self) -> list[CacheEntry]:
        """Every stored file (for `sparseconv cache ls`), sorted by kind, key, suffix."""
        found: list[CacheEntry] = []
        for kind, shard, name in self._walk():
            m = _ENTRY_NAME_RE.fullmatch(name)
            if m is None or m.group(1)[:2] != shard.name:
                continue
            path = shard / name
            try:
                with open(path, "rb") as f:
                    data = f.read()
                    st = os.fstat(f.fileno())
            except OSError:  # removed meanwhile, or unreadable
                continue
            found.append(CacheEntry(kind, m.group(1), m.group(2), path, st.st_size,
                                    st.st_mtime, _unwrap(data) is not None))
        found.sort(key=lambda e: (e.kind, e.key, e.suffix))
        return found

    def verify(self) -> list[CacheEntry]:
        """The entries whose self-check fails, and the JSON entries whose "refs"
        (a list of [kind, key, suffix]) name an entry that is missing or fails
        its own (a kernel index whose specialised PTX or cubin is gone).
        Nothing is deleted; a build rebuilds what they name on next use."""
        entries = self.entries()
        good = {(e.kind, e.key, e.suffix) for e in entries if e.ok}
        bad: list[CacheEntry] = []
        for e in entries:
            if not e.ok:
                bad.append(replace(e, problem="self-check failed"))
                continue
            if e.suffix != ".json":
                continue
            missing = [r for r in self._refs(e) if r not in good]
            if missing:
                kind, key, suffix = missing[0]
                bad.append(replace(e, ok=False, problem=f"refers to {kind}/{key[:16]}{suffix}, which is missing "
                                                        "or corrupt"))
        return bad

    def _refs(self, entry: CacheEntry) -> list[tuple[str, str, str]]:
        """The [kind, key, suffix] triples a JSON entry's "refs" lists."""
        try:
            obj = json.loads(entry.path.read_bytes().split(b"\n", 1)[1])
        except (OSError, ValueError, IndexError):
            return []
        refs = obj.get("refs") if isinstance(obj, dict) else None
        if not isinstance(refs, list):
            return []
        return [tuple(r) for r in refs if isinstance(r, list) and len(r) == 3 and all(isinstance(p, str) for p in r)]

    def clear(self) -> int:
        """Remove every entry and stale temp file; return how many files were removed.
        Files that are not cache entries (README, .gitignore, ...) are left alone."""
        removed = 0
        now = time.time()
        for _kind, shard, name in self._walk():
            path = shard / name
            if _ENTRY_NAME_RE.fullmatch(name) and name[:2] == shard.name:
                pass
            elif name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX):
                try:
                    if now - path.stat().st_mtime < STALE_TEMP_SECONDS:
                        continue  # probably a put() in progress
                except OSError:
                    continue
            else:
                continue
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
        return removed

    # ---------------------------------------------------------------- helpers
    def _walk(self) -> Iterable[tuple[str, Path, str]]:
        """(kind, shard folder, file name) for each file in a shard folder."""
        for kind in KINDS:
            kind_dir = self.root / kind
            try:
                shards = sorted(kind_dir.iterdir())
            except OSError:
                continue
            for shard in shards:
                if not _SHARD_RE.fullmatch(shard.name) or not shard.is_dir():
                    continue
                try:
                    names = sorted(os.listdir(shard))
                except OSError:
                    continue
                for name in names:
                    yield kind, shard, name

    @staticmethod
    def _discard(path: Path, seen: os.stat_result | None = None) -> None:
        """Delete a bad entry, ignoring races. With seen, delete only if path is
        still that same file (a writer may have just replaced it with a good one)."""
        with contextlib.suppress(OSError):
            if seen is not None:
                now = os.stat(path)
                if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
                    return
            os.unlink(path)
