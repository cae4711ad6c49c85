"""The tokenizer step: a byte-level BPE that round-trips text, deterministic, readable by Levanter."""

import json
import re

import pytest

from keel.data import (
    build_stdlib_corpus,
    ingest_documents,
    IngestConfig,
    iter_documents,
    load_tokenizer,
    split_of,
    StdlibCorpusConfig,
    train_tokenizer,
)
from keel.spec import TrainTokenizerConfig


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus"))
    build_stdlib_corpus(StdlibCorpusConfig(max_bytes=300_000, validation_fraction=0.2, output_path=path))
    return path


def _train(path, corpus, **kwargs):
    train_tokenizer(TrainTokenizerConfig(documents=corpus, output_path=str(path), **kwargs))
    return str(path)


def test_tokenizer_round_trips_text_and_names_its_special_tokens(tmp_path, corpus):
    tok_dir = _train(tmp_path / "tok", corpus, vocab_size=512)
    loaded = load_tokenizer(tok_dir)

    assert loaded.vocab_size == 512
    assert (loaded.eos_id, loaded.bos_id, loaded.pad_id) == (0, 1, 2)
    samples = [d.text for d in iter_documents(corpus, "validation")]
    samples += ["unicode: ünïcödé ✓ 日本語 \U0001f600", "\ttabs  and   spaces\r\n", "<|endoftext|> stays text"]
    for text in samples:
        ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
        assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == text
    code = "".join(d.text for d in iter_documents(corpus, "validation"))
    assert len(loaded.tokenizer.encode(code).ids) < 0.6 * len(code.encode())  # it learned merges


def test_tokenizer_training_is_deterministic_and_uses_only_the_train_split(tmp_path, corpus):
    a = _train(tmp_path / "a", corpus, vocab_size=512)
    b = _train(tmp_path / "b", corpus, vocab_size=512)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()

    # train-split documents repeat one word, validation-split documents another: only the first is learned
    lines = []
    for line in range(1, 201):
        word = "zqxjvk" if split_of(f"docs.jsonl:{line}", 0.5) == "train" else "pwgfby"
        lines.append(json.dumps({"text": " ".join([word] * 50)}) + "\n")
    (tmp_path / "docs.jsonl").write_text("".join(lines))
    ingest_documents(IngestConfig(inputs=(str(tmp_path / "docs.jsonl"),), validation_fraction=0.5,
                                  output_path=str(tmp_path / "docs")))
    c = load_tokenizer(_train(tmp_path / "c", str(tmp_path / "docs"), vocab_size=300, min_frequency=1))
    assert len(c.tokenizer.encode(" zqxjvk").ids) == 1
    assert len(c.tokenizer.encode(" pwgfby").ids) > 1
    assert load_tokenizer(a).tokenizer.to_str() == load_tokenizer(b).tokenizer.to_str()


def test_max_training_bytes_caps_the_text_even_inside_the_first_document(tmp_path):
    """The document that reaches the cap is cut there, on a character boundary: a large first document
    went to the trainer whole."""
    from keel.data.summary import read_summary

    first = {"text": "zqxjvk é " * 2000}  # 20 kB, two-byte characters: a cut can fall inside one
    rest = [{"text": " ".join(["pwgfby"] * 50)} for _ in range(20)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [first, *rest]))
    ingest_documents(IngestConfig(inputs=(str(tmp_path / "docs.jsonl"),), validation_fraction=0.0,
                                  output_path=str(tmp_path / "docs")))
    for cap in (1001, 1000):  # 1,000 bytes end inside an "é"
        tok = _train(tmp_path / f"tok{cap}", str(tmp_path / "docs"), vocab_size=300, min_frequency=1,
                     max_training_bytes=cap)
        summary = read_summary(tok)
        assert summary["documents"] == 1 and cap - 1 <= summary["bytes"] <= cap, summary
        assert len(load_tokenizer(tok).tokenizer.encode(" pwgfby").ids) > 1  # the text past the cap was not read
        assert "raise max_training_bytes, which stopped it" in summary["warnings"][0]  # not merely "more text"


def test_a_tokenizer_json_path_with_explicit_special_tokens(tmp_path, corpus):
    _train(tmp_path / "tok", corpus, vocab_size=400, bos_token=None, pad_token=None)
    path = str(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()

    bare = load_tokenizer(path)
    assert (bare.bos_id, bare.eos_id, bare.pad_id) == (None, None, None)
    assert load_tokenizer(path, eos_token="<|endoftext|>").eos_id == 0
    with pytest.raises(ValueError, match="has no token '<missing>'"):
        load_tokenizer(path, eos_token="<missing>")


def test_levanter_loads_the_tokenizer_directory(tmp_path, corpus):
    from levanter.tokenizers import load_tokenizer as levanter_load

    tok_dir = _train(tmp_path / "tok", corpus, vocab_size=512)
    levanter_tok = levanter_load(tok_dir)
    ours = load_tokenizer(tok_dir)
    assert (levanter_tok.eos_token_id, levanter_tok.bos_token_id, levanter_tok.vocab_size) == (ours.eos_id, ours.bos_id, 512)
    text = "def f(x):\n    return x + 1\n"
    assert list(levanter_tok.encode(text, add_special_tokens=False)) == ours.tokenizer.encode(text).ids


def test_bad_tokenizer_declarations():
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        TrainTokenizerConfig(documents="x", vocab_size=100)
    with pytest.raises(ValueError, match="must differ"):
        TrainTokenizerConfig(documents="x", bos_token="<|endoftext|>")


@pytest.mark.parametrize("ref", ["/no/such/tokenizer", "./tok", "runs/bpe/tokenizer", "my-tokenizer.json"])
def test_a_tokenizer_path_that_is_missing_says_so_and_not_that_the_hub_has_no_such_repo(ref):
    """A typo in a local path was sent to the hub, which answered that repo ids look like 'org/name'."""
    from keel.data.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError, match=rf"no tokenizer.json at '{re.escape(ref)}'.*TokenizeConfig.tokenizer"):
        load_tokenizer(ref)


def test_a_file_that_is_not_a_tokenizer_names_itself_and_the_field(tmp_path):
    """A vocab.json given as the tokenizer raised the Rust parser's bare "expected ',' or '}'"."""
    from keel.data.tokenizer import load_tokenizer

    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 1}')
    with pytest.raises(ValueError, match=rf"{re.escape(str(vocab))} is not a Hugging Face tokenizers file \(.*\): give "
                                         r"the tokenizer's folder or its tokenizer.json \(TokenizeConfig.tokenizer\)"):
        load_tokenizer(str(vocab))


@pytest.mark.parametrize("ref, config", [
    ("memory://tok.json", "memory://tokenizer_config.json"),  # a store's root: was memory:/..., a local path
    ("gs://bucket/tok.json", "gs://bucket/tokenizer_config.json"),
    ("gs://bucket/d/tok.json", "gs://bucket/d/tokenizer_config.json"),
    ("tok.json", "./tokenizer_config.json"),
    ("/a/tok.json", "/a/tokenizer_config.json"),
    ("dir", "dir/tokenizer_config.json"),
])
def test_a_tokenizers_config_is_read_beside_its_file_on_every_store(ref, config):
    from keel.spec.data import tokenizer_files

    assert tokenizer_files(ref)[1] == config
