"""Run one step in a child process of its own: `python -m keel.executor.child WORKDIR LAUNCHER_PID`.

Steps with heavy process-wide state (jax and its devices, wandb, XLA flags) cannot share a
process: two training steps in threads of one launcher share one wandb service and one device set.
An isolated step therefore runs here, in a fresh interpreter whose environment the step's config
declares (`config.process_env(processes=1)`, e.g. the simulated device count of its hardware).

The launcher and the child speak through two files beside each other: the payload (the launcher's
`sys.path`, then the cloudpickled `(fn, resolved config, output path, watch writes, graph prefix)`)
and the result (JSON: `succeeded`, `interrupted` or `failed` with the error line). The same folder holds the
child's temporary directory (`TMPDIR`), deleted with it when the step ends: a write to the system
temp dir (`/tmp/x`) is outside the step's output and its own temp dir, and fails it (`writes.py`). Signals: the child runs in its own
session, so a terminal's Ctrl-C reaches the launcher only, which forwards it; the first SIGINT or
SIGTERM asks the step to stop at its next safe point (`keel.executor.interrupt`), a second one
stops the child at once (the launcher then removes the folder itself: `abandon`). A child whose
launcher died (kill -9) ends at once with its process group, after removing the folder, which nobody
would: no launcher can record its result now, and the next one takes the lease over and runs the step
again (an attempt that died RUNNING, resumed from its last checkpoint like an interrupted one), so an
orphan must not write the output beside it. It learns of the death from `PR_SET_PDEATHSIG` on Linux,
else within a second (`_watch_launcher`); until it is gone, the lease names its pid and stays live.
The death signal is SIGUSR2, which means nothing else here: the kernel sends it when the launcher
*thread* that started the child ends, which during a kill -9 may be before the launcher's last
thread (the child then still has the launcher's pid as its parent), so it is not a stop request;
the child checks whether its parent changed, and the kernel signals again when it does.

A child that crashes in native code (SIGSEGV, SIGABRT, ...: `CRASH_SIGNALS`) reports nothing either
and comes back `failed`, its Python stacks at the end of its log (`job._crash_stacks_into`). A log
that a child died before uploading (its output is not on a local disk) the launcher uploads.
A child killed from outside (SIGKILL, a preempted VM) reports nothing and comes back `killed`, unless
the kernel's out-of-memory killer killed it (its count rose meanwhile: `failed`, as a rerun runs out
of memory again); a child watched by its heartbeat (`heartbeat.py`) that stops beating for the
declared timeout (or whose heartbeat cannot be read that long) has its process group killed and
comes back `stalled`. The launcher retries `killed` and `stalled` as a preemption. A child that
reported its result but does not exit is killed `EXIT_GRACE_S` later, its result standing.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass

from keel.executor import heartbeat as heartbeat_mod
from keel.executor import interrupt, storage
from keel.executor.lease import CHILD_FOLDER_PREFIX, group_lives
from keel.executor.resources import OomKills, oom_kills

_PARENT_POLL_S = 1.0
EXIT_GRACE_S = 120.0
"""How long a child that reported its result may take to exit (interpreter shutdown: exit hooks,
threads joined) before its process group is killed and the result stands: a hook or non-daemon
thread that hangs would otherwise keep the launcher waiting forever, or past a `progress_timeout_s`
turn a finished step into a stalled one."""
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
"""Signals a process raises on itself when its native code faults (a compiler's segfault, an XLA CHECK's
abort): the step failed, and a rerun meets the same fault. Any other signal came from outside."""


@dataclass(frozen=True)
class ChildOutcome:
    state: str  # "succeeded" | "interrupted" | "failed" | "killed" | "stalled"
    message: str = ""
    resume: str = ""  # for "interrupted": what the next run resumes from
    beside: tuple[str, ...] = ()  # the entries beside its output the step wrote (`writes.written_beside`)


def start_child(fn, resolved_config, output_path: str, env: dict[str, str], drop: tuple[str, ...] = (),
                watch: bool = False, prefix: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start the child for one step, in the launcher's environment plus `env`, less the variables
    named in `drop`, with a temporary directory of its own; returns the process and the folder
    holding its payload/result. With `watch`, the step fails if it writes outside its output (or
    into another output under `prefix`, the graph's)."""
    workdir = tempfile.mkdtemp(prefix=CHILD_FOLDER_PREFIX)
    try:  # a config that does not pickle (a lock, an open file) or a process that does not start leaves no folder
        os.mkdir(os.path.join(workdir, "tmp"))
        with open(os.path.join(workdir, "payload"), "wb") as f:
            pickle.dump(list(sys.path), f)
            _pickler(f).dump((fn, resolved_config, output_path, watch, prefix))
        child_env = {k: v for k, v in {**os.environ, **env, "TMPDIR": os.path.join(workdir, "tmp")}.items() if k not in drop}
        process = subprocess.Popen(
            [sys.executable, "-m", "keel.executor.child", workdir, str(os.getpid())],
            env=child_env, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return process, workdir


def _pickler(f):
    """A cloudpickle pickler whose functions pickled by value (an experiment file's own) keep their
    file's name. cloudpickle names their code `<dynamic-code>`, so that a payload does not depend on
    where its code was written; a payload here goes to one child, on this machine, and a step's
    traceback there then names the experiment file and shows its lines, as in the launcher."""
    import cloudpickle

    reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]

    def keeping_filename(code: types.CodeType):
        constructor, args = reduce_code(code)
        return constructor, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a for a in args)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({types.CodeType: keeping_filename}, cloudpickle.Pickler.dispatch_table)

    return Pickler(f)


def collect(process: subprocess.Popen, workdir: str, heartbeat: str | None = None, timeout_s: float | None = None,
            log: str | None = None, oom_kills_before: OomKills | None = None) -> ChildOutcome:
    """Wait for the child and read what it reported (a child killed outright reports nothing).
    With `heartbeat` and `timeout_s`, a child whose heartbeat is older than `timeout_s` (counted
    from its start until its first beat) is killed with its process group: `stalled`; one that
    reported but does not exit is killed `EXIT_GRACE_S` later, its result standing. `log` is the
    step's log, where a log the child staged but did not upload goes (`_upload_staged_log`). A
    child killed with SIGKILL while the out-of-memory killer's count rose from `oom_kills_before`
    (`resources.oom_kills`, read before it started) `failed`: a rerun runs out of memory again,
    so it is no preemption to retry or resume."""
    result_path = os.path.join(workdir, "result.json")
    stalled = _wait(process, result_path, heartbeat, timeout_s)
    code = process.wait()
    try:
        if stalled:
            return ChildOutcome("stalled", stalled)
        with open(result_path) as f:
            result = json.load(f)
        return ChildOutcome(result["state"], result.get("message", ""), result.get("resume", ""), tuple(result.get("beside", ())))
    except (OSError, ValueError):
        if code == interrupt.EXIT_INTERRUPTED or code in (-signal.SIGINT, -signal.SIGTERM):
            return ChildOutcome("interrupted", f"the step's process was stopped (exit {code})")
        if code < 0 and -code in CRASH_SIGNALS:
            return ChildOutcome("failed", f"the step's process crashed with {signal.Signals(-code).name} (a fault in "
                                          "native code, which a rerun meets again): the Python stack of every thread at "
                                          "the crash ends the step's log")
        now = oom_kills() if code == -signal.SIGKILL and oom_kills_before is not None else None
        if now is not None and now.count > oom_kills_before.count:
            counted = ("the machine's count of such kills, which no memory cgroup here narrows to its own (another "
                       "process's kill counts too)" if now.whole_machine else "its memory cgroup's count of such kills")
            return ChildOutcome("failed", f"the step's process was killed by the kernel's out-of-memory killer "
                                          f"({counted} rose from {oom_kills_before.count} to {now.count} while the step "
                                          "ran): it needs more memory than it has here; lower its batch or model, or "
                                          "give it more (Resources(memory=...) on a cluster), then run again")
        if code < 0:
            return ChildOutcome("killed", f"the step's process was killed by {signal.Signals(-code).name}")
        return ChildOutcome("failed", f"the step's process exited with code {code} without reporting a result")
    finally:
        discard(workdir, log)


def discard(workdir: str, log: str | None) -> None:
    """Remove a child's folder, with the step's temporary directory, once its process has ended,
    uploading first into `log` what a child whose output is not on a local disk staged there."""
    if log is not None:
        _upload_staged_log(workdir, log)
    shutil.rmtree(workdir, ignore_errors=True)


def _upload_staged_log(workdir: str, log: str) -> None:
    """A child whose output is not on a local disk writes its log into its temporary directory and
    uploads it as the step ends (`job.STAGED_LOG_PREFIX`). One that died first (a crash in native
    code, whose Python stacks faulthandler wrote there; a kill) left it behind: it is uploaded here,
    before the directory goes, so that the step's log holds what the process wrote up to its end."""
    from keel.executor.job import STAGED_LOG_PREFIX

    # A second Ctrl-C's abort and the step's own collect both end here, on two threads: the second
    # waits for the first's upload (the abort then exits the process) and finds the log gone.
    with _UPLOADING:
        for staged in glob.glob(os.path.join(workdir, "tmp", STAGED_LOG_PREFIX + "*")):
            try:
                storage.append_local_file(staged, log)
                os.remove(staged)
            except Exception as e:  # noqa: BLE001 - the step's outcome stands; the lost log is named
                print(f"[keel] could not upload the log of a step whose process ended early to {log}: {e!r}",
                      file=sys.stderr)


_UPLOADING = threading.RLock()
"""Held over an upload of staged logs (rare: only a child that ended before uploading its own);
re-entrant, as the abort runs in a signal handler on whichever thread the signal found."""


def abandon(process: subprocess.Popen, workdir: str, log: str | None = None) -> None:
    """Kill the child's process group at once (the step and every process it started, which would
    otherwise go on writing its output beside the next launcher's attempt) and remove its folder,
    which no `collect` will read now (a launcher aborting on a second Ctrl-C), after uploading into
    `log` what it staged there; the step's temporary files go with it."""
    _kill_group(process)
    discard(workdir, log)


def _wait(process: subprocess.Popen, result_path: str, heartbeat: str | None, timeout_s: float | None) -> str | None:
    """Wait for the child. Before it reports its result (`result_path`), with a `heartbeat` and
    `timeout_s`, its process group is killed when the heartbeat is older than `timeout_s`: why is
    returned. After it reported, it has `EXIT_GRACE_S` to exit, then its group is killed and the
    result stands (said on the console). None unless it stalled. Once the child has exited, what it
    left running in its group (a writer, a server the step started) is killed too: a retry must
    not find it writing the output beside it."""
    poll = min(1.0, timeout_s / 4) if timeout_s else 1.0
    watch = heartbeat_mod.Watch(heartbeat, time.time()) if heartbeat and timeout_s else None
    reported_at = None
    exited = _exit_event(process)
    while True:
        if exited.wait(poll):
            _kill_group(process)  # not reaped yet, so its pid still names its group and nothing else
            return None
        if reported_at is None and os.path.exists(result_path):
            reported_at = time.monotonic()
        if reported_at is not None:
            if time.monotonic() - reported_at > EXIT_GRACE_S:
                _kill_group(process)
                print(f"[keel] the step's process reported its result but had not exited {EXIT_GRACE_S:g}s later "
                      "(an exit hook or a non-daemon thread hung): its process group was killed; the result stands",
                      file=sys.stderr, flush=True)
                return None
            continue
        if watch is None:
            continue
        silent, why = watch.silent_for(time.time())
        if silent > timeout_s:
            _kill_group(process)
            return f"no progress for {silent:.0f}s (progress_timeout_s={timeout_s:g}): {why}, so its process group was killed"


def _exit_event(process: subprocess.Popen) -> threading.Event:
    """Set once the child has exited, which leaves it unreaped (`WNOWAIT`) for `_kill_group`."""
    exited = threading.Event()

    def watch():
        if not hasattr(os, "waitid"):  # macOS before Python 3.13: reaped here (a live member keeps the group's id)
            process.wait()
        else:
            try:
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # reaped already
                pass
        exited.set()

    threading.Thread(target=watch, name="keel-child-exit", daemon=True).start()
    return exited


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's process group, reap the child and wait until no process of the group
    lives (at most 10 s in all): a kill takes effect when its process next runs, and on a busy
    machine a writer the step started still ran after the launcher had moved on to a retry."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the group is the step's processes
    except OSError:  # the group is gone already
        pass
    deadline = time.monotonic() + 10
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    while group_lives(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _install_signal_handlers(launcher: int, workdir: str) -> None:
    def on_signal(signum, _frame):
        if os.getppid() != launcher:  # sent by whoever, the launcher is gone
            _end_orphan(workdir)
        if interrupt.requested():  # the second one: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        interrupt.request()

    def on_parent_death(_signum, _frame):
        if os.getppid() != launcher:  # else only the launcher thread that started this one ended
            _end_orphan(workdir)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)


def _die_with(launcher: int, workdir: str) -> None:
    """Have the kernel send PARENT_DEATH_SIGNAL when the launcher dies (Linux; elsewhere
    `_watch_launcher` notices within a second), and end now if it died already."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the watch thread is the fallback
            pass
    if os.getppid() != launcher:
        _end_orphan(workdir)


_PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGUSR2  # sent for nothing else (see the module's docstring)


_ORPHANED = threading.RLock()  # re-entrant: a second signal may land inside the first one's removal


def _end_orphan(workdir: str) -> None:
    """The launcher died: remove the folder nobody will collect, then kill this process group (the step
    and the processes it started) at once, before the next launcher runs the step. The signal and the
    watch thread may both get here: the second waits, never to return, so that one removal is not
    cut short by the other's kill (a folder was left so on a loaded machine)."""
    _ORPHANED.acquire()
    for _ in range(3):  # a file the step was still writing can keep the first pass from emptying it
        shutil.rmtree(workdir, ignore_errors=True)
        if not os.path.exists(workdir):
            break
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch_launcher(launcher: int, workdir: str) -> None:
    """If the launcher (pid `launcher`, this process's parent when it started) dies, end at once."""
    def watch():
        while os.getppid() == launcher:
            time.sleep(_PARENT_POLL_S)
        _end_orphan(workdir)

    threading.Thread(target=watch, name="keel-launcher-watch", daemon=True).start()


def main(workdir: str, launcher: int) -> int:
    from keel.executor import writes
    from keel.executor.job import run_step_job

    _install_signal_handlers(launcher, workdir)
    _die_with(launcher, workdir)
    _watch_launcher(launcher, workdir)
    with open(os.path.join(workdir, "payload"), "rb") as f:
        sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
        import cloudpickle  # noqa: F401 - unpickling by-value functions needs it importable

        fn, resolved_config, output_path, watch, prefix = pickle.load(f)
    try:
        run_step_job(fn, resolved_config, output_path, watch=watch, prefix=prefix, whole_process=True)
        outcome, code = {"state": "succeeded"}, 0
    except interrupt.StepInterrupted as exc:
        outcome, code = {"state": "interrupted", "message": str(exc), "resume": exc.resume}, interrupt.EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which marks the step FAILED
        outcome, code = {"state": "failed", "message": "".join(traceback.format_exception_only(type(exc), exc)).strip()}, 1
    outcome["beside"] = writes.written_beside()
    storage.replace_local(os.path.join(workdir, "result.json"), json.dumps(outcome).encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
