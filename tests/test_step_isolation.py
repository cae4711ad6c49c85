"""Steps cannot hurt each other: training steps run in processes of their own, with the devices
their declared hardware asks for, from a user's environment with no XLA flags set.

The tests run keel as a user would: `keel run` as a subprocess whose environment has neither
`XLA_FLAGS` nor `JAX_PLATFORMS` (tests/conftest.py sets them for in-process tests only).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.cli import load_experiment
from keel.executor.plan import Graph, plan_graph
from keel.executor.status import keel_path, read_status, verify_manifest
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SWEEP = str(REPO / "tests/experiments/lr_sweep_2.py")


def user_env(**extra) -> dict:
    """The environment a user runs keel in: no simulated devices, platform or compilation cache
    set from outside. Its machine caches are the session's (`XDG_CACHE_HOME`, `conftest.py`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith(
        ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return {**env, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **extra}


def keel(*args, timeout=900, **env):
    """`uv run --locked keel ARGS` (the README's spelling) from the repository, as a user runs it."""
    uv = shutil.which("uv")
    command = [uv, "run", "--locked", "keel"] if uv else [sys.executable, "-m", "keel.cli_entry"]
    return subprocess.run([*command, *args], env=user_env(**env), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def graph_as_run(steps, prefix: str) -> Graph:
    """The graph of `steps` under `prefix` with each step's path where its output is, as `keel status`
    shows it: in a prefix that several experiments share, a step whose work another one already did
    under its own name reads that output (`keel.executor.reuse`), which `Graph.path` alone does not know."""
    graph = Graph(steps, prefix)
    plan_graph(graph)
    return graph


def test_the_readme_main_job_trains_then_everything_is_cached(tmp_path):
    done = keel("run", "experiments/tutorials/tiny_moe.py", "--prefix", str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    graph = Graph(load_experiment(str(REPO / "experiments/tutorials/tiny_moe.py")), str(tmp_path))
    train = next(s for s in graph.steps() if s.name == "train/tiny_moe")
    evals = latest_by_step(read_metrics(os.path.join(graph.path(train), METRICS_FILE)), "eval/loss")
    assert evals[0] > 6.0 and evals[max(evals)] < 0.7 * evals[0], evals  # it learned (on modules it never saw)
    again = keel("run", "experiments/tutorials/tiny_moe.py", "--prefix", str(tmp_path), timeout=120)
    assert again.returncode == 0 and "0 ran, 0 reused, 4 cached" in again.stdout, again.stdout + again.stderr

    # the run's own record of the state it trained is what `keel plan --json` prints, leaf by leaf
    planned = keel("plan", "experiments/tutorials/tiny_moe.py", "--prefix", str(tmp_path), "--json", timeout=120)
    sheet = next(s for s in json.loads(planned.stdout)["fact_sheets"] if s["step"] == "train/tiny_moe")
    layout = json.loads(Path(keel_path(graph.path(train), "layout.json")).read_text())["records"]
    assert [(r["step"], r["reason"]) for r in layout] == [(0, "start"), (150, "phase change")]
    # the step's process saw the 2 racks x 4 devices its hardware declares (this test's environment sets none)
    assert [(r["devices"], r["processes"]) for r in layout] == [(8, 1), (8, 1)]
    for record in layout:
        live = [leaf for leaf in record["leaves"] if not leaf["path"].startswith("opt_state/counter/")]
        assert live == sheet["state_layout"][0]["leaves"]

    # the run records what its ids mean, which its evaluations hold their caches to
    cache = graph.path(next(s for s in graph.steps() if s.name.startswith("tokenized/")))
    run_record, cache_record = (json.loads(Path(p, f).read_text()) for p, f in ((graph.path(train), "data.json"),
                                                                                  (cache, "tokenize.json")))
    recorded = run_record["tokenizer"]
    assert recorded == cache_record["tokenizer"] and recorded["vocabulary"]
    assert run_record["trained_documents"] == [cache_record["documents"]]  # and the documents an eval may not hold out
    # the checkpoints the finished run holds are those its config keeps, which an eval or sample may name
    kept = sorted(int(name.split("-")[1]) for name in os.listdir(os.path.join(graph.path(train), "checkpoints")))
    steps = train.config.train.num_steps
    assert kept == [s for s in range(1, steps + 1) if train.config.train.keeps_checkpoint(s)] == [100, 150, 200, 300]

    # the logged validation loss is the whole split's (a representative sample of it)
    whole = _whole_split_loss(graph, train)
    assert abs(evals[max(evals)] - whole) < 0.05, (evals[max(evals)], whole)


def _whole_split_loss(graph, train) -> float:
    """The final checkpoint's loss over every sequence of the validation split (in-process, as the eval step
    does), loaded without compiling a program of the model."""
    import jax

    from keel.data import load_token_cache
    from keel.spec.topology import BATCH_AXES
    from keel.train.loop import eval_loss_fn, validation_losses
    from keel.executor.resolve import resolve_config
    from keel.spec.trained import TrainedModel
    from keel.trained.load import load_model

    config = train.config
    cache = graph.path(next(s for s in graph.steps() if s.name.startswith("tokenized/")))
    split = load_token_cache(cache, "validation", seq_len=config.train.seq_len)
    lowered = []  # every program JAX lowers while the checkpoint loads, by name

    def record(event, _seconds, fun_name="", **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        loaded = load_model(resolve_config(TrainedModel(run=train), "", graph.path))  # its final checkpoint
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    # the checkpoint is read into the planned shapes: no model init compiles only to be overwritten (the one
    # program allowed is the zero Haliax casts to ask whether it runs inside jit)
    assert set(lowered) <= {"jit(convert_element_type)"}, lowered
    batches = -(-len(split) // config.train.batch_size)
    with jax.set_mesh(loaded.mesh):
        evaluate = eval_loss_fn(loaded.lm, loaded.static, loaded.shardings, loaded.transport, loaded.compute_dtype)
        (loss, rows), = validation_losses(evaluate, loaded.arrays, {"data": split}, batch_size=config.train.batch_size,
                                          num_batches=batches, mesh=loaded.mesh, batch_axes=BATCH_AXES).values()
    assert len(rows) == len(split)
    return loss


SWEEP_STEPS = "40"


def _cache_home(prefix) -> str:
    """The user cache folder of the sweep's machine (beside its prefix)."""
    return f"{prefix}-cache"


def _sweep_graph(prefix: str) -> Graph:
    os.environ["SWEEP_STEPS"] = SWEEP_STEPS
    try:
        return Graph(load_experiment(SWEEP), prefix)
    finally:
        del os.environ["SWEEP_STEPS"]


@pytest.fixture(scope="module")
def interrupted_sweep(tmp_path_factory):
    """The two-point sweep run as a user runs it, stopped with Ctrl-C once both training steps have
    logged 3 steps, then run again to the end: (prefix, graph, console of the interrupted run, each
    training step's status and checkpoints when it stopped, the rerun's CompletedProcess). Three
    tests read it: the interruption, the two steps running at once, and compiled programs reused by
    a later attempt. Its machine (`XDG_CACHE_HOME`) is its own, so its compilation cache starts empty."""
    prefix = tmp_path_factory.mktemp("sweep")
    args = ("run", SWEEP, "--prefix", str(prefix))
    env = user_env(SWEEP_STEPS=SWEEP_STEPS, XDG_CACHE_HOME=_cache_home(prefix))
    uv = shutil.which("uv")
    command = [uv, "run", "--locked", "keel"] if uv else [sys.executable, "-m", "keel.cli_entry"]
    graph = _sweep_graph(str(prefix))
    trains = [graph.path(s) for s in graph.steps() if s.name.startswith("train/")]
    log = prefix / "console.txt"
    with open(log, "w") as console:  # a file, not a pipe: nobody reads the console while training runs
        proc = subprocess.Popen([*command, *args], env=env, cwd=REPO, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, as in a terminal
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not all(_train_rows(p) >= 3 for p in trains):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group (uv, if any, and keel) gets it
        proc.wait(timeout=300)
    finally:
        proc.kill()
    out = log.read_text()
    assert proc.returncode == 130, out[-4000:]
    # what each training step left when it stopped: its status and its checkpoints (the rerun prunes them)
    stopped = {path: (read_status(path), _complete_checkpoints(path)) for path in trains}
    rerun = subprocess.run([*command, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    return prefix, graph, out, stopped, rerun


def test_ctrl_c_stops_training_steps_at_a_step_boundary_and_the_rerun_resumes(interrupted_sweep):
    _, _, out, statuses, rerun = interrupted_sweep
    assert "interrupted; run the same command again" in out and "Traceback" not in out, out[-4000:]
    stopped = {}
    for path, (status, checkpoints) in statuses.items():
        assert status.state == "INTERRUPTED" and "training stopped after step" in status.error, status
        stopped[path] = int(status.error.split("after step ")[1].split()[0])
        assert 3 <= stopped[path] < int(SWEEP_STEPS)
        assert f"step-{stopped[path]}" in checkpoints, checkpoints

    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    for path in statuses:
        assert read_status(path).state == "SUCCESS"
        assert f"Resumed from {path}/checkpoints/step-{stopped[path]}" in Path(keel_path(path, "log.txt")).read_text()
        rows = [r["step"] for r in read_metrics(os.path.join(path, METRICS_FILE)) if "train/loss" in r]
        assert rows == list(range(int(SWEEP_STEPS))), rows


def _complete_checkpoints(path) -> list[str]:
    root = os.path.join(path, "checkpoints")
    return sorted(name for name in os.listdir(root) if os.path.exists(os.path.join(root, name, "metadata.json")))


def _train_rows(path) -> int:
    try:
        return sum("train/loss" in r for r in read_metrics(os.path.join(path, METRICS_FILE)))
    except FileNotFoundError:
        return 0


def test_a_two_point_sweep_runs_both_training_steps_at_once_in_their_own_processes(interrupted_sweep):
    prefix, graph, first, _, done = interrupted_sweep  # the rerun, which resumed both training steps
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # the two points differ only in their learning rates, so they compile one training step: the
    # first to take its lock compiles it, the other waits and loads it (keel.train.compile_cache)
    made = re.findall(r": (compiled|loaded) the \S+ training step", first)
    assert sorted(made) == ["compiled", "loaded"], first[-4000:]
    # so do their initial states, which compile under the same kind of lock (compile_ahead.compile_now)
    inits = re.findall(r": (compiled|loaded) the initial state\b", first)
    assert sorted(inits) == ["compiled", "loaded"], first[-4000:]
    trains = [s for s in graph.steps() if s.name.startswith("train/")]
    assert len(trains) == 2
    statuses = [read_status(graph.path(s)) for s in trains]
    assert all(s.state == "SUCCESS" for s in statuses)
    assert max(s.started for s in statuses) < min(s.finished for s in statuses), "the two steps ran at the same time"
    for step in trains:
        path = graph.path(step)
        assert verify_manifest(path, read_status(path)) is None
        run_id = path.rsplit("/", 1)[-1].replace(".", "_")
        runs = os.listdir(os.path.join(path, "wandb_files", "wandb"))
        assert [r for r in runs if r.startswith("offline-run-")] and all(
            r.endswith(run_id) for r in runs if r.startswith("offline-run-")), runs  # its own run, under its own output
        log = Path(keel_path(path, "log.txt")).read_text()
        assert "Traceback" not in log and "Exception ignored" not in log  # wandb shut down before the exit hooks
    launchers = {json.loads(Path(keel_path(graph.path(s), "step.json")).read_text())["provenance"]["pid"] for s in trains}
    assert len(launchers) == 1, "one launcher started both"
    assert all(p.state == "cached" for p in plan_graph(graph)), [(p.name, p.state, p.reason) for p in plan_graph(graph)]
    status = keel("status", SWEEP, "--prefix", str(prefix), timeout=60, SWEEP_STEPS=SWEEP_STEPS)
    assert status.returncode == 0 and "cache entry invalid" not in status.stdout, status.stdout
    assert "-- 5 steps: 5 cached" in status.stdout, status.stdout


def test_the_readme_twin_command_works_without_xla_flags(readme_twin):
    done, graph = readme_twin  # conftest.py: the command, run once per session
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    twin = next(s for s in graph.steps() if s.name.startswith("train/"))
    assert read_status(graph.path(twin)).state == "SUCCESS"
    log = Path(keel_path(graph.path(twin), "log.txt")).read_text()
    assert "RackTopology" not in log


def test_plan_refuses_a_topology_the_declared_hardware_cannot_provide(tmp_path):
    done = keel("plan", "experiments/tutorials/tiny_moe.py", "--prefix", str(tmp_path),
                "--set", "train/tiny_moe.topology.gpus_per_rack=8", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "topology.gpus_per_rack=8 differs from hardware.gpus_per_rack=4" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_step_declaring_gpus_never_trains_on_the_cpu_devices_its_launchers_shell_asks_for(tmp_path):
    """A shell left with a CPU run's JAX_PLATFORMS=cpu and 8 simulated devices trained a step that
    declares GPU hardware on fake CPU devices, and called it SUCCESS: its process takes its platform
    from the hardware, and the step checks the platform it got against the declared one."""
    experiment = tmp_path / "gpu_exp.py"
    experiment.write_text(
        "import dataclasses\nfrom defaults import default_train\nfrom defaults.hardware import cpu_sim\n"
        "from defaults.models import tiny_moe\nfrom keel import External, main\n"
        "from keel.spec import AdamWConfig, RackTopology, TrainConfig\n"
        "gpus = dataclasses.replace(cpu_sim, name='a GPU box', platform='gpu')\n"
        "train = TrainConfig(batch_size=8, seq_len=32, num_steps=2, optimizer=AdamWConfig(lr=1e-3))\n"
        "step = default_train('on_gpus', data=External('cache', '/nowhere', version='v1'), model=tiny_moe, train=train,\n"
        "                     topology=RackTopology(2, 4, expert_parallel=4), hardware=gpus)\n"
        "if __name__ == '__main__':\n    main([step])\n")
    done = keel("run", str(experiment), "--prefix", str(tmp_path / "out"), timeout=300,
                JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("the step declares hardware 'a GPU box' (platform gpu), but its process's jax runs on cpu" in
            done.stdout + done.stderr), done.stdout + done.stderr
    assert "1 failed" in done.stdout + done.stderr


def test_a_rerun_of_a_training_step_reuses_its_compiled_programs(interrupted_sweep, tmp_path):
    sweep, _, first_console, _, finished = interrupted_sweep
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-3000:]
    assert "empty (the first run compiles everything)" in first_console
    prefix = tmp_path / "copy"
    shutil.copytree(sweep, prefix)  # the sweep's other tests read the original
    graph = _sweep_graph(str(prefix))
    path = next(graph.path(s) for s in graph.steps() if s.name == "train/sweep/lr1.0")
    losses = latest_by_step(read_metrics(os.path.join(path, METRICS_FILE)), "train/loss")
    shutil.rmtree(os.path.join(path, "checkpoints"))  # as if the attempts had died before their first checkpoint
    os.remove(os.path.join(path, METRICS_FILE))
    again = keel("run", SWEEP, "--prefix", str(prefix), "--only", "lr1.0", "--force", "lr1.0", SWEEP_STEPS=SWEEP_STEPS,
                 XDG_CACHE_HOME=_cache_home(sweep))  # the same machine
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    found = [int(m.group(1)) for m in re.finditer(r"compilation cache .*: (\d+) compiled programs", again.stdout)]
    assert found and found[0] > 0, again.stdout[-3000:]
    assert re.search(r"loaded the \S+ training step from the compilation cache", again.stdout), again.stdout[-3000:]
    # from scratch, the losses of the run that was stopped and resumed
    assert latest_by_step(read_metrics(os.path.join(path, METRICS_FILE)), "train/loss") == losses
