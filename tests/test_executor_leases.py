"""A launcher that loses a step: suspended past its lease's timeout (SIGSTOP, a paused VM) it records
nothing once another launcher took the step over; killed (kill -9), its step's process dies with it,
so the launcher that takes the lease over never runs beside an orphan."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from keel.executor import lease as leases
from keel.executor.status import read_status
from test_executor_concurrency import wait_until

pytestmark = pytest.mark.waits  # on launchers sleeping in their steps, and leases

LAUNCHER = '''
import os, sys, time
from dataclasses import dataclass
from pathlib import Path
from keel.executor.run import run_steps
from keel.executor.step import Step, this_output

WHO, CONTROL = os.environ["WHO"], Path(os.environ["CONTROL"])


@dataclass(frozen=True)
class C:
    n: int = 1
    output_path: str = this_output()


def held(config):
    """Says it started, then runs until the test says go (or, with TICKS, ticks), then writes who it is."""
    (CONTROL / f"started-{WHO}").write_text(config.output_path)
    deadline = time.monotonic() + 30
    for tick in range(int(os.environ.get("TICKS", "0"))):
        with open(CONTROL / "ticks", "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.1)
    while "TICKS" not in os.environ and not (CONTROL / f"go-{WHO}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(config.output_path, "out.txt").write_text(WHO)


report = run_steps([Step("s", held, C(), isolated="TICKS" in os.environ)], sys.argv[1],
                   lease_timeout=float(os.environ.get("TIMEOUT", "60")), echo=lambda line: print(line, flush=True))
print("ran", report.ran, "reused", report.reused, flush=True)
'''


def launch(tmp_path: Path, who: str, **env) -> tuple[subprocess.Popen, Path]:
    script, log = tmp_path / "launcher.py", tmp_path / f"{who}.log"
    script.write_text(LAUNCHER)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "WHO": who, "CONTROL": str(tmp_path), "KEEL_WRITABLE": str(tmp_path), **env})
    return proc, log


def test_a_superseded_lease_is_never_renewed_and_says_who_took_it(tmp_path):
    """A holder suspended past its timeout and superseded: resumed, its heartbeat renews nothing (not
    even once the new holder let go) and it learns who took the lease."""
    output = str(tmp_path / "step-abc")
    first, _ = leases.try_acquire(output, timeout=0.3)
    leases._HEARTBEATS.discard(first)  # suspended: no heartbeats
    assert first.taken_over() is None
    wait_until(lambda: not leases.current_lease(output).is_live())  # however late a heartbeat under way landed
    second, _ = leases.try_acquire(output, timeout=0.3)
    assert second is not None and second.epoch == first.epoch + 1
    first.heartbeat()  # resumed: its heartbeat must not make its old epoch live again
    assert not _epoch(output, first.epoch).is_live()
    assert first.taken_over() == f"host {second.owner.split(':')[0]}, pid {os.getpid()}"
    second.release()
    first.heartbeat()  # not even once the new holder let go
    assert leases.current_lease(output) is None and not _epoch(output, first.epoch).is_live()
    assert first.taken_over() == "a launcher that has since let it go"
    first.release()


def _epoch(output: str, epoch: int) -> leases.LeaseInfo:
    """The lease of one epoch, newest or not."""
    record = json.loads(Path(output, ".keel", f"lease-{epoch:08d}").read_text())
    return leases.LeaseInfo(epoch, record["owner"], record["heartbeat"], record["timeout"])


@pytest.mark.timeout(120)
def test_a_launcher_suspended_past_its_lease_records_nothing_and_waits_for_the_taker(tmp_path):
    """A is stopped (SIGSTOP) mid-step past its 1 s lease; B takes the step over. A resumes and its
    step returns while B still runs it: A writes no status, says it lost the lease to B, waits for
    B and reuses B's result."""
    a, a_log = launch(tmp_path, "A", TIMEOUT="1")
    b = None
    try:
        wait_until(lambda: (tmp_path / "started-A").exists())
        output = (tmp_path / "started-A").read_text()
        os.kill(a.pid, signal.SIGSTOP)
        wait_until(lambda: not leases.current_lease(output).is_live())
        b, b_log = launch(tmp_path, "B", TIMEOUT="1")
        wait_until(lambda: (tmp_path / "started-B").exists())
        (tmp_path / "go-A").touch()
        os.kill(a.pid, signal.SIGCONT)
        wait_until(lambda: "[keel] lost" in a_log.read_text() or a.poll() is not None)
        assert read_status(output).state == "RUNNING" and read_status(output).attempt == 2, "A recorded its attempt"
        (tmp_path / "go-B").touch()
        assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
                proc.wait()
    a_out, b_out = a_log.read_text(), b_log.read_text()
    assert f"[keel] lost  s: this launcher lost its lease to host {os.uname().nodename}, pid {b.pid} while running: its " \
           "result is not recorded; the holder's run decides" in a_out, a_out
    assert "ran [] reused ['s']" in a_out and "ran ['s'] reused []" in b_out, (a_out, b_out)
    status = read_status(output)
    assert status.state == "SUCCESS" and status.attempt == 2 and Path(output, "out.txt").read_text() == "B"


@pytest.mark.timeout(120)
def test_a_killed_launchers_step_process_dies_with_it_before_the_next_launcher_runs_it(tmp_path):
    """kill -9 of a launcher whose isolated step ticks: its step's process (recorded in the lease) dies
    at once, and the next launcher, taking the lease over at once, never ticks beside it."""
    a, a_log = launch(tmp_path, "A", TICKS="60")  # 6 s, unless it dies with its launcher
    try:
        wait_until(lambda: (tmp_path / "ticks").exists())
        output = (tmp_path / "started-A").read_text()
        orphan = int((tmp_path / "ticks").read_text().split()[0])
        holder = leases.current_lease(output)
        a.kill()
        a.wait()
    finally:
        a.kill()
        a.wait()
    b, b_log = launch(tmp_path, "B", TICKS="5")
    try:
        assert b.wait(timeout=60) == 0, b_log.read_text()
    finally:
        b.kill()
    ticks = (tmp_path / "ticks").read_text().split()
    first_of_b = next(i for i, pid in enumerate(ticks) if int(pid) != orphan)
    assert str(orphan) not in ticks[first_of_b:], f"the orphan {orphan} ticked beside the next launcher's step: {ticks}"
    b_out = b_log.read_text()
    assert f"its lease was held by host {os.uname().nodename}, pid {a.pid} (that process is gone" in b_out, b_out
    assert read_status(output).state == "SUCCESS" and read_status(output).attempt == 2  # attempt 1 died RUNNING
    assert holder.child == orphan, "the lease names the step's process, live while it is"


@pytest.mark.timeout(120)
def test_a_stopped_launchers_step_process_is_killed_by_the_launcher_that_takes_its_lease(tmp_path):
    """Ctrl-Z stops a launcher, not its isolated step (a session of its own), which went on ticking
    beside the step of the launcher that took the expired lease over: two processes, one output.
    The launcher that kills it removes its folder too, which the stopped one would have."""
    a, a_log = launch(tmp_path, "A", TICKS="400", TIMEOUT="1")  # 40 s of ticks, unless stopped
    b = None
    try:
        wait_until(lambda: (tmp_path / "ticks").exists())
        output = (tmp_path / "started-A").read_text()
        stray = int((tmp_path / "ticks").read_text().split()[0])
        stray_folder = Path(os.fsdecode(Path(f"/proc/{stray}/cmdline").read_bytes().split(b"\0")[-3]))
        assert (stray_folder / "payload").exists()
        os.kill(a.pid, signal.SIGSTOP)  # the launcher only, as Ctrl-Z stops the terminal's foreground group
        wait_until(lambda: not leases.current_lease(output).is_live())
        b, b_log = launch(tmp_path, "B", TICKS="5", TIMEOUT="1")
        assert b.wait(timeout=60) == 0, b_log.read_text()
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    ticks = (tmp_path / "ticks").read_text().split()
    first_of_b = next(i for i, pid in enumerate(ticks) if int(pid) != stray)
    assert str(stray) not in ticks[first_of_b:], f"A's step ticked beside B's: {ticks}"
    assert f"its step's process (pid {stray}) still ran, its launcher silent: killed it" in b_log.read_text()
    assert read_status(output).state == "SUCCESS"
    assert not stray_folder.exists(), "the killed step's folder (its temporary files) outlived both launchers"


def test_a_lease_released_while_another_launcher_takes_it_over_leaves_one_holder(tmp_path, monkeypatch):
    """B finds A's lease expired (A alive but starved) and numbers its own after it; before B creates
    that, A finishes and releases, and D arrives. Had the release emptied the folder, D would have
    numbered from 0 and both would hold the step; the released lease numbers D after it, so B's and
    D's creates race for one epoch, which one of them wins."""
    from keel.executor import storage

    output = str(tmp_path / "step-0123456789")
    starved = f"{os.uname().nodename}:{os.getppid()}:aaaaaa"  # a live process: not taken over for being gone
    storage.write_atomic(leases._lease_url(output, 5), json.dumps({"owner": starved, "heartbeat": 0.0, "timeout": 60}))
    create, meanwhile = storage.create_exclusive, []

    def a_releases_and_d_arrives(url, text):
        if not meanwhile:
            meanwhile.append(leases.Lease(output, 5, starved, 60).release())
            meanwhile.append(leases.try_acquire(output, 60)[0])
        return create(url, text)

    monkeypatch.setattr(storage, "create_exclusive", a_releases_and_d_arrives)
    b = leases.try_acquire(output, 60)[0]
    d = meanwhile[1]
    try:
        assert [lease.epoch for lease in (b, d) if lease is not None] == [6]
        assert sorted(os.listdir(Path(output, ".keel"))) == ["lease-00000006"]  # the released lease went with its successor
    finally:
        for lease in (b, d):
            if lease is not None:
                lease.release()
    assert leases.current_lease(output) is None  # released: no holder, the epoch kept
    assert sorted(os.listdir(Path(output, ".keel"))) == ["lease-00000006"]


def test_a_launcher_whose_listing_is_stale_does_not_take_a_lease_another_holds(tmp_path, monkeypatch):
    """A lists and reads the released epoch 0; before its create, B takes epoch 1 (deleting 0) and
    lets it go, and C takes epoch 2 (deleting 1). A's exclusive create of epoch 1 then succeeds, as
    the file is gone: A must see C's newer epoch and back off, or two launchers run the step into
    one output."""
    out = str(tmp_path / "step")
    first, _ = leases.try_acquire(out)
    first.release()
    create, others = leases.storage.create_exclusive, []

    def others_first(url, record):  # A's listing and read are done: B and C go before its create
        monkeypatch.setattr(leases.storage, "create_exclusive", create)
        b, _ = leases.try_acquire(out)
        b.release()
        others.extend([b, leases.try_acquire(out)[0]])
        return create(url, record)

    monkeypatch.setattr(leases.storage, "create_exclusive", others_first)
    a, holder = leases.try_acquire(out)
    b, c = others
    try:
        assert (b.epoch, c.epoch) == (1, 2)
        assert a is None and holder is not None and holder.owner == c.owner, (a, holder)
        assert leases.current_lease(out).owner == c.owner and leases._latest_epoch(out) == 2
        assert not os.path.exists(leases._lease_url(out, 1))  # A's epoch is gone again
    finally:
        c.release()
