"""`keel.train.tracking`: `OpenedLater`, a tracker opened on a thread of its own while the run goes
on, and `MetricsLog`, the run's metrics file, as a resume finds it."""

import json
import threading
import uuid

import pytest

from keel.spec.metrics import read_metrics
from keel.train.tracking import MetricsLog, OpenedLater


class Recorder:
    """A tracker that records its calls and the thread it was opened on."""

    def __init__(self):
        self.calls, self.opened_on, self.finished = [], threading.current_thread().name, False

    def log(self, metrics, *, step, commit=None):
        self.calls.append(("log", step, metrics))

    def log_summary(self, metrics):
        self.calls.append(("summary", None, metrics))

    def finish(self):
        self.finished = True


def test_calls_before_it_opens_are_queued_and_sent_first_in_order_from_its_own_thread():
    made, release = [], threading.Event()

    def open_tracker():
        release.wait(30)
        made.append(Recorder())
        return made[0]

    tracker = OpenedLater(open_tracker, name="recorder")
    tracker.log({"a": 1.0}, step=0)
    tracker.open()
    tracker.log({"a": 2.0}, step=1)
    tracker.log_summary({"best": 1.0})
    assert not made  # still opening: nothing was lost, nothing sent yet
    release.set()
    tracker.finish()
    recorder = made[0]
    assert recorder.opened_on == "keel-open-recorder" and recorder.finished
    assert recorder.calls == [("log", 0, {"a": 1.0}), ("log", 1, {"a": 2.0}), ("summary", None, {"best": 1.0})]
    tracker.log({"a": 3.0}, step=2)  # opened: sent at once
    assert recorder.calls[-1] == ("log", 2, {"a": 3.0})


def test_a_tracker_that_fails_to_open_fails_the_next_call_and_finish():
    def open_tracker():
        raise PermissionError("wandb: invalid API key")

    tracker = OpenedLater(open_tracker, name="wandb")
    tracker.open()
    tracker._thread.join(30)
    with pytest.raises(RuntimeError, match="the wandb tracker failed to open or to send a record: wandb: invalid API key"):
        tracker.log({"a": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="failed to open"):
        tracker.finish()


def test_finish_opens_a_tracker_nobody_opened_and_sends_what_was_queued():
    made = []
    tracker = OpenedLater(lambda: made.append(Recorder()) or made[0], name="recorder")
    tracker.log({"eval/loss": 2.0}, step=5)  # a run resumed at its last step: nothing trained, one record
    tracker.finish()
    assert made[0].calls == [("log", 5, {"eval/loss": 2.0})] and made[0].finished


def test_finish_gives_up_on_a_tracker_that_does_not_open_in_time():
    release = threading.Event()
    tracker = OpenedLater(lambda: release.wait(30) and Recorder(), name="wandb", timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match="the wandb tracker did not open within 0.2s"):
            tracker.finish()
    finally:
        release.set()


def test_a_resume_drops_the_line_the_attempt_before_tore_and_keeps_every_step(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "train/loss": 5.0 - s}) + "\n" for s in range(10))
    path.write_text(rows + '{"step": 10, "train/lo')  # the attempt died writing step 10's row
    log = MetricsLog(str(path), resume_at=10)  # its checkpoint is at step 10: nothing past it to drop
    for step in (10, 11):
        log.log({"train/loss": 5.0 - step}, step=step)
    log.finish()
    assert [r["step"] for r in read_metrics(str(path))] == list(range(12))
    assert path.read_text().count("\n") == 12 and "dropped 1 torn line(s)" in caplog.text


def test_a_resume_ends_a_whole_last_row_the_attempt_before_left_without_its_newline(tmp_path):
    """The attempt died between a row and its newline: the next row was appended onto it, and the
    two read as one torn line, both lost."""
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "train/loss": 5.0 - s}) + "\n" for s in range(10))
    path.write_text(rows + json.dumps({"step": 10, "train/loss": -5.0}))
    log = MetricsLog(str(path), resume_at=11)
    log.log({"train/loss": -6.0}, step=11)
    log.finish()
    assert [r["step"] for r in read_metrics(str(path))] == list(range(12))



def test_on_a_store_without_appends_the_file_is_rewritten_and_a_resume_keeps_every_step(monkeypatch):
    """`memory://` refuses append mode and gcsfs turns it into overwrite: there the file is rewritten
    whole, when a checkpoint starts (`flush`), every REWRITE_SECONDS and at the end."""
    import keel.train.tracking as tracking

    clock = [1000.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: clock[0])
    url = f"memory://metrics-{uuid.uuid4().hex}/run/metrics.jsonl"
    log = MetricsLog(url)
    assert read_metrics(url) == []  # there from the start, as a local file is
    for step in range(3):
        log.log({"train/loss": 5.0 - step}, step=step)
    assert read_metrics(url) == []  # within REWRITE_SECONDS of the start: not rewritten yet
    log.flush()  # a checkpoint of step 3 starts
    assert [r["step"] for r in read_metrics(url)] == [0, 1, 2]
    log.log({"train/loss": 2.0}, step=3)  # the attempt dies here: its unflushed record is lost, and retrained
    resumed = MetricsLog(url, resume_at=3)
    resumed.log({"train/loss": 2.0}, step=3)
    clock[0] += MetricsLog.REWRITE_SECONDS
    resumed.log({"train/loss": 1.0}, step=4)
    assert [r["step"] for r in read_metrics(url)] == [0, 1, 2, 3, 4]  # its interval passed: rewritten
    resumed.log({"train/loss": 0.5}, step=5)
    resumed.finish()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(url)] == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0),
                                                                          (5, 0.5)]


def test_rows_wandb_refuses_are_said_once_on_the_console(capsys):
    """wandb takes steps in order only: a resumed online run holds an earlier attempt's rows, and
    Levanter's tracker refused this attempt's rows for those steps with a warning in the log only."""
    from types import SimpleNamespace

    from keel.train.tracking import _WandbRun

    sent = []
    run = SimpleNamespace(id="tiny_moe-44d4c1d68a", step=50)  # wandb's next step: it holds 0..49

    def log(row, step, commit):
        sent.append(step)
        run.step = step + 1

    run.log = log
    tracker = _WandbRun(run)
    for step in (20, 21, 49, 50, 51):
        tracker.log({"train/loss": 4.0}, step=step)
    assert sent == [50, 51]  # the rows of steps it held were refused
    said = capsys.readouterr().out
    assert said.count("[wandb]") == 1 and ("[wandb] run tiny_moe-44d4c1d68a already holds rows up to step 49 (an earlier "
                                           "attempt's, or a spike guard's replay's): wandb keeps those and refuses this "
                                           "attempt's rows from step 20 to 49; metrics.jsonl") in said, said
