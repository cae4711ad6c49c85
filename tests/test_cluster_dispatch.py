"""Cluster dispatch: the executor's caching, failure/retry and concurrent launchers, run in-process
(`local`) and on a real Iris cluster on this machine (`iris`); gangs on a fake TPU slice; requests
no scaling group can place. One cluster serves the whole module.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import pytest

from iris_local import local_iris_client
from keel import Resources, Retries, Step, execution_only, output_of, this_output
from keel.executor.replicas import replica_index
from keel.executor.plan import Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.status import keel_path, read_status

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # on the cluster starting and its jobs' polls

REPO = Path(__file__).resolve().parent.parent
CLUSTER_GRAPH = str(REPO / "tests/fixtures/cluster_graph.py")
HELLO = str(REPO / "experiments/tutorials/hello_world.py")
QUIET = lambda _: None  # noqa: E731

# Cluster tasks unpickle the step functions: ship this module's code with them, since the tests
# folder is not importable there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    """(controller URL, fray client) of one local Iris cluster for the module."""
    with local_iris_client(tmp_path_factory.mktemp("iris")) as cluster:
        yield cluster


@pytest.fixture(params=["local", "iris"])
def cluster(request):
    """None (everything in-process) or the cluster client (steps with resources go there)."""
    return None if request.param == "local" else request.getfixturevalue("iris")[1]


@dataclass(frozen=True)
class NoteConfig:
    text: str
    source: str | None = None
    output_path: str = this_output()
    ledger: str = execution_only(default="")  # each execution appends `text@where` here
    fail_while: str = execution_only(default="")  # the step raises while this file exists


def note(config: NoteConfig) -> None:
    with open(config.ledger, "a") as f:
        f.write(f"{config.text}@{os.environ.get('IRIS_TASK_ID', 'driver')}\n")
    print(f"execution {len(ledger_lines(config.ledger, config.text))} of {config.text}", flush=True)
    if config.fail_while and os.path.exists(config.fail_while):
        print("about to explode", flush=True)
        raise ValueError("the step exploded")
    prefix = open(config.source).read() if config.source else ""
    with open(f"{config.output_path}/data.txt", "w") as f:
        f.write(prefix + config.text)


def ledger_lines(path: str, text: str) -> list[str]:
    return [line for line in open(path).read().split() if line.split("@", 1)[0] == text]


def chain(tmp_path: Path, fail: str = ""):
    """a -> b -> c with resources, and `side` (no resources: always in the driver) off a."""
    cpu = Resources.with_cpu()

    def cfg(text, source=None):
        flag = str(tmp_path / "explode") if text == fail else ""
        return NoteConfig(text, source, ledger=str(tmp_path / "ledger"), fail_while=flag)

    a = Step("t/a", note, cfg("a"), resources=cpu)
    b = Step("t/b", note, cfg("b", output_of(a, "data.txt")), resources=cpu)
    c = Step("t/c", note, cfg("c", output_of(b, "data.txt")), resources=cpu)
    side = Step("t/side", note, cfg("side", output_of(a, "data.txt")))
    return a, b, c, side


def ledger(tmp_path: Path) -> dict[str, list[str]]:
    """Where each step ran, per step label (one entry per execution)."""
    runs: dict[str, list[str]] = {}
    path = tmp_path / "ledger"
    for line in path.read_text().split() if path.exists() else []:
        label, where = line.split("@", 1)
        runs.setdefault(label, []).append(where)
    return runs


def test_run_then_cached(tmp_path, cluster):
    a, b, c, side = chain(tmp_path)
    prefix = str(tmp_path / "out")
    report = run_steps([c, side], prefix, cluster=cluster, echo=QUIET)
    assert report.ok and sorted(report.ran) == ["t/a", "t/b", "t/c", "t/side"]
    graph = Graph([c, side], prefix)
    assert Path(graph.path(c), "data.txt").read_text() == "abc"
    runs = ledger(tmp_path)
    assert sorted(runs) == ["a", "b", "c", "side"] and all(len(w) == 1 for w in runs.values())
    assert runs["side"] == ["driver"]  # no resources: never sent to the cluster
    on_cluster = [runs[s][0].startswith("/") for s in "abc"]
    assert on_cluster == [cluster is not None] * 3  # an Iris task id, or the driver
    assert "data.txt" in read_status(graph.path(b)).manifest["files"]  # the driver listed what the task wrote
    assert read_status(graph.path(c)).state == "SUCCESS"

    again = run_steps([c, side], prefix, cluster=cluster, echo=QUIET)
    assert again.ok and again.ran == [] and {p.state for p in again.plans} == {"cached"}
    assert ledger(tmp_path) == runs  # nothing executed


class NamingCluster:
    """A fray client that runs each job at once in this process and keeps the names it was given:
    fray adopts a running job of the same name, so no two outputs' attempts may share one."""

    def __init__(self):
        self.names: list[str] = []

    def submit(self, request):
        from fray.types import JobStatus

        self.names.append(request.name)
        call = request.entrypoint.callable_entrypoint
        call.callable(*call.args, **call.kwargs)
        return type("Finished", (), {"job_id": request.name, "status": lambda _: JobStatus.SUCCEEDED,
                                     "wait": lambda _, timeout=None, raise_on_failure=True: None})()


def test_one_step_under_two_prefixes_is_two_cluster_jobs(tmp_path):
    a, _, _, _ = chain(tmp_path)
    cluster = NamingCluster()
    for prefix in ("first", "second"):  # at the same attempt: what a scratch run beside the real one makes
        assert run_steps([a], str(tmp_path / prefix), cluster=cluster, echo=QUIET).ok
    assert len(set(cluster.names)) == 2 and all(n.startswith("t-a-") and n.endswith("-attempt1") for n in cluster.names)


def test_failure_then_retry(tmp_path, cluster):
    (tmp_path / "explode").touch()
    a, b, c, side = chain(tmp_path, fail="b")
    prefix = str(tmp_path / "out")
    report = run_steps([c, side], prefix, cluster=cluster, echo=QUIET)
    assert not report.ok
    assert [f.step for f in report.failures] == ["t/b"] and report.blocked == ["t/c"]
    assert sorted(report.ran) == ["t/a", "t/side"]  # the independent branch finished
    failure = report.failures[0]
    assert "the step exploded" in failure.error
    if cluster is not None:  # keel's own error, carrying the job's log tail
        assert "ClusterJobFailed" in failure.error and "lines of the job's log" in failure.error
        assert "about to explode" in failure.error
    assert "the step exploded" in Path(failure.log).read_text()  # the job wrote the step's log
    assert read_status(failure.output_path).state == "FAILED"
    assert "c" not in ledger(tmp_path)

    (tmp_path / "explode").unlink()  # the cause goes away; the next run retries without being asked
    report = run_steps([c, side], prefix, cluster=cluster, echo=QUIET)
    assert report.ok and sorted(report.ran) == ["t/b", "t/c"]
    runs = ledger(tmp_path)
    assert len(runs["a"]) == 1 and len(runs["b"]) == 2 and len(runs["c"]) == 1
    status = read_status(failure.output_path)
    assert status.state == "SUCCESS" and status.attempt == 2


def test_a_retried_jobs_log_tail_holds_only_that_attempts_lines(tmp_path, iris):
    (tmp_path / "explode").touch()
    a, _, _, _ = chain(tmp_path, fail="a")
    prefix = str(tmp_path / "out")
    first = run_steps([a], prefix, cluster=iris[1], echo=QUIET).failures[0].error
    second = run_steps([a], prefix, cluster=iris[1], echo=QUIET).failures[0].error
    assert "execution 1 of a" in first and "execution 2 of a" not in first
    assert "execution 2 of a" in second and "execution 1 of a" not in second, second


class LateLogs:
    """A job handle whose log server receives the job's last lines a moment after it failed."""

    def __init__(self, delay_s: float):
        self.failed_at, self.delay_s = time.monotonic(), delay_s

    def logs(self, max_lines: int = 0) -> tuple[str, ...]:
        late = time.monotonic() - self.failed_at >= self.delay_s
        return ("execution 1 of b", "about to explode") if late else ("execution 1 of b",)


def test_a_failed_jobs_log_tail_waits_for_lines_still_in_flight():
    from keel.executor.cluster import _log_tail

    tail = _log_tail(LateLogs(delay_s=1.0))  # the worker's shipping interval
    assert tail.endswith("execution 1 of b\nabout to explode") and "last 2 lines" in tail


class FakeClock:
    """`time` for keel.executor.cluster: sleeping moves the clock on at once."""

    def __init__(self):
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now


class RunningJob:
    """A fray job handle whose job runs until `ends_at` on the clock; its blocking `wait` may only
    be called once the job has ended (Iris's own wait polls up to 30 s apart)."""

    job_id = "fake-job"

    def __init__(self, clock: FakeClock, ends_at: float, answers_from: float = 0.0):
        self.clock, self.ends_at, self.answers_from = clock, ends_at, answers_from
        self.polls, self.waited_at = 0, None

    def status(self):
        from fray.types import JobStatus

        self.polls += 1
        if self.clock.now < self.answers_from:
            raise ConnectionError("controller unavailable")
        return JobStatus.SUCCEEDED if self.clock.now >= self.ends_at else JobStatus.RUNNING

    def wait(self, timeout=None, *, raise_on_failure=True):
        assert self.clock.now >= self.ends_at, "wait() called on a running job: it would poll at Iris's pace"
        self.waited_at = self.clock.now

    def submit(self, request):  # also the client that submits it
        return self


@pytest.mark.parametrize("runs_for", [0.05, 40.0, 600.0])
def test_the_driver_notices_a_finished_job_within_a_poll_interval(monkeypatch, runs_for):
    from keel.executor import cluster as cluster_module

    clock = FakeClock()
    job = RunningJob(clock, ends_at=runs_for)
    monkeypatch.setattr(cluster_module, "time", clock)
    cluster_module.run_on_cluster(job, request=None, resources="cpu=1")
    assert job.waited_at is not None and job.waited_at - runs_for <= cluster_module.STATE_POLL_MAX_S
    assert job.polls <= runs_for / cluster_module.STATE_POLL_MAX_S + 10  # and no busier than once a second


def test_a_controller_that_does_not_answer_is_asked_again_until_it_does(monkeypatch):
    from keel.executor import cluster as cluster_module

    clock = FakeClock()
    job = RunningJob(clock, ends_at=30.0, answers_from=120.0)  # away for two minutes, past the job's end
    monkeypatch.setattr(cluster_module, "time", clock)
    cluster_module.run_on_cluster(job, request=None, resources="cpu=1")
    assert job.waited_at is not None and job.waited_at - 120.0 <= cluster_module.STATE_POLL_MAX_S  # not a failed step
    # one that never answers again fails the step after UNANSWERED_S, naming the job (not a wait of years)
    clock = FakeClock()
    gone = RunningJob(clock, ends_at=30.0, answers_from=float("inf"))
    gone.terminated_at = None
    gone.terminate = lambda: setattr(gone, "terminated_at", clock.now)
    monkeypatch.setattr(cluster_module, "time", clock)
    with pytest.raises(cluster_module.ClusterJobFailed, match=r"cluster job fake-job .*has not said how it is for 3600s"
                                                              r".*\ncluster job fake-job was terminated"):
        cluster_module.run_on_cluster(gone, request=None, resources="cpu=1")
    assert cluster_module.UNANSWERED_S <= clock.now <= cluster_module.UNANSWERED_S + 2 * cluster_module.STATE_POLL_MAX_S
    # the step fails, and a retry may start the job again: the one it gave up waiting on is terminated, not left running
    assert gone.terminated_at == clock.now


def test_ctrl_c_reaches_a_job_whose_controller_stopped_answering(monkeypatch):
    """A Ctrl-C while the controller is away still terminates the job; a terminate the controller
    refuses leaves the step INTERRUPTED (not failed), with the job named as possibly running."""
    from keel.executor import cluster as cluster_module
    from keel.executor import interrupt

    class Interrupting(FakeClock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            if self.now >= 5.0:
                interrupt.request()

    for refuses in (False, True):
        clock = Interrupting()
        job = RunningJob(clock, ends_at=600.0, answers_from=float("inf"))
        job.terminated_at = None

        def terminate(job=job, clock=clock, refuses=refuses):
            if refuses:
                raise ConnectionError("controller unavailable")
            job.terminated_at = clock.now

        job.terminate = terminate
        monkeypatch.setattr(cluster_module, "time", clock)
        expected = "could not terminate cluster job fake-job .*it may still be running" if refuses else "was terminated"
        try:
            with pytest.raises(interrupt.StepInterrupted, match=expected) as stopped:
                cluster_module.run_on_cluster(job, request=None, resources="cpu=1")
        finally:
            interrupt.clear()
        assert refuses or job.terminated_at - 5.0 <= cluster_module.STATE_POLL_MAX_S
        assert stopped.value.may_run == ("fake-job" if refuses else None)  # what the step's lease keeps naming


@pytest.mark.parametrize("adopted", [False, True])
def test_a_job_whose_step_another_launcher_took_over_is_terminated_unless_that_one_adopted_it(monkeypatch, tmp_path,
                                                                                               adopted):
    """This launcher was suspended past its lease's timeout; another took the step over (a newer
    epoch). Resumed, this one's heartbeat finds the newer lease and stops waiting. When that
    launcher runs the step in a job of its own, this one's job, still running, is terminated, so
    that one job writes the output; when it adopted this job (its lease names it), the job runs on."""
    import json

    from keel.executor import cluster as cluster_module
    from keel.executor import lease as leases
    from keel.executor import storage

    output = str(tmp_path / "step-0123456789")
    lease, _ = leases.try_acquire(output, 60)
    lease.runs_job(leases.ClusterJob("t-a-attempt1", "fake-job"))

    class TakenOverAt30(FakeClock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            if self.now >= 30.0 and not lease.superseded:
                storage.write_atomic(leases._lease_url(output, lease.epoch + 1), json.dumps(
                    {"owner": "otherhost:1:b", "heartbeat": 1e12, "timeout": 60,
                     "job": {"name": "t-a-attempt1", "id": "fake-job" if adopted else "/other/t-a-attempt1"}}))
                lease.heartbeat()  # as its heartbeat thread does

    clock = TakenOverAt30()
    job = RunningJob(clock, ends_at=600.0)
    job.terminated_at = None
    job.terminate = lambda: setattr(job, "terminated_at", clock.now)
    monkeypatch.setattr(cluster_module, "time", clock)
    said = ": cluster job fake-job " + ("runs on, adopted by the launcher that took the step over" if adopted else
                                        "was terminated")
    with pytest.raises(cluster_module.ClusterJobSuperseded, match="another launcher took the step over while this one "
                                                                  f"was suspended{said}"):
        cluster_module.run_on_cluster(job, None, "cpu=1", superseded=lambda: lease.superseded,
                                      handed_over=lease.handed_over)
    assert clock.now - 30.0 <= cluster_module.STATE_POLL_MAX_S  # noticed within a poll
    assert (job.terminated_at is None) == adopted


class AdoptingCluster(NamingCluster):
    """A fray client that hands back the job `running` names while it runs, as Iris does for a
    submit under a running job's name, and gives each job the id `prefix + name` (another user's or
    parent job's prefix makes the same name another job)."""

    def __init__(self, running: str | None = None, prefix: str = ""):
        super().__init__()
        self.running, self.prefix, self.terminated = running, prefix, []

    def submit(self, request):
        from fray.types import JobStatus

        if request.name == self.running and not self.prefix:  # the running job, handed back
            self.names.append(request.name)
            cluster, call = self, request.entrypoint.callable_entrypoint

            class Adopted:
                job_id, ran = request.name, False

                def status(self):  # it finishes the step, unless terminated first
                    if request.name in cluster.terminated:
                        return JobStatus.STOPPED
                    if not self.ran:
                        self.ran = True
                        call.callable(*call.args, **call.kwargs)
                    return JobStatus.SUCCEEDED

                def wait(self, timeout=None, raise_on_failure=True):
                    return None

                def terminate(self):
                    cluster.terminated.append(request.name)

            return Adopted()
        if self.prefix:
            self.names.append(request.name)
        handle = super().submit(request) if not self.prefix else type("New", (), {
            "job_id": self.prefix + request.name, "status": lambda _: JobStatus.RUNNING})()
        handle.terminate = lambda: self.terminated.append(handle.job_id)
        return handle


def _expired_lease_naming(output: str, job: dict, released: bool = False) -> None:
    """The lease of a launcher silent for an hour on another host (or released), naming `job`."""
    import json

    from keel.executor import lease as leases
    from keel.executor import storage

    record = {"owner": "otherhost:1:b", "released": True} if released else {
        "owner": "otherhost:1:b", "heartbeat": time.time() - 3600, "timeout": 60}
    storage.write_atomic(leases._lease_url(output, 0), json.dumps({**record, "job": job}))


JOB = {"name": "t-a-0123-attempt3", "id": "t-a-0123-attempt3"}


@pytest.mark.parametrize("released", [False, True])
def test_a_launcher_taking_over_a_lease_adopts_its_cluster_job(tmp_path, released):
    """The expired lease names the cluster job its launcher ran the step in, which may still run
    (or a released one does: its launcher gave the step up while the job ran): the launcher taking
    it over submits its first attempt under that name, which the cluster hands back while the job
    runs, so that one job writes the output; its lease names the job from the start, so the old
    launcher, resumed, leaves the job be."""
    from keel.executor import lease as leases

    a, _, _, _ = chain(tmp_path)
    prefix = str(tmp_path / "out")
    output = Graph([a], prefix).path(a)
    _expired_lease_naming(output, JOB, released)
    cluster, said = AdoptingCluster(running=JOB["name"]), []
    assert run_steps([a], prefix, cluster=cluster, echo=said.append).ok
    assert cluster.names == [JOB["name"]] and not cluster.terminated
    assert any("its cluster job t-a-0123-attempt3 is adopted while it still runs" in line for line in said), said
    assert read_status(output).state == "SUCCESS"
    assert leases.current_lease(output) is None and leases._released_job(output, 1) is None  # the job ended: not named


def test_a_launcher_that_cannot_adopt_the_job_fails_the_step_and_leaves_it_named(tmp_path):
    """With no cluster, a launcher could only run the step beside the job; and a name that gives
    another job (another user or parent job submitted it) is not the job: either way the step fails
    naming the job, the new job is terminated, and the released lease still names the old one, so
    the next launcher is refused too rather than run beside it."""
    from keel.executor import lease as leases

    a, _, _, _ = chain(tmp_path)
    prefix = str(tmp_path / "out")
    output = Graph([a], prefix).path(a)
    _expired_lease_naming(output, JOB)
    for attempt in range(2):  # the second launcher finds the job in the first one's released lease
        said = []
        assert not run_steps([a], prefix, echo=said.append).ok
        assert "ran the step in cluster job t-a-0123-attempt3, which may still run and write the output, and this " \
               "launcher has no cluster" in "\n".join(said), said
        assert leases.current_lease(output) is None and leases._released_job(output, attempt + 1) == leases.ClusterJob(**JOB)
    a = Step("t/a", note, a.config, resources=a.resources, retries=Retries(on_failure=2))  # not retried: a next
    # attempt would run beside the job
    other, said = AdoptingCluster(running=JOB["name"], prefix="/other/"), []
    assert not run_steps([a], prefix, cluster=other, echo=said.append).ok
    assert other.names == [JOB["name"]] and other.terminated == ["/other/t-a-0123-attempt3"]  # the new job, at once
    assert "cluster job t-a-0123-attempt3, which the launcher before ran the step in, may still run, and this " \
           "launcher cannot adopt it" in "\n".join(said) + (read_status(output).error or ""), said
    assert "remove the step's lease files (OUTPUT/.keel/lease-*)" in read_status(output).error  # the way out
    assert leases._released_job(output, 3) == leases.ClusterJob(**JOB)


def test_a_forced_run_stops_the_job_the_launcher_before_ran_the_step_in_before_emptying_its_output(tmp_path):
    """--force starts from an empty output: the old job, adopted by its name and left running, would
    go on writing into the new run (and the forced run would be that old one). It is stopped first,
    then the step runs in a job of its own."""
    a, _, _, _ = chain(tmp_path)
    prefix = str(tmp_path / "out")
    assert run_steps([a], prefix, echo=QUIET).ok
    output = Graph([a], prefix).path(a)
    _expired_lease_naming(output, JOB)
    cluster, said = AdoptingCluster(running=JOB["name"]), []
    assert run_steps([a], prefix, cluster=cluster, force="a", echo=said.append).ok
    assert cluster.terminated == [JOB["name"]] and cluster.names[0] == JOB["name"] != cluster.names[1]
    assert any("cluster job t-a-0123-attempt3, which the launcher before ran it in, was stopped" in line
               for line in said), said


def test_the_abort_terminates_every_live_job_even_when_one_refuses_but_one_handed_over(capsys):
    """`d`'s step was taken over by a launcher that adopted the job: that one's to stop, not this one's."""
    from keel.executor import cluster as cluster_module

    class Job:
        def __init__(self, job_id, refuses):
            self.job_id, self.refuses, self.terminated = job_id, refuses, False

        def terminate(self):
            if self.refuses:
                raise ConnectionError("controller unavailable")
            self.terminated = True

    jobs = [Job("a", False), Job("b", True), Job("c", False), Job("d", False)]
    with cluster_module._LIVE_LOCK:
        cluster_module._LIVE_JOBS.update({job: (lambda job_id: job_id == "d") for job in jobs})
    try:
        terminated = cluster_module.terminate_live_jobs()
    finally:
        with cluster_module._LIVE_LOCK:
            for job in jobs:
                cluster_module._LIVE_JOBS.pop(job)
    assert [j.terminated for j in jobs] == [True, False, True, False]
    assert terminated == {"a", "c"}  # the leases naming these forget them; b may still run, d is another's
    assert "could not terminate cluster job b (ConnectionError: controller unavailable)" in capsys.readouterr().err


def test_the_abort_waits_for_a_job_being_submitted_and_terminates_it_too():
    """A second Ctrl-C while a submit was under way (bundling the workspace takes seconds) exited
    before the job was known: it then ran with nobody to stop it, beside the rerun's."""
    import threading
    import time

    from keel.executor import cluster as cluster_module

    release = threading.Event()

    class SlowClient:
        def __init__(self):
            self.job = None

        def submit(self, request):
            release.wait(timeout=30)
            self.job = Job()
            return self.job

    class Job:
        job_id, terminated = "slow", False

        def status(self):
            from fray.types import JobStatus

            return JobStatus.SUCCEEDED if self.terminated else JobStatus.RUNNING

        def terminate(self):
            self.terminated = True

        def wait(self, timeout=None, *, raise_on_failure=True):
            return None

    client = SlowClient()
    runner = threading.Thread(target=cluster_module.run_on_cluster, args=(client, None, "cpu=1"), daemon=True)
    runner.start()
    deadline = time.monotonic() + 10
    while not cluster_module._SUBMITTING and time.monotonic() < deadline:
        time.sleep(0.01)
    threading.Timer(0.5, release.set).start()  # the submit returns half a second into the abort
    cluster_module.terminate_live_jobs()
    assert client.job is not None and client.job.terminated
    runner.join(timeout=30)


@pytest.mark.parametrize("handed_over", [False, True])
def test_an_interrupted_run_terminates_the_job_it_waits_on_unless_handed_over(monkeypatch, handed_over):
    """...to a launcher that took the step over and adopted the job, before this one's heartbeat
    noticed: that launcher waits on it now, and a Ctrl-C here must not stop it."""
    from keel.executor import cluster as cluster_module
    from keel.executor import interrupt

    class Interrupting(FakeClock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            if self.now >= 5.0:
                interrupt.request()  # Ctrl-C, 5 s into a 600 s job

    clock = Interrupting()
    job = RunningJob(clock, ends_at=600.0)
    job.terminated_at = None
    job.terminate = lambda: setattr(job, "terminated_at", clock.now)
    monkeypatch.setattr(cluster_module, "time", clock)
    said = "runs on, adopted by the launcher that took the step over" if handed_over else "was terminated"
    try:
        with pytest.raises(interrupt.StepInterrupted, match=f"cluster job fake-job {said}"):
            cluster_module.run_on_cluster(job, request=None, resources="cpu=1",
                                          handed_over=lambda job_id: handed_over and job_id == "fake-job")
    finally:
        interrupt.clear()
    if handed_over:
        assert job.terminated_at is None
    else:
        assert job.terminated_at is not None and job.terminated_at - 5.0 <= cluster_module.STATE_POLL_MAX_S
    assert job.waited_at is None  # never left to Iris's wait on a running job


def test_a_job_queued_for_its_hardware_is_not_silent_until_it_runs(monkeypatch, tmp_path):
    """The stall clock of `progress_timeout_s` starts when the job is first seen running: a job that
    waits 100 s in the cluster's queue, then never beats, is terminated 30 s after it started."""
    from fray.types import JobStatus

    from keel.executor import cluster as cluster_module

    class WallClock(FakeClock):
        def time(self) -> float:
            return 1e9 + self.now

    class QueuedThenSilent(RunningJob):
        def status(self):
            self.polls += 1
            return JobStatus.PENDING if self.clock.now < 100.0 else JobStatus.RUNNING

    clock = WallClock()
    job = QueuedThenSilent(clock, ends_at=float("inf"))
    job.terminated_at = None
    job.terminate = lambda: setattr(job, "terminated_at", clock.now)
    monkeypatch.setattr(cluster_module, "time", clock)
    with pytest.raises(cluster_module.ClusterJobStalled, match=r"no progress for 3\ds \(progress_timeout_s=30\).*was terminated"):
        cluster_module.run_on_cluster(job, None, "cpu=1", str(tmp_path / "heartbeat"), 30.0)  # never written
    assert 130.0 <= job.terminated_at <= 130.0 + 30.0 / 4 + cluster_module.STATE_POLL_MAX_S


@dataclass(frozen=True)
class SleepConfig:
    seconds: float
    pid_file: str = execution_only(default="")
    output_path: str = this_output()


def sleep_a_while(config: SleepConfig) -> None:
    Path(config.pid_file).write_text(str(os.getpid()))
    time.sleep(config.seconds)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet collected, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_terminates_a_step_running_on_the_cluster(tmp_path, iris):
    pid_file = tmp_path / "pid"
    step = Step("t/sleeps", sleep_a_while, SleepConfig(300.0, str(pid_file)), resources=Resources.with_cpu())

    def ctrl_c_once_it_runs():
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's handler, installed for the run, gets it

    threading.Thread(target=ctrl_c_once_it_runs, daemon=True).start()
    report = run_steps([step], str(tmp_path / "out"), cluster=iris[1], echo=QUIET)
    assert [s.step for s in report.interrupted] == ["t/sleeps"], report
    status = read_status(Graph([step], str(tmp_path / "out")).path(step))
    assert status.state == "INTERRUPTED" and "was terminated" in status.error, status
    # the worker kills it once the controller has the job terminated: seconds when quiet, past 30 s
    # on a loaded 2-core machine; well inside the 300 s the step would sleep on its own
    pid, deadline = int(pid_file.read_text()), time.monotonic() + 120
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the job's process is still running"


def beat_then_hang(config: SleepConfig) -> None:
    from keel.executor import heartbeat

    Path(config.pid_file).write_text(str(os.getpid()))
    for step in range(3):
        heartbeat.beat(step)
        time.sleep(0.5)
    time.sleep(config.seconds)  # a hung collective: no more beats


def test_a_cluster_job_silent_past_its_progress_timeout_is_terminated(tmp_path, iris):
    pid_file = tmp_path / "pid"
    step = Step("t/hangs", beat_then_hang, SleepConfig(300.0, str(pid_file)), resources=Resources.with_cpu(),
                isolated=True, progress_timeout_s=5)
    started = time.monotonic()
    report = run_steps([step], str(tmp_path / "out"), cluster=iris[1], echo=QUIET)
    assert time.monotonic() - started < 150, "waited on the hung job rather than its heartbeat"
    assert [s.step for s in report.interrupted] == ["t/hangs"], report  # no preemption retries declared: resume by hand
    output = Graph([step], str(tmp_path / "out")).path(step)
    status = read_status(output)
    assert status.state == "INTERRUPTED" and "no progress for" in status.error and "was terminated" in status.error, status
    assert Path(keel_path(output, "heartbeat")).read_text().startswith("2 ")  # the job's beats reached the shared store
    pid, deadline = int(pid_file.read_text()), time.monotonic() + 120
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung job's process is still running"


def test_concurrent_launchers_run_each_step_once(tmp_path, cluster, iris):
    """Three `keel run` processes on overlapping graphs (with `--cluster` for iris)."""
    flags = ["--cluster", iris[0]] if cluster is not None else []
    env = {**os.environ, "KEEL_TEST_COUNTER": str(tmp_path / "ledger"), "KEEL_TEST_SLEEP": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "keel.cli_entry", "run", CLUSTER_GRAPH, "--prefix", str(tmp_path / "out"), *flags],
                              env={**env, "KEEL_TEST_BRANCH": branch}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for branch in ("a", "b", "all")]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    runs = ledger(tmp_path)
    assert sorted(runs) == ["join", "left", "right", "root"] and all(len(w) == 1 for w in runs.values()), runs
    assert all(w[0].startswith("/") == (cluster is not None) for w in runs.values()), runs
    assert any("reuse" in out for out in outputs)  # someone waited for a shared step and reused it


@dataclass(frozen=True)
class GangConfig:
    output_path: str = this_output()


def report_replica(config: GangConfig) -> None:
    with open(f"{config.output_path}/replica-{replica_index()}.txt", "w") as f:
        f.write(os.environ.get("IRIS_NUM_TASKS", "?"))


def test_tpu_step_runs_as_a_gang_on_the_slice(tmp_path, iris):
    step = Step("t/gang", report_replica, GangConfig(), resources=Resources.with_tpu("v5litepod-16"))
    report = run_steps([step], str(tmp_path), cluster=iris[1], echo=QUIET)
    assert report.ok, report.failures
    out = Path(Graph([step], str(tmp_path)).path(step))
    written = {p.name: p.read_text() for p in out.glob("replica-*.txt")}
    assert written == {f"replica-{i}.txt": "4" for i in range(4)}  # one task per host of the slice
    assert Path(keel_path(str(out), "log.txt")).exists()  # replica 0 keeps the step's log ...
    assert sorted(p.name for p in out.glob(".keel/log.replica*.txt")) == [f"log.replica{i}.txt" for i in (1, 2, 3)]
    assert read_status(str(out)).state == "SUCCESS"
    assert [p.state for p in plan_graph(Graph([step], str(tmp_path)))] == ["cached"]  # ... and the manifest


def test_unschedulable_request_fails_at_submit_naming_the_step(tmp_path, iris):
    cpu_step = Step("t/fine", note, NoteConfig("fine", ledger=str(tmp_path / "ledger")), resources=Resources.with_cpu())
    wrong = Step("t/a100", note, NoteConfig("a100", ledger=str(tmp_path / "ledger")), resources=Resources.with_gpu("A100", 8))
    after = Step("t/after", note, NoteConfig("after", output_of(wrong, "data.txt"), ledger=str(tmp_path / "ledger")))
    started = time.monotonic()
    report = run_steps([cpu_step, after], str(tmp_path / "out"), cluster=iris[1], echo=QUIET)
    assert time.monotonic() - started < 60  # refused at submit, not left pending
    assert [f.step for f in report.failures] == ["t/a100"] and report.blocked == ["t/after"]
    assert report.ran == ["t/fine"]
    error = report.failures[0].error
    assert "cannot schedule this step's resources (cpu 1, gpu A100 x8)" in error
    assert "no scaling group provides device gpu:a100 (available: cpu, tpu_v5e_16, gpu_h100_8)" in error
    assert "scaling groups offers" in error.splitlines()[-1]  # the fix, on the line keel's progress shows
    assert "a100" not in ledger(tmp_path)  # nothing ran
    assert read_status(report.failures[0].output_path).state == "FAILED"


def test_plan_with_a_cluster_configured_imports_no_fray(tmp_path):
    code = ("import sys; from keel.cli import console_main;"
            f"console_main(['plan', {HELLO!r}, '--prefix', {str(tmp_path)!r}, '--cluster', 'http://127.0.0.1:9']);"
            "print('HEAVY', [m for m in ('jax', 'fray', 'iris') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KEEL_CLUSTER": "http://127.0.0.1:9"})
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_a_wrong_cluster_url_fails_fast_with_the_fix(tmp_path):
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", HELLO, "--prefix", str(tmp_path), "--cluster", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert out.returncode == 2
    assert "no Iris controller answers at http://127.0.0.1:9" in out.stderr and "cluster start" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


@dataclass(frozen=True)
class DriverConfig:
    inner_prefix: str
    ledger: str
    output_path: str = this_output()


def drive_inner_graph(config: DriverConfig) -> None:
    """`keel run` from inside an Iris task, with no --cluster: it must find the cluster itself."""
    from keel.cli import console_main

    os.environ["KEEL_TEST_COUNTER"] = config.ledger  # read by the experiment file as it loads
    assert console_main(["run", CLUSTER_GRAPH, "--prefix", config.inner_prefix]) == 0


def test_a_driver_inside_an_iris_job_sends_steps_to_that_cluster(tmp_path, iris):
    driver = Step("t/driver", drive_inner_graph, DriverConfig(str(tmp_path / "inner"), str(tmp_path / "ledger")),
                  resources=Resources.with_cpu(), no_outputs=True)  # its outputs are the inner graph's
    report = run_steps([driver], str(tmp_path / "out"), cluster=iris[1], echo=QUIET)
    assert report.ok, report.failures
    runs = ledger(tmp_path)
    assert sorted(runs) == ["join", "left", "right", "root"] and all(len(w) == 1 for w in runs.values()), runs
    driver_job = "/root/t-driver-"
    assert all(w[0].startswith(driver_job) and w[0].count("/") >= 4 for w in runs.values()), runs  # child jobs
