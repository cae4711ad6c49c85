"""Where a step writes: under its output path, nowhere else.

While a step's function runs, keel watches the files it opens for writing and the files it renames
into place, through Python's audit hook (`sys.addaudithook`, events `open` and `os.rename`, which
`open`, `os.open`, `pathlib`, `tempfile`, `shutil` and `os.replace` all raise; `os.mkdir` too, for
the entries beside the output, below): one Python call per audited event, with no system call
unless the event is a write. Watched are the step's own thread in the launcher and every thread of
an isolated step's process (not a cluster task: on a remote machine, a local file outside the
output is lost with the machine anyway). A file written anywhere else fails the step
(`StepWroteOutside`), naming the files (left where they are) and the fix.

The rule: a step writes only under `config.output_path`. Also allowed, because libraries write
there on their own:
- the temporary directory (`tempfile.gettempdir()`): an isolated step's process gets one of its own
  (`TMPDIR`, beside its payload in the launcher's temp folder), deleted when the step ends, so a
  write to `/tmp/elsewhere` is caught there; in the launcher's threads the system one is shared;
- the user's caches, library settings and data: `$XDG_CACHE_HOME` (else `~/.cache`: Hugging Face,
  matplotlib, keel's own input memo), `$XDG_CONFIG_HOME` (else `~/.config`: wandb's settings),
  `$XDG_DATA_HOME` (else `~/.local/share`: wandb's artifact staging), `$XDG_STATE_HOME` (else
  `~/.local/state`), and the folders `HF_HOME`, `MPLCONFIGDIR`, `WANDB_DIR`, `WANDB_CACHE_DIR`,
  `WANDB_CONFIG_DIR`, `WANDB_DATA_DIR`, `TRITON_CACHE_DIR`, `JAX_COMPILATION_CACHE_DIR` and
  `KEEL_CACHE_DIR` (keel's input memo and compiled programs, `inputs.cache_dir`) name;
- Python's bytecode (`__pycache__`), devices and kernel files (`/dev`, `/proc`, `/sys`), and the
  heartbeat file the launcher watches (`KEEL_HEARTBEAT`);
- the folders `KEEL_WRITABLE` lists (separated by `os.pathsep`): where every step of a launch may
  also write, such as a shared registry of runs.

Into another step's output (anywhere under the graph's prefix but its own output), a step must not
write, even where the rule above allows it (a prefix under the temporary directory, as tests and
quick runs use): a file planted in a finished neighbour's folder is in no manifest, so no check
would see it. Beside its output folder (`{output}/../x`), a step must not write either: the launcher
fails a step for a new entry there (`run._Beside`), and so that it blames the step that made the
entry, not a neighbour running in the same folder meanwhile, each watch records the entries beside
its output it wrote or made (`writer_of`; an isolated step's process reports its own to the launcher).

Not seen: writes by native code (XLA, tensorstore) and by other processes the step starts. A name
opened with a `dir_fd` is judged as if relative to the working directory (the event does not carry
the folder). A step declared `no_outputs=True` (its effect is elsewhere) is not watched.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time

from keel.executor import heartbeat
from keel.executor.status import KEEL_DIR

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_SYSTEM = ("/dev/", "/proc/", "/sys/")
_CACHE_ENV = ("HF_HOME", "MPLCONFIGDIR", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR",
              "TRITON_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "KEEL_CACHE_DIR")
WRITABLE_ENV = "KEEL_WRITABLE"
SHOWN = 5
"""How many of the files written outside a failing step's message names."""


class StepWroteOutside(RuntimeError):
    """The step wrote files outside its output path (and outside the temporary and cache folders)."""


class _Watch:
    """What one step wrote outside the folders it may write to."""

    def __init__(self, local_output: str | None, local_prefix: str | None = None):
        self.outside: list[str] = []
        self.output = os.path.abspath(local_output) if local_output else None
        self.parent = os.path.dirname(self.output).rstrip("/") + "/" if self.output else None
        home = os.path.expanduser("~")
        shared = [tempfile.gettempdir(),
                  os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                  os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"),
                  os.environ.get("XDG_DATA_HOME") or os.path.join(home, ".local", "share"),
                  os.environ.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state"),
                  *(os.environ[name] for name in _CACHE_ENV if os.environ.get(name)),
                  *(p for p in os.environ.get(WRITABLE_ENV, "").split(os.pathsep) if p)]
        roots = [*([self.output] if self.output else []), *map(os.path.abspath, shared)]
        self.roots = tuple(sorted({r.rstrip("/") + "/" for r in roots}))
        # The graph's prefix holds the other steps' outputs: off limits even inside a root (a prefix
        # under the temporary directory), but for the roots that lie inside it (a TMPDIR there).
        self.prefix = os.path.abspath(local_prefix).rstrip("/") + "/" if local_prefix and self.output else None
        self.inside_prefix = tuple(r for r in self.roots if self.prefix and r.startswith(self.prefix))
        self._real_roots: tuple[str, ...] | None = None  # resolved when a write is first checked by its real path
        beat = heartbeat.path()
        self.files = (os.path.abspath(beat),) if beat else ()

    def allowed(self, path: str) -> bool:
        if (path + "/").startswith(self.roots) or path.startswith(_SYSTEM) or "/__pycache__/" in path:  # a root itself: O_TMPFILE
            return True
        return any(path == f or path.startswith(f + ".tmp-") for f in self.files)

    def _allowed_real(self, path: str) -> bool:
        """Whether `path` resolved through links lands in a root resolved through links. Resolving
        every root costs ~18 stat calls, so a watch does it once, for the first write its roots do
        not hold as written: at each step's start it was a fifth of a cold run of trivial steps."""
        if self._real_roots is None:
            self._real_roots = tuple(sorted({os.path.realpath(r).rstrip("/") + "/" for r in self.roots}))
        real = os.path.realpath(path)
        return (real + "/").startswith(self._real_roots) or self.allowed(real)

    def _in_another_output(self, path: str) -> bool:
        """Whether `path` lies under the graph's prefix, outside this step's own output (and outside
        the roots inside the prefix): in another step's output, or where one would go. A new entry
        beside the output folder is left to `run._Beside`, which names it so; one inside a
        neighbour's output (a folder holding keel's `.keel`) is not new there."""
        if self.prefix is None or not path.startswith(self.prefix) or (path + "/").startswith(self.inside_prefix):
            return False
        if self.parent and path.startswith(self.parent):
            entry = self.parent + path[len(self.parent):].split("/", 1)[0]
            return entry != path and os.path.isdir(os.path.join(entry, KEEL_DIR))
        return True

    def saw(self, path, made_folder: bool = False) -> None:
        """A file written (or, `made_folder`, a folder made: only an entry beside the output counts)."""
        if isinstance(path, int):  # an open file descriptor: opened by a path already seen
            return
        try:
            path = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError, OSError):
            return
        if self.parent and path.startswith(self.parent) and not (path + "/").startswith(self.output + "/"):
            _wrote_beside[self.parent + path[len(self.parent):].split("/", 1)[0]] = (self.output, time.time_ns())
        if made_folder or ((self.allowed(path) or self._allowed_real(path)) and not self._in_another_output(path)):
            return
        if path not in self.outside:
            self.outside.append(path)

    def check(self) -> None:
        """Raise `StepWroteOutside` naming what the step wrote outside its output, if anything."""
        if not self.outside:
            return
        shown = ", ".join(self.outside[:SHOWN]) + (f" and {len(self.outside) - SHOWN} more" if len(self.outside) > SHOWN else "")
        raise StepWroteOutside(
            f"the step wrote {shown} outside its output path: a step writes only under config.output_path "
            "(temporary files in tempfile.gettempdir(), which keel empties when an isolated step ends), or declares "
            f"Step(..., no_outputs=True) when its effect is elsewhere (a folder every step may share: {WRITABLE_ENV}); "
            "those files were left where they are")


_lock = threading.Lock()
_hooked = False
_local = threading.local()
_process_watch: _Watch | None = None
_wrote_beside: dict[str, tuple[str, int]] = {}
"""An entry beside a watched step's output folder -> (that output, when a watch last saw it written, ns)."""


def wrote_beside(entries, output: str) -> None:
    """Record that the step whose (local) output is `output` wrote `entries`, beside that output, just now."""
    now = time.time_ns()
    for entry in entries:
        _wrote_beside[os.path.abspath(entry)] = (os.path.abspath(output), now)


def writer_of(entry: str, since_ns: int) -> str | None:
    """The output of the step last seen writing `entry` (beside it) at or after `since_ns`; None if none was."""
    output, when = _wrote_beside.get(os.path.abspath(entry), (None, 0))
    return output if when >= since_ns else None


def written_beside() -> list[str]:
    """Every entry this process's watches saw written beside their outputs (an isolated step reports them)."""
    return sorted(_wrote_beside.copy())


def _current() -> _Watch | None:
    return getattr(_local, "watch", None) or _process_watch


def _hook(event: str, args: tuple) -> None:
    if event == "open":
        watch = _current()
        if watch is not None and args[2] & _WRITE_FLAGS:
            watch.saw(args[0])
    elif event == "os.rename":
        watch = _current()
        if watch is not None:
            watch.saw(args[1])
    elif event == "os.mkdir":
        watch = _current()
        if watch is not None:
            watch.saw(args[0], made_folder=True)


def _install() -> None:
    global _hooked
    with _lock:
        if not _hooked:
            sys.addaudithook(_hook)  # for the rest of the process: an audit hook cannot be removed
            _hooked = True


@contextlib.contextmanager
def watched(output_path: str, *, whole_process: bool, prefix: str | None = None):
    """Watch the writes of the step whose output is `output_path` while the block runs: this
    thread's, or (`whole_process`, for a process that runs one step) every thread's; `check()`
    on the yielded watch raises when some landed outside, or in another output under `prefix`
    (the graph's). A remote output (gs://, memory://) leaves only the temporary and cache folders
    allowed locally."""
    global _process_watch
    from keel.executor import storage

    local = storage.is_local(output_path)
    watch = _Watch(storage.split(output_path)[1] if local else None,
                   storage.split(prefix)[1] if local and prefix and storage.is_local(prefix) else None)
    _install()
    if whole_process:
        _process_watch = watch
    else:
        _local.watch = watch
    try:
        yield watch
    finally:
        if whole_process:
            _process_watch = None
        else:
            _local.watch = None
