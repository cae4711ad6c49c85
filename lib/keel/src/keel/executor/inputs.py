"""Fingerprints of the files a step reads from outside keel, so that edited inputs are never served stale.

A config names its input files by path, and the bytes behind a path can change while the path
stays the same. So a step whose config reads outside files (it defines `input_files()`, as
`IngestConfig` does) and an `External` without a `version` get the fingerprint of every such file
in their identity:

- a local file: its size and the SHA-256 of its contents (never its mtime, so a fresh clone or a
  `touch` re-keys nothing). Hashes are memoised in `fingerprints.json` under keel's cache folder
  (`$KEEL_CACHE_DIR`, else `$XDG_CACHE_HOME/keel`, else `~/.cache/keel`), keyed by path, size and
  mtime_ns, so a plan reads only the files that changed since the last one;
- a remote file (gs://, s3://, ...): its size and the version its store reports through fsspec's
  `info()` (GCS generation, S3 version id or etag, else a modification time); nothing is
  downloaded.

A declared version (`IngestConfig.input_version`, `External(version=...)`) stands for the files
instead: nothing is listed or read, and bumping it is what makes the step stale.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading

from keel.executor import storage
from keel.executor.status import KEEL_DIR
from keel.executor.step import StepDeclarationError

MEMO_FILE = "fingerprints.json"
MAX_MEMO_ENTRIES = 200_000
REMOTE_VERSION_KEYS = ("generation", "VersionId", "ETag", "etag", "md5Hash", "mtime", "LastModified", "updated", "created")


class InputError(StepDeclarationError):
    """An input file a step declares cannot be found or fingerprinted (`keel plan` reports it)."""


def cache_dir() -> str:
    if os.environ.get("KEEL_CACHE_DIR"):
        return os.environ["KEEL_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "keel")


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class _HashMemo:
    """path -> (size, mtime_ns, sha256) of local files hashed before, shared by the process's plans."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, list] | None = None
        self._dirty = False
        self._where = ""

    def _load(self) -> dict[str, list]:
        where = os.path.join(cache_dir(), MEMO_FILE)
        if self._entries is None or where != self._where:
            try:
                with open(where) as f:
                    self._entries = json.load(f)["entries"]
            except (OSError, ValueError, KeyError):
                self._entries = {}
            self._where, self._dirty = where, False
        return self._entries

    def sha256(self, path: str) -> tuple[int, str]:
        """(size, sha256) of a local file, hashed only when its size or mtime changed."""
        stat = os.stat(path)
        with self._lock:
            entry = self._load().get(path)
        if entry is not None and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return stat.st_size, entry[2]
        digest = sha256_file(path)
        with self._lock:
            entries = self._load()
            entries.pop(path, None)  # re-inserted last: the oldest entries are dropped first
            entries[path] = [stat.st_size, stat.st_mtime_ns, digest]
            self._dirty = True
        return stat.st_size, digest

    def save(self) -> None:
        """Write the memo if it changed; a folder keel cannot write costs re-hashing, nothing more."""
        with self._lock:
            if not self._dirty or self._entries is None:
                return
            entries = dict(list(self._entries.items())[-MAX_MEMO_ENTRIES:])
            try:
                os.makedirs(os.path.dirname(self._where), exist_ok=True)
                storage.write_atomic(self._where, json.dumps({"entries": entries}))  # in order: oldest first
                self._dirty = False
            except OSError:
                pass


_memo = _HashMemo()


def _remote_version(info: dict) -> dict:
    for key in REMOTE_VERSION_KEYS:
        value = info.get(key)
        if value is not None:
            if isinstance(value, datetime.datetime):
                value = value.timestamp()
            return {key: str(value)}
    return {}


def fingerprint(url: str, info: dict | None = None) -> dict:
    """{"size", "sha256"} of a local file; {"size", <the store's version key>} of a remote one."""
    fs, path = storage.split(url)
    if storage.is_local(url):
        size, sha256 = _memo.sha256(path)
        return {"size": size, "sha256": sha256}
    info = info if info is not None else fs.info(path)
    return {"size": int(info.get("size") or 0), **_remote_version(info)}


def fingerprint_files(files: dict[str, str]) -> dict[str, dict]:
    """{name: fingerprint} for {name: url}, names sorted."""
    try:
        return {name: fingerprint(files[name]) for name in sorted(files)}
    finally:
        _memo.save()


def fingerprint_tree(root: str) -> dict[str, dict]:
    """{path relative to `root`: fingerprint} of every file under `root` (or of `root` itself, a file),
    keel's own `.keel/` folders excepted (their status and leases change as steps run). A missing
    `root` has no files."""
    fs, path = storage.split(root)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    base = path.rstrip("/")
    out = {}
    try:
        for name, info in sorted(found.items()):
            relative = name[len(base) + 1:] if name.startswith(base + "/") else name.rsplit("/", 1)[-1]
            if KEEL_DIR in relative.split("/") or info.get("type") == "directory":
                continue
            out[relative] = fingerprint(_with_protocol(root, name), info)
    finally:
        _memo.save()
    return out


def _with_protocol(like: str, path: str) -> str:
    return f"{like.partition('://')[0]}://{path}" if "://" in like else path


def describe_change(name: str, old: dict | None, new: dict | None) -> str:
    """One line naming an input file and how it changed, for `keel plan`'s stale reasons."""
    if old is None:
        return f"input {name}: added"
    if new is None:
        return f"input {name}: removed"
    if old.get("size") != new.get("size"):
        return f"input {name}: changed ({old.get('size'):,} -> {new.get('size'):,} bytes)"
    return f"input {name}: contents changed ({new.get('size'):,} bytes)"
