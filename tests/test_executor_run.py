"""Running graphs: caching, failure, retry, --force/--only, manifests, overrides, records, gc."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest

from keel import External, Retries, Step, execution_only, output_of, this_output
from keel.cli import console_main
from keel.executor import lease as leases
from keel.executor.plan import Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.status import keel_path, read_status
from keel.executor.step import StepDeclarationError

REPO = Path(__file__).resolve().parent.parent
COUNTING = str(REPO / "tests/fixtures/counting_graph.py")
HELLO = str(REPO / "experiments/tutorials/hello_world.py")


@dataclass(frozen=True)
class WriteConfig:
    text: str
    source: str | None = None
    output_path: str = this_output()
    verbose: bool = execution_only(default=False)


CALLS: list[str] = []
EXPLODE: set[str] = set()  # texts whose step raises: a transient failure the test can clear


def write(config: WriteConfig) -> None:
    CALLS.append(config.text)
    prefix = ""
    if config.source:
        with fsspec.open(config.source) as f:
            prefix = f.read().decode()
    if config.text in EXPLODE:
        raise ValueError("the step exploded")
    with fsspec.open(f"{config.output_path}/data.txt", "w") as f:
        f.write(prefix + config.text)


def chain():
    a = Step("t/a", write, WriteConfig("a"))
    b = Step("t/b", write, WriteConfig("b", output_of(a, "data.txt")))
    c = Step("t/c", write, WriteConfig("c", output_of(b, "data.txt")))
    side = Step("t/side", write, WriteConfig("side", output_of(a, "data.txt")))
    return a, b, c, side


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()
    EXPLODE.clear()


@pytest.mark.parametrize("prefix_kind", ["local", "memory", "memory-root"])
def test_run_then_cached(tmp_path, prefix_kind, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # a URL read as a local path would show up here
    prefix = {"local": str(tmp_path / "out"), "memory": f"memory://keel-test-{os.getpid()}-{tmp_path.name}",
              "memory-root": "memory://"}[prefix_kind]
    if prefix == "memory://":  # the store's root, which this test alone writes to: emptied of it afterwards
        memory = fsspec.filesystem("memory")
        request.addfinalizer(lambda: [memory.rm(f"/{d}", recursive=True) for d in ("t", ".keel") if memory.exists(f"/{d}")])
    a, b, c, side = chain()
    report = run_steps([c, side], prefix, echo=lambda _: None)
    assert report.ok and sorted(report.ran) == ["t/a", "t/b", "t/c", "t/side"]
    graph = Graph([c], prefix)
    with fsspec.open(f"{graph.path(c)}/data.txt") as f:
        assert f.read() == b"abc"
    CALLS.clear()
    again = run_steps([c, side], prefix, echo=lambda _: None)
    assert again.ran == [] and CALLS == []
    assert {p.state for p in again.plans} == {"cached"}
    record = json.loads(fsspec.open(f"{graph.path(b)}/.keel/step.json").open().read())
    assert record["name"] == "t/b" and record["dependencies"]["t/a"] == graph.path(a)
    assert record["config"]["source"] == f"{graph.path(a)}/data.txt"
    assert "git_commit" in record["provenance"] and "packages" in record["provenance"]
    status = json.loads(fsspec.open(f"{graph.path(b)}/.keel/status").open().read())
    assert status["state"] == "SUCCESS" and status["manifest"]["files"]["data.txt"]["size"] == 2
    assert record["attempt"] == status["attempt"] == 1 and record["started"] == status["started"]
    assert os.listdir(tmp_path) == (["out"] if prefix_kind == "local" else [])


def test_execution_only_change_reuses(tmp_path):
    a = Step("t/a", write, WriteConfig("a"))
    run_steps([a], str(tmp_path), echo=lambda _: None)
    CALLS.clear()
    report = run_steps([Step("t/a", write, WriteConfig("a", verbose=True))], str(tmp_path), echo=lambda _: None)
    assert report.ran == [] and CALLS == []


def test_failure_propagates_and_retry(tmp_path):
    a, b, c, side = chain()
    EXPLODE.add("b")
    report = run_steps([c, side], str(tmp_path), echo=lambda _: None)
    assert not report.ok
    assert [f.step for f in report.failures] == ["t/b"]
    assert report.blocked == ["t/c"]
    assert sorted(report.ran) == ["t/a", "t/side"]  # the independent branch finished
    failure = report.failures[0]
    assert "the step exploded" in failure.error and failure.log.endswith(".keel/log.txt")
    assert "the step exploded" in Path(failure.log).read_text()
    assert read_status(failure.output_path).state == "FAILED"
    plans = {p.name: p for p in plan_graph(Graph([c, side], str(tmp_path)))}
    assert plans["t/b"].state == "failed" and "the step exploded" in plans["t/b"].reason
    # the cause goes away; the next run retries the failed step without being asked
    EXPLODE.clear()
    CALLS.clear()
    report = run_steps([c, side], str(tmp_path), echo=lambda _: None)
    assert report.ok and sorted(report.ran) == ["t/b", "t/c"] and sorted(CALLS) == ["b", "c"]
    status = read_status(failure.output_path)
    assert status.state == "SUCCESS" and status.attempt == 2


def test_a_failure_skips_every_step_below_it_in_plan_order(tmp_path):
    a, b, c, side = chain()
    EXPLODE.add("a")
    report = run_steps([c, side], str(tmp_path), echo=lambda _: None)
    order = [p.name for p in report.plans]
    assert [f.step for f in report.failures] == ["t/a"] and report.ran == []
    assert report.blocked == [n for n in order if n != "t/a"] and sorted(report.blocked) == ["t/b", "t/c", "t/side"]


def test_cli_exit_code_and_message_on_failure(tmp_path):
    env = {**os.environ, "KEEL_TEST_COUNTER": str(tmp_path / "count"), "KEEL_TEST_FAIL": "left"}
    out = subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", COUNTING, "--prefix", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "step count/left failed" in out.stderr and "told to fail" in out.stderr and "log.txt" in out.stderr
    assert "right" in (tmp_path / "count").read_text().split()  # the independent branch ran
    assert "join" not in (tmp_path / "count").read_text().split()  # the dependent did not


def test_force_and_only(tmp_path):
    a, b, c, side = chain()
    prefix = str(tmp_path)
    report = run_steps([c, side], prefix, only="t/b", echo=lambda _: None)
    assert sorted(report.ran) == ["t/a", "t/b"]
    report = run_steps([c, side], prefix, force="^t/a$", echo=lambda _: None)
    assert sorted(report.ran) == ["t/a", "t/c", "t/side"]
    assert read_status(Graph([a], prefix).path(a)).attempt == 2
    assert read_status(Graph([b], prefix).path(b)).attempt == 1


def say(config: WriteConfig) -> None:
    write(config)
    print(f"run {len(CALLS)} of {config.text}")


def test_a_forced_rerun_starts_its_log_afresh(tmp_path):
    """--force discards the old run's outputs and its log: the page's log tail and `log.txt` show the
    new run's lines only, not the old run's ahead of them."""
    step = Step("t/say", say, WriteConfig("a"))
    assert run_steps([step], str(tmp_path), echo=lambda _: None).ran == ["t/say"]
    log = Path(keel_path(Graph([step], str(tmp_path)).path(step), "log.txt"))
    assert log.read_text() == "run 1 of a\n"
    assert run_steps([step], str(tmp_path), force="^t/say$", echo=lambda _: None).ran == ["t/say"]
    assert log.read_text() == "run 2 of a\n"


def test_a_run_refuses_to_start_steps_that_read_an_empty_external_and_runs_the_rest_with_only(tmp_path):
    empty = External("raw/empty", str(tmp_path / "nothing-here"))
    reads = Step("t/reads", write, WriteConfig("reads", source=output_of(empty, "data.txt")))
    alone = Step("t/alone", write, WriteConfig("alone"))
    CALLS.clear()
    with pytest.raises(StepDeclarationError, match=r"no files at the path of external input raw/empty at .*nothing-here"):
        run_steps([reads, alone], str(tmp_path / "out"), echo=lambda _: None)
    assert CALLS == [] and not (tmp_path / "out").exists()  # refused before any step started or wrote
    report = run_steps([reads, alone], str(tmp_path / "out"), only="t/alone", echo=lambda _: None)
    assert report.ran == ["t/alone"] and CALLS == ["alone"]


def _interrupt_then_free(config: WriteConfig) -> None:
    """Ctrl-C this launcher while the other step sleeps between polls of its lease, and free that
    lease the moment the launcher has taken the signal: the step's next poll finds it free."""
    from keel.executor import interrupt

    time.sleep(2.5)  # the waiting step's polls are a second apart by now
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 10
    while not interrupt.requested() and time.monotonic() < deadline:
        time.sleep(0.005)
    HELD.pop().release()


HELD: list = []


@pytest.mark.waits  # on a launcher's lease polls
def test_a_step_whose_lease_frees_after_ctrl_c_does_not_start(tmp_path):
    from keel.executor import lease as leases

    first = Step("t/first", _interrupt_then_free, WriteConfig("first"))
    waits = Step("t/waits", write, WriteConfig("waits"))
    prefix = str(tmp_path)
    HELD.append(leases.try_acquire(Graph([waits], prefix).path(waits))[0])  # "another launcher" runs it
    report = run_steps([first, waits], prefix, echo=lambda _: None)
    assert "waits" not in CALLS and report.not_started == ["t/waits"]
    assert read_status(Graph([waits], prefix).path(waits)) is None  # never marked RUNNING
    assert leases.current_lease(Graph([waits], prefix).path(waits)) is None  # its lease let go


def test_manifest_verified_on_cache_hit(tmp_path):
    a, b, c, side = chain()
    run_steps([c], str(tmp_path), echo=lambda _: None)
    graph = Graph([c], str(tmp_path))
    os.remove(f"{graph.path(b)}/data.txt")
    Path(f"{graph.path(c)}/data.txt").write_text("ab")  # truncated
    plans = {p.name: p for p in plan_graph(graph)}
    assert plans["t/a"].state == "cached"
    assert plans["t/b"].state == "run" and "data.txt is missing" in plans["t/b"].reason
    assert plans["t/c"].state == "run" and "has 2 bytes, the manifest recorded 3" in plans["t/c"].reason
    CALLS.clear()
    report = run_steps([c], str(tmp_path), echo=lambda _: None)
    assert sorted(report.ran) == ["t/b", "t/c"] and sorted(CALLS) == ["b", "c"]


SEEN_WHILE_RUNNING: list = []  # (status on disk, plan state) as the step function saw them


def peek(config: WriteConfig) -> None:
    """What a crash at this point (outputs being written) would leave on disk."""
    graph = Graph([Step("t/peek", peek, WriteConfig(config.text))], str(Path(config.output_path).parent.parent))
    SEEN_WHILE_RUNNING.append((read_status(config.output_path), plan_graph(graph)[0].state))
    write(config)


def test_one_record_per_attempt_and_a_status_only_at_its_end(tmp_path):
    """A step leaves `step.json` (its record, naming the attempt) and `status` (SUCCESS with the
    manifest); while it runs there is no status, so a crash then leaves a step that is not finished.
    A forced rerun drops the earlier SUCCESS before the function rewrites the outputs it describes."""

    SEEN_WHILE_RUNNING.clear()
    step = Step("t/peek", peek, WriteConfig("p"))
    assert run_steps([step], str(tmp_path), echo=lambda _: None).ok
    path = Graph([step], str(tmp_path)).path(step)
    # no manifest.json, no log; the lease released, its file kept so that the next one numbers after it
    assert sorted(os.listdir(keel_path(path, ""))) == ["lease-00000000", "status", "step.json"]
    assert leases.current_lease(path) is None
    (running, state), = SEEN_WHILE_RUNNING
    assert running.state == "RUNNING" and running.attempt == 1 and state == "running-elsewhere"
    status = read_status(path)
    assert status.state == "SUCCESS" and status.manifest["files"]["data.txt"]["size"] == 1 and status.started == running.started

    assert run_steps([step], str(tmp_path), force="t/peek", echo=lambda _: None).ok
    (running, state) = SEEN_WHILE_RUNNING[-1]
    assert running.state == "RUNNING" and running.attempt == 2 and state == "running-elsewhere"  # not "cached"
    assert read_status(path).attempt == 2


def test_a_crash_between_the_records_leaves_the_step_unfinished(tmp_path):
    """The states a crash can leave (record written, status absent or torn) read as not finished,
    and the next run resumes the attempt count."""

    a = Step("t/a", write, WriteConfig("a"))
    assert run_steps([a], str(tmp_path), echo=lambda _: None).ok
    path = Graph([a], str(tmp_path)).path(a)
    status_file = Path(keel_path(path, "status"))
    for torn in ("", '{"state": "SUCC'):  # what a machine crash can leave of a status not fsynced
        status_file.write_text(torn)
        assert read_status(path).state == "RUNNING"  # from step.json: the attempt started, never ended
        plan = plan_graph(Graph([a], str(tmp_path)))[0]
        assert plan.state == "run" and "died while RUNNING" in plan.reason
    status_file.unlink()  # the launcher died before writing it
    assert plan_graph(Graph([a], str(tmp_path)))[0].state == "run"
    CALLS.clear()
    assert run_steps([a], str(tmp_path), echo=lambda _: None).ran == ["t/a"] and CALLS == ["a"]
    assert read_status(path).state == "SUCCESS" and read_status(path).attempt == 2


def test_outputs_of_the_earlier_layout_still_read_as_cached(tmp_path):
    """Before the manifest moved into the status, it was `.keel/manifest.json` beside a status
    without one: such outputs are cached, and still verified against that manifest."""

    a = Step("t/a", write, WriteConfig("a"))
    assert run_steps([a], str(tmp_path), echo=lambda _: None).ok
    path = Graph([a], str(tmp_path)).path(a)
    status = json.loads(Path(keel_path(path, "status")).read_text())
    Path(keel_path(path, "manifest.json")).write_text(json.dumps(status.pop("manifest")))
    Path(keel_path(path, "status")).write_text(json.dumps(status))
    assert plan_graph(Graph([a], str(tmp_path)))[0].state == "cached"
    os.remove(f"{path}/data.txt")
    plan = plan_graph(Graph([a], str(tmp_path)))[0]
    assert plan.state == "run" and "data.txt is missing" in plan.reason


def test_stale_shows_field_diff(tmp_path, capsys):
    prefix = str(tmp_path)
    assert console_main(["run", HELLO, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["plan", HELLO, "--prefix", prefix, "--set", "tutorial/numbers.n=7", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    states = {s["name"]: s for s in plan["steps"]}
    assert set(states["tutorial/numbers"]) >= {"name", "output_path", "state", "reason", "deps"}
    assert states["tutorial/numbers"]["state"] == "stale"
    assert states["tutorial/numbers"]["reason"] == "config.n: 100 -> 7"
    assert states["tutorial/stats"]["state"] == "stale" and "dependency changed" in states["tutorial/stats"]["reason"]
    assert states["tutorial/stats"]["deps"] == [states["tutorial/numbers"]["output_path"]]


def test_set_override_runs_and_errors(tmp_path, capsys):
    prefix = str(tmp_path)
    assert console_main(["run", HELLO, "--prefix", prefix, "--set", "tutorial/numbers.n=5", "--set", "tutorial/numbers.seed=3"]) == 0
    capsys.readouterr()
    stats = list(Path(prefix, "tutorial").glob("stats-*/stats.json"))
    assert len(stats) == 1 and json.loads(stats[0].read_text())["count"] == 5
    assert console_main(["plan", HELLO, "--prefix", prefix, "--set", "tutorial/numbers.nn=5"]) == 2
    err = capsys.readouterr().err
    assert "no config field 'nn'" in err and "closest: tutorial/numbers:n" in err
    assert console_main(["plan", HELLO, "--prefix", prefix, "--set", "tutorial/numbers.n=abc"]) == 2
    assert "cannot read 'abc' as an int" in capsys.readouterr().err
    assert console_main(["plan", HELLO, "--prefix", prefix, "--set", "tutorial/nope.n=1"]) == 2
    assert "no step named" in capsys.readouterr().err


def test_secrets_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-wandb-value")
    monkeypatch.setenv("HF_TOKEN", "sekrit-hf-value")
    monkeypatch.setenv("KEEL_DB_PASSWORD", "sekrit-password")
    monkeypatch.setattr(sys, "argv", ["exp.py", "run", "--set", "x.api_key=sekrit-argv"])

    @dataclass(frozen=True)
    class WithKey:
        api_key: str
        note: str
        experts_per_token: int = 2
        tokenizer: str = "bpe"
        output_path: str = this_output()

    step = Step("t/secret", lambda c: None, WithKey("sekrit-config", note="copied sekrit-hf-value"))
    run_steps([step], str(tmp_path), echo=lambda _: None)
    text = Path(Graph([step], str(tmp_path)).path(step), ".keel/step.json").read_text()
    assert "sekrit" not in text
    assert "WANDB_API_KEY" in text  # recorded as present, value redacted
    record = json.loads(text)
    assert record["config"]["experts_per_token"] == 2 and record["config"]["tokenizer"] == "bpe"  # not secrets


def test_plan_imports_no_jax(tmp_path):
    code = ("import sys; from keel.cli import console_main;"
            f"console_main(['plan', {HELLO!r}, '--prefix', {str(tmp_path)!r}]);"
            "heavy = [m for m in ('jax', 'levanter', 'haliax', 'equinox', 'fray', 'iris') if m in sys.modules];"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout


def test_gc_lists_and_deletes_unreached(tmp_path, capsys):
    prefix = str(tmp_path / "out")
    edited = tmp_path / "hello_edited.py"  # the experiment as it was before an edit: its outputs are abandoned
    edited.write_text(Path(HELLO).read_text().replace("NumbersConfig(n=100)", "NumbersConfig(n=3)"))
    assert console_main(["run", str(edited), "--prefix", prefix]) == 0
    assert console_main(["run", HELLO, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["gc", HELLO, "--prefix", prefix]) == 0
    listed = capsys.readouterr().out
    assert "3 unreached output(s)" in listed and "(pass --yes to delete)" in listed
    assert len(list(Path(prefix).glob("tutorial/*"))) == 6  # nothing deleted without --yes
    # of the three: one an experiment reads as an External, one whose step another launcher runs now
    reached = {p.output_path for p in plan_graph(Graph(_hello_steps(), prefix))}
    read, running, abandoned = sorted(str(p) for p in Path(prefix).glob("tutorial/*") if str(p) not in reached)
    reader = tmp_path / "reads_it.py"
    reader.write_text(f"from keel import External, main\nif __name__ == '__main__':\n    main([External('prev', {read + '/'!r})])\n")
    lease, _ = leases.try_acquire(running)
    try:
        assert console_main(["gc", HELLO, str(reader), "--prefix", prefix, "--yes"]) == 0
    finally:
        lease.release()
    out = capsys.readouterr().out
    assert f"{read} (an External reads {read})" in out and f"{running} (running now: lease held by" in out
    assert "1 unreached output(s)" in out and "; 2 kept" in out
    assert sorted(str(p) for p in Path(prefix).glob("tutorial/*")) == sorted(reached | {read, running})
    assert console_main(["gc", HELLO, "--prefix", prefix, "--yes"]) == 0
    assert len(list(Path(prefix).glob("tutorial/*"))) == 3 and not Path(abandoned).exists()
    plans = plan_graph(Graph(_hello_steps(), prefix))
    assert {p.state for p in plans} == {"cached"}


def _hello_steps():
    from keel.cli import load_experiment

    return load_experiment(HELLO)


def test_experiment_file_as_script(tmp_path):
    out = subprocess.run([sys.executable, HELLO, "run", "--prefix", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 ran" in out.stdout
    out = subprocess.run([sys.executable, HELLO, "status", "--prefix", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.count("cached") >= 3 and "attempt 1" in out.stdout


def test_scale_selects_a_declared_version_of_the_graph(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KEEL_TEST_COUNTER", str(tmp_path / "count"))
    counting = str(REPO / "tests/fixtures/counting_graph.py")
    assert console_main(["plan", counting, "--prefix", str(tmp_path), "--scale", "left-only", "--json"]) == 0
    names = [s["name"] for s in json.loads(capsys.readouterr().out)["steps"]]
    assert names == ["count/root", "count/left"]
    assert console_main(["plan", counting, "--prefix", str(tmp_path), "--scale", "huge"]) == 2
    assert "declares no such scale (declared: left-only)" in capsys.readouterr().err


def chatty(config: WriteConfig) -> None:
    import logging

    # a log record, not print: pytest swaps sys.stdout per test, the root logger's handler stays
    logging.getLogger("keel.test").warning("writing %s", config.text)
    with open(f"{config.output_path}/data.txt", "w") as f:
        f.write(config.text)


def test_log_is_created_on_first_output(tmp_path):
    """An in-process step that prints nothing leaves no log file; one that prints has its lines
    there; a failure's message names the log when it exists and says "(no output)" otherwise."""
    from keel.executor.run import _log_or_none

    quiet, loud = Step("t/quiet", write, WriteConfig("q")), Step("t/loud", chatty, WriteConfig("l"))
    report = run_steps([quiet, loud], str(tmp_path), echo=lambda _: None)
    assert report.ok
    graph = Graph([quiet, loud], str(tmp_path))
    assert not Path(keel_path(graph.path(quiet), "log.txt")).exists()
    assert "writing l" in Path(keel_path(graph.path(loud), "log.txt")).read_text()
    assert _log_or_none(graph.path(loud)) == keel_path(graph.path(loud), "log.txt")
    assert _log_or_none(graph.path(quiet)) == keel_path(graph.path(quiet), "log.txt") + " (no output)"
    assert [p.state for p in plan_graph(graph)] == ["cached", "cached"]


def threaded(config: WriteConfig) -> None:
    """A step whose output comes from a thread it starts, as a compile-ahead thread's does."""
    import logging
    import threading

    def side():
        print(f"a side thread prints {config.text}", flush=True)
        logging.getLogger("keel.test").warning("a side thread logs %s", config.text)

    thread = threading.Thread(target=side)
    thread.start()
    thread.join()
    with open(f"{config.output_path}/data.txt", "w") as f:
        f.write(config.text)


def test_an_isolated_steps_own_threads_write_to_its_log_a_launcher_steps_do_not(tmp_path):
    """An isolated step's process runs that step alone, so every thread of it writes to its log; in
    the launcher, other threads may be other steps', so only the step's own thread does."""
    isolated = Step("t/isolated", threaded, WriteConfig("iso"), isolated=True)
    shared = Step("t/shared", threaded, WriteConfig("shared"))
    assert run_steps([isolated, shared], str(tmp_path), echo=lambda _: None).ok
    graph = Graph([isolated, shared], str(tmp_path))
    log = Path(keel_path(graph.path(isolated), "log.txt")).read_text()
    assert "a side thread prints iso" in log and "a side thread logs iso" in log, log
    assert not Path(keel_path(graph.path(shared), "log.txt")).exists()


@dataclass(frozen=True)
class SpanConfig:
    name: str
    meet: str | None = None  # a folder where the step waits until two steps are in it
    output_path: str = this_output()


def span(config: SpanConfig) -> None:
    """Record when the step ran: with `meet`, from its arrival there until two steps have arrived
    (and a second more, so that a step held back meanwhile is told so); without, for a second."""
    start = time.time()
    if config.meet is None:
        time.sleep(1.0)
    else:
        Path(config.meet, config.name).touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(config.meet)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.2)
    with open(f"{config.output_path}/span.txt", "w") as f:
        f.write(f"{start} {time.time()}")


def test_steps_in_processes_of_their_own_run_one_per_core_and_others_pass_them(tmp_path, monkeypatch):
    """A step in its own process keeps the machine's cores busy, so no more of them run at once than
    it has cores; the ones held back say so, and a step that runs in the launcher starts meanwhile."""
    from keel.executor import run

    monkeypatch.setattr(run, "machine_cores", lambda: 2)
    meet = tmp_path / "meet"
    meet.mkdir()
    monkeypatch.setenv("KEEL_WRITABLE", str(meet))  # the folder the steps share to meet in
    heavy = [Step(f"p/heavy{i}", span, SpanConfig(f"h{i}", str(meet)), isolated=True) for i in range(3)]
    light = Step("p/light", span, SpanConfig("light"))
    lines: list[str] = []
    assert run_steps([*heavy, light], str(tmp_path / "out"), echo=lines.append).ok
    graph = Graph([*heavy, light], str(tmp_path / "out"))
    spans = {s.name: tuple(map(float, Path(graph.path(s), "span.txt").read_text().split())) for s in (*heavy, light)}
    starts = sorted(spans[s.name][0] for s in heavy)
    ends = sorted(spans[s.name][1] for s in heavy)
    assert starts[1] < ends[0]  # two ran together, on the 2 cores (each waited for the other) ...
    assert starts[2] >= ends[0]  # ... and the third started only once one of them had ended
    assert spans["p/light"][0] < starts[2]  # the launcher's step did not wait behind the held-back one
    third = next(s.name for s in heavy if spans[s.name][0] == starts[2])
    assert [line for line in lines if line.startswith("[keel] wait")] == [
        f"[keel] wait  {third}: every core of this machine (2) already runs a step in a process of its own; "
        "it starts when one ends"]


V2 = "0::/kubepods/pod1/ctr\n"
V2_MOUNT = "41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw\n"
V1 = "4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n0::/\n"  # a hybrid host: v1 controllers beside an empty v2
V1_MOUNTS = ("32 31 0:29 /docker/abc {root}/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 /docker/abc {root}/memory rw,relatime - cgroup cgroup rw,memory\n" + V2_MOUNT)


@pytest.mark.parametrize("cgroup, mounts, limits, cores", [
    # cgroup v2: a pod's limit binds the container inside it; the least of the two; rounded up
    (V2, V2_MOUNT, {"unified/kubepods/pod1/cpu.max": "250000 100000", "unified/kubepods/pod1/ctr/cpu.max": "max 100000"}, 3),
    (V2, V2_MOUNT, {"unified/kubepods/cpu.max": "400000 100000", "unified/kubepods/pod1/ctr/cpu.max": "100000 100000"}, 1),
    (V2, V2_MOUNT, {"unified/kubepods/pod1/ctr/cpu.max": "max 100000"}, 8),
    # cgroup v1, the container's cgroup mounted as its hierarchy's root (docker without a cgroup namespace)
    (V1, V1_MOUNTS, {"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 2),
    (V1, V1_MOUNTS, {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 8),
    (None, None, {}, 8),  # no cgroups to read (not Linux)
], ids=["v2-pod-limit", "v2-least-of-two", "v2-no-limit", "v1-container", "v1-no-limit", "no-cgroups"])
def test_the_cores_are_the_affinitys_or_the_least_cgroup_cpu_quota_when_less(tmp_path, monkeypatch, cgroup, mounts,
                                                                            limits, cores):
    """Read as the kernel lays them out: /proc/self/cgroup names the process's cgroup in each
    hierarchy, mountinfo where each is mounted and which of its cgroups is the mount's root."""
    resources = _fake_proc(tmp_path, monkeypatch, cgroup, mounts, limits)
    monkeypatch.setattr(resources.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert resources.machine_cores() == cores


def _fake_proc(tmp_path, monkeypatch, cgroup: str | None, mounts: str | None, files: dict[str, str]):
    """`keel.executor.resources` reading a fake /proc/self (`cgroup`, `mountinfo`) and cgroup tree
    (`files` under it, `vmstat` among them standing for /proc/vmstat)."""
    from keel.executor import resources

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    if cgroup is not None:
        (proc / "cgroup").write_text(cgroup)
        (proc / "mountinfo").write_text(mounts.format(root=root))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    monkeypatch.setattr(resources, "PROC_SELF", str(proc))
    monkeypatch.setattr(resources, "PROC_VMSTAT", str(root / "vmstat"))
    return resources


@pytest.mark.parametrize("cgroup, mounts, files, kills", [
    (V2, V2_MOUNT, {"unified/kubepods/pod1/ctr/memory.events": "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0",
                    "vmstat": "pgfault 10\noom_kill 9"}, (2, False)),
    (V1, V1_MOUNTS, {"memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3", "vmstat": "oom_kill 9"},
     (3, False)),
    (V1, V1_MOUNTS, {"vmstat": "pgfault 10\noom_kill 9"}, (9, True)),  # no memory cgroup to read: the machine's count
    (None, None, {}, None),
], ids=["v2", "v1", "vmstat", "none"])
def test_the_out_of_memory_kills_are_read_from_the_memory_cgroup_else_the_machine(tmp_path, monkeypatch, cgroup, mounts,
                                                                                files, kills):
    assert _fake_proc(tmp_path, monkeypatch, cgroup, mounts, files).oom_kills() == kills


def test_a_step_process_the_out_of_memory_killer_killed_failed_and_is_not_a_preemption(tmp_path, monkeypatch):
    """A SIGKILL is a preemption (retried, resumed) unless the out-of-memory killer's count rose
    meanwhile: then the step failed, as a rerun runs out of memory again."""
    from keel.executor import child
    from keel.executor.resources import OomKills

    def killed_by_sigkill():
        (tmp_path / "child").mkdir(exist_ok=True)
        process = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        return process, str(tmp_path / "child")

    monkeypatch.setattr(child, "oom_kills", lambda: OomKills(5, whole_machine=False))
    outcome = child.collect(*killed_by_sigkill(), oom_kills_before=OomKills(4, whole_machine=False))
    assert outcome.state == "failed" and outcome.message.startswith(
        "the step's process was killed by the kernel's out-of-memory killer (its memory cgroup's count of such kills "
        "rose from 4 to 5"), outcome
    assert child.collect(*killed_by_sigkill(), oom_kills_before=OomKills(5, whole_machine=False)) == child.ChildOutcome(
        "killed", "the step's process was killed by SIGKILL")
    # counted for the whole machine, the message says that another process's kill counts there too
    monkeypatch.setattr(child, "oom_kills", lambda: OomKills(10, whole_machine=True))
    outcome = child.collect(*killed_by_sigkill(), oom_kills_before=OomKills(9, whole_machine=True))
    assert outcome.state == "failed" and "(the machine's count of such kills, which no memory cgroup here narrows to its " \
        "own (another process's kill counts too) rose from 9 to 10" in outcome.message, outcome

def test_a_process_a_launcher_step_forks_exits_and_takes_signals_as_any_process(monkeypatch):
    """A step in the launcher may fork (a multiprocessing pool): the child inherits the launcher's
    `os._exit` guard and signal handlers. Its `os._exit` must end it (not raise StepExited, sending
    it on into a copy of the step), and Ctrl-C / SIGTERM must not run the launcher's stop logic
    there. (Forked for real, the child of a multi-threaded test worker can deadlock: Python warns
    so; the fork is stood in for by the pid it would have.)"""
    from keel.executor import job, run

    exited: list[int] = []
    monkeypatch.setattr(job, "_process_exit", exited.append)
    monkeypatch.setattr(os, "_exit", os._exit)  # restored after the test
    job.guard_process_exit()
    monkeypatch.setattr(job._in_step, "active", True, raising=False)
    with pytest.raises(job.StepExited):
        os._exit(3)  # in the launcher, inside a step
    monkeypatch.setattr(job, "_launcher_pid", os.getpid() + 1)  # as a forked child sees it
    os._exit(4)
    assert exited == [4]

    runner = run.Runner(Graph([], "memory://keel-fork"), echo=lambda _: None)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in saved:
            signal.signal(sig, runner._on_signal)  # as while the launcher runs a graph
        run._forget_launcher_signals()  # what os.register_at_fork runs in the child
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_ctrl_c_that_lands_while_the_scheduler_holds_its_lock_stops_the_run():
    """Python runs a signal handler on the main thread between two bytecodes, so Ctrl-C can land
    while the scheduler there holds the runner's lock (`_take_core`, each round): the handler
    takes it again. With a plain lock it waited for itself, every later Ctrl-C too, and the leases'
    heartbeats kept other launchers waiting on the steps; only `kill -9` ended it."""
    from keel.executor import interrupt, run

    said: list[str] = []
    runner = run.Runner(Graph([], "memory://keel-signal-in-lock"), echo=said.append)

    def scheduler_round_interrupted():  # on a thread of its own, so that a hang fails the test, not the worker
        with runner._lock:
            runner._on_signal(signal.SIGINT, None)

    thread = threading.Thread(target=scheduler_round_interrupted, daemon=True)
    try:
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the handler waited for the lock its own thread held"
        assert runner._stopping and interrupt.requested()
        assert said and said[0].startswith("[keel] SIGINT: stopping 0 running step(s)"), said
    finally:
        interrupt.clear()


def flaky(config: WriteConfig) -> None:
    CALLS.append(config.text)
    print(f"attempt {len(CALLS)} starts", flush=True)
    if len(CALLS) == 1:
        raise ValueError("the first attempt fails")
    with fsspec.open(f"{config.output_path}/data.txt", "w") as f:
        f.write("done")


def test_a_retried_steps_log_on_an_object_store_keeps_every_attempt(tmp_path):
    prefix = f"memory://keel-log-{tmp_path.name}"
    step = Step("t/flaky", flaky, WriteConfig("flaky"), retries=Retries(on_failure=1))
    assert run_steps([step], prefix, echo=lambda _: None).ok
    with fsspec.open(keel_path(Graph([step], prefix).path(step), "log.txt"), "r") as f:
        log = f.read()
    assert "attempt 1 starts" in log and "the first attempt fails" in log and "attempt 2 starts" in log, log


def test_an_isolated_step_under_memory_is_refused_before_anything_runs():
    """`memory://` lives in the launcher: an isolated step's process could not write there, and running
    it in the launcher dropped its declared environment and stall kill without a word."""
    plain = Step("m/plain", write, WriteConfig("plain"))
    isolated = Step("m/isolated", write, WriteConfig("iso", source=output_of(plain, "data.txt")), isolated=True,
                    progress_timeout_s=5)
    prefix = f"memory://keel-isolated-{os.getpid()}"
    with pytest.raises(StepDeclarationError, match=r"m/isolated is isolated \(it runs in a process of its own, with its "
                       r"declared environment and progress_timeout_s\), but its output memory://.* lives in this process's "
                       r"memory.*give a prefix on disk or a shared store"):
        run_steps([isolated], prefix, echo=lambda _: None)
    assert not fsspec.filesystem("memory").exists(Graph([plain], prefix).path(plain)), "nothing ran, not even its input"
    assert run_steps([plain], prefix, echo=lambda _: None).ok  # a step in the launcher is fine there


def test_a_stale_step_is_told_apart_from_its_newest_finished_output_not_a_failed_attempt_or_a_set(tmp_path, capsys):
    """A failed attempt, or a one-off `--set`, between the last good output and now listed changes
    the file never had."""
    prefix = str(tmp_path)
    assert console_main(["run", HELLO, "--prefix", prefix]) == 0  # n=100, finished
    assert console_main(["run", HELLO, "--prefix", prefix, "--set", "tutorial/numbers:n=3"]) == 0  # a one-off, newer
    capsys.readouterr()
    assert console_main(["plan", HELLO, "--prefix", prefix, "--set", "tutorial/numbers:n=7", "--json"]) == 0
    states = {s["name"]: s for s in json.loads(capsys.readouterr().out)["steps"]}
    assert states["tutorial/numbers"]["reason"] == "config.n: 100 -> 7"  # the file's own output, not the --set one's 3


def test_a_step_process_that_cannot_start_leaves_no_folder(tmp_path, monkeypatch):
    """A config that does not pickle (here a lock) fails the start: the folder made for the child's
    payload goes with it (one was left behind per attempt)."""
    from keel.executor.child import start_child

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match="lock"):
        start_child(write, WriteConfig(threading.Lock()), str(tmp_path / "out"), env={})
    assert list(tmp_path.glob("keel-step-*")) == []


@pytest.mark.parametrize("fails", [False, True])
def test_a_lease_that_cannot_be_released_leaves_the_steps_own_outcome(tmp_path, monkeypatch, fails):
    """Releasing the lease is keel's last write (a full disk can refuse it): the step finished, or
    failed with its own error, all the same; before, the release's OSError replaced either."""
    from keel.executor import lease as leases_module

    def refused(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(leases_module.Lease, "release", refused)
    said: list[str] = []
    step = Step("full/disk", flaky if fails else write, WriteConfig("x"), retries=Retries(on_failure=0))
    CALLS.clear()
    report = run_steps([step], str(tmp_path), echo=said.append)
    if fails:
        (failure,) = report.failures
        assert "the first attempt fails" in failure.error, failure.error
    else:
        assert report.ok and report.ran == ["full/disk"], report.failures
        assert read_status(Graph([step], str(tmp_path)).path(step)).state == "SUCCESS"
    assert [line for line in said if line.startswith("[keel] warn  full/disk: its lease could not be released")] == [
        "[keel] warn  full/disk: its lease could not be released (OSError: [Errno 28] No space left on device); another "
        f"launcher can take the step over once it expires, within {leases_module.DEFAULT_TIMEOUT_S:.0f} s"]
