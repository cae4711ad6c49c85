"""Faults a long run meets with nobody watching: a step's process killed (SIGKILL), frozen
(SIGSTOP), raising mid-run or crashing in native code (SIGSEGV: the step's own failure, not a
preemption). A step that declares `retries=Retries(...)` and, for hangs, `progress_timeout_s` is
retried by the launcher, resumes from its newest checkpoint and ends SUCCESS with the result of an
uninterrupted run, each attempt recorded; spent retries fail the step naming every attempt.

The step here stands in for training (no jax, so each attempt starts in a second): it takes
`steps` deterministic steps, beats the heartbeat after each and meets the fault that Levanter's
`LEVANTER_FAULT_KIND`/`LEVANTER_FAULT_STEP` declare, as `keel.train.progress` does through
`levanter.recovery.faults` (read here without importing it: it imports jax), and checkpoints every
other step. The launcher runs retries without those variables, as Levanter's supervisor does, so
the fault fires once; `KEEL_TEST_FAIL_ALWAYS` raises on every attempt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.waits  # on stalled steps timing out, and retries

EXPERIMENT = '''
import json
import os
import signal
from dataclasses import dataclass

from keel import Retries, Step, main, this_output
from keel.executor import heartbeat


@dataclass(frozen=True)
class Train:
    steps: int
    output_path: str = this_output()


def train(config):
    checkpoint = os.path.join(config.output_path, "checkpoint.json")
    state = json.load(open(checkpoint)) if os.path.exists(checkpoint) else {"step": 0, "loss": 8.0}
    print(f"resuming at step {state['step']}", flush=True)
    kind, at = os.environ.get("LEVANTER_FAULT_KIND", "none"), int(os.environ.get("LEVANTER_FAULT_STEP", "-1"))
    while state["step"] < config.steps:
        state = {"step": state["step"] + 1, "loss": round(state["loss"] * 0.9 + 0.05, 12)}
        heartbeat.beat(state["step"])
        if state["step"] % 2 == 0:
            with open(checkpoint + ".tmp", "w") as f:
                json.dump(state, f)
            os.replace(checkpoint + ".tmp", checkpoint)
        if os.environ.get("KEEL_TEST_FAIL_ALWAYS") or (kind != "none" and state["step"] == at):
            if kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if kind == "sigsegv":  # what a compiler's segfault does to the process
                os.kill(os.getpid(), signal.SIGSEGV)
            raise RuntimeError(f"injected fault at step {state['step']}")
    with open(os.path.join(config.output_path, "final.json"), "w") as f:
        json.dump(state, f)


run = Step("train/faulty", train, Train(steps=8), isolated=True, retries=Retries(on_failure=2, on_preemption=2),
           progress_timeout_s=float(os.environ.get("KEEL_TEST_TIMEOUT", "5")))

if __name__ == "__main__":
    main([run])
'''


def uninterrupted_loss(steps: int) -> float:
    loss = 8.0
    for _ in range(steps):
        loss = round(loss * 0.9 + 0.05, 12)
    return loss


def run_with_fault(tmp_path: Path, **fault: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", str(tmp_path / "exp.py"), "--prefix", str(tmp_path / "out")],
                            env={**env, **fault}, capture_output=True, text=True, timeout=300)
    [output] = (tmp_path / "out").glob("train/faulty-*")
    return result, output


@pytest.mark.parametrize("fault,kind,why", [
    ("sigkill", "preemption", "killed by SIGKILL"),
    ("sigstop", "preemption", "no progress for"),
    ("sticky", "failure", "injected fault at step 5"),
    ("sigsegv", "failure", "crashed with SIGSEGV"),  # a crash is the step's own fault, not a preemption
])
def test_a_fault_is_retried_and_resumes_to_the_uninterrupted_result(tmp_path, fault, kind, why):
    result, output = run_with_fault(tmp_path, LEVANTER_FAULT_KIND=fault, LEVANTER_FAULT_STEP="5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[keel] retry train/faulty: attempt 1 ended by {kind}" in result.stdout, result.stdout
    assert json.loads((output / "final.json").read_text()) == {"step": 8, "loss": uninterrupted_loss(8)}
    status = json.loads((output / ".keel/status").read_text())
    assert status["state"] == "SUCCESS" and status["attempt"] == 2, status
    [earlier] = status["attempts"]
    assert earlier["attempt"] == 1 and earlier["state"] == kind and why in earlier["error"], earlier
    log = (output / ".keel/log.txt").read_text()
    assert "resuming at step 4" in log  # from the newest checkpoint, not from 0
    # where it failed, in the experiment file (not cloudpickle's `<dynamic-code>`): the traceback shows
    # the raising line; faulthandler's stack of the crash names the file
    if fault == "sticky":
        line = _line_of("raise RuntimeError(")
        assert f'File "{tmp_path / "exp.py"}", line {line}, in train\n    raise RuntimeError(' in log, log
    if fault == "sigsegv":
        assert "Fatal Python error: Segmentation fault" in log, log
        line = _line_of("os.kill(os.getpid(), signal.SIGSEGV)")
        assert re.search(rf'File "{re.escape(str(tmp_path / "exp.py"))}", line {line} in train\n', log), log


def _line_of(code: str) -> int:
    """The line of exp.py (EXPERIMENT) that holds `code`."""
    [line] = [n for n, text in enumerate(EXPERIMENT.splitlines(), start=1) if code in text]
    return line


def test_spent_retries_fail_the_step_naming_every_attempt(tmp_path):
    result, output = run_with_fault(tmp_path, KEEL_TEST_FAIL_ALWAYS="1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert "failed after 3 attempts: attempt 1 (failure): RuntimeError: injected fault at step 1; attempt 2 (failure)" in result.stderr
    status = json.loads((output / ".keel/status").read_text())
    assert status["state"] == "FAILED" and status["attempt"] == 3 and [a["attempt"] for a in status["attempts"]] == [1, 2]


CRASHING_STEP = '''
import os, signal, sys
from keel.executor.job import run_step_job

def crash(config):
    print("step output before the crash")
    os.kill(os.getpid(), signal.SIGSEGV)

run_step_job(crash, None, "memory://crashing-step/out", whole_process=True)
'''


def test_a_crashed_step_with_remote_outputs_still_gets_its_log(tmp_path):
    """Outputs not on a local disk (here `memory://`): the step's process stages its log in its
    temporary directory and uploads it as the step ends. One that crashed first left it there, with
    the crash's Python stacks; the launcher (`collect`) uploads it before removing the directory."""
    import fsspec

    from keel.executor.child import collect

    workdir = tmp_path / "child"
    (workdir / "tmp").mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-c", CRASHING_STEP], env={**os.environ, "TMPDIR": str(workdir / "tmp")},
                               cwd=tmp_path)
    log = "memory://crashing-step-launcher/.keel/log.txt"
    outcome = collect(process, str(workdir), log=log)
    assert outcome.state == "failed" and "crashed with SIGSEGV" in outcome.message, outcome
    text = fsspec.filesystem("memory").cat_file(log.removeprefix("memory://")).decode()
    assert "step output before the crash" in text and "Fatal Python error: Segmentation fault" in text, text
    assert re.search(r'File "<string>", line \d+ in crash\n', text), text
    assert not workdir.exists()


STUBBORN_STEP = '''
import time
from keel.executor.job import run_step_job

def stubborn(config):
    print("step output before the abort", flush=True)
    time.sleep(300)

run_step_job(stubborn, None, "memory://stubborn-step/out", whole_process=True)
'''


def test_a_step_aborted_by_a_second_ctrl_c_still_gets_its_log(tmp_path):
    """The second Ctrl-C kills a step's process at once (`abandon`): what it staged for its remote
    log is uploaded before its folder goes, as after a crash."""
    import fsspec

    from keel.executor.child import abandon
    from keel.executor.job import STAGED_LOG_PREFIX

    workdir = tmp_path / "child"
    (workdir / "tmp").mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-c", STUBBORN_STEP], env={**os.environ, "TMPDIR": str(workdir / "tmp")},
                               cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(b"before the abort" in p.read_bytes() for p in (workdir / "tmp").glob(STAGED_LOG_PREFIX + "*")):
            assert process.poll() is None and time.monotonic() < deadline, "the step never printed"
            time.sleep(0.1)
        log = "memory://stubborn-step-launcher/.keel/log.txt"
        abandon(process, str(workdir), log)
    finally:
        process.kill()
    assert "step output before the abort" in fsspec.filesystem("memory").cat_file(log.removeprefix("memory://")).decode()
    assert not workdir.exists()


def test_a_staged_log_is_uploaded_once_whichever_threads_end_its_step(tmp_path):
    """A second Ctrl-C's abort and the step's own `collect` both discard the child's folder, from two
    threads: each appended the staged log to the remote one, which then held its lines twice."""
    import fsspec

    from keel.executor.child import _upload_staged_log
    from keel.executor.job import STAGED_LOG_PREFIX

    workdir = tmp_path / "child"
    (workdir / "tmp").mkdir(parents=True)
    (workdir / "tmp" / (STAGED_LOG_PREFIX + "x")).write_text("the step's last words\n")
    log = "memory://staged-once/.keel/log.txt"
    _upload_staged_log(str(workdir), log)
    _upload_staged_log(str(workdir), log)
    assert fsspec.filesystem("memory").cat_file(log.removeprefix("memory://")).decode() == "the step's last words\n"


def test_an_abort_that_cannot_mark_one_step_marks_the_others_and_exits(monkeypatch, capsys):
    """A second Ctrl-C on a full disk: the first step's record cannot be written. The abort still
    marks the next one, releases both leases and exits (it raised before, and waited on the steps)."""
    import threading
    import types

    from keel.executor import run

    marked, released = [], []

    def mark_finished(output_path, running, error=None, **_):
        if output_path == "/out/a":
            raise OSError(28, "No space left on device")
        marked.append(output_path)

    class Lease:
        def __init__(self, path):
            self.path = path

        def release(self):
            released.append(self.path)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(run, "mark_finished", mark_finished)
    monkeypatch.setattr(run, "_taken_over", lambda *_: None)
    monkeypatch.setattr(run.os, "_exit", exit_)
    runner = types.SimpleNamespace(_lock=threading.RLock(), _children={}, cluster=None,
                                   _active={p: (None, Lease(p)) for p in ("/out/a", "/out/b")})
    with pytest.raises(SystemExit) as exited:
        run.Runner._abort(runner)
    assert exited.value.code == 130
    assert marked == ["/out/b"] and released == ["/out/b"]
    err = capsys.readouterr().err
    assert "could not mark /out/a interrupted (OSError: [Errno 28] No space left on device)" in err, err
    assert "keel: aborted; interrupted: a, b." in err

def test_a_log_that_cannot_be_uploaded_is_named_and_the_step_still_succeeds(tmp_path, monkeypatch, capsys):
    """The store answering 503 to the log's upload, after the step wrote its outputs, failed the step
    (and a cluster job, retried on failure, ran again). The log's file is kept and named."""
    import tempfile

    import fsspec

    from keel.executor import job, storage

    def unavailable(local, url):
        raise OSError("503 Service Unavailable")

    def step(config):
        print("the step's line")
        with fsspec.open("memory://unuploaded/out/result.txt", "w") as f:
            f.write("done")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(storage, "append_local_file", unavailable)
    job.run_step_job(step, None, "memory://unuploaded/out")
    err = capsys.readouterr().err
    assert "the step's log could not be uploaded to memory://unuploaded/out/.keel/log.txt (OSError: 503" in err, err
    [kept] = tmp_path.glob(job.STAGED_LOG_PREFIX + "*")
    assert "the step's line" in kept.read_text() and f"its lines are in {kept}" in err

def test_a_heartbeat_on_an_object_store_is_written_at_most_every_few_seconds_and_read_by_its_age(monkeypatch):
    """A cluster job beats on the shared store (`gs://`, here `memory://`), which takes about one
    write per object per second: a training step's beats are thinned to one per REMOTE_BEAT_S, and
    the launcher reads the beat's age from the store's own time."""
    import time

    from keel.executor import heartbeat, storage

    target = "memory://supervision/heartbeat-thinned/.keel/heartbeat"
    monkeypatch.setenv(heartbeat.ENV, target)
    monkeypatch.setattr(heartbeat, "_last_remote_beat", 0.0)
    started = time.time()
    for step in range(50):  # fast steps: only the first lands within REMOTE_BEAT_S
        heartbeat.beat(step)
    assert storage.read_text(target).split()[0] == "0"
    assert heartbeat.seconds_since(target, started - 60, time.time()) < 5  # it just beat
    assert heartbeat.seconds_since(target, started - 60, time.time() + 600) > 590  # silent for ten minutes
    monkeypatch.setattr(heartbeat, "_last_remote_beat", time.monotonic() - heartbeat.REMOTE_BEAT_S)
    heartbeat.beat(50)
    assert storage.read_text(target).split()[0] == "50"
    # a store that fails to answer says nothing either way: the watcher neither kills nor gives up on the job
    fs, _ = storage.split(target)

    def unanswered(path):
        raise OSError("HTTP 503: service unavailable")

    monkeypatch.setattr(fs, "modified", unanswered)
    assert heartbeat.seconds_since(target, started - 60, time.time() + 600) is None
    # ...but no news for longer than the timeout is silence: a heartbeat that cannot be read never
    # switches progress_timeout_s off
    watch = heartbeat.Watch(target, started)
    silent, why = watch.silent_for(started + 10)
    assert silent == 0 and why.endswith("could not be read")
    assert watch.silent_for(started + 310) == (300, f"its heartbeat {target} could not be read")


HANGS_ON_EXIT = '''
import os
import threading
import time
from dataclasses import dataclass

from keel import Step, main, this_output


@dataclass(frozen=True)
class Out:
    output_path: str = this_output()


def finish_then_linger(config):
    with open(os.path.join(config.output_path, "done.txt"), "w") as f:
        f.write("done")
    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()  # joined at exit: for ten minutes


run = Step("x/lingers", finish_then_linger, Out(), isolated=True, progress_timeout_s=15.0)

if __name__ == "__main__":
    main([run])
'''


def test_a_step_whose_process_hangs_after_reporting_success_is_success_and_not_waited_on(tmp_path, monkeypatch, capsys):
    """A non-daemon thread (or an exit hook) that never ends kept the launcher waiting forever; with a
    progress_timeout_s, the silent heartbeat then turned the finished step into a stalled one."""
    import time

    from keel.cli import console_main
    from keel.executor import child

    experiment = tmp_path / "lingers.py"
    experiment.write_text(HANGS_ON_EXIT)
    monkeypatch.setattr(child, "EXIT_GRACE_S", 3.0)
    started = time.monotonic()
    assert console_main(["run", str(experiment), "--prefix", str(tmp_path / "out")]) == 0
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "reported its result but had not exited 3s later" in err and "the result stands" in err, err
    assert (next((tmp_path / "out" / "x").glob("lingers-*")) / "done.txt").read_text() == "done"


LEAVES_A_WRITER = '''
import os
import subprocess
from dataclasses import dataclass

from keel import Step, main, this_output


@dataclass(frozen=True)
class Out:
    output_path: str = this_output()


def start_a_writer_then_die(config):
    writer = subprocess.Popen(["sleep", "300"])  # in the step's process group, as a data writer would be
    with open(os.path.join(config.output_path, "writer.pid"), "w") as f:
        f.write(str(writer.pid))
    os._exit(3)  # the step's process dies (as from a fault) with its writer still running


run = Step("x/leaves", start_a_writer_then_die, Out(), isolated=True)

if __name__ == "__main__":
    main([run])
'''


def test_a_killed_group_is_waited_for_until_only_zombies_are_left():
    """`_kill_group` returns once no process of the group lives: the kill lands when each process
    next runs, and CI once found the dead step's writer still running after the launcher returned.
    A zombie (killed, not yet reaped) answers kill(pid, 0) but writes nothing: it does not count."""
    import signal
    import subprocess
    import time

    from keel.executor.child import _kill_group
    from keel.executor.lease import group_lives, process_lives

    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        assert group_lives(leader.pid)
        os.kill(leader.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process_lives(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(leader.pid, 0)  # the zombie still answers a kill...
        assert not group_lives(leader.pid)  # ...but no process of the group lives
    finally:
        leader.kill()
        leader.wait(timeout=30)

    group = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    time.sleep(0.2)  # its two sleeps started
    _kill_group(group)
    assert group.returncode is not None and not group_lives(group.pid)


def test_processes_a_dead_steps_process_left_running_are_killed_with_it(tmp_path, capsys):
    """A step's process that dies leaves what it started (a writer, a server) running, in its group,
    writing the output beside the next attempt: the launcher kills the group once the process ends."""
    from keel.cli import console_main
    from keel.executor.lease import process_lives

    experiment = tmp_path / "leaves.py"
    experiment.write_text(LEAVES_A_WRITER)
    assert console_main(["run", str(experiment), "--prefix", str(tmp_path / "out")]) != 0
    assert "exited with code 3 without reporting a result" in capsys.readouterr().err
    writer = int((next((tmp_path / "out" / "x").glob("leaves-*")) / "writer.pid").read_text())
    try:
        assert not process_lives(writer), "the dead step's writer still runs"
    finally:
        if process_lives(writer):
            os.kill(writer, 9)


def other_pid() -> int:
    """The pid of a process that has ended (reaped)."""
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=60)
    return ended.pid


def test_two_launchers_of_one_remote_output_keep_their_heartbeats_apart(tmp_path):
    """The heartbeat of a step writing to an object store lies beside the launcher's temporary files,
    and the launcher removes it when the step ends. It was named by the output alone: a launcher
    resumed (`fg`) after another had taken the step over removed the other's live file."""
    import subprocess
    import sys

    from keel.executor.run import _heartbeat_file

    output = "memory://bucket/out/train/run-0123456789"
    other = subprocess.run([sys.executable, "-c", f"from keel.executor.run import _heartbeat_file; "
                            f"print(_heartbeat_file({output!r}))"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    mine = _heartbeat_file(output)
    assert mine != other.stdout.strip() and mine == _heartbeat_file(output)
    # a launcher killed before it removed its file leaves one behind: the next of that output removes it
    left, live = mine.rsplit("-", 1)[0] + f"-{other_pid()}", mine
    for path in (left, live):
        with open(path, "w") as f:
            f.write("beat")
    try:
        _heartbeat_file(output)
        assert not os.path.exists(left) and os.path.exists(live)
    finally:
        for path in (left, live):
            if os.path.exists(path):
                os.remove(path)
    local = str(tmp_path / "out" / "train" / "run-0123456789")  # a local output's is the output's own, for any launcher
    assert _heartbeat_file(local) == str(tmp_path / "out" / "train" / "run-0123456789" / ".keel" / "heartbeat")


def test_an_abort_forgets_only_the_cluster_jobs_it_terminated(monkeypatch):
    """A lease that names a job the abort terminated stops naming it (the next launcher has nothing
    to adopt); one naming a job it did not terminate (adopted with the lease and not submitted yet,
    or whose terminate the controller refused) keeps naming it, for the next launcher to adopt or
    stop rather than run the step beside it."""
    import threading
    import types

    from keel.executor import cluster, run
    from keel.executor.lease import ClusterJob

    forgot = []

    class Lease:
        def __init__(self, path, job_id):
            self.path, self.job = path, ClusterJob(path.rsplit("/", 1)[-1], job_id)

        def runs_job(self, job):
            forgot.append(self.path) if job is None else None

        def release(self):
            pass

    monkeypatch.setattr(run, "mark_finished", lambda *_, **__: None)
    monkeypatch.setattr(run, "_taken_over", lambda *_: None)
    monkeypatch.setattr(run.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(cluster, "terminate_live_jobs", lambda: {"/u/a"})
    runner = types.SimpleNamespace(_lock=threading.RLock(), _children={}, cluster=object(),
                                   _active={p: (None, Lease(p, f"/u/{p[-1]}")) for p in ("/out/a", "/out/b")})
    with pytest.raises(SystemExit):
        run.Runner._abort(runner)
    assert forgot == ["/out/a"]
