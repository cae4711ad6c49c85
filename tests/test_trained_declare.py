"""Declaring compare / eval / sample steps (no jax), the comparison table of recorded runs, and the
per-sequence byte counts bits per byte divide by."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from defaults import default_compare, default_eval, default_sample, default_tokenize, default_tokenizer, default_train
from defaults import stdlib_corpus
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from keel import External
from keel.cli import console_main
from keel.spec import Mixture, RackTopology, TrainConfig, TransportPhase
from keel.executor.plan import Graph

REPO = Path(__file__).resolve().parent.parent


def _chain():
    corpus = stdlib_corpus(max_bytes=100_000)
    tokenizer = default_tokenizer("bpe", corpus, vocab_size=tiny_moe.vocab_size)
    return tokenizer, default_tokenize("bpe-128", corpus, tokenizer, seq_len=128)


def _run(name="a", data=None, lr=1e-3, steps=20):
    from keel.spec import AdamWConfig

    train = TrainConfig(batch_size=8, seq_len=128, num_steps=steps, optimizer=AdamWConfig(lr=lr), eval_batches=3,
                        permanent_checkpoint_every=10)
    return default_train(name, data=data if data is not None else _chain()[1], model=tiny_moe, train=train,
                         topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4), hardware=cpu_sim)


def test_an_eval_is_keyed_by_its_run_data_and_checkpoint():
    run, other = _run("a"), _run("b", lr=2e-3)
    tokens = _chain()[1]
    graph = Graph([
        final := default_eval("e", run=run, data={"stdlib": tokens}),
        by_number := default_eval("e", run=run, data={"stdlib": tokens}, checkpoint=20),
    ], "/tmp/keel-test")
    assert graph.path(final) == graph.path(by_number)  # "final" is the run's last step
    paths = {Graph([s], "/tmp/keel-test").path(s) for s in (
        final,
        default_eval("e", run=run, data={"stdlib": tokens}, checkpoint=10),
        default_eval("e", run=other, data={"stdlib": tokens}),
        default_eval("e", run=run, data={"other": tokens}),
    )}
    assert len(paths) == 4
    assert final.isolated and final.deps == (run, tokens)
    assert final.config.batches == (8, 3)  # the run's own validation reads
    assert final.config.process_env() == run.config.process_env() != {}  # the run's 8 simulated devices


def test_an_eval_that_reads_as_many_batches_as_the_run_is_keyed_by_that_count():
    """The run's `eval_batches` is execution-only for the run, but an eval that follows it
    (num_batches=None) reads as many sequences: 8 batches are another eval than 3."""
    import dataclasses

    run = _run("a")
    more = run.with_config(dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, eval_batches=8)))
    tokens = _chain()[1]

    def path(run, **kw):
        step = default_eval("e", run=run, data={"stdlib": tokens}, **kw)
        return Graph([step], "/tmp/keel-test").path(step)

    assert Graph([run], "/tmp/keel-test").path(run) == Graph([more], "/tmp/keel-test").path(more)
    assert path(run) != path(more)
    assert path(run, num_batches=3) == path(more, num_batches=3)  # a declared count: the run's does not matter


def test_an_eval_on_a_cache_of_a_larger_vocabulary_is_refused_before_loading_the_model(tmp_path):
    """The embedding lookup clamps ids past the model's vocabulary, so such an eval would write a
    plausible loss and bits per byte; the training step refuses that cache, and so does the eval."""
    from dataclasses import replace

    from keel.trained.evaluate import eval_step

    cache = tmp_path / "cache-32k"
    cache.mkdir()
    (cache / "tokenize.json").write_text(json.dumps({"seq_len": 128, "vocab_size": 32_000}))
    step = default_eval("e", run=_run("a"), data={"other": str(cache)})
    config = replace(step.config, data={"other": str(cache)}, output_path=str(tmp_path / "eval"))
    with pytest.raises(ValueError, match=r"EvalConfig.data\['other'\] .* makes ids up to 31,999 but "
                                         rf"MoELMConfig.vocab_size={tiny_moe.vocab_size:,}"):
        eval_step(config)


def test_an_eval_batch_a_run_without_topology_cannot_split_over_this_process_is_refused_before_loading(tmp_path):
    """A run declaring no topology lays its mesh out on every device of its process, so its eval's
    batch size can only be checked where the eval runs: declared, any size passed, and 12 rows on 8
    devices went on to read the caches and load the checkpoint, to fail at the first batch."""
    from dataclasses import replace

    import jax

    from keel.spec import AdamWConfig
    from keel.trained.evaluate import eval_step

    train = TrainConfig(batch_size=8, seq_len=128, num_steps=20, optimizer=AdamWConfig(lr=1e-3), eval_batches=3)
    run = default_train("a", data=_chain()[1], model=tiny_moe, train=train)
    step = default_eval("e", run=run, data={"stdlib": _chain()[1]}, batch_size=12)
    config = replace(step.config, data={"stdlib": str(tmp_path / "never-read")}, output_path=str(tmp_path / "eval"))
    assert len(jax.devices()) == 8
    with pytest.raises(ValueError, match=r"EvalConfig.batch_size=12 does not split over the 8 devices the eval runs on"):
        eval_step(config)


def test_an_eval_of_the_runs_own_data_leaves_out_a_cache_without_validation_as_the_loop_does(tmp_path, capsys):
    from keel.spec import AdamWConfig, MixturePhase
    from keel.trained.evaluate import evaluated_caches
    from test_data_mixture import SEQ_LEN, _write_cache

    held_out = _write_cache(tmp_path / "a", "validation", [1999])
    _write_cache(tmp_path / "a", "train", range(1000, 1040))
    none_held_out = _write_cache(tmp_path / "b", "validation", [])  # declared with validation_fraction=0
    _write_cache(tmp_path / "b", "train", range(2000, 2040))
    train_only = _write_cache(tmp_path / "c", "train", range(3000, 3040))  # another tool's: no validation split at all
    data = Mixture({"a": External("a", held_out, version="1"), "b": External("b", none_held_out, version="1"),
                    "c": External("c", train_only, version="1")},
                   (MixturePhase(0, {"a": 0.4, "b": 0.3, "c": 0.3}),), block_size=8)
    train = TrainConfig(batch_size=8, seq_len=SEQ_LEN, num_steps=4, optimizer=AdamWConfig(lr=1e-3), eval_batches=1)
    run = default_train("own", data=data, model=tiny_moe, train=train,
                        topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4), hardware=cpu_sim)

    def resolved(step):  # the config the step function receives
        from keel.executor.resolve import resolve_config

        graph = Graph([step], str(tmp_path / "out"))
        return resolve_config(step.config, graph.path(step), graph.path)

    own = default_eval("own", run=run)
    assert own.config.own_data and list(evaluated_caches(resolved(own))) == ["a"]
    said = capsys.readouterr().out
    assert "EvalConfig.data['b'] (" in said and "EvalConfig.data['c'] (" in said  # said, not silent
    for left_out in ("b", "c"):
        named = default_eval("named", run=run, data={"a": data.components["a"], left_out: data.components[left_out]})
        with pytest.raises(ValueError, match=rf"the validation split of EvalConfig.data\['{left_out}'\] .* is empty or absent"):
            evaluated_caches(resolved(named))


def test_an_eval_on_a_cache_of_another_tokenizer_than_the_runs_is_refused_before_loading_the_model(tmp_path):
    """Ids of another vocabulary (or other bos/eos) than the run's training data mean other text:
    the eval's loss and bits per byte would measure nothing the model learned. The training step
    records its caches' tokenizer (`data.json`), and the eval holds each of its caches to it."""
    from keel.executor.resolve import resolve_config
    from keel.trained.evaluate import evaluated_caches

    def cache(name: str, vocabulary: str) -> str:
        root = tmp_path / name
        root.mkdir()
        identity = {"vocabulary": vocabulary, "bos_id": None, "eos_id": 0}
        (root / "tokenize.json").write_text(json.dumps({"seq_len": 128, "vocab_size": 512, "tokenizer": identity}))
        return str(root)

    run = _run("a")
    step = default_eval("e", run=run, data={"theirs": External("theirs", cache("theirs", "ffff0000ffff0000"), version="1")})
    graph = Graph([step], str(tmp_path / "out"))
    config = resolve_config(step.config, graph.path(step), graph.path)
    run_output = Path(config.model.run)
    run_output.mkdir(parents=True)
    (run_output / "data.json").write_text(json.dumps({"tokenizer": {"vocabulary": "0123456789abcdef", "bos_id": None,
                                                                      "eos_id": 0}}))
    with pytest.raises(ValueError, match=r"EvalConfig.data\['theirs'\] \(.*theirs\) was tokenized differently from the "
                                         r"training data of run .* \(vocabulary ffff0000ffff0000, .* against vocabulary "
                                         r"0123456789abcdef.*evaluate on caches made with the run's tokenizer"):
        evaluated_caches(config)


def test_the_training_step_records_its_caches_tokenizer_for_its_evaluations(tmp_path):
    from keel.spec import AdamWConfig, MixturePhase, TrainStepConfig
    from keel.train.data_checks import RUN_DATA_FILE, check_token_caches, record_run_data

    identity = {"vocabulary": "0123456789abcdef", "bos_id": None, "eos_id": 0}
    (tmp_path / "cache").mkdir()
    stats = {"seq_len": 128, "vocab_size": 1024, "tokenizer": identity, "splits": {"train": {"sequences": 64}}}
    (tmp_path / "cache" / "tokenize.json").write_text(json.dumps(stats))
    data = Mixture({"a": str(tmp_path / "cache")}, (MixturePhase(0, {"a": 1.0}),), block_size=8)
    train = TrainConfig(batch_size=8, seq_len=128, num_steps=4, optimizer=AdamWConfig(lr=1e-3), eval_batches=0)
    config = TrainStepConfig(model=tiny_moe, data=data, train=train, output_path=str(tmp_path / "run"))
    record_run_data(config.output_path, check_token_caches(config), config.data)  # as the step does, its caches checked
    assert json.loads((tmp_path / "run" / RUN_DATA_FILE).read_text()) == {"tokenizer": identity, "trained_documents": []}


def test_eval_and_sample_follow_their_run_under_set():
    """A `--set` on the run reaches the steps that read it: "final" is its new last step, and the
    checkpoint is loaded with the run's new shapes and batches (not copies made at declaration)."""
    from keel.executor.overrides import apply_overrides
    from keel.executor.graph import topological_order

    run = _run("a")
    evaluation = default_eval("e", run=run, data={"stdlib": _chain()[1]})
    sample = default_sample("s", run=run, prompts=["def "])
    targets = [evaluation, sample]
    sets = ["train/a.train.num_steps=80", "train/a.train.batch_size=16", "train/a.model.num_experts=16"]
    evaluation, sample = apply_overrides(targets, topological_order(targets), sets)
    for step in (evaluation, sample):
        trained = step.config.model
        assert trained.run.config.train.num_steps == 80 and trained.step == 80
        assert trained.model.num_experts == 16 and trained.train.batch_size == 16
    assert evaluation.config.batches == (16, 3)
    with pytest.raises(TypeError, match="model= is now run="):
        default_eval("e", model=run, data={"stdlib": _chain()[1]})


def test_a_sample_uses_the_tokenizer_the_runs_data_was_tokenized_with(tmp_path):
    tokenizer, tokens = _chain()
    sample = default_sample("s", run=_run(data=tokens), prompts=["def "], seed=3)
    assert sample.config.tokenizer is tokenizer and sample.config.add_bos is False and sample.isolated
    mixture = Mixture.constant({"x": tokens, "y": tokens}, {"x": 0.5, "y": 0.5})
    assert default_sample("s", run=_run(data=mixture), prompts=["a"]).config.tokenizer is tokenizer
    cache = External("cache", "/data/cache")
    with pytest.raises(ValueError, match=r"not a keel tokenize step.*pass tokenizer="):
        default_sample("s", run=_run(data=cache), prompts=["a"])
    assert default_sample("s", run=_run(data=cache), prompts=["a"], tokenizer="/tok").config.tokenizer == "/tok"
    # a tokenizer given by hand comes with the convention its documents were encoded with
    given = default_sample("s", run=_run(data=cache), prompts=["a"], tokenizer="/tok", add_bos=True, bos_token="<s>").config
    assert (given.add_bos, given.bos_token, given.eos_token) == (True, "<s>", None)
    with pytest.raises(TypeError, match="add_bos=, bos_token= and eos_token= go with tokenizer="):
        default_sample("s", run=_run(data=tokens), prompts=["a"], add_bos=True)
    (tmp_path / "tokenizer.json").write_text("{}")  # a tokenizer given by path: its file joins the identity
    by_path = default_sample("s", run=_run(data=cache), prompts=["a"], tokenizer=str(tmp_path)).config
    assert by_path.input_files() == {str(tmp_path / "tokenizer.json"): str(tmp_path / "tokenizer.json")}
    assert sample.config.input_files() == {}  # the tokenize step's own tokenizer counts through that step


def test_declaration_mistakes_name_the_fix():
    run, tokens = _run(), _chain()[1]
    with pytest.raises(TypeError, match="not a training step"):
        default_eval("e", run=tokens, data={"x": tokens})
    with pytest.raises(ValueError, match="give 'final' or a checkpoint step"):
        default_eval("e", run=run, data={"x": tokens}, checkpoint="last")
    with pytest.raises(ValueError, match=r"checkpoint step in 1\.\.20"):
        default_eval("e", run=run, data={"x": tokens}, checkpoint=21)
    with pytest.raises(ValueError, match=r"checkpoint=15: the run keeps no checkpoint of step 15 \(it keeps its last "
                                         r"step, 20, every 10 steps; .*permanent_checkpoint_every as a divisor of 15 \(execution-only"):
        default_sample("s", run=run, prompts=["a"], checkpoint=15)  # it failed only once the sample had started
    switching = default_train("switching", data=tokens, model=tiny_moe, hardware=cpu_sim,
                              topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4),
                              train=TrainConfig(batch_size=8, seq_len=128, num_steps=20, transports=(
                                  TransportPhase(0, "fixed_all_to_all"), TransportPhase(5, "ring"))))
    assert default_eval("e", run=switching, data={"x": tokens}, checkpoint=5).config.model.step == 5  # a switch's
    with pytest.raises(ValueError, match=r"it keeps its last step, 20, the transport switches at 5; rolling"):
        default_eval("e", run=switching, data={"x": tokens}, checkpoint=6)
    with pytest.raises(ValueError, match="data is empty"):
        default_eval("e", run=run, data={})
    silent = default_train("quiet", data=tokens, model=tiny_moe, train=TrainConfig(batch_size=8, seq_len=128, num_steps=20,
                                                                                   eval_batches=0))
    with pytest.raises(ValueError, match=r"EvalConfig.num_batches=None follows the run's eval_batches, which is 0"):
        default_eval("e", run=silent, data={"x": tokens})
    assert default_eval("e", run=silent, data={"x": tokens}, num_batches=2).config.batches == (8, 2)
    with pytest.raises(ValueError, match="name one step twice"):
        default_compare("c", runs=[run, run])
    with pytest.raises(ValueError, match="temperature"):
        default_sample("s", run=run, prompts=["a"], temperature=-1.0)


_RECORDED_RUNS = textwrap.dedent(
    """
    import json, os
    from defaults import default_compare, default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, TrainConfig

    def pretend_to_train(config):  # writes what a training step records, in a second
        rows = [{"step": 0, "eval/loss": 7.0}]
        for s in range(4):
            rows.append({"step": s, "train/loss": 7.0 - s * config.train.optimizer.lr, "throughput/tokens_per_s": 100.0 * (s + 1)})
        rows += [{"step": 2, "eval/loss": 6.0 - config.train.optimizer.lr}, {"step": 4, "eval/loss": 6.5}]
        with open(os.path.join(config.output_path, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\\n" for r in rows)

    def run(lr):
        train = TrainConfig(batch_size=8, seq_len=128, num_steps=4, optimizer=AdamWConfig(lr=lr))
        step = default_train(f"fake/lr{lr}", data=External("cache", "/nowhere", version="fake"), model=tiny_moe, train=train)
        return step.__class__(step.name, pretend_to_train, step.config)

    runs = [run(0.5), run(0.25)]
    if __name__ == "__main__":
        main([default_compare("fake", runs=runs)])
    """
)


def test_the_comparison_table_shows_what_each_run_recorded(tmp_path, capsys):
    experiment = tmp_path / "exp.py"
    experiment.write_text(_RECORDED_RUNS)
    prefix = str(tmp_path / "out")
    assert console_main(["compare", str(experiment), "--prefix", prefix]) == 1  # nothing finished yet
    assert "no finished training steps" in capsys.readouterr().err
    assert console_main(["run", str(experiment), "--prefix", prefix]) == 0
    compare_dir = next((tmp_path / "out" / "compare").glob("fake-*"))
    rows = json.loads((compare_dir / "comparison.json").read_text())["runs"]
    steady = pytest.approx(3 / (1 / 200 + 1 / 300 + 1 / 400))  # steps 1-3's tokens over their time (step 0 compiled)
    assert [(r["run"], r["steps"], r["final_step"], r["final_loss"], r["best_loss"], r["best_step"], r["tokens_per_s"])
            for r in rows] == [("train/fake/lr0.5", 4, 4, 6.5, 5.5, 2, steady), ("train/fake/lr0.25", 4, 4, 6.5, 5.75, 2, steady)]
    assert [r["fields"] for r in rows] == [{"train.optimizer.lr": 0.5}, {"train.optimizer.lr": 0.25}]
    assert all(r["wall_s"] > 0 for r in rows)
    table = (compare_dir / "comparison.md").read_text().splitlines()
    assert table[0] == ("| run | steps | final val loss | best val loss (step) | tokens/s | wall time | compile | "
                        "training | eval+ckpt | setup | train.optimizer.lr |")
    assert table[2].startswith("| train/fake/lr0.5 | 4 | 6.5000 | 5.5000 (2) | 277 ") and table[2].endswith(" | 0.5 |")
    legend = table[table.index("") + 1:]  # every column shown is defined under the table
    assert [line.split(":")[0] for line in legend[:11]] == [f"- {c}" for c in table[0].strip("| ").split(" | ")[:-1]] + [
        "- train.optimizer.lr"]
    assert (compare_dir / "comparison.png").stat().st_size > 1000

    # `keel compare` prints the same table from the cached runs, and imports no jax doing so.
    script = ("import sys; from keel.cli import console_main; code = console_main(sys.argv[1:]); "
              "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'levanter', 'haliax')]; sys.exit(code)")
    printed = subprocess.run([sys.executable, "-c", script, "compare", str(experiment), "--prefix", prefix],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines() == table
    capsys.readouterr()
    assert console_main(["compare", str(experiment), "--prefix", prefix, "--only", r"lr0\.25"]) == 0
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[2:3]] == ["| train/fake/lr0.25"]
    assert console_main(["compare", str(experiment), "--prefix", prefix, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == rows


def test_the_tokenize_step_records_each_sequences_utf8_bytes(tmp_path):
    from keel.data import ingest_documents, IngestConfig, load_token_cache
    from keel.spec import TokenizeConfig, TrainTokenizerConfig
    from keel.data import load_tokenizer, tokenize_documents, train_tokenizer
    from keel.data.datasets import read_sequence_bytes

    texts = [f"déjà vu {i}: naïve café, {'x' * (i % 7)} Größe\n" * (1 + i % 3) for i in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ingest_documents(IngestConfig(inputs=(str(tmp_path / "d.jsonl"),), validation_fraction=0.0,
                                  output_path=str(tmp_path / "docs")))
    train_tokenizer(TrainTokenizerConfig(documents=str(tmp_path / "docs"), vocab_size=400, output_path=str(tmp_path / "tok")))
    tokenize_documents(TokenizeConfig(documents=str(tmp_path / "docs"), tokenizer=str(tmp_path / "tok"), seq_len=16,
                                      output_path=str(tmp_path / "cache")))
    counts = read_sequence_bytes(str(tmp_path / "cache"), "train")
    rows = [r["input_ids"] for r in load_token_cache(str(tmp_path / "cache"), "train", seq_len=16)]
    assert counts.dtype == np.int64 and len(counts) == len(rows) > 10

    # The documents' bytes, less those of the tail the packer dropped and of the tokens the loss only
    # reads (each row's first, each document's first): every predicted byte lands in one sequence.
    loaded = load_tokenizer(str(tmp_path / "tok"))
    loaded.tokenizer.encode_special_tokens = True
    stats = json.loads((tmp_path / "cache" / "tokenize.json").read_text())
    stream = np.concatenate([loaded.tokenizer.encode(t).ids + [loaded.eos_id] for t in texts])
    dropped = stats["splits"]["train"]["dropped_tokens"]
    tail = loaded.tokenizer.decode(stream[len(stream) - dropped:].tolist(), skip_special_tokens=True)
    starts = np.cumsum([0] + [len(loaded.tokenizer.encode(t).ids) + 1 for t in texts[:-1]])
    context = {i for i in starts.tolist() if i < len(stream) - dropped} | set(range(0, len(stream) - dropped, 16))
    read_only = sum(len(loaded.tokenizer.decode([int(stream[i])]).encode()) for i in context)  # whole characters here
    assert counts.sum() == stats["splits"]["train"]["bytes"] == (sum(len(t.encode()) for t in texts) - len(tail.encode())
                                                                 - read_only)
    assert read_sequence_bytes(str(tmp_path / "cache"), "validation").shape == (0,)
    assert read_sequence_bytes(str(tmp_path), "train") is None  # a cache written without them

    # A cache written before counted every token's bytes: refused, naming the rerun
    (tmp_path / "cache" / "tokenize.json").write_text(json.dumps({**stats, "format": "keel.token_cache/v1"}))
    with pytest.raises(ValueError, match=r"counted the bytes of every token.*keel run --force"):
        read_sequence_bytes(str(tmp_path / "cache"), "train")


def test_a_completion_reads_as_it_follows_its_prompt():
    """A SentencePiece-style decoder drops a completion's leading space when it decodes the completion
    alone: "The cat" + "sat". A byte-level one (keel's) reads the same either way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from keel.trained.sample import completion_text

    metaspace = Tokenizer(models.WordLevel(vocab={"▁The": 0, "▁cat": 1, "▁sat": 2}, unk_token="▁The"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert metaspace.decode([2]) == "sat"
    assert completion_text(metaspace, [0, 1], [2]) == " sat"

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    prompt, completion = byte_level.encode("The café").ids, byte_level.encode(" au lait").ids
    assert completion_text(byte_level, prompt, completion) == byte_level.decode(completion) == " au lait"
