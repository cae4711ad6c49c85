"""Cross-step checks before compute: a tokenizer larger than the model's vocabulary, a cache packed
at another sequence length, or a declared evaluation with no validation data is refused by
`keel plan` where the data steps' configs say it, and by the training step before it compiles."""

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from defaults.models import tiny_moe
from keel.cli import console_main
from keel.data import ingest_documents, IngestConfig, split_of, tokenize_documents, train_tokenizer
from keel.spec import AdamWConfig, TokenizeConfig, TrainConfig, TrainTokenizerConfig
from keel.spec.train import TrainStepConfig

_EXPERIMENT = """
    from defaults import default_tokenize, default_tokenizer, default_train, ingest
    from defaults.models import tiny_moe
    from keel import main
    from keel.spec import AdamWConfig, TrainConfig

    docs = ingest("mine", ({corpus!r},), validation_fraction={validation_fraction})
    tokenizer = default_tokenizer("mine-bpe", docs, vocab_size={tokenizer_vocab})
    tokens = default_tokenize("mine", docs, tokenizer, seq_len=64)
    train = TrainConfig(batch_size=16, seq_len={train_seq}, num_steps=5, optimizer=AdamWConfig(lr=1e-3))
    model = default_train("mine", data=tokens, model=tiny_moe.replace(vocab_size={model_vocab}), train=train)
    if __name__ == "__main__":
        main([model])
"""


def _experiment(tmp_path, *, tokenizer_vocab=512, model_vocab=512, train_seq=64, validation_fraction=0.1):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(10)))
    path = tmp_path / "exp.py"
    path.write_text(textwrap.dedent(_EXPERIMENT).format(
        corpus=str(corpus), tokenizer_vocab=tokenizer_vocab, model_vocab=model_vocab, train_seq=train_seq,
        validation_fraction=validation_fraction))
    return str(path)


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case, expected", [
    (dict(model_vocab=300), "model.vocab_size=300 is smaller than TrainTokenizerConfig.vocab_size=512 of tokenizer step "
                            "'tokenizers/mine-bpe' (data step 'tokenized/mine' tokenizes with it): ids >= 300 would be "
                            "clamped into wrong embeddings; set model.vocab_size >= 512"),
    (dict(train_seq=32), "train.seq_len=32 differs from TokenizeConfig.seq_len=64 of data step 'tokenized/mine': set "
                         "train.seq_len=64, or tokenize with seq_len=32"),
    (dict(validation_fraction=0.0), "train.eval_batches=4 declares an evaluation, but the documents behind "
                                    "'tokenized/mine' have validation_fraction=0"),
])
def test_keel_plan_refuses_what_the_data_steps_configs_already_say(tmp_path, capsys, command, case, expected):
    prefix = tmp_path / "outputs"
    assert console_main([command, _experiment(tmp_path, **case), "--prefix", str(prefix)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: train/mine: ") and expected in err, err
    assert not prefix.exists() or not any(prefix.iterdir())  # nothing ran


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Token caches from a 512-token tokenizer, packed at 64: one with a validation split; and, all
    trained on, one of other texts under the same ids (`corpus.jsonl:N` of another folder), one of
    the first one's documents, and one of its texts under other ids (a copy of its file); and the
    other texts again, by a 400-token tokenizer, and by the first tokenizer without eos tokens."""
    root = tmp_path_factory.mktemp("caches")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} talks about topic {i % 11} at length " * 4}) + "\n"
                              for i in range(300)))
    (root / "other").mkdir()
    (root / "other" / "corpus.jsonl").write_text("".join(json.dumps({"text": f"another text {i} on theme {i % 7} " * 4}) + "\n"
                                                 for i in range(300)))
    (root / "corpus0.jsonl").write_text(corpus.read_text())
    ingest_documents(IngestConfig(inputs=(str(corpus),), validation_fraction=0.1, output_path=str(root / "docs")))
    train_tokenizer(TrainTokenizerConfig(documents=str(root / "docs"), vocab_size=512, min_frequency=1,
                                         output_path=str(root / "tok")))
    out = {"with_validation": _tokenize(root, root / "docs", "with_validation")}
    for name, source in (("no_validation", root / "other" / "corpus.jsonl"), ("same_documents", corpus),
                         ("copied_documents", root / "corpus0.jsonl")):
        ingest_documents(IngestConfig(inputs=(str(source),), validation_fraction=0.0, output_path=str(root / f"{name}-docs")))
        out[name] = _tokenize(root, root / f"{name}-docs", name)
    train_tokenizer(TrainTokenizerConfig(documents=str(root / "docs"), vocab_size=400, min_frequency=1,
                                         output_path=str(root / "tok400")))
    tokenize_documents(TokenizeConfig(documents=str(root / "no_validation-docs"), tokenizer=str(root / "tok400"), seq_len=64,
                                      output_path=str(root / "other_tokenizer")))
    out["other_tokenizer"] = str(root / "other_tokenizer")
    tokenize_documents(TokenizeConfig(documents=str(root / "no_validation-docs"), tokenizer=str(root / "tok"), seq_len=64,
                                      add_eos=False, output_path=str(root / "no_eos")))
    out["no_eos"] = str(root / "no_eos")
    return out


def _tokenize(root, documents, name):
    tokenize_documents(TokenizeConfig(documents=str(documents), tokenizer=str(root / "tok"), seq_len=64,
                                      output_path=str(root / name)))
    return str(root / name)


def _config(data, *, vocab=512, seq_len=64, eval_batches=4):
    train = TrainConfig(batch_size=16, seq_len=seq_len, num_steps=5, optimizer=AdamWConfig(lr=1e-3),
                        eval_batches=eval_batches)
    return TrainStepConfig(model=tiny_moe.replace(vocab_size=vocab), data=data, train=train, output_path="/unused")


def test_the_training_step_refuses_caches_that_do_not_fit_before_it_compiles(caches, monkeypatch):
    import keel.mesh.mesh
    from keel.train.step import train_step

    monkeypatch.setattr(keel.mesh.mesh, "build_mesh", lambda *_: pytest.fail("the step got as far as building a mesh"))
    cache = caches["with_validation"]
    with pytest.raises(ValueError, match=rf"the tokenizer of token cache 'data' \({cache}\) makes ids up to 511 but "
                                         r"MoELMConfig.vocab_size=300: ids >= 300 would be clamped into wrong embeddings; "
                                         r"set MoELMConfig.vocab_size >= 512, or train the tokenizer with "
                                         r"TrainTokenizerConfig.vocab_size <= 300"):
        train_step(_config(cache, vocab=300))
    with pytest.raises(ValueError, match=r"TrainConfig.seq_len=32 differs from TokenizeConfig.seq_len=64 of token cache "
                                         r"'data' .*: set TrainConfig.seq_len=64, or tokenize again with "
                                         r"TokenizeConfig.seq_len=32"):
        train_step(_config(cache, seq_len=32))


def test_a_declared_evaluation_with_no_validation_sequences_is_refused(caches, tmp_path):
    import shutil

    from keel.data.cache_files import STATS_FILE
    from keel.spec import Mixture
    from keel.train.step import check_step_config
    from keel.spec import RackTopology

    racks = RackTopology(racks=1, gpus_per_rack=8)
    bare = caches["no_validation"]
    with pytest.raises(ValueError, match=r"TrainConfig.eval_batches=4 declares an evaluation, but no token cache has "
                                         r"validation sequences \('data' has 0 validation sequences from 0 documents\).*"
                                         r"or set TrainConfig.eval_batches=0"):
        check_step_config(_planned(_config(bare), racks), num_devices=8, platform="cpu")
    check_step_config(_planned(_config(bare, eval_batches=0), racks), num_devices=8, platform="cpu")
    # a cache keel did not make (no tokenize.json) is checked for its validation split too
    external = tmp_path / "external"
    shutil.copytree(bare, external)
    (external / STATS_FILE).unlink()
    shutil.rmtree(external / "validation", ignore_errors=True)
    with pytest.raises(ValueError, match=r"no token cache has validation sequences \('data' has no validation split\): "
                                         r"build the cache with a validation split, or set TrainConfig.eval_batches=0"):
        check_step_config(_planned(_config(str(external)), racks), num_devices=8, platform="cpu")
    mixed = Mixture.constant({"a": bare, "b": caches["with_validation"]}, {"a": 0.5, "b": 0.5}, block_size=16)
    check_step_config(_planned(_config(mixed), racks), num_devices=8, platform="cpu")  # one component is enough


def test_caches_of_different_tokenizers_are_refused_even_when_the_model_holds_both_vocabularies(caches):
    """A cache an External names (or a tokenizer given by path) is not in the plan's view: its ids,
    from a 400-token tokenizer, fit the 512-token model and trained beside the 512-token cache's ids,
    one id two texts, with a plausible loss."""
    from keel.spec import Mixture, RackTopology
    from keel.train.step import check_step_config

    racks = RackTopology(racks=1, gpus_per_rack=8)
    mixed = Mixture.constant({"a": caches["with_validation"], "b": caches["other_tokenizer"]}, {"a": 0.5, "b": 0.5},
                             block_size=16)
    with pytest.raises(ValueError, match=r"the run's token caches were tokenized differently \('a' \(.*\): vocabulary "
                                         r"[0-9a-f]{16}, bos id None, eos id \d+; 'b' \(.*other_tokenizer\): "
                                         r"vocabulary .*tokenize every component with one tokenizer"):
        check_step_config(_planned(_config(mixed), racks), num_devices=8, platform="cpu")
    no_eos = Mixture.constant({"a": caches["with_validation"], "b": caches["no_eos"]}, {"a": 0.5, "b": 0.5}, block_size=16)
    with pytest.raises(ValueError, match=r"'b' \(.*no_eos\): vocabulary [0-9a-f]{16}, bos id None, eos id None\)"):
        check_step_config(_planned(_config(no_eos), racks), num_devices=8, platform="cpu")  # one vocabulary, no eos
    same = Mixture.constant({"a": caches["with_validation"], "b": caches["no_validation"]}, {"a": 0.5, "b": 0.5},
                            block_size=16)
    check_step_config(_planned(_config(same), racks), num_devices=8, platform="cpu")  # one tokenizer: fine


@pytest.mark.parametrize("trained", ["same_documents", "copied_documents"])
def test_an_evaluation_on_documents_another_component_trains_on_is_refused(caches, trained):
    """The first set's documents all trained on by a second set: the same file ingested at
    validation_fraction 0 (same ids), or a copy of it under another name (other ids, same texts)."""
    from keel.data import read_index
    from keel.spec import Mixture, RackTopology
    from keel.train.step import check_step_config

    racks = RackTopology(racks=1, gpus_per_rack=8)
    components = {"held": caches["with_validation"], "trained": caches[trained]}
    documents = json.loads((Path(caches["with_validation"]) / "tokenize.json").read_text())["documents"]
    held_out = read_index(documents)["splits"]["validation"]["documents"]  # counted as written, not from the hashes
    assert held_out > 0
    leaky = Mixture.constant(components, {"held": 0.5, "trained": 0.5}, block_size=16)
    with pytest.raises(ValueError, match=rf"{held_out} of the {held_out} validation documents of token cache 'held' "
                                         rf"\(.*docs\), 100.0% of its validation text, are training documents of "
                                         rf"'trained' \(.*{trained}-docs\): its "
                                         r"validation loss would measure memorisation.*give them one "
                                         r"validation_fraction.*remove the shared texts"):
        check_step_config(_planned(_config(leaky), racks), num_devices=8, platform="cpu")
    check_step_config(_planned(_config(leaky, eval_batches=0), racks), num_devices=8, platform="cpu")  # nothing evaluated


def test_an_eval_on_validation_documents_its_run_trained_on_is_refused_before_loading_the_model(caches, tmp_path, capsys):
    """A run records the document sets its drawn components come from (`data.json`); an eval of its
    checkpoint on held-out documents among them would report memorisation as generalisation, as the
    run's own evaluation would (the test above). Its train split, or its own caches' validation
    split, may be evaluated."""
    from defaults import default_eval, default_train
    from keel import External
    from keel.executor.plan import Graph
    from keel.executor.resolve import resolve_config
    from keel.spec import Mixture
    from keel.trained.evaluate import evaluated_caches
    from keel.train.data_checks import RUN_DATA_FILE, record_run_data

    def cache(name):
        return External(name, caches[name], version="1")

    trained = Mixture.constant({"same": cache("same_documents"), "probe": cache("no_validation")},
                               {"same": 1.0, "probe": 0.0}, block_size=16)  # probe: evaluated only, never drawn
    train = TrainConfig(batch_size=16, seq_len=64, num_steps=5, optimizer=AdamWConfig(lr=1e-3), eval_batches=1)
    run = default_train("run", data=trained, model=tiny_moe, train=train)

    def eval_config(split="validation", **data):
        step = default_eval("e", run=run, data={label: cache(name) for label, name in data.items()}, split=split)
        graph = Graph([step], str(tmp_path / "out"))
        return resolve_config(step.config, graph.path(step), graph.path)

    run_output = eval_config(held="with_validation").model.run
    resolved = resolve_config(run.config, run_output, Graph([run], str(tmp_path / "out")).path)
    record_run_data(run_output, None, resolved.data)  # as the training step does
    documents = {name: json.loads((Path(caches[name]) / "tokenize.json").read_text())["documents"] for name in caches}
    assert json.loads(Path(run_output, RUN_DATA_FILE).read_text()) == {
        "tokenizer": None, "trained_documents": [documents["same_documents"]]}
    with pytest.raises(ValueError, match=r"(\d+) of the \1 validation documents of EvalConfig.data\['held'\] \(document "
                                         rf"set {documents['with_validation']}\), 100.0% of its validation text, are "
                                         rf"training documents of run {run_output} \({documents['same_documents']}\): "
                                         r"its validation loss would measure memorisation"):
        evaluated_caches(eval_config(held="with_validation"))
    assert list(evaluated_caches(eval_config(split="train", held="with_validation"))) == ["held"]  # asked for
    assert list(evaluated_caches(eval_config(other="copied_documents", split="train"))) == ["other"]
    Path(run_output, RUN_DATA_FILE).write_text(json.dumps({"tokenizer": None}))  # a run trained before it was recorded
    assert list(evaluated_caches(eval_config(held="with_validation"))) == ["held"]
    assert f"[data] run {run_output} trained before keel recorded its document sets" in capsys.readouterr().out


def test_other_texts_under_the_same_ids_are_not_a_leak(caches):
    """Two folders' `corpus.jsonl` give their documents the same ids: their texts differ, so the
    second set training on every id the first holds out leaks nothing."""
    from keel.spec import Mixture, RackTopology
    from keel.train.step import check_step_config

    mixed = Mixture.constant({"held": caches["with_validation"], "other": caches["no_validation"]},
                             {"held": 0.5, "other": 0.5}, block_size=16)
    check_step_config(_planned(_config(mixed), RackTopology(racks=1, gpus_per_rack=8)), num_devices=8, platform="cpu")


def test_a_few_shared_texts_are_a_warning_and_more_are_refused(tmp_path, capsys):
    """One of ~150 validation texts trained on by another component is under the 1% of validation
    text refused, and is warned of on the console and in the step's record; two are over, whether
    one component or two train on them, and so is one long text. Blank texts and components drawn
    in no phase (evaluated only) count for nothing."""
    from keel.data import iter_documents
    from keel.data.documents import Document, write_documents
    from keel.data.quality import RecordLog
    from keel.executor import step_warnings
    from keel.train.data_checks import check_held_out_documents

    def documents(name, texts, fraction):
        write_documents(str(tmp_path / name), (Document(f"{name}:{i}", t) for i, t in enumerate(texts)),
                        validation_fraction=fraction, shard_bytes=1 << 20, log=RecordLog(), source={}, what=name,
                        near_duplicate_overlap=None)
        return "/cache/" + name, {"documents": str(tmp_path / name)}

    def check(**others):  # every component but `probe` is drawn in some phase
        check_held_out_documents({"held": held, **others}, trained={"held", *others} - {"probe"})

    texts = [f"held out text number {i:04d}" for i in range(1500)]
    texts[next(i for i in range(1500) if split_of(f"held:{i}", 0.1) == "validation")] = " \n "  # a blank one
    held = documents("held", texts, 0.1)
    validation = [d.text for d in iter_documents(held[1]["documents"], "validation")]
    assert 100 < len(validation) < 200 and " \n " in validation  # 1 shared is under 1% of their text, 2 are over
    others = [f"other text {i}" for i in range(200)]
    plain = [t for t in validation if t.strip()]
    # one shared text, its whitespace changed (compared collapsed); a blank text on both sides
    one = documents("one", others + ["  " + plain[0].replace(" ", "\n"), "\t"], 0.0)
    with step_warnings.running(str(tmp_path / "step"), whole_process=False):
        check(other=one)
    message = f"1 of the {len(validation)} validation documents of token cache 'held' (/"
    assert f"[data] warning: {message}" in capsys.readouterr().out
    assert [w for w in step_warnings.read(str(tmp_path / "step")) if message in w]
    two = documents("two", others + plain[:2], 0.0)
    with pytest.raises(ValueError, match=rf"2 of the {len(validation)} validation documents .* are training documents "
                                         r"of 'other' \(.*two\): .*memorisation"):
        check(other=two)
    check(probe=two)  # evaluated, never drawn: it trains on nothing
    with pytest.raises(ValueError, match=r"2 of the .* training documents of 'other'"):
        check(other=two, probe=one, external=("/cache/external", {}))  # a trained cache keel did not tokenize: no set
    another = documents("another", others + plain[1:2], 0.0)
    with pytest.raises(ValueError, match=r"2 of the .* are training documents of 'another' \(.*another\) and 'other' \(.*one\)"):
        check(other=one, another=another)
    # one long text of the validation split is over 1% of its text on its own
    first = next(i for i in range(1500) if split_of(f"long:{i}", 0.1) == "validation")
    longer = [f"held out text number {i:04d}" * (50 if i == first else 1) for i in range(1500)]
    with pytest.raises(ValueError, match=r"1 of the \d+ validation documents of token cache 'long' .*, 2\d\.\d% of its "
                                         r"validation text"):
        check_held_out_documents({"long": documents("long", longer, 0.1), "other": documents("copy", [longer[first]], 0.0)},
                                 trained={"long", "other"})
    # a set written before keel recorded text hashes cannot be checked, and the console says so
    (tmp_path / "two" / "train.texts.npy").unlink()
    check(other=two)
    assert f"[data] document set {two[1]['documents']} was written before keel recorded its texts' hashes" in \
        capsys.readouterr().out


def _planned(config, topology):
    """The resolved run a training step checks before it compiles (train_step resolves it first)."""
    import dataclasses

    from keel.spec.resolved import resolve

    return resolve(dataclasses.replace(config, topology=topology))


def test_keel_plan_refuses_a_mixture_of_differently_tokenized_caches_and_bos_a_tokenizer_lacks():
    from defaults import default_tokenize, default_tokenizer, default_train, ingest
    from keel.spec import Mixture, PlanError
    from keel.spec.checks import check_train_step

    notes, code = ingest("notes", ("/in/notes.jsonl",)), ingest("code", ("/in/code.jsonl",))
    notes_bpe, code_bpe = (default_tokenizer(f"{d.name}-bpe", d, vocab_size=384) for d in (notes, code))
    train = TrainConfig(batch_size=16, seq_len=64, num_steps=5, optimizer=AdamWConfig(lr=1e-3))

    def mixture(**caches):
        return default_train("mix", data=Mixture.constant(caches, dict.fromkeys(caches, 0.5)), model=tiny_moe,
                             train=train).config

    same = {"notes": default_tokenize("n", notes, notes_bpe, seq_len=64), "code": default_tokenize("c", code, notes_bpe, seq_len=64)}
    check_train_step(mixture(**same))  # one tokenizer: the ids mean one thing
    other = default_tokenize("c2", code, code_bpe, seq_len=64)
    with pytest.raises(PlanError, match=r"components were tokenized differently \('notes': tokenizers/documents/notes-bpe, "
                                        r"add_bos=False, add_eos=True; 'code': tokenizers/documents/code-bpe, .*one tokenizer"):
        check_train_step(mixture(notes=same["notes"], code=other))
    with pytest.raises(PlanError, match=r"components were tokenized differently .*add_bos=True"):
        check_train_step(mixture(notes=same["notes"], code=default_tokenize("c3", code, notes_bpe, seq_len=64,
                                                                           add_bos=True)))
    with pytest.raises(PlanError, match=r"components were tokenized differently .*eos_token='<\|pad\|>'"):
        check_train_step(mixture(notes=same["notes"], code=default_tokenize("c4", code, notes_bpe, seq_len=64,
                                                                           eos_token="<|pad|>")))
    no_bos = default_tokenizer("no-bos", notes, vocab_size=384, bos_token=None)
    with pytest.raises(PlanError, match=r"TokenizeConfig.add_bos=True of data step 'tokenized/b', but its tokenizer step "
                                        r"'tokenizers/no-bos' has bos_token=None"):
        check_train_step(default_train("b", data=default_tokenize("b", notes, no_bos, seq_len=64, add_bos=True),
                                       model=tiny_moe, train=train).config)


def test_a_tokenizer_whose_ids_leave_gaps_is_checked_by_its_largest_id(caches, tmp_path):
    """A tokenizer of 512 tokens whose eos sits at id 5000 makes ids the model's 512 rows cannot hold."""
    from keel.train.data_checks import check_token_caches

    root = Path(caches["with_validation"]).parent
    spec = json.loads((root / "tok" / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] == "<|endoftext|>":
            token["id"] = spec["model"]["vocab"][token["content"]] = 5000
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tok" / "tokenizer_config.json").write_text((root / "tok" / "tokenizer_config.json").read_text())
    tokenize_documents(TokenizeConfig(documents=str(root / "docs"), tokenizer=str(tmp_path / "tok"), seq_len=64,
                                      output_path=str(tmp_path / "cache")))
    assert json.loads((tmp_path / "cache" / "tokenize.json").read_text())["vocab_size"] == 5001
    with pytest.raises(ValueError, match=r"makes ids up to 5,000 but MoELMConfig.vocab_size=512"):
        check_token_caches(_config(str(tmp_path / "cache")))


def test_a_data_step_read_where_another_kind_of_output_is_wanted_is_refused_when_declared():
    """A documents step given as training data failed only at run time, on its missing token cache,
    after a plan that called it an External cache; swapped tokenize arguments failed on a missing
    tokenizer.json."""
    from defaults import default_tokenize, default_tokenizer, default_train, ingest
    from keel.data import StdlibCorpusConfig
    from keel import Step

    documents = ingest("corpus", ("corpus.jsonl",))
    tokenizer = default_tokenizer("corpus-bpe", documents, vocab_size=320)
    train = TrainConfig(batch_size=8, num_steps=2, optimizer=AdamWConfig(lr=1e-3))
    with pytest.raises(ValueError, match=r"^data is the step 'documents/corpus', which makes a document set, not a token "
                                         r"cache: give a tokenize step made from it \(`default_tokenize`\)"):
        default_train("t", data=documents, model=tiny_moe, train=train)
    with pytest.raises(ValueError, match=r"data is the step 'tokenizers/corpus-bpe', which makes a tokenizer"):
        default_train("t", data=tokenizer, model=tiny_moe, train=train)
    with pytest.raises(ValueError, match=r"^TokenizeConfig.documents is the step 'tokenizers/corpus-bpe', which makes a "
                                         r"tokenizer, not a document set"):
        default_tokenize("x", tokenizer, documents, seq_len=64)
    stdlib = Step("documents/stdlib", print, StdlibCorpusConfig(max_files=3))
    with pytest.raises(ValueError, match=r"^TokenizeConfig.tokenizer is the step 'documents/stdlib', which makes a "
                                         r"document set, not a tokenizer"):
        TokenizeConfig(documents=documents, tokenizer=stdlib)
    cache = default_tokenize("x", documents, tokenizer, seq_len=64)  # in order: declared
    assert default_train("t", data=cache, model=tiny_moe, train=train).config.data.components["data"] is cache


def test_a_run_that_draws_more_sequences_than_a_cache_holds_warns_with_the_passes(caches, capsys):
    """Levanter's datasets wrap around: 16 passes over 10 training sequences trained without a word."""
    from keel.train.data_checks import check_token_caches

    cache = caches["with_validation"]
    held = json.loads((Path(cache) / "tokenize.json").read_text())["splits"]["train"]["sequences"]
    config = _config(cache)
    steps = -(-3 * held // config.train.batch_size)  # about three passes
    check_token_caches(dataclasses.replace(config, train=dataclasses.replace(config.train, num_steps=steps)))
    drawn = steps * config.train.batch_size
    assert (f"[data] warning: token cache 'data' ({cache}) holds {held:,} training sequences and the run draws about "
            f"{drawn:,} from it: {drawn / held:.1f} passes over the same data") in capsys.readouterr().out
    check_token_caches(dataclasses.replace(config, train=dataclasses.replace(config.train, num_steps=held // 16)))
    assert "passes over the same data" not in capsys.readouterr().out  # one pass or less: nothing to say
