"""Cross-step checks before compute: a tokenizer larger than the model's vocabulary, a cache packed
at another sequence length, or a declared evaluation with no validation data is refused by
`keel plan` where the data steps' configs say it, and by the training step before it compiles."""

import json
import textwrap
from pathlib import Path

import pytest

from defaults.models import tiny_moe
from keel.cli import console_main
from keel.data import ingest_documents, IngestConfig, tokenize_documents, train_tokenizer
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
    """Token caches from a 512-token tokenizer, packed at 64: one with a validation split, one of other
    documents without, and one of the first one's documents without."""
    root = tmp_path_factory.mktemp("caches")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} talks about topic {i % 11} at length " * 4}) + "\n"
                              for i in range(300)))
    ingest_documents(IngestConfig(inputs=(str(corpus),), validation_fraction=0.1, output_path=str(root / "docs")))
    train_tokenizer(TrainTokenizerConfig(documents=str(root / "docs"), vocab_size=512, min_frequency=1,
                                         output_path=str(root / "tok")))
    out = {}
    for name, docs in (("with_validation", root / "docs"), ("no_validation", root / "docs0"), ("same_documents", root / "same")):
        if name == "no_validation":  # other documents: the same texts from another file, so other ids
            (root / "corpus0.jsonl").write_text(corpus.read_text())
            ingest_documents(IngestConfig(inputs=(str(root / "corpus0.jsonl"),), validation_fraction=0.0,
                                          output_path=str(docs)))
        if name == "same_documents":  # with_validation's documents, all of them trained on
            ingest_documents(IngestConfig(inputs=(str(corpus),), validation_fraction=0.0, output_path=str(docs)))
        tokenize_documents(TokenizeConfig(documents=str(docs), tokenizer=str(root / "tok"), seq_len=64,
                                          output_path=str(root / name)))
        out[name] = str(root / name)
    return out


def _config(data, *, vocab=512, seq_len=64, eval_batches=4):
    train = TrainConfig(batch_size=16, seq_len=seq_len, num_steps=5, optimizer=AdamWConfig(lr=1e-3),
                        eval_batches=eval_batches)
    return TrainStepConfig(model=tiny_moe.replace(vocab_size=vocab), data=data, train=train, output_path="/unused")


def test_the_training_step_refuses_caches_that_do_not_fit_before_it_compiles(caches, monkeypatch):
    import keel.mesh.mesh
    from keel.train.step import train_step

    monkeypatch.setattr(keel.mesh.mesh, "build_mesh", lambda *_: pytest.fail("the step got as far as building a mesh"))
    cache = caches["with_validation"]
    with pytest.raises(ValueError, match=rf"the tokenizer of token cache 'data' \({cache}\) has 512 tokens but "
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


def test_an_evaluation_on_documents_another_component_trains_on_is_refused(caches):
    """The same documents ingested at validation_fraction 0.1 and 0: the first set's validation
    documents are all training documents of the second."""
    from keel.data import read_index
    from keel.spec import Mixture, RackTopology
    from keel.train.step import check_step_config

    racks = RackTopology(racks=1, gpus_per_rack=8)
    components = {"held": caches["with_validation"], "trained": caches["same_documents"]}
    documents = json.loads((Path(caches["with_validation"]) / "tokenize.json").read_text())["documents"]
    held_out = read_index(documents)["splits"]["validation"]["documents"]  # counted as written, not from the ids
    assert held_out > 0
    leaky = Mixture.constant(components, {"held": 0.5, "trained": 0.5}, block_size=16)
    with pytest.raises(ValueError, match=rf"{held_out} of the {held_out} validation documents of token cache 'held' "
                                         r"\(.*docs\) are training documents of 'trained' \(.*same\): its validation "
                                         r"loss would measure memorisation.*give both document sets one "
                                         r"validation_fraction"):
        check_step_config(_planned(_config(leaky), racks), num_devices=8, platform="cpu")
    check_step_config(_planned(_config(leaky, eval_batches=0), racks), num_devices=8, platform="cpu")  # nothing evaluated


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
