"""The research loop on the lr_sweep tutorial, run as a user runs it (`keel run` without XLA flags):
a sweep of three tiny-MoE runs, a comparison whose rows are what the runs recorded, an eval that
reproduces a run's last validation loss, samples that a seed fixes, and `keel compare` printing
the same table without jax."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keel.cli import load_experiment
from keel.data.datasets import load_token_cache, read_sequence_bytes
from keel.executor.resolve import resolve_config
from keel.executor.status import read_status
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics
from test_step_isolation import graph_as_run, keel, user_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TUTORIAL = str(REPO / "experiments/tutorials/lr_sweep.py")


@pytest.fixture(scope="module")
def sweep(shared_prefix):
    prefix = shared_prefix  # the session's: the tutorial's data chain is tiny_moe's, which other tests' runs there share
    done = keel("run", TUTORIAL, "--prefix", prefix)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    graph = graph_as_run(load_experiment(TUTORIAL), prefix)  # its data chain may be another run's, reused
    return graph, {s.name: s for s in graph.steps()}


def _metrics(path):
    return read_metrics(os.path.join(path, METRICS_FILE))


def test_the_comparison_has_one_row_per_run_with_the_values_the_runs_recorded(sweep):
    graph, steps = sweep
    out = Path(graph.path(steps["compare/lr_sweep"]))
    rows = json.loads((out / "comparison.json").read_text())["runs"]
    runs = [s for s in steps.values() if s.name.startswith("train/lr_sweep/")]
    assert [r["run"] for r in rows] == [s.name for s in runs] and len(rows) == 3
    for row, run in zip(rows, runs):
        path = graph.path(run)
        evals = latest_by_step(_metrics(path), "eval/loss")
        throughput = latest_by_step(_metrics(path), "throughput/tokens_per_s")
        assert row["steps"] == run.config.train.num_steps == 30
        assert (row["final_step"], row["final_loss"]) == (30, evals[30])
        assert row["best_loss"] == min(evals.values()) and evals[row["best_step"]] == row["best_loss"]
        waited = latest_by_step(_metrics(path), "compile/waited_s")  # steps that waited for a program
        steady = [v for s, v in throughput.items() if s > 0 and s not in waited]  # one transport: step 0 compiled
        assert row["tokens_per_s"] == pytest.approx(len(steady) / sum(1 / v for v in steady))  # tokens over their time
        assert row["wall_s"] == pytest.approx(read_status(path).duration)
        # the declared difference: the scale of the law's rates (the rates themselves follow from it)
        assert row["fields"] == {"train.optimizer.lr_scale": run.config.train.optimizer.lr_scale}
    table = (out / "comparison.md").read_text().splitlines()
    assert table[5] == "" and "train.optimizer.lr_scale" in table[0]  # 3 rows, then each column's definition
    assert all(f"- {column}:" in "\n".join(table[6:]) for column in table[0].strip("| ").split(" | "))
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # `keel compare` prints that table from the cached runs, without running anything or importing jax.
    script = ("import sys; from keel.cli import console_main; code = console_main(sys.argv[1:]); "
              "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'levanter', 'haliax')]; sys.exit(code)")
    printed = subprocess.run([sys.executable, "-c", script, "compare", TUTORIAL, "--prefix", graph.prefix],
                             env=user_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines() == table
    only = keel("compare", TUTORIAL, "--prefix", graph.prefix, "--only", r"lr2\.0", timeout=120)
    assert only.returncode == 0, only.stdout + only.stderr
    lines = only.stdout.splitlines()  # one run: no field differs, the rest of its row is the same
    assert lines[3] == "" and lines[2].startswith(" | ".join(table[4].split(" | ")[:6])), lines


def test_the_eval_step_reproduces_the_runs_last_validation_loss(sweep):
    graph, steps = sweep
    report = json.loads((Path(graph.path(steps["eval/lr_sweep/lr1.0"])) / "eval.json").read_text())
    run = graph.path(steps["train/lr_sweep/lr1.0"])
    evals = latest_by_step(_metrics(run), "eval/loss")
    result = report["datasets"]["stdlib"]
    assert report["step"] == 30 and report["checkpoint"] == f"{run}/checkpoints/step-30"
    assert abs(result["loss"] - evals[30]) < 1e-4, (result["loss"], evals[30])
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    tokens_path = graph.path(steps["tokenized/stdlib-bpe-1k-128"])
    counts = read_sequence_bytes(tokens_path, "validation")
    sequences = min(16 * 4, len(counts))  # the run's batch size x eval_batches, or the whole (smaller) split
    rows = np.random.default_rng(steps["train/lr_sweep/lr1.0"].config.train.seed).permutation(len(counts))[:sequences]  # the loop's sample
    num_bytes = int(counts[rows].sum())
    assert (result["sequences"], result["tokens"], result["bytes"]) == (sequences, sequences * 128, num_bytes)
    # the loss is a mean over the targets it weighs: a next token of the same document, never past a row's end
    segments = np.stack([load_token_cache(tokens_path, "validation", seq_len=128).as_sync_dataset()[int(i)]["segment_ids"]
                         for i in rows])
    targets = int(((segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)).sum())
    assert 0 < result["targets"] == targets < sequences * 128
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2) * targets / num_bytes)


def test_samples_are_fixed_by_their_seed(sweep, tmp_path):
    from keel.trained.sample import SAMPLES_FILE, sample_step

    graph, steps = sweep
    step = steps["sample/lr_sweep/lr1.0"]
    written = [json.loads(line) for line in (Path(graph.path(step)) / SAMPLES_FILE).read_text().splitlines()]
    assert [s["prompt"] for s in written] == list(step.config.prompts)
    assert all(s["completion_ids"] for s in written)

    def sample(seed):  # the same step again, in this process
        out = tmp_path / f"seed{seed}"
        config = dataclasses.replace(resolve_config(step.config, str(out), graph.path), seed=seed)
        sample_step(config)
        return [json.loads(line)["completion_ids"] for line in (out / SAMPLES_FILE).read_text().splitlines()]

    assert sample(0) == [s["completion_ids"] for s in written]  # same seed, another process: identical
    other = sample(1)
    assert other != [s["completion_ids"] for s in written] and all(other)


def test_the_sample_program_returns_the_models_logits_at_each_rows_last_position(sweep):
    """The sample's program picks each row's last-position logits on the devices (replicated, so every
    process of a sample on several hosts reads them): exactly the model's full logits gathered on
    the host, as the step read them before, for rows of other lengths and the padding rows."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from keel.mesh.mesh import compute_axis_mapping
    from keel.model.axes import BATCH, POS
    from keel.spec.resolved import default_transport
    from keel.spec.topology import BATCH_AXES
    from keel.spec.transports import TransportSpec
    from keel.trained.load import load_model
    from keel.trained.sample import _next_token_logits, _window

    graph, steps = sweep
    config = resolve_config(steps["sample/lr_sweep/lr1.0"].config, "/unused", graph.path)
    loaded = load_model(config.model)
    rows, context = loaded.topology.batch_shards, config.model.train.seq_len
    ids, segments, last = _window([[5, 6, 7], list(range(20, 20 + context + 9)), [1]], rows, context)
    transport = TransportSpec(default_transport(loaded.topology).transport)

    def full(arrays, input_ids, segment_ids):  # the whole [rows, context, vocab], as the step computed it before
        model = eqx.combine(arrays, loaded.static)
        with hax.axis_mapping(compute_axis_mapping()):
            out, _ = model(hax.named(input_ids, (BATCH, POS)), hax.named(segment_ids, (BATCH, POS)),
                           transport=transport, compute_dtype=loaded.compute_dtype)
        return out.array.astype(jnp.float32)

    split = NamedSharding(loaded.mesh, PartitionSpec(BATCH_AXES, None))
    with jax.set_mesh(loaded.mesh):
        args = (loaded.arrays, jax.device_put(ids, split), jax.device_put(segments, split))
        picked = _next_token_logits(loaded, NamedSharding(loaded.mesh, PartitionSpec()))(
            *args, jax.device_put(last, NamedSharding(loaded.mesh, PartitionSpec(BATCH_AXES))))
        whole = jax.device_get(jax.jit(full)(*args))
    assert picked.sharding.is_fully_replicated and len(set(last)) == 3
    np.testing.assert_array_equal(np.asarray(picked), np.asarray(whole)[np.arange(rows), last])


def test_a_sample_whose_prompts_would_not_read_as_the_runs_documents_is_refused_before_loading(sweep, tmp_path):
    """The sample step checks its encoding against the run's record (`data.json`): a bos id the run's
    documents did not start with (a sample declared before a `--set` on the tokenize step kept the
    old add_bos), or another vocabulary, is refused naming the fix; before, it sampled."""
    from tokenizers import Tokenizer

    from keel.trained.sample import sample_step

    graph, steps = sweep
    config = resolve_config(steps["sample/lr_sweep/lr1.0"].config, str(tmp_path / "out"), graph.path)
    assert config.add_bos is False and json.loads((Path(config.model.run) / "data.json").read_text())["tokenizer"]["bos_id"] is None
    with pytest.raises(ValueError, match=r"prompts would start with bos id \d+, while the documents of run .* started "
                                         r"with no bos id: set add_bos=False"):
        sample_step(dataclasses.replace(config, add_bos=True))
    other = Tokenizer.from_file(str(Path(config.tokenizer) / "tokenizer.json"))
    other.add_tokens(["<|not-in-the-run|>"])
    (tmp_path / "other").mkdir()
    other.save(str(tmp_path / "other" / "tokenizer.json"))
    (tmp_path / "other" / "tokenizer_config.json").write_text((Path(config.tokenizer) / "tokenizer_config.json").read_text())
    with pytest.raises(ValueError, match="its tokenizer's vocabulary .* is not the one run .* trained on"):
        sample_step(dataclasses.replace(config, tokenizer=str(tmp_path / "other")))
    assert not (tmp_path / "out").exists()  # refused before the model loaded or anything was written


def test_the_tutorial_shares_the_tiny_moe_data_chain_and_reruns_cached(sweep):
    graph, steps = sweep
    tiny = graph_as_run(load_experiment(str(REPO / "experiments/tutorials/tiny_moe.py")), graph.prefix)
    shared = {s.name: tiny.path(s) for s in tiny.steps() if not s.name.startswith("train/")}
    assert shared == {name: graph.path(steps[name]) for name in shared} and len(shared) == 3
    again = keel("run", TUTORIAL, "--prefix", graph.prefix, timeout=300)
    assert again.returncode == 0 and "0 ran, 0 reused, 9 cached" in again.stdout, again.stdout + again.stderr


def test_the_dashboard_shows_the_sweep(sweep):
    """`keel dashboard experiments/tutorials/lr_sweep.py` (the README's command) in Chromium: every
    step with its state, each run's loss chart with one point per logged step, the runs overlaid,
    a fact sheet per run with its measured step time."""
    from dashboard_browser import browser_page, keel_command, local_only, node_states, points, wait_until_listening
    from iris_local import free_port

    from keel.executor.plan import plan_graph

    graph, steps = sweep
    runs = {s.name: graph.path(s) for s in steps.values() if s.name.startswith("train/")}
    port = free_port()
    served = subprocess.Popen([*keel_command(), "dashboard", TUTORIAL, "--prefix", graph.prefix, "--port", str(port)],
                              env=user_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_listening(port, timeout=120)
        with browser_page() as page:
            page.goto(f"http://127.0.0.1:{port}/")
            states = node_states(page)
            assert states == {p.name: p.state for p in plan_graph(graph)} and set(states.values()) == {"cached"}
            for name, path in runs.items():
                logged = latest_by_step(_metrics(path), "train/loss")
                assert points(page, name, "loss", "train/loss") == len(logged) == 30
                assert points(page, name, "loss", "eval/loss") == len(latest_by_step(_metrics(path), "eval/loss"))
            overlay = page.locator('svg[data-chart="overlay-eval"] polyline').evaluate_all("ls => ls.map(l => l.dataset.series)")
            assert sorted(overlay) == sorted(runs)
            sheets = page.locator(".sheet")
            assert sorted(sheets.evaluate_all("s => s.map(x => x.dataset.step)")) == sorted(runs)
            assert all("s/step (mean of the latest transport's training steps); 30/30 steps; finished" in t
                       for t in sheets.locator(".measured").all_inner_texts())
            assert not local_only(page.requested) and not page.errors
    finally:
        served.terminate()
        printed = served.communicate(timeout=30)[0]
    assert f"http://127.0.0.1:{port}/" in printed  # it said where
