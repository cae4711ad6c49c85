"""Ctrl-C and SIGTERM: the first stops running steps at their next safe point (INTERRUPTED, never
SUCCESS, leases released, exit 130, the rerun resumes); the second aborts at once. Leases held by
a dead launcher name their owner and are taken over without waiting out the timeout."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.cli import load_experiment
from keel.executor import lease as leases
from keel.executor.plan import Graph, plan_graph
from keel.executor.status import read_status

REPO = Path(__file__).resolve().parent.parent
GRAPH = str(REPO / "tests/fixtures/interruptible_graph.py")

pytestmark = pytest.mark.waits  # on steps ticking to their end, and signals


def _launch(prefix, command="run", **env):
    return subprocess.Popen([sys.executable, "-m", "keel.cli_entry", command, GRAPH, "--prefix", str(prefix)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _graph(prefix, **env):
    """The fixture's graph as a launcher with `env` declares it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Graph(load_experiment(GRAPH), str(prefix))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _paths(prefix, **env):
    graph = _graph(prefix, **env)
    return {s.name: graph.path(s) for s in graph.steps()}


def _launcher_tmp(tmp_path) -> Path:
    """A temporary folder of the launcher's own (its TMPDIR), where each step's child keeps its folder."""
    folder = tmp_path / "launcher-tmp"
    folder.mkdir(exist_ok=True)
    return folder


def _left_behind(folder: Path, timeout: float = 0.0) -> list[str]:
    """The child folders still in `folder` after up to `timeout` seconds (a stopping child removes its own)."""
    deadline = time.monotonic() + timeout
    while (left := sorted(p.name for p in folder.glob("keel-step-*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_for_progress(path, at_least=3, timeout=60.0):
    deadline = time.monotonic() + timeout
    progress = Path(path) / "progress"
    while time.monotonic() < deadline:
        text = progress.read_text().strip() if progress.exists() else ""
        if text and int(text) >= at_least:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{progress} did not reach {at_least}")


def _run_and_signal(tmp_path, signum):
    """Launch the graph, send `signum` once the step is under way; (paths, exit code, console)."""
    paths = _paths(tmp_path)
    proc = _launch(tmp_path)
    try:
        _wait_for_progress(paths["count/steady"])
        proc.send_signal(signum)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    return paths, proc.returncode, out


def test_first_ctrl_c_interrupts_then_the_rerun_resumes(tmp_path):
    paths, code, out = _run_and_signal(tmp_path, signal.SIGINT)
    assert code == 130, out
    assert "count/steady was interrupted: stopped after tick" in out and "not started: count/after" in out, out
    assert "run the same command again" in out and "Traceback" not in out, out
    status = read_status(paths["count/steady"])
    assert status.state == "INTERRUPTED" and "resumes it from tick" in status.error
    assert leases.current_lease(paths["count/steady"]) is None, "the lease is released"
    plans = {p.name: p for p in plan_graph(_graph(tmp_path))}
    assert plans["count/steady"].state == "interrupted" and plans["count/after"].state == "run"
    stopped_at = int((Path(paths["count/steady"]) / "progress").read_text())

    rerun = _launch(tmp_path)
    out = rerun.communicate(timeout=120)[0]
    assert rerun.returncode == 0, out
    assert f"starting at tick {stopped_at}" in out, out  # resumed, not restarted
    assert read_status(paths["count/steady"]).state == "SUCCESS" and read_status(paths["count/after"]).state == "SUCCESS"


def test_sigterm_interrupts_like_ctrl_c(tmp_path):
    paths, code, out = _run_and_signal(tmp_path, signal.SIGTERM)
    assert code == 130, out
    assert read_status(paths["count/steady"]).state == "INTERRUPTED"


def test_a_step_silent_past_its_progress_timeout_while_stopping_is_interrupted_not_failed(tmp_path):
    """After Ctrl-C a training step writes its checkpoint without beating; the launcher's stall kill
    cuts it short when that outlasts progress_timeout_s. The step declares preemption retries, which a
    stopping run does not spend: it is INTERRUPTED (the rerun resumes), never FAILED."""
    env = {"KEEL_TEST_PROGRESS_TIMEOUT": "5", "KEEL_TEST_SLOW_STOP": "12", "KEEL_TEST_TICKS": "100000"}
    paths = _paths(tmp_path, **env)
    proc = _launch(tmp_path, **env)
    try:
        _wait_for_progress(paths["count/steady"])
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    status = read_status(paths["count/steady"])
    assert status.state == "INTERRUPTED" and "no progress for" in status.error, (status.state, status.error, out)


def test_second_ctrl_c_aborts_at_once(tmp_path):
    paths = _paths(tmp_path, KEEL_TEST_TICKS="100000")
    launcher_tmp = _launcher_tmp(tmp_path)
    proc = _launch(tmp_path, KEEL_TEST_STUBBORN="1", KEEL_TEST_TICKS="100000", TMPDIR=str(launcher_tmp))
    try:
        _wait_for_progress(paths["count/steady"])
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)  # a second signal within a second is the same Ctrl-C (forwarded by `uv run`)
        assert proc.poll() is None, "a step that ignores the request keeps the first Ctrl-C waiting"
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out = proc.communicate(timeout=30)[0]
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "aborted" in out, out
    assert took < 10, f"the second Ctrl-C took {took:.1f}s to stop the launcher"
    assert read_status(paths["count/steady"]).state == "INTERRUPTED"
    assert leases.current_lease(paths["count/steady"]) is None
    progress = Path(paths["count/steady"]) / "progress"
    seen = progress.read_text()
    time.sleep(0.3)
    assert progress.read_text() == seen, "the step's child process was killed"
    assert _left_behind(launcher_tmp) == [], "the killed child's folder (its payload and temporary files) is removed"
    helper = int((Path(paths["count/steady"]) / "helper.pid").read_text())  # a process the step started
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(helper):
        os.kill(helper, signal.SIGKILL)
        raise AssertionError("a process the step started outlived the abort: it would go on writing the output")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended: only its exit status is left to reap
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _read_until(proc, text: str, timeout: float = 60.0) -> str:
    """The console lines `proc` printed up to the first that holds `text`."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if not line:
                break  # it exited
            seen.append(line)
            if text in line:
                return "".join(seen)
    raise TimeoutError(f"{text!r} not printed; printed: {''.join(seen)}")


def test_ctrl_c_stops_waiting_for_a_step_another_launcher_runs(tmp_path):
    ticks = {"KEEL_TEST_TICKS": "100000"}  # the first launcher's step outlives the test
    paths = _paths(tmp_path, **ticks)
    first, second = _launch(tmp_path, **ticks), None
    try:
        _wait_for_progress(paths["count/steady"])
        second = _launch(tmp_path, **ticks)
        _read_until(second, "[keel] wait  count/steady")
        second.send_signal(signal.SIGINT)
        out = second.communicate(timeout=30)[0]
        assert second.returncode == 130, out
        assert "no longer waiting for the launcher running it" in out and "not started: count/steady, count/after" in out, out
        assert first.poll() is None and read_status(paths["count/steady"]).state == "RUNNING", "the other launcher goes on"
        assert leases.current_lease(paths["count/steady"]).pid == first.pid
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.communicate()


def test_a_dead_launchers_lease_names_its_owner_and_is_taken_over_at_once(tmp_path):
    paths = _paths(tmp_path)
    launcher_tmp = _launcher_tmp(tmp_path)
    proc = _launch(tmp_path, KEEL_LEASE_TIMEOUT="600", TMPDIR=str(launcher_tmp))
    try:
        _wait_for_progress(paths["count/steady"])
        holder = leases.current_lease(paths["count/steady"])
        assert holder.pid == proc.pid and "last heartbeat" in holder.describe()
        plans = {p.name: p for p in plan_graph(_graph(tmp_path))}
        assert plans["count/steady"].state == "running-elsewhere"
        assert f"pid {proc.pid}" in plans["count/steady"].reason and "takeover in" in plans["count/steady"].reason
        proc.kill()  # kill -9: its orphaned child notices and stops at its next tick
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    t0 = time.monotonic()
    rerun = _launch(tmp_path, KEEL_LEASE_TIMEOUT="600")
    out = rerun.communicate(timeout=120)[0]
    assert rerun.returncode == 0, out
    assert f"its lease was held by host {holder.host}, pid {proc.pid} (that process is gone" in out, out
    assert time.monotonic() - t0 < 60, "no waiting out the 600 s lease timeout"
    # the orphaned child stopped at a tick with nobody to collect it: it removed its own folder
    assert _left_behind(launcher_tmp, timeout=30) == [], "an orphaned child's folder is left in the launcher's TMPDIR"


_THREAD_STARTS_CHILD = """
import json, os, sys, threading, time
sys.path.insert(0, {fixtures!r})
from interruptible_graph import TickConfig, tick
from keel.executor.child import collect, start_child

started = {{}}
def start():  # once the step runs, this thread ends, while its process goes on
    started["child"] = start_child(tick, TickConfig(ticks=60, output_path={output!r}), {output!r}, {{}})
    while not os.path.exists(os.path.join({output!r}, "progress")):
        time.sleep(0.02)
thread = threading.Thread(target=start)
thread.start()
thread.join()
process, workdir = started["child"]
process.wait(timeout=120)
print(json.dumps({{"state": collect(process, workdir).state}}))
"""


def test_the_end_of_the_launcher_thread_that_started_a_child_is_not_a_stop_request(tmp_path):
    """The kernel's parent-death signal fires when the *thread* that started the child ends (during a
    kill -9 the launcher's threads end one by one): while the launcher lives, the step goes on."""
    output = tmp_path / "count" / "steady-0123456789"
    output.mkdir(parents=True)
    script = _THREAD_STARTS_CHILD.format(fixtures=str(REPO / "tests" / "fixtures"), output=str(output))
    launcher_tmp = tmp_path / "launcher-tmp"
    launcher_tmp.mkdir()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "TMPDIR": str(launcher_tmp)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["state"] == "succeeded", done.stdout
    assert (output / "progress").read_text() == "60"
    assert list(launcher_tmp.iterdir()) == []
