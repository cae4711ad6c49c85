"""Concurrent launchers and dead launchers: leases make every step run exactly once."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from keel.cli import load_experiment
from keel.executor.plan import Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.step import Step, this_output
from keel.executor.status import keel_path, read_status
from test_bad_inputs import HEADER  # an experiment file's imports, its config C and the step `write`

REPO = Path(__file__).resolve().parent.parent
COUNTING = str(REPO / "tests/fixtures/counting_graph.py")

pytestmark = pytest.mark.waits  # on launchers sleeping in their steps, and leases


def launch(tmp_path, branch, sleep, **extra):
    env = {**os.environ, "KEEL_TEST_COUNTER": str(tmp_path / "count"), "KEEL_TEST_BRANCH": branch,
           "KEEL_TEST_SLEEP": str(sleep), **extra}
    return subprocess.Popen([sys.executable, "-m", "keel.cli_entry", "run", COUNTING, "--prefix", str(tmp_path / "out")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    raise TimeoutError("condition not reached in time")


def recorded(counter: Path) -> list[str]:
    """The complete lines the steps have recorded so far."""
    text = counter.read_text() if counter.exists() else ""
    return text.split("\n")[:-1]


def test_four_launchers_on_overlapping_graphs_run_each_step_once(tmp_path):
    procs = [launch(tmp_path, branch, 0.5) for branch in ("a", "b", "all", "all")]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    counts = (tmp_path / "count").read_text().split()
    assert sorted(counts) == ["join", "left", "right", "root"], counts
    assert any("reuse" in out for out in outputs)  # someone waited and reused a shared step


def test_stale_lease_is_taken_over_after_kill_9(tmp_path):
    os.environ["KEEL_TEST_COUNTER"] = str(tmp_path / "count")
    steps = load_experiment(COUNTING)
    graph = Graph(steps, str(tmp_path / "out"))
    root = next(s for s in graph.order if s.name == "count/root")
    root_path = graph.path(root)

    first = launch(tmp_path, "all", 30, KEEL_LEASE_TIMEOUT="1.5")
    try:
        wait_until(lambda: (s := read_status(root_path)) is not None and s.state == "RUNNING")
        # The line itself, not the file: `open(.., "a")` creates the file before the line is written,
        # and a kill in between would leave the first attempt unrecorded.
        wait_until(lambda: recorded(tmp_path / "count") == ["root"])
        running = {p.name: p for p in plan_graph(graph)}["count/root"]
        assert running.state == "running-elsewhere"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    assert read_status(root_path).state == "RUNNING"  # from step.json: the attempt started, never ended
    assert not os.path.exists(keel_path(root_path, "status"))  # so no SUCCESS, and no manifest

    time.sleep(1.6)  # let the dead launcher's lease expire
    plans = {p.name: p for p in plan_graph(graph, None)}
    assert plans["count/root"].state == "run" and "lease expired" in plans["count/root"].reason

    second = launch(tmp_path, "all", 0, KEEL_LEASE_TIMEOUT="1.5")
    out = second.communicate(timeout=120)[0]
    assert second.returncode == 0, out
    status = read_status(root_path)
    assert status.state == "SUCCESS" and status.attempt == 2
    assert recorded(tmp_path / "count").count("root") == 2


def test_lease_takeover_on_memory_store():
    from keel.executor import lease as leases

    path = f"memory://lease-test-{os.getpid()}/step-abc"
    first, holder = leases.try_acquire(path, timeout=0.3)
    assert first is not None and holder is None
    second, holder = leases.try_acquire(path, timeout=0.3)
    assert second is None and holder.owner == first.owner  # live: refused
    leases._HEARTBEATS.discard(first)  # the holder "dies": no more heartbeats
    time.sleep(0.4)
    second, holder = leases.try_acquire(path, timeout=0.3)
    assert second is not None and second.epoch == first.epoch + 1
    first.release()  # a superseded holder cannot free its successor's lease
    assert leases.current_lease(path).owner == second.owner
    second.release()


def test_a_shorter_lease_taken_while_the_heartbeat_sleeps_is_beaten_within_its_timeout(monkeypatch):
    from keel.executor import lease as leases

    monkeypatch.setattr(leases, "_HEARTBEATS", leases._Heartbeats())  # its loop sleeps a quarter of 60 s
    path = f"memory://lease-short-{os.getpid()}"
    long_one, _ = leases.try_acquire(f"{path}/long", timeout=60)
    time.sleep(0.2)  # the heartbeat thread is in its 15 s wait now
    short_one, _ = leases.try_acquire(f"{path}/short", timeout=2.0)
    try:
        time.sleep(3.0)  # past the short lease's timeout: only heartbeats (every 0.5 s) keep it live
        assert leases.current_lease(f"{path}/short").age() < 2.0
    finally:
        short_one.release()
        long_one.release()


def test_a_lease_file_left_empty_is_taken_over_once_its_writer_is_surely_gone(tmp_path, monkeypatch):
    from keel.executor import lease as leases

    output = str(tmp_path / "step-abc")
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        leases.try_acquire(output)
    monkeypatch.undo()
    assert leases.current_lease(output) is None, "a claim that could not write its lease leaves no empty file"

    empty = Path(output, ".keel", "lease-00000000")
    empty.touch()  # a launcher that died between creating and writing it (a crash)
    refused, holder = leases.try_acquire(output)
    assert refused is None and holder.epoch == 0  # just created: perhaps being written right now
    past = time.time() - leases.EMPTY_LEASE_S - 1
    os.utime(empty, (past, past))
    taken, superseded = leases.try_acquire(output)
    assert taken is not None and taken.epoch == 1 and superseded.epoch == 0
    taken.release()


SHARING = HEADER + '''
import time


def slow(config):
    """Runs until the test says go (the file GO names), after the other experiment ran beside it."""
    os.makedirs(config.output_path, exist_ok=True)
    open(os.path.join(config.output_path, "started"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["GO"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    write(config)


def stray(config):
    write(config)
    os.makedirs(os.path.join(config.output_path, "..", "junk", "deeper"))  # a folder of its own beside its output


if __name__ == "__main__":
    main({"slow": [Step("x/slow", slow, C(1))], "quick": [Step("x/nested/quick", write, C(2))],
          "stray": [Step("x/stray", stray, C(3))]}[os.environ["WHICH"]])
'''


def test_another_experiments_nested_steps_beside_a_running_step_are_not_its_writes(tmp_path):
    """Two experiments share a prefix. While one's step `x/slow` runs, the other's `x/nested/quick`
    writes `x/nested/quick-HASH` beside it: the new folder `x/nested` holds another step's output,
    not a stray write of `x/slow` (the own-data tutorial failed so beside the scaling ladder, in the
    test session's shared prefix).
    A folder a step makes beside its output that holds no outputs still fails it."""
    experiment, prefix, go = tmp_path / "sharing.py", str(tmp_path / "out"), tmp_path / "go"
    experiment.write_text(SHARING)

    def keel_run(which):
        return subprocess.Popen([sys.executable, "-m", "keel.cli_entry", "run", str(experiment), "--prefix", prefix],
                                env={**os.environ, "WHICH": which, "GO": str(go)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = keel_run("slow")
    try:
        wait_until(lambda: list(Path(prefix, "x").glob("slow-*/started")))
        other = keel_run("quick")
        out, _ = other.communicate(timeout=120)
        assert other.returncode == 0 and list(Path(prefix, "x", "nested").glob("quick-*/n.txt")), out
        go.touch()
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "1 ran" in out, out

    stray = keel_run("stray")
    out, _ = stray.communicate(timeout=120)
    assert stray.returncode != 0 and "the step wrote junk beside its output folder" in out, out


@dataclass(frozen=True)
class Beside:
    n: int
    stray: str = "stray.txt"
    output_path: str = this_output()


def _writes_stray(config):
    """Writes its output and, wrongly, an entry beside it."""
    Path(config.output_path, "n.txt").write_text(str(config.n))
    Path(config.output_path, "..", config.stray).write_text("x")


def _waits_for_stray(config):
    """Behaves: runs until the neighbour's stray entry appears beside it, then writes only its own output."""
    deadline = time.monotonic() + 10
    while not Path(config.output_path, "..", config.stray).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(config.output_path, "n.txt").write_text(str(config.n))


def _waits_for_stray_elsewhere(config):
    """No outputs of its own (so no watch): its effect is elsewhere; it waits like `_waits_for_stray`."""
    deadline = time.monotonic() + 10
    while not Path(config.output_path, "..", config.stray).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_stray_beside_its_folder_fails_the_step_that_wrote_it_not_its_neighbours(tmp_path, monkeypatch):
    """Steps running at once in one folder: `x/a` writes `../stray.txt`, its neighbours only wait for
    it. The watch saw `x/a` write it: `x/a` fails; neither `x/b` (watched) nor `x/n` (no watch: it
    declares no outputs) is blamed for it. An isolated step's stray is still its own (its process
    reports what it wrote beside its output)."""
    monkeypatch.setenv("KEEL_WRITABLE", str(tmp_path))  # as the launcher's threads, which share the system temp dir
    steps = [Step("x/a", _writes_stray, Beside(1)), Step("x/b", _waits_for_stray, Beside(2)),
             Step("x/n", _waits_for_stray_elsewhere, Beside(3), no_outputs=True),
             Step("y/iso", _writes_stray, Beside(4, stray="own.txt"), isolated=True)]
    report = run_steps(steps, str(tmp_path / "out"), echo=lambda line: None)
    failed = {f.step: f.error for f in report.failures}
    assert sorted(failed) == ["x/a", "y/iso"] and sorted(report.ran) == ["x/b", "x/n"], (failed, report.ran)
    assert "the step wrote stray.txt beside its output folder" in failed["x/a"]
    assert "the step wrote own.txt beside its output folder" in failed["y/iso"]


HELD_ELSEWHERE = HEADER + '''
import time
from pathlib import Path


def held(config):
    """Runs until the test says go (at most a minute), then records when it ended."""
    Path(config.output_path, "started").touch()
    deadline = time.monotonic() + 60
    while not Path(os.environ["GO"]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(config.output_path, "n.txt").write_text(str(time.time()))


def free(config):
    Path(config.output_path, "n.txt").write_text(str(time.time()))


a = Step("x/held", held, C(1), isolated=True)
b = Step("x/free", free, C(2), isolated=True)
''' + '\nif __name__ == "__main__":\n    main([a, b])\n'


@pytest.mark.timeout(120)
def test_a_step_waiting_for_another_launcher_holds_none_of_this_machines_cores(tmp_path, monkeypatch):
    """Launcher A runs `x/held`; launcher B, on a machine of one core, runs both steps: its `x/held`
    waits for A, and its `x/free` starts meanwhile instead of waiting behind a step it does not run."""
    import threading

    from keel.executor import run

    experiment, prefix, go = tmp_path / "held.py", str(tmp_path / "out"), tmp_path / "go"
    experiment.write_text(HELD_ELSEWHERE)
    monkeypatch.setenv("GO", str(go))
    first = subprocess.Popen([sys.executable, "-m", "keel.cli_entry", "run", str(experiment), "--prefix", prefix,
                              "--only", "x/held"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: list(Path(prefix, "x").glob("held-*/started")))
        monkeypatch.setattr(run, "machine_cores", lambda: 1)

        def release_when_free_is_done():  # or after 30 s, so that a run that holds `x/free` back still ends
            try:
                wait_until(lambda: list(Path(prefix, "x").glob("free-*/n.txt")), timeout=30)
            except TimeoutError:
                pass
            go.touch()

        releaser = threading.Thread(target=release_when_free_is_done, daemon=True)
        releaser.start()
        lines: list[str] = []
        assert run_steps(load_experiment(str(experiment)), prefix, echo=lines.append).ok, lines
        releaser.join(timeout=60)
        out, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0, out
    ended = {name: float(next(Path(prefix, "x").glob(f"{name}-*/n.txt")).read_text()) for name in ("held", "free")}
    assert ended["free"] < ended["held"], ended
    assert [line for line in lines if line.startswith("[keel] wait")] == [
        next(line for line in lines if line.startswith("[keel] wait  x/held: another launcher is running it"))], lines
    assert any(line == "[keel] reuse x/held (finished by another launcher)" for line in lines), lines


LEFT_TO_US = HEADER + '''
import time
from pathlib import Path


def _until(name):
    deadline = time.monotonic() + 60
    while not Path(os.environ[name]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def held(config):
    """Launcher A's attempt fails when the test says so; launcher B's records when it started."""
    if os.environ.get("ROLE") == "A":
        Path(config.output_path, "started").touch()
        _until("FAIL_A")
        raise RuntimeError("launcher A's attempt fails")
    Path(config.output_path, "n.txt").write_text(str(time.time()))


def free(config):
    Path(config.output_path, "started").touch()
    _until("END_FREE")
    Path(config.output_path, "n.txt").write_text(str(time.time()))


a = Step("x/held", held, C(1), isolated=True)
b = Step("x/free", free, C(2), isolated=True)
''' + '\nif __name__ == "__main__":\n    main([a, b])\n'


@pytest.mark.timeout(120)
def test_a_step_another_launcher_leaves_to_this_one_waits_for_a_core_before_its_process_starts(tmp_path, monkeypatch):
    """Launcher B, on a machine of one core, waits on `x/held` (A runs it) and gives its core to
    `x/free`. A's attempt then fails, so B takes `x/held` over: its process starts only once `x/free`
    has ended, not beside it (three processes on two cores before)."""
    import threading

    from keel.executor import run

    experiment, prefix = tmp_path / "left.py", str(tmp_path / "out")
    experiment.write_text(LEFT_TO_US)
    fail_a, end_free = tmp_path / "fail_a", tmp_path / "end_free"
    monkeypatch.setenv("FAIL_A", str(fail_a))
    monkeypatch.setenv("END_FREE", str(end_free))
    first = subprocess.Popen([sys.executable, "-m", "keel.cli_entry", "run", str(experiment), "--prefix", prefix,
                              "--only", "x/held"], env={**os.environ, "ROLE": "A"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        wait_until(lambda: list(Path(prefix, "x").glob("held-*/started")))
        monkeypatch.setattr(run, "machine_cores", lambda: 1)

        def fail_a_then_end_free():  # each bounded, so that the run ends whatever B does
            try:
                wait_until(lambda: list(Path(prefix, "x").glob("free-*/started")), timeout=30)
                fail_a.touch()
                first.wait(timeout=30)
                wait_until(lambda: any(line.startswith("[keel] wait  x/held: every core") for line in lines), timeout=10)
            except (TimeoutError, subprocess.TimeoutExpired):
                pass
            end_free.touch()

        helper = threading.Thread(target=fail_a_then_end_free, daemon=True)
        helper.start()
        report = run_steps(load_experiment(str(experiment)), prefix, echo=lines.append)
        helper.join(timeout=60)
        out, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode != 0 and "launcher A's attempt fails" in out, out
    assert report.ok and sorted(report.ran) == ["x/free", "x/held"], (report, lines)
    ended_free = float(next(Path(prefix, "x").glob("free-*/n.txt")).read_text())
    started_held = float(next(Path(prefix, "x").glob("held-*/n.txt")).read_text())
    assert started_held >= ended_free, (started_held, ended_free)
    assert [line for line in lines if line.startswith("[keel] wait  x/held")] == [
        next(line for line in lines if line.startswith("[keel] wait  x/held: another launcher is running it")),
        "[keel] wait  x/held: every core of this machine (1) already runs a step in a process of its own; "
        "it starts when one ends"], lines


REMADE_MEANWHILE = HEADER + '''
import subprocess, sys, time
from pathlib import Path


def stamp(config):
    os.makedirs(config.output_path, exist_ok=True)
    Path(config.output_path, "n.txt").write_text(str(time.time_ns()))  # other content each time it runs


def read_then_wait(config):
    """Reads its input, then another launcher makes that input again (`--force`) before it ends."""
    text = Path(config.inputs[0], "n.txt").read_text()
    subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", os.environ["EXPERIMENT"], "--prefix", os.environ["PREFIX"],
                    "--only", "^x/d$", "--force", "^x/d$"], check=True, capture_output=True, timeout=120)
    os.makedirs(config.output_path, exist_ok=True)
    Path(config.output_path, "n.txt").write_text(text)


d = Step("x/d", stamp, C(1))
a = Step("x/a", read_then_wait, C(2, (output_of(d),)))
''' + '\nif __name__ == "__main__":\n    main([a])\n'


@pytest.mark.timeout(180)
def test_a_step_whose_input_is_made_again_while_it_runs_records_what_it_read_and_says_so(tmp_path, monkeypatch):
    """`x/a` reads `x/d`, which another launcher then forces again: `x/a` ends SUCCESS with a
    warning, and its status records `x/d` as it read it (it recorded the new one, so the next plan
    took the output made from the old data as current)."""
    experiment, prefix = tmp_path / "remade.py", str(tmp_path / "out")
    experiment.write_text(REMADE_MEANWHILE)
    monkeypatch.setenv("EXPERIMENT", str(experiment))
    monkeypatch.setenv("PREFIX", prefix)
    lines: list[str] = []
    report = run_steps(load_experiment(str(experiment)), prefix, echo=lines.append)
    assert report.ok and sorted(report.ran) == ["x/a", "x/d"], (report, lines)
    (warned,) = report.warned
    assert warned.step == "x/a" and warned.warnings == [
        "x/d: made again while it ran (by another launcher); it read the earlier output, so the next `keel run` runs it "
        "again"], warned
    plans = {p.name: p for p in plan_graph(Graph(load_experiment(str(experiment)), prefix))}
    assert plans["x/d"].state == "cached" and plans["x/a"].state == "run" and plans["x/a"].remade_inputs, plans["x/a"]
