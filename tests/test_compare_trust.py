"""`keel compare` figures a researcher can trust: runs of several experiments in one table, throughput
of training steps alone (no compiling step), the wall time split, a mark on runs that shared their
host, and every column defined under the table. Training is a stand-in that writes what a training
step records, so this runs in seconds."""

import json
import os
import socket
import textwrap
import time
from dataclasses import dataclass

from keel import Step, this_output
from keel.cli import console_main
from keel.executor.resources import Resources
from keel.executor.run import run_steps
from keel.trained.compare import summarize

_EXPERIMENT = textwrap.dedent(
    """
    import json, os, time
    from defaults import default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, TrainConfig

    def pretend_to_train(config):
        # 4 steps, the transport switching at step 2: steps 0 and 2 compile (slow), 1 and 3 do not.
        speeds = {0: 10.0, 1: 100.0 * config.train.optimizer.lr, 2: 5.0, 3: 200.0 * config.train.optimizer.lr}
        rows = [{"step": 0, "eval/loss": 7.0}]
        rows += [{"step": s, "train/loss": 6.0 - s / 10, "throughput/tokens_per_s": v,
                  "transport": "ring" if s < 2 else "fixed_all_to_all"} for s, v in speeds.items()]
        rows += [{"step": 4, "eval/loss": 5.0 + config.train.optimizer.lr}]
        if config.train.optimizer.lr == 0.5:  # the spike guard rolled this one back twice at step 2, as its rows say
            rows += [{"step": 2, "spike/rollback_from": 2, "spike/rollback_to": 0, "spike/skipped_batch": b} for b in (2, 3)]
        with open(os.path.join(config.output_path, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\\n" for r in rows)
        meet = os.environ.get("MEET_DIR")  # runs declared together wait for each other: they surely overlap
        if meet:
            open(os.path.join(meet, str(config.train.optimizer.lr)), "w").close()
            deadline = time.monotonic() + 120
            while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        print("[train] x: done: steps 0->4 in 9.9s (compiling 3.0s, waited for 1.5s, 1.0s of it by training steps), "
              "final validation loss 5.0")

    def run(name, lr, seed=0):
        train = TrainConfig(batch_size=2, seq_len=8, num_steps=4, optimizer=AdamWConfig(lr=lr), seed=seed)
        step = default_train(name, data=External("cache", "/nowhere", version="v1"), model=tiny_moe, train=train)
        return step.__class__(step.name, pretend_to_train, step.config)

    if __name__ == "__main__":
        main(RUNS)
    """
)


def _experiment(path, runs: str):
    path.write_text(_EXPERIMENT.replace("RUNS)", f"{runs})"))
    return str(path)


def test_compare_across_experiments_with_columns_defined_and_shared_runs_marked(tmp_path, capsys, monkeypatch):
    prefix = str(tmp_path / "out")
    dense = _experiment(tmp_path / "dense.py", '[run("dense", 1.0)]')
    moe = _experiment(tmp_path / "moe.py", '[run("moe", 0.5)]')
    # (another seed than "dense": the same work under another name would reuse dense's output, not run)
    together = _experiment(tmp_path / "together.py", '[run("pair/a", 1.0, seed=1), run("pair/b", 2.0, seed=1)]')
    for experiment in (dense, moe):  # one after the other: neither shares the host
        assert console_main(["run", experiment, "--prefix", prefix]) == 0
    capsys.readouterr()

    assert console_main(["compare", dense, moe, "--prefix", prefix, "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert {r["experiment"] for r in rows.values()} == {"dense.py", "moe.py"}
    # The last transport phase's speed (fixed_all_to_all, from step 2), less its first step (it compiled)
    assert rows["train/dense"]["tokens_per_s"] == 200.0 and rows["train/moe"]["tokens_per_s"] == 100.0
    assert rows["train/dense"]["shared"] is None and rows["train/moe"]["shared"] is None
    assert rows["train/dense"]["compile_s"] == 1.5
    assert rows["train/dense"]["fields"] == {"train.optimizer.lr": 1.0} and rows["train/moe"]["fields"] == {
        "train.optimizer.lr": 0.5}

    assert console_main(["compare", dense, moe, "--prefix", prefix]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].strip("| ").split(" | ")
    assert header[:2] == ["experiment", "run"] and {"compile", "training", "eval+ckpt", "setup"} <= set(header)
    notes = lines[lines.index("") + 1:]
    defined = [line.split(":")[0][2:] for line in notes if not line.startswith("- train/")]
    assert defined == header[:-1] + ["train.optimizer.lr"]  # every column shown, defined where it is shown
    assert "- train/moe rolled back past 2 loss spike(s), skipping the batch at step(s) 2, 2 " in "\n".join(notes)
    assert not [line for line in notes if line.startswith("- train/dense")]  # a plain run has no such note

    # Beside them: a launcher killed mid-step days ago (step.json, no status, no lease) on this host, and a
    # step.json torn by a crash. Neither shared the runs' host, and neither stops the table.
    host = json.loads(next((tmp_path / "out" / "train").glob("dense-*/.keel/step.json")).read_text())["provenance"]["host"]
    for name, text in (("crashed", json.dumps({"name": "train/crashed", "attempt": 1, "started": 1.0,
                                               "provenance": {"host": host}})), ("torn", '{"name": "train/to')):
        (tmp_path / "out" / "train" / f"{name}-0123456789" / ".keel").mkdir(parents=True)
        (tmp_path / "out" / "train" / f"{name}-0123456789" / ".keel" / "step.json").write_text(text)
    assert console_main(["compare", dense, moe, "--prefix", prefix, "--json"]) == 0
    assert all(r["shared"] is None for r in json.loads(capsys.readouterr().out)["runs"])

    # Two experiment files of one name in two folders, each declaring train/same: both rows, told apart
    same = [_experiment(tmp_path / folder / "exp.py", f'[run("same", {lr})]') for folder, lr in (("v1", 0.25), ("v2", 0.75))
            if (tmp_path / folder).mkdir() or True]
    for experiment in same:
        assert console_main(["run", experiment, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["compare", *same, "--prefix", prefix, "--json"]) == 0
    rows = {r["run"]: r["experiment"] for r in json.loads(capsys.readouterr().out)["runs"]}
    assert rows == {"v1/exp.py:train/same": "v1/exp.py", "v2/exp.py:train/same": "v2/exp.py"}

    (tmp_path / "meet").mkdir()
    monkeypatch.setenv("MEET_DIR", str(tmp_path / "meet"))
    assert console_main(["run", together, "--prefix", prefix]) == 0  # two runs at once on this host
    capsys.readouterr()
    assert console_main(["compare", together, "--prefix", prefix, "--json"]) == 0
    pair = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert pair["train/pair/a"]["shared"]["steps"] == ["train/pair/b"]
    assert pair["train/pair/b"]["shared"]["steps"] == ["train/pair/a"]
    assert all(0 < r["shared"]["fraction"] <= 1 for r in pair.values())
    assert console_main(["compare", together, "--prefix", prefix]) == 0
    table = capsys.readouterr().out
    assert "| 200 * |" in table and "- * train/pair/a shared its host for " in table


def test_the_wall_split_times_the_last_attempts_steps_less_their_compile_waits():
    """The steps are the last attempt's (a resumed run keeps the earlier rows, and an interrupted
    attempt's lines stay in the log), each row standing for the steps since the one before it
    (`log_every`) at its own time less the compile wait it names: a step that waited for its program
    has a row of its own naming the wait (the loop writes it off the cadence). The evaluations'
    waits (the summary's rest) are in no step's time."""
    from keel.spec.metrics import COMPILE_WAIT
    from keel.trained.compare import wall_split

    interrupted = ("[train] x: compiled the fixed_all_to_all training step in 9.0s, ahead (step 0 waited 9.0s for it)\n"
                   "[train] x: interrupted: stopped after step 10 of 20, checkpoint saved\n")
    log = interrupted + ("[train] x: resumed at step 10\n"
                         "[train] x: done: steps 10->20 in 30.0s (compiling 14.0s, waited for 8.0s, 5.0s of it by training steps)\n")
    earlier = [{"step": s, "throughput/tokens_per_s": 10.0} for s in range(10)]  # an earlier attempt's rows
    resumed = [{"step": 10, "throughput/tokens_per_s": 100 / 7.0, COMPILE_WAIT: 5.0}]  # 2 s of training, 5 s waiting
    rows = [{"step": s, "throughput/tokens_per_s": 50.0} for s in range(11, 20, 2)]  # log_every=2; 2 s a step
    split = wall_split(log, earlier + resumed + rows, tokens_per_step=100, wall=40.0)
    # this attempt's 10 steps at 2 s each: 20 s, the 5 s step 10 waited being compile time; the loop's
    # other 30 - 20 - 8 s (all it waited for compiles) went to evaluations and checkpoints. (This test
    # once expected 15 s and 7 s from rows without step 10's: it took the 5 s wait out of steps whose
    # rows never held it, moving it from training to eval+ckpt.)
    assert split == {"compile_s": 8.0, "train_s": 20.0, "eval_s": 2.0, "setup_s": 10.0}, split
    # log_every=10, 1 s a step: step 0 waited 15 s for its program, and step 15 (off the cadence, a new
    # transport) 14 s; each such row stands for the steps before it at its time less its wait
    log = "[train] x: done: steps 0->30 in 100.0s (compiling 40.0s, waited for 29.0s, 29.0s of it by training steps)\n"
    rows = [{"step": 0, "throughput/tokens_per_s": 100 / 16, COMPILE_WAIT: 15.0}, {"step": 15, "throughput/tokens_per_s": 100 / 15,
            COMPILE_WAIT: 14.0}] + [{"step": s, "throughput/tokens_per_s": 100.0} for s in (9, 19, 29)]
    split = wall_split(log, rows, tokens_per_step=100, wall=110.0)
    assert split == {"compile_s": 29.0, "train_s": 30.0, "eval_s": 41.0, "setup_s": 10.0}, split


def _ran_together(out, names: list[str]) -> list:
    """The runs of these step names under `out`, their recorded attempts made to span one window:
    as if they had trained at once, without waiting on two launchers in a test."""
    paths = [path for name in names for path in sorted(out.glob(f"{name}-*"))]
    for path in paths:
        status = json.loads((path / ".keel" / "status").read_text())
        (path / ".keel" / "status").write_text(json.dumps({**status, "started": 1000.0, "finished": 1010.0}))
    return paths


def test_two_runs_of_one_name_from_two_files_that_overlapped_are_both_marked(tmp_path, capsys):
    """`keel compare A.py B.py` labels two `train/same` runs `a.py:train/same` and `b.py:train/same`;
    each is told from the other by its output path, not its name, so both are marked."""
    prefix = str(tmp_path / "out")
    files = [_experiment(tmp_path / f"{name}.py", f'[run("same", {lr})]') for name, lr in (("a", 0.25), ("b", 0.75))]
    for experiment in files:
        assert console_main(["run", experiment, "--prefix", prefix]) == 0
    assert len(_ran_together(tmp_path / "out" / "train", ["same"])) == 2
    capsys.readouterr()
    assert console_main(["compare", *files, "--prefix", prefix, "--json"]) == 0
    rows = {r["run"]: r["shared"] for r in json.loads(capsys.readouterr().out)["runs"]}
    assert rows == {label: {"steps": ["train/same"], "fraction": 1.0} for label in ("a.py:train/same", "b.py:train/same")}


@dataclass(frozen=True)
class _Job:
    n: int
    output_path: str = this_output()


def _write_metrics(config: _Job) -> None:
    with open(os.path.join(config.output_path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "train/loss": 6.0, "throughput/tokens_per_s": 100.0}) + "\n")


def test_runs_are_marked_only_where_the_host_they_ran_on_was_shared(tmp_path):
    """The host compared is the one each step ran on (`.keel/host`, written by the job where it runs),
    not the driver's in step.json: two cluster jobs the driver sent to two workers did not share one.
    A step with resources and no host recorded (sent to a cluster before keel recorded workers) is
    marked with nothing. The cluster here is fray's local one: its jobs run as a worker's would."""
    from fray.local_backend import LocalClient

    steps = [Step(f"train/{name}", _write_metrics, _Job(n), resources=Resources.with_gpu("H100", count=8))
             for n, name in enumerate("ab")]
    assert run_steps(steps, str(tmp_path), cluster=LocalClient(), echo=lambda _: None).ok
    a, b = _ran_together(tmp_path / "train", ["a", "b"])
    assert (a / ".keel" / "host").read_text() == socket.gethostname()

    def shared() -> dict:
        return {r.run: r.shared and r.shared["steps"] for r in summarize({"a": str(a), "b": str(b)})}

    assert shared() == {"a": ["train/b"], "b": ["train/a"]}
    (b / ".keel" / "host").write_text("worker-2")  # one driver, two workers
    assert shared() == {"a": None, "b": None}
    for path in (a, b):
        (path / ".keel" / "host").unlink()
    assert shared() == {"a": None, "b": None}
    (a / ".keel" / "host").write_text("worker-7")  # an earlier attempt's worker: the next attempt drops it
    assert run_steps(steps[:1], str(tmp_path), force="^train/a$", echo=lambda _: None).ran == ["train/a"]
    assert not (a / ".keel" / "host").exists()  # run in the launcher's threads now: no host recorded


def test_one_file_given_twice_is_compared_once(tmp_path, capsys):
    """`keel compare exp.py sub/../exp.py`: one file under two spellings, not two files nothing tells apart."""
    prefix = str(tmp_path / "out")
    experiment = _experiment(tmp_path / "exp.py", '[run("once", 1.0)]')
    (tmp_path / "sub").mkdir()
    assert console_main(["run", experiment, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["compare", experiment, str(tmp_path / "sub" / ".." / "exp.py"), "--prefix", prefix, "--json"]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["train/once"]


def test_a_diverged_runs_figures_are_null_in_every_json_document(tmp_path, capsys):
    """`compare --json` and the compare step's comparison.json are JSON a strict parser (a browser's
    `JSON.parse`) reads: a run whose losses became NaN gives null, never a bare `NaN` token."""
    from keel.spec.trained import CompareConfig
    from keel.trained.compare import JSON_FILE, compare_step

    prefix = str(tmp_path / "out")
    experiment = str(tmp_path / "diverged.py")
    diverging = _EXPERIMENT.replace('"eval/loss": 5.0 + config.train.optimizer.lr}', '"eval/loss": float("nan")}')
    assert diverging != _EXPERIMENT
    (tmp_path / "diverged.py").write_text(diverging.replace("RUNS)", '[run("diverged", 1.0)])'))
    assert console_main(["run", experiment, "--prefix", prefix]) == 0
    (output,) = (tmp_path / "out" / "train").glob("diverged-*")
    capsys.readouterr()

    def refuse(token: str):
        raise ValueError(f"{token} is not JSON")

    def strict(text: str):
        return json.loads(text, parse_constant=refuse)

    assert console_main(["compare", experiment, "--prefix", prefix, "--json"]) == 0
    (row,) = strict(capsys.readouterr().out)["runs"]
    assert row["run"] == "train/diverged" and row["final_loss"] is None
    compare_step(CompareConfig(runs={"diverged": str(output)}, output_path=str(tmp_path / "compared")))
    (row,) = strict((tmp_path / "compared" / JSON_FILE).read_text())["runs"]
    assert row["final_loss"] is None


def test_the_best_loss_is_the_least_finite_one(tmp_path, capsys):
    """A NaN evaluation is never the run's best: `min` keeps whichever NaN comes first (it compares
    neither less nor greater), so a run whose first evaluation was NaN reported it as its best."""
    experiment = tmp_path / "nan_first.py"
    nan_first = _EXPERIMENT.replace('rows = [{"step": 0, "eval/loss": 7.0}]', 'rows = [{"step": 0, "eval/loss": float("nan")}]')
    assert nan_first != _EXPERIMENT
    experiment.write_text(nan_first.replace("RUNS)", '[run("nan_first", 1.0)])'))
    prefix = str(tmp_path / "out")
    assert console_main(["run", str(experiment), "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["compare", str(experiment), "--prefix", prefix, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert (row["best_step"], row["best_loss"]) == (4, 6.0), row


def test_runs_that_differ_only_in_the_drops_their_layout_decides_are_told_apart(tmp_path):
    """A capacity factor on a fixed-capacity transport is execution-only for the config but part of
    the run's identity (`derived`): two such runs got two output paths, and compare's table showed
    no field that told them apart."""
    runs = {}
    for label, factor in (("cf1.0", 1.0), ("cf1.25", 1.25)):
        digest = f"{int(factor * 100):010d}"
        path = tmp_path / "out" / "train" / f"{label}-{digest}"
        (path / ".keel").mkdir(parents=True)
        drops = [[0, {"transport": "fixed_all_to_all", "capacity_factor": factor, "expert_parallel": 4}]]
        identity = {"config": {"train": {"num_steps": 4, "seq_len": 8, "batch_size": 2}}, "derived": {"drops": drops}}
        (path / ".keel" / "step.json").write_text(json.dumps({"name": f"train/{label}", "hash": digest, "identity": identity,
                                                              "started": time.time() - 60}))
        (path / "metrics.jsonl").write_text(json.dumps({"step": 4, "eval/loss": 5.0}) + "\n")
        runs[label] = str(path)
    rows = {row.run: row.fields for row in summarize(runs)}
    assert rows == {"cf1.0": {"derived.drops[0][1].capacity_factor": 1.0}, "cf1.25": {"derived.drops[0][1].capacity_factor": 1.25}}
