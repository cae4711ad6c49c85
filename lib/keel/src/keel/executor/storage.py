"""The few filesystem operations the executor needs, on any fsspec URL (local, memory://, gs://, s3://).

Two of them need care beyond `fsspec.open`: an atomic replace (local files go through a temporary
name and `os.replace`; object stores replace an object in one PUT) and an exclusive create
(`open(mode="xb")`, which fsspec implements for local and memory stores and gcsfs/s3fs implement
with conditional writes). Leases are built on the exclusive create.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import itertools
import json
import os
import posixpath
import threading
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


@functools.lru_cache(maxsize=64)
def _fs_for_protocol(protocol: str) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem(protocol)


def split(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `url` and the path inside it (a bare `memory://` is that store's root)."""
    protocol, sep, _ = url.partition("://")
    if not sep:
        return _fs_for_protocol("file"), os.path.abspath(url)
    return _fs_for_protocol(protocol), fsspec.core.strip_protocol(url)


def is_local(url: str) -> bool:
    return isinstance(split(url)[0], LocalFileSystem)


def is_shared_between_processes(url: str) -> bool:
    """False for `memory://`, which lives inside one process: a child process would not see it."""
    return not url.startswith("memory://")


def trim(url: str) -> str:
    """`url` without trailing slashes, but a store's root keeps its `scheme://`."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rstrip('/')}" if sep else url.rstrip("/")


def join(base: str, *parts: str) -> str:
    parts = tuple(p.strip("/") for p in parts if p)
    if not parts:
        return base
    root = trim(base)
    return root + ("" if root.endswith("://") else "/") + "/".join(parts)


def relative_to(url: str, base: str) -> str | None:
    """The part of `url` under the folder `base`, or None when it lies elsewhere."""
    head = join(base, "x")[:-1]  # `base` with the one separator its children start after
    return url[len(head):] if url.startswith(head) and len(url) > len(head) else None


def read_text(url: str) -> str | None:
    """The file's text, or None when it does not exist."""
    fs, path = split(url)
    try:
        if isinstance(fs, LocalFileSystem):
            return read_local(path).decode()
        return fs.cat_file(path).decode()
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_json(url: str) -> Any | None:
    text = read_text(url)
    return None if text is None else json.loads(text)


_made_dirs: set[tuple[int, str]] = set()


def _ensure_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """makedirs for `folder`, once per folder and process (folders are never removed mid-run); the
    folders above it are remembered as made too."""
    key = (id(fs), folder)
    if key not in _made_dirs:
        parent = folder.rsplit("/", 1)[0]
        if isinstance(fs, LocalFileSystem) and parent and (id(fs), parent) in _made_dirs:
            try:  # the folder above is known: one mkdir, no stat of each ancestor
                os.mkdir(folder)
            except FileExistsError:
                if not os.path.isdir(folder):
                    raise
            except FileNotFoundError:  # the folder above was removed behind this process's back
                fs.makedirs(folder, exist_ok=True)
        else:
            fs.makedirs(folder, exist_ok=True)
        while key not in _made_dirs:
            _made_dirs.add(key)
            parent = folder.rsplit("/", 1)[0]
            if not parent or parent == folder:
                break
            key, folder = (id(fs), parent), parent


def _ensure_parent(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """makedirs for the file's folder (see `_ensure_folder`)."""
    _ensure_folder(fs, posixpath.dirname(path.rstrip("/")))


def make_folder(url: str) -> None:
    """Create the folder `url` (and those above it) unless this process made or saw it made."""
    fs, path = split(url)
    _ensure_folder(fs, path.rstrip("/") or path)


def read_local(path: str) -> bytes:
    """A local file's bytes through `os.open`/`os.read`: two or three system calls fewer than
    `open()` (its fstat, ioctl, lseek). Each call lets go of the GIL, which the steps running in
    other threads contend for: a tenth of a trivial step's bookkeeping, measured on two cores."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_local(path: str, data: bytes, flags: int) -> None:
    """`data` into a new local file, as `read_local` reads: open, write, close and nothing else.
    With `os.O_EXCL` a file this call created but could not fill (a full disk) is removed again:
    an empty lease would block the next claim."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        if flags & os.O_EXCL:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
    finally:
        os.close(fd)


_tmp_names = itertools.count()
_TMP_TAG = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _new_tmp_tag() -> None:
    global _TMP_TAG
    _TMP_TAG = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


os.register_at_fork(after_in_child=_new_tmp_tag)  # a forked process shares no temporary name with its parent


def replace_local(path: str, data: bytes) -> None:
    """Replace a local file's content (its folder exists) so that readers see the old or the new
    content, never a part: a temporary file beside it (`{path}.tmp-...`), then `os.replace`. A few
    system calls and no folder check: cheap enough for a heartbeat at every training step."""
    tmp = f"{path}.tmp-{_TMP_TAG}-{next(_tmp_names)}"  # unique per process and call, no urandom per write
    try:
        _write_local(tmp, data, os.O_TRUNC)
        os.replace(tmp, path)
    except BaseException:  # a full disk: leave no partial temporary file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomic(url: str, data: str | bytes) -> None:
    """Replace the file's content so that readers see the old or the new content, never a part
    (object stores replace an object in one PUT); its folder is made when missing."""
    fs, path = split(url)
    _ensure_parent(fs, path)
    data = data.encode() if isinstance(data, str) else data
    if isinstance(fs, LocalFileSystem):
        replace_local(path, data)
    else:
        fs.pipe_file(path, data)


def write_json(url: str, obj: Any, indent: int | None = 1) -> None:
    """`indent=None`: one line, by json's C encoder (the indenting encoder is pure Python)."""
    write_atomic(url, json.dumps(obj, indent=indent, sort_keys=True, default=str))


def create_exclusive(url: str, text: str) -> bool:
    """Create the file with `text` unless it exists; True when this call created it."""
    fs, path = split(url)
    _ensure_parent(fs, path)
    try:
        if isinstance(fs, LocalFileSystem):
            _write_local(path, text.encode(), os.O_EXCL)
        else:
            with fs.open(path, "xb") as f:
                f.write(text.encode())
        return True
    except FileExistsError:
        return False


def append_local_file(local_path: str, url: str) -> None:
    """Add a local file's bytes to the end of the file at `url` (made when missing). Object stores
    cannot append: what is there is read and written back with the new bytes after it, so a step's
    log on gs:// keeps every attempt's lines, as a local one does."""
    fs, path = split(url)
    with open(local_path, "rb") as f:
        new = f.read()
    try:
        old = fs.cat_file(path)
    except FileNotFoundError:
        old = b""
    _ensure_parent(fs, path)
    fs.pipe_file(path, old + new)


def list_names(url: str) -> list[str]:
    """Base names of the entries directly under `url` (empty when it does not exist)."""
    fs, path = split(url)
    if isinstance(fs, LocalFileSystem):
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]


def file_sizes(url: str, skip_dir: str) -> dict[str, int]:
    """Every file under `url` (relative path -> size), except those under the sub folder `skip_dir`."""
    fs, path = split(url)
    if isinstance(fs, LocalFileSystem):
        return {rel: size for rel, (size, _) in local_file_stats(path, skip_dir).items()}
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    root = path.rstrip("/") + "/"
    out = {}
    for full, info in found.items():
        rel = full[len(root):] if full.startswith(root) else full
        if rel.split("/", 1)[0] == skip_dir or info.get("type") != "file":  # dirs, and links (wandb's latest-run)
            continue
        out[rel] = int(info.get("size") or 0)
    return out


def local_file_stats(path: str, skip_dir: str) -> dict[str, tuple[int, int]]:
    """Every file under the local folder `path` (relative path -> (size, mtime_ns)) except those
    under `skip_dir`, with `os.scandir`, as fsspec's `find` sees them (regular files only; links
    are neither listed nor followed) at a fraction of its cost."""
    out: dict[str, tuple[int, int]] = {}
    stack = [("", path)]
    while stack:
        rel_dir, folder = stack.pop()
        try:
            entries = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                rel = f"{rel_dir}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    if rel != skip_dir:
                        stack.append((rel + "/", entry.path))
                elif entry.is_file(follow_symlinks=False) and rel != skip_dir:
                    stat = entry.stat(follow_symlinks=False)
                    out[rel] = (stat.st_size, stat.st_mtime_ns)
    return out


def exists(url: str) -> bool:
    fs, path = split(url)
    return fs.exists(path)


def delete_file(url: str) -> None:
    fs, path = split(url)
    try:
        if isinstance(fs, LocalFileSystem):
            os.remove(path)
        else:
            fs.rm_file(path)
    except FileNotFoundError:
        pass


def delete_contents(url: str, keep: str) -> None:
    """Delete every entry directly under the folder `url` except the one named `keep`."""
    fs, path = split(url)
    for name in list_names(url):
        if name != keep:
            fs.rm(f"{path.rstrip('/')}/{name}", recursive=True)
    _made_dirs.clear()


def forget_made_folders() -> None:
    """Forget which folders this process made: a step removed some of them (its own output folder,
    deleted and made again), and a write must make them anew."""
    _made_dirs.clear()


def delete_tree(url: str) -> None:
    fs, path = split(url)
    fs.rm(path, recursive=True)
    _made_dirs.clear()


PROBE_TIMEOUT_S = 10.0


class PrefixError(ValueError):
    """The `--prefix` cannot hold outputs: an unknown scheme, an unreachable store, or no access."""


def check_prefix(url: str, write: bool) -> None:
    """Fail in one line, before any step runs, when `url` cannot be read (or, with `write`, written).

    The probe looks the prefix up (absent is fine, a file is not) and, for `write`, creates and
    deletes a small file there. It runs in a daemon thread bounded by PROBE_TIMEOUT_S: an object
    store without network or credentials would otherwise retry for about a minute before the first
    step's error.
    """
    protocol = url.partition("://")[0] if "://" in url else "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        known = fsspec.available_protocols()
        close = difflib.get_close_matches(protocol, known, n=1)
        raise PrefixError(f"--prefix {url}: unknown storage scheme {protocol + '://'!r}"
                          + (f" (did you mean {close[0]}://?)" if close else "")
                          + "; give a local folder or an fsspec URL such as memory://, gs://bucket/path, s3://bucket/path") from None
    except ImportError as exc:
        raise PrefixError(f"--prefix {url}: {protocol}:// needs a package that is not installed ({exc})") from None
    outcome: list[tuple[str, BaseException | None]] = []  # (stage reached, its error)

    def probe() -> None:
        stage = "read"
        try:
            fs, path = split(url)
            try:
                if fs.info(path)["type"] == "file":
                    raise NotADirectoryError(f"{url} is a file, not a folder")
            except FileNotFoundError:
                pass
            if write:
                stage = "write"
                marker = join(url, f".keel-probe-{uuid.uuid4().hex[:8]}")
                write_atomic(marker, "")
                delete_file(marker)
            outcome.append((stage, None))
        except Exception as exc:  # noqa: BLE001 - any failure here means the prefix is unusable
            outcome.append((stage, exc))

    thread = threading.Thread(target=probe, name="keel-prefix-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S)
    if not outcome:
        raise PrefixError(f"--prefix {url}: no answer within {PROBE_TIMEOUT_S:g}s (store unreachable, or no "
                          "credentials?); check the network and credentials, or pass a --prefix that answers")
    stage, exc = outcome[0]
    if exc is not None:
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise PrefixError(f"--prefix {url}: cannot {stage} there ({type(exc).__name__}: {detail}); "
                          f"pass a --prefix this process can {'read and write' if write else 'read'}")

