"""Sending steps to an Iris cluster through fray.

With `keel run --cluster URL` (or `KEEL_CLUSTER=URL`, or a driver that itself runs inside an Iris
job) every step that declares `resources=` becomes a fray job with those resources; steps without
resources still run in the driver. The cluster only runs step functions: the driver keeps leases,
status, manifests and caching, and the job writes the outputs and log under the step's output
path, so the prefix must be storage that the driver and the workers both reach.

Imported only when a run uses a cluster, so that planning never loads fray or Iris.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from keel.executor import heartbeat, interrupt

LOG_TAIL_LINES = 30
HEALTH_TIMEOUT_S = 5.0
# An Iris worker ships a task's log lines to the log server every second, and may report the task
# failed before its last batch lands: a tail is taken as complete once it has not changed for longer
# than that interval, and never waited on for more than LOG_WAIT_S.
LOG_SETTLE_S = 1.5
LOG_WAIT_S = 6.0
LOG_POLL_S = 0.25
# A running job's state is asked for at most this often apart. Iris's own wait backs off to 30 s
# between polls (each ~1.5x the last), so a step was noticed up to half its run time late: a 40 s
# step, 18 s late, and its dependents waited as long. One state RPC a second per running step is
# little for a controller.
STATE_POLL_MAX_S = 1.0
# How long a running job's state may go unanswered (a controller restarting, the network away) before
# the step fails; meanwhile the wait keeps polling, so a Ctrl-C still reaches the job.
UNANSWERED_S = 3600.0


class ClusterUnreachable(RuntimeError):
    """No Iris controller answers at the given URL."""


class NoProject(FileNotFoundError):
    """No pyproject.toml at or above the current directory: no project to ship to the workers."""


class ClusterJobFailed(RuntimeError):
    """A step's cluster job failed, or the cluster refused it; the message carries the job's log tail."""

    may_run: str | None = None
    """The id of a job the failure leaves possibly running (one this launcher could not stop, or
    another launcher's it could not adopt), which the step's lease keeps naming; None: none."""


class ClusterJobNotAdopted(ClusterJobFailed):
    """The job a launcher taking a step over submitted under the name of the job its expired lease
    named became another job: that one may still run (`may_run`)."""


class ClusterJobStalled(RuntimeError):
    """A step's cluster job beat no heartbeat for its `progress_timeout_s`, and was terminated."""


class ClusterJobSuperseded(RuntimeError):
    """Another launcher took the step's lease over while its job ran: the job was terminated, or
    runs on under that launcher, which adopted it."""


def _leaving(error: BaseException, handle, ended: bool) -> BaseException:
    """`error`, naming the job as possibly running unless `ended` (`ClusterJobFailed.may_run`; the
    launcher reads it off any error its wait raises)."""
    error.may_run = None if ended else handle.job_id
    return error


def _check_adopted(handle, expected_id: str | None, action: str) -> None:
    """Raise `ClusterJobNotAdopted` where the job a submit under the old job's name gave is not that
    job (another user or parent job submitted it), terminating the new one at once."""
    if expected_id is None or handle.job_id == expected_id:
        return
    said, _ = _stopped(handle)
    error = ClusterJobNotAdopted(
        f"cluster job {expected_id}, which the launcher before ran the step in, may still run, and this launcher "
        f"cannot {action} it: submitted under its name, the step became another job ({handle.job_id}: another user "
        f"or parent job), {said}; {FORGET_JOB}")
    error.may_run = expected_id
    raise error


HandedOver = Callable[[str], bool]
"""Whether a launcher that took the step over adopted the cluster job of this id (its to stop, not ours)."""


def in_iris_job() -> bool:
    """True inside an Iris task (checked without importing Iris)."""
    return bool(os.environ.get("IRIS_TASK_ID"))


def workspace_root(start: Path | None = None) -> Path:
    """The project the workers need: the nearest folder at or above `start` (default: the current
    directory) whose pyproject.toml declares a uv workspace, else the nearest with a pyproject.toml.
    """
    here = (start or Path.cwd()).resolve()
    candidates = [here, *here.parents]
    for folder in candidates:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and "[tool.uv.workspace]" in pyproject.read_text():
            return folder
    for folder in candidates:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise NoProject(
        f"no pyproject.toml at or above {here}; run keel from inside the project so that its "
        "code can be shipped to the cluster's workers"
    )


def cluster_client(url: str | None = None, *, workspace: Path | None = None):
    """A fray client for the Iris controller at `url`, shipping `workspace` (default: the project
    around the current directory) to the workers so their tasks import keel, defaults and the
    experiment. Without a URL, the cluster of the Iris job this process runs in.
    """
    if url:
        check_reachable(url)
        from fray.iris_backend import FrayIrisClient

        return FrayIrisClient(url, workspace=workspace or workspace_root())
    if in_iris_job():
        from fray.current_client import current_client

        return current_client()
    raise ValueError("keel: no cluster given: pass --cluster URL or set KEEL_CLUSTER")


def check_reachable(url: str) -> None:
    """Ask the controller's `/health` once, so that a wrong URL fails now, in seconds, rather than
    after Iris's submit retries (many minutes)."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https") or not urllib.parse.urlsplit(url).netloc:
        raise ClusterUnreachable(f"--cluster {url}: not a controller URL; give the http://HOST:PORT that "
                                 "`iris --config=CLUSTER.yaml cluster start` prints (or set KEEL_CLUSTER to it)")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    try:
        with opener.open(f"{url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S) as response:
            if response.status == 200:
                return
            why = f"HTTP {response.status}"
    except OSError as exc:
        why = str(exc)
    raise ClusterUnreachable(
        f"no Iris controller answers at {url} ({why}): start one (`iris --config=CLUSTER.yaml cluster start`, "
        "add --local for this machine) and pass the URL it prints to --cluster or KEEL_CLUSTER"
    )


def run_on_cluster(client, request, resources: str, beat: str | None = None, timeout_s: float | None = None,
                   superseded: Callable[[], bool] | None = None, handed_over: HandedOver | None = None,
                   adopts: str | None = None, submitted: Callable[[str], None] | None = None) -> None:
    """Submit `request` and wait for it; any failure becomes `ClusterJobFailed`. With `beat` (the
    heartbeat the job writes on the shared store) and `timeout_s`, a job silent for longer (a hung
    collective, a wedged host) is terminated: `ClusterJobStalled`. Once `superseded()` (the step's
    lease, taken over by another launcher while this one was suspended past its timeout), this
    launcher stops waiting, `ClusterJobSuperseded`, and the job is terminated, as that launcher
    runs the step in a job of its own, unless `handed_over(job id)`: that launcher adopted the job
    (it submitted under its name), which then runs on. No other way out of the wait (interrupted,
    stalled, the controller silent) stops a job handed over either.

    `adopts` is the id of the job an expired lease ran the step in, whose name `request` reuses: the
    cluster hands that job back while it runs, and a job of another id (submitted under another
    user or parent job, so not that one) is terminated at once, `ClusterJobNotAdopted`, naming the
    one that may still run. `submitted(job id)` is told the id once the job is submitted.

    A request the cluster cannot place (no scaling group offers the device) fails here, at submit,
    before anything waits on it. A job that fails brings back the tail of its log. An interrupted
    run (the first Ctrl-C or SIGTERM) terminates the job within a poll interval and raises
    `StepInterrupted`: a job elsewhere cannot be asked to checkpoint first, so the next run resumes
    the step from its last checkpoint.
    """
    global _SUBMITTING
    with _LIVE_LOCK:
        _SUBMITTING += 1  # a second Ctrl-C now waits for this job, to terminate it too
    handle = None
    try:
        handle = client.submit(request)
    except Exception as exc:  # noqa: BLE001 - Iris raises raw RPC errors at submit
        raise ClusterJobFailed(_refusal(exc, resources)) from exc
    finally:
        with _LIVE_LOCK:
            _SUBMITTING -= 1
            if handle is not None:
                _LIVE_JOBS[handle] = handed_over
            _LIVE_LOCK.notify_all()
    finished = False
    try:
        _check_adopted(handle, adopts, "adopt")
        if submitted is not None:
            submitted(handle.job_id)
        _wait_until_finished(handle, beat, timeout_s, superseded, handed_over)
        finished = True
        handle.wait(raise_on_failure=True)  # finished: returns at once, or raises as fray does on a failure
    except (interrupt.StepInterrupted, ClusterJobStalled, ClusterJobSuperseded, ClusterJobNotAdopted):
        raise
    except Exception as exc:  # noqa: BLE001 - JobFailedError, JobFailed, timeouts: one error for all
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # waiting failed (the controller unanswered): the job may run on, and a retry would start a second one
        said, ended = _stopped(handle, handed_over) if not finished else ("", True)
        raise _leaving(ClusterJobFailed(f"cluster job {handle.job_id} failed: {reason}" + (f"\n{said}" if said else "")
                                        + f"\n{_log_tail(handle)}"), handle, ended) from exc
    finally:
        with _LIVE_LOCK:
            _LIVE_JOBS.pop(handle, None)


def stop_job(client, request, expected_id: str | None) -> str:
    """End the job named `request.name`, which the launcher before ran the step in: submitted under
    that name, the cluster hands that job back while it runs (one that ended is started again, and
    stopped here at once), which is terminated and waited for, at most STOP_WAIT_S. What became of
    it; `ClusterJobFailed` where it could not be stopped (`ClusterJobNotAdopted`: the name gave
    another job than `expected_id`)."""
    from fray.types import JobStatus

    try:
        handle = client.submit(request)
    except Exception as exc:  # noqa: BLE001 - Iris raises raw RPC errors at submit
        raise ClusterJobFailed(f"cluster job {expected_id or request.name}, which the launcher before ran the step in, "
                               f"could not be reached to stop it ({type(exc).__name__}: {exc}): stop it with the "
                               "cluster's own tools (iris), then run the step again") from exc
    _check_adopted(handle, expected_id, "stop")
    problem = _terminate(handle)
    if problem:
        raise ClusterJobFailed(problem)
    deadline = time.monotonic() + STOP_WAIT_S
    while not JobStatus.finished(handle.status()):
        if time.monotonic() > deadline or interrupt.requested():
            when = "when the run was interrupted" if interrupt.requested() else f"after {STOP_WAIT_S:.0f}s"
            raise ClusterJobFailed(f"cluster job {handle.job_id}, which the launcher before ran the step in, was asked "
                                   f"to stop but still ran {when}: stop it with the cluster's own tools (iris), then "
                                   "run the step again")
        time.sleep(0.2)
    return f"cluster job {handle.job_id}, which the launcher before ran it in, was stopped"


STOP_WAIT_S = 120.0
"""How long `stop_job` waits for a terminated job to end."""


def terminate_live_jobs() -> set[str]:
    """Terminate every job this process is still waiting on (but one a launcher that took its step
    over adopted): the driver is about to exit (a second Ctrl-C), and a job left running would keep
    writing an output a rerun starts again. A job being submitted is waited for (at most
    SUBMIT_WAIT_S), to be terminated too. A job the controller does not terminate is named on the
    console, and the others are still terminated. The ids of the jobs it terminated."""
    with _LIVE_LOCK:
        if _SUBMITTING and not _LIVE_LOCK.wait_for(lambda: not _SUBMITTING, timeout=SUBMIT_WAIT_S):
            print(f"keel: {_SUBMITTING} cluster job(s) still being submitted after {SUBMIT_WAIT_S:g}s may run on: stop "
                  "them with the cluster's own tools (iris) before running the step again", file=sys.stderr, flush=True)
        handles = list(_LIVE_JOBS.items())
    terminated = set()
    for handle, handed_over in handles:
        if handed_over is not None and _adopted(handle, handed_over):
            continue
        problem = _terminate(handle)
        if problem:
            print(f"keel: {problem}", file=sys.stderr, flush=True)
        else:
            terminated.add(handle.job_id)
    return terminated


def _adopted(handle, handed_over: HandedOver) -> bool:
    """Whether a launcher that took the step over adopted the job; a store that cannot be read (any
    error) says no, and the job is stopped as usual."""
    try:
        return handed_over(handle.job_id)
    except Exception:  # noqa: BLE001 - gcsfs's HTTP errors, a torn record: not adopted, as far as this one knows
        return False


def _stopped(handle, handed_over: HandedOver | None = None) -> tuple[str, bool]:
    """Terminate the job, unless a launcher that took the step over adopted it: (what became of
    it, whether it is ended as far as this launcher is concerned: terminated, or another's now)."""
    if handed_over is not None and _adopted(handle, handed_over):
        return f"cluster job {handle.job_id} runs on, adopted by the launcher that took the step over", True
    problem = _terminate(handle)
    return problem or f"cluster job {handle.job_id} was terminated", problem is None


FORGET_JOB = ("once it has ended (stop it with the cluster's own tools, iris, if it still runs), remove the step's "
              "lease files (OUTPUT/.keel/lease-*), which name it, and run the step again")
"""The way out where a job a lease names can be neither adopted nor stopped by this launcher."""


def _terminate(handle) -> str | None:
    """Ask the cluster to end the job; what went wrong (naming the job and the fix), or None."""
    try:
        handle.terminate()
    except Exception as exc:  # noqa: BLE001 - an RPC error: the job may still run, which is what matters
        return (f"could not terminate cluster job {handle.job_id} ({type(exc).__name__}: {exc}): it may still be "
                "running and writing its output; stop it with the cluster's own tools (iris) before running the step again")
    return None


_LIVE_JOBS: dict = {}
"""The jobs this process waits on, each with its `HandedOver` (or None)."""
_LIVE_LOCK = threading.Condition()
_SUBMITTING = 0  # submissions under way, whose jobs are not in _LIVE_JOBS yet
SUBMIT_WAIT_S = 15.0
"""How long a second Ctrl-C waits for a submission under way (bundling the workspace takes seconds)."""


def _wait_until_finished(handle, beat: str | None = None, timeout_s: float | None = None,
                         superseded: Callable[[], bool] | None = None, handed_over: HandedOver | None = None) -> None:
    """Poll the job's state, 0.1 s apart at first, growing to STATE_POLL_MAX_S, until it ends or
    the run is interrupted or the step's lease `superseded()` (either stops it: `_stopped`). A
    controller that does not answer is asked again (those still checked between tries) for up to
    UNANSWERED_S, then the step fails. The heartbeat `beat`, when given, is read every quarter of
    `timeout_s` (at least once a minute) once the job runs (a job queued for its hardware is not
    silent), and a job silent for longer is stopped."""
    from fray.types import JobStatus

    interval, unanswered_since = 0.1, None
    watch, beat_read = None, time.monotonic()  # watched from when the job is first seen running
    while True:
        if interrupt.requested():
            said, ended = _stopped(handle, handed_over)
            raise _leaving(interrupt.StepInterrupted(f"the run was interrupted: {said}"), handle, ended)
        if superseded is not None and superseded():
            said, ended = _stopped(handle, handed_over)
            raise _leaving(ClusterJobSuperseded(f"another launcher took the step over while this one was suspended: "
                                                f"{said}"), handle, ended)
        if watch is not None and time.monotonic() - beat_read >= min(timeout_s / 4, 60.0):
            beat_read = time.monotonic()
            silent, why = watch.silent_for(time.time())
            if silent > timeout_s:
                said, ended = _stopped(handle, handed_over)
                raise _leaving(ClusterJobStalled(f"no progress for {silent:.0f}s (progress_timeout_s={timeout_s:g}): "
                                                 f"{why}, so the job was stopped: {said}"), handle, ended)
        try:
            state = handle.status()
            if JobStatus.finished(state):
                return
            if beat and timeout_s and state == JobStatus.RUNNING and watch is None:
                watch, beat_read = heartbeat.Watch(beat, time.time()), time.monotonic()
            unanswered_since = None
        except Exception as exc:  # noqa: BLE001 - an RPC error: ask again, within bounds
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > UNANSWERED_S:
                raise ClusterJobFailed(f"cluster job {handle.job_id}: the controller has not said how it is for "
                                       f"{UNANSWERED_S:.0f}s ({type(exc).__name__}: {exc}); check the cluster") from exc
        time.sleep(interval)
        interval = min(interval * 1.5, STATE_POLL_MAX_S)


def _refusal(exc: Exception, resources: str) -> str:
    text = str(exc)
    if "unschedulable" in text:
        why = re.sub(r" \(constraints: .*\)$", "", text.split(": ", 1)[-1])  # drop Iris's internal constraint dump
        return (f"the cluster cannot schedule this step's resources ({resources}): {why}; ask for a device and "
                "size that one of the cluster's scaling groups offers, or add such a group to the cluster's config")
    return f"could not submit the step to the cluster ({type(exc).__name__}): {text}"


def _log_tail(handle) -> str:
    try:
        lines = _settled_logs(handle)
    except Exception as exc:  # noqa: BLE001 - the failure itself matters more than its log
        return f"(the job's log could not be read: {exc})"
    if not lines:
        return "(the job left no log lines)"
    return f"--- last {len(lines)} lines of the job's log ---\n" + "\n".join(lines)


def _settled_logs(handle) -> tuple[str, ...]:
    """The job's last log lines, read again until they stop changing (see LOG_SETTLE_S)."""
    start = time.monotonic()
    lines, changed = handle.logs(max_lines=LOG_TAIL_LINES), start
    while time.monotonic() - changed < LOG_SETTLE_S and time.monotonic() - start < LOG_WAIT_S:
        time.sleep(LOG_POLL_S)
        newer = handle.logs(max_lines=LOG_TAIL_LINES)
        if newer != lines:
            lines, changed = newer, time.monotonic()
    return tuple(lines)
