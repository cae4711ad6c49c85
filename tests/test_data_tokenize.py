"""The tokenize step: packed sequences with segment ids in Levanter caches that Levanter reads,
identical across runs and after a kill."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from keel.data import (
    build_stdlib_corpus,
    iter_documents,
    load_token_cache,
    load_tokenizer,
    StdlibCorpusConfig,
    tokenize_documents,
    train_tokenizer,
)
from keel.spec import TokenizeConfig, TrainTokenizerConfig
from keel.data.packing import SequencePacker
from keel.executor import storage

SEQ_LEN = 64
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    corpus, tok = str(root / "corpus"), str(root / "tok")
    build_stdlib_corpus(StdlibCorpusConfig(max_bytes=250_000, validation_fraction=0.1, output_path=corpus))
    train_tokenizer(TrainTokenizerConfig(documents=corpus, vocab_size=512, output_path=tok))
    return corpus, tok


def _tokenize(output, inputs, seq_len=SEQ_LEN, **kwargs):
    corpus, tok = inputs
    tokenize_documents(TokenizeConfig(documents=corpus, tokenizer=tok, seq_len=seq_len, output_path=str(output), **kwargs))
    return str(output)


@pytest.fixture(scope="module")
def cache(inputs, tmp_path_factory):
    return _tokenize(tmp_path_factory.mktemp("cache") / "out", inputs)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_packer_counts_segments_per_sequence_and_drops_the_tail():
    packer = SequencePacker(4)
    ids, segs = packer.add([np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8]), np.array([9])])
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert segs.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]
    ids, segs = packer.add([np.array([10, 11]), np.array([12])])
    assert ids.tolist() == [[9, 10, 11, 12]] and segs.tolist() == [[0, 1, 1, 2]]
    assert packer.add([np.array([13])])[0].shape == (0, 4) and packer.leftover_tokens == 1


@pytest.mark.parametrize("split", ["train", "validation"])
def test_cache_holds_every_document_packed_with_segment_ids(cache, inputs, split):
    corpus, tok = inputs
    loaded = load_tokenizer(tok)
    loaded.tokenizer.encode_special_tokens = True
    docs = [loaded.tokenizer.encode(d.text).ids + [loaded.eos_id] for d in iter_documents(corpus, split)]
    stream = np.concatenate(docs)
    doc_of_token = np.repeat(np.arange(len(docs)), [len(d) for d in docs])

    records = list(load_token_cache(cache, split, seq_len=SEQ_LEN))
    stats = storage.read_json(f"{cache}/tokenize.json")["splits"][split]

    n = len(records)
    assert n == stats["sequences"] == len(stream) // SEQ_LEN > 0
    assert stats["tokens"] == len(stream) and stats["dropped_tokens"] == len(stream) - n * SEQ_LEN
    assert stats["documents"] == len(docs)
    input_ids = np.stack([r["input_ids"] for r in records])
    segment_ids = np.stack([r["segment_ids"] for r in records])
    assert input_ids.dtype == np.int32 and input_ids.shape == (n, SEQ_LEN)
    assert np.array_equal(input_ids.ravel(), stream[: n * SEQ_LEN])
    rows = doc_of_token[: n * SEQ_LEN].reshape(n, SEQ_LEN)
    assert np.array_equal(segment_ids, rows - rows[:, :1])


def test_levanter_dataset_classes_read_the_cache(cache, inputs):
    import jax
    from haliax import Axis
    from levanter.data.text.datasets import DatasetComponent, LmDataConfig
    from levanter.data.text.formats import PrebuiltLmDatasetFormat
    from levanter.schedule import BatchSchedule

    _, tok = inputs
    config = LmDataConfig(
        tokenizer=tok,
        cache_dir=None,
        auto_build_caches=False,
        shuffle=False,
        components={"stdlib": DatasetComponent(cache_dir=cache, format=PrebuiltLmDatasetFormat())},
    )
    Pos = Axis("position", SEQ_LEN)
    train = config.train_mixture(Pos, BatchSchedule(4), key=jax.random.PRNGKey(0))
    validation = config.validation_sets(Pos)["stdlib"]

    ours = load_token_cache(cache, "train", seq_len=SEQ_LEN)
    first = train.as_sync_dataset()[0]
    match = [i for i in range(len(ours)) if np.array_equal(ours[i]["input_ids"], np.asarray(first.tokens))]
    assert match, "Levanter's training mixture served a sequence that is not in the cache"
    # Levanter derives segments from eos; they agree with the stored segment ids
    assert np.array_equal(np.asarray(first.attn_mask.segment_ids[0]), ours[match[0]]["segment_ids"])
    assert len(validation.as_sync_dataset()) == len(load_token_cache(cache, "validation", seq_len=SEQ_LEN))


def test_a_levanter_cache_of_input_ids_only_is_refused_naming_what_it_lacks(tmp_path):
    """Levanter's own LM caches hold `input_ids` alone: read as keel's, they failed 20 frames deep on
    a missing segment_ids/offsets file."""
    from levanter.store.cache import SerialCacheWriter

    with SerialCacheWriter(str(tmp_path / "ext" / "train"), {"input_ids": np.zeros((0,), np.int32)}) as writer:
        writer.write_batch({"input_ids": np.arange(32, dtype=np.int32).reshape(4, 8)})
    with pytest.raises(ValueError, match=r"token cache .*ext/train has no segment_ids: keel trains on packed sequences "
                                         r"with input_ids and segment_ids .*defaults.default_tokenize"):
        load_token_cache(str(tmp_path / "ext"), "train", seq_len=8)


def test_a_split_whose_last_partial_sequence_holds_much_of_it_is_warned_of(cache, inputs, tmp_path, capsys):
    """The tokens of a split's last, partial sequence are left out of its cache: the console line
    says how many, and a share over `LEFT_OUT_WARNS` is a warning of the step (here a validation
    split of 1.5 sequences loses a third of its tokens; it counted them as if tokenized)."""
    from keel.data.summary import read_summary
    from keel.data.tokenize import LEFT_OUT_WARNS

    validation = storage.read_json(f"{cache}/tokenize.json")["splits"]["validation"]["tokens"]
    seq_len = validation * 2 // 3
    capsys.readouterr()
    out = _tokenize(tmp_path / "long", inputs, seq_len=seq_len)
    splits = storage.read_json(f"{out}/tokenize.json")["splits"]
    left = splits["validation"]["dropped_tokens"]
    assert splits["validation"]["sequences"] == 1 and left / splits["validation"]["tokens"] > LEFT_OUT_WARNS
    printed = capsys.readouterr().out
    assert f"validation 1 sequences ({validation:,} tokens from" in printed
    assert f"; the last {left:,} left out, short of a sequence)" in printed
    warnings = [f"the {split} split's last {s['dropped_tokens']:,} tokens ({s['dropped_tokens'] / s['tokens']:.0%} of "
                f"them) do not fill a {seq_len}-token sequence and are left out of its cache: give it more documents "
                "or a shorter seq_len" for split, s in splits.items() if s["dropped_tokens"] > LEFT_OUT_WARNS * s["tokens"]]
    assert any(w.startswith(f"the validation split's last {left:,} tokens") for w in warnings)
    assert read_summary(out)["warnings"] == warnings and all(f"\n  {w}" in printed for w in warnings)


def test_two_runs_write_identical_caches(cache, inputs, tmp_path):
    again = _tokenize(tmp_path / "again", inputs, batch_documents=7)  # batch size is execution-only
    assert _files(Path(again)) == _files(Path(cache))


def test_truncation_or_padding_saved_in_the_tokenizer_file_changes_nothing(cache, inputs, tmp_path):
    """A published tokenizer.json may carry truncation or padding: the cache holds whole documents,
    whatever the file says and however many documents an encode batch holds."""
    from tokenizers import Tokenizer

    corpus, tok = inputs
    for setting, configure in (("truncation", lambda t: t.enable_truncation(8)),
                               ("padding", lambda t: t.enable_padding(pad_id=0, pad_token=t.id_to_token(0)))):
        saved = tmp_path / setting
        shutil.copytree(tok, saved)
        tokenizer = Tokenizer.from_file(str(saved / "tokenizer.json"))
        configure(tokenizer)
        tokenizer.save(str(saved / "tokenizer.json"))
        out = _tokenize(tmp_path / f"{setting}-out", (corpus, str(saved)), batch_documents=64)
        assert _files(Path(out)) == _files(Path(cache)), setting


def test_a_special_token_inside_a_document_is_text(tmp_path):
    from keel.data import IngestConfig, ingest_documents

    (tmp_path / "d.jsonl").write_text('{"text": "before <|endoftext|> after"}\n' * 40)
    ingest_documents(IngestConfig(inputs=(str(tmp_path / "d.jsonl"),), validation_fraction=0.0,
                                  output_path=str(tmp_path / "docs")))
    train_tokenizer(TrainTokenizerConfig(documents=str(tmp_path / "docs"), vocab_size=300, output_path=str(tmp_path / "tok")))
    tokenize_documents(TokenizeConfig(documents=str(tmp_path / "docs"), tokenizer=str(tmp_path / "tok"), seq_len=16,
                                      output_path=str(tmp_path / "cache")))
    tokens = np.concatenate([r["input_ids"] for r in load_token_cache(str(tmp_path / "cache"), "train", seq_len=16)])
    stats = storage.read_json(str(tmp_path / "cache" / "tokenize.json"))
    assert (tokens == stats["eos_id"]).sum() <= 40  # one eos per document, none from the text


_KILLED_RUN = textwrap.dedent(
    """
    import sys, time
    from levanter.store.cache import SerialCacheWriter
    from keel.data import tokenize, tokenize_documents
    from keel.spec import TokenizeConfig

    original = SerialCacheWriter.write_batch
    def write_then_stall(self, batch):  # the first batch of sequences reaches the disk, then the kill comes
        original(self, batch)
        print("WRITTEN", len(batch["input_ids"]), flush=True)
        time.sleep(600)
    SerialCacheWriter.write_batch = write_then_stall
    corpus, tok, out, seq_len = sys.argv[1:]
    tokenize.WRITE_TOKENS = 1024 * int(seq_len)  # groups of 1024 sequences: this small corpus fills several
    tokenize_documents(TokenizeConfig(documents=corpus, tokenizer=tok, seq_len=int(seq_len), output_path=out))
    """
)


@pytest.mark.slow
def test_a_killed_run_leaves_no_complete_cache_and_a_rerun_matches_a_clean_run(inputs, tmp_path):
    corpus, tok = inputs
    seq_len = 16  # enough sequences for several write batches: the kill lands after the first
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, corpus, tok, str(out), str(seq_len)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().split() == ["WRITTEN", "1024"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    assert any((out / "train" / "input_ids" / "data").rglob("c/*")), "the kill should land with part of the cache written"
    assert not (out / "tokenize.json").exists() and not (out / "train" / "shard_ledger.json").exists()
    with pytest.raises(FileNotFoundError):
        load_token_cache(str(out), "train", seq_len=seq_len)

    _tokenize(out, inputs, seq_len=seq_len)
    clean = _tokenize(tmp_path / "clean", inputs, seq_len=seq_len)
    assert _files(out) == _files(Path(clean))
    assert storage.read_json(f"{clean}/tokenize.json")["splits"]["train"]["sequences"] > 2 * 1024


def test_bad_tokenize_declarations(inputs, tmp_path):
    corpus, tok = inputs
    with pytest.raises(ValueError, match="seq_len must be positive"):
        TokenizeConfig(documents=corpus, tokenizer=tok, seq_len=0)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(Path(tok, "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="names no eos token: set TokenizeConfig.eos_token"):
        _tokenize(tmp_path / "out", (corpus, str(tmp_path / "tok")))
    with pytest.raises(FileNotFoundError, match="no keel document set"):
        _tokenize(tmp_path / "out", (str(tmp_path), tok))


def test_an_error_mid_way_stops_the_pipeline_threads_and_leaves_no_complete_cache(inputs, tmp_path, monkeypatch):
    import threading

    from keel.data import tokenize as module

    real_batches = module._document_batches

    def batches_then_fail(urls, batch_documents):
        for i, batch in enumerate(real_batches(urls, batch_documents)):
            if i == 3:
                raise OSError("the shard store went away")
            yield batch

    monkeypatch.setattr(module, "_document_batches", batches_then_fail)
    with pytest.raises(OSError, match="the shard store went away"):
        _tokenize(tmp_path / "out", inputs, seq_len=16, batch_documents=2)
    assert not (tmp_path / "out" / "train" / "shard_ledger.json").exists()
    assert not (tmp_path / "out" / "tokenize.json").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("keel-tokenize")]


@pytest.mark.parametrize("setting", [None, "true"])
def test_two_tokenize_steps_overlapping_in_one_launcher_leave_the_setting_as_it_was(monkeypatch, setting):
    """The first to end restored what it saw before, the other then what it saw: "false", the
    first's; `tokenizers` stayed serial for the rest of the launcher's life."""
    from keel.data.tokenize import PARALLELISM, serial_tokenizer

    if setting is None:
        monkeypatch.delenv(PARALLELISM, raising=False)
    else:
        monkeypatch.setenv(PARALLELISM, setting)
    first, second = serial_tokenizer(), serial_tokenizer()
    first.__enter__()
    second.__enter__()
    assert os.environ[PARALLELISM] == "false"
    first.__exit__(None, None, None)
    assert os.environ[PARALLELISM] == "false"  # the second still encodes
    second.__exit__(None, None, None)
    assert os.environ.get(PARALLELISM) == setting


@pytest.mark.parametrize("setting", [None, "true"])
def test_batches_encode_with_the_tokenizers_threads_off_and_the_setting_comes_back(inputs, tmp_path, monkeypatch, setting):
    """The step's threads parallelise over batches; `tokenizers` must not also spread each batch
    over every core (two thread pools on the same cores only contend), and whatever the process
    had set before is back afterwards, after a failure too."""
    from keel.data import tokenize as module

    if setting is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", setting)
    seen = set()
    real_encoder = module._encoder

    def recording_encoder(config, loaded):
        encode = real_encoder(config, loaded)

        def encode_and_record(texts):
            seen.add(os.environ.get("TOKENIZERS_PARALLELISM"))
            return encode(texts)

        return encode_and_record

    monkeypatch.setattr(module, "_encoder", recording_encoder)
    _tokenize(tmp_path / "out", inputs, seq_len=16, batch_documents=2)
    assert seen == {"false"}
    assert os.environ.get("TOKENIZERS_PARALLELISM") == setting

    monkeypatch.setattr(module, "_encoder", lambda config, loaded: lambda texts: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _tokenize(tmp_path / "failed", inputs, seq_len=16, batch_documents=2)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == setting


_KILLED_GRAPH = textwrap.dedent(
    """
    import sys, time
    from levanter.store.cache import SerialCacheWriter
    from defaults import default_tokenize, default_tokenizer, stdlib_corpus
    from keel.executor.run import run_steps

    original = SerialCacheWriter.write_batch
    def write_then_stall(self, batch):
        original(self, batch)
        print("WRITTEN", flush=True)
        time.sleep(600)
    SerialCacheWriter.write_batch = write_then_stall
    corpus = stdlib_corpus(max_bytes=250_000, validation_fraction=0.1)
    cache = default_tokenize("stdlib", corpus, default_tokenizer("bpe", corpus, vocab_size=512), seq_len=16)
    run_steps([cache], prefix=sys.argv[1], lease_timeout=2.0, echo=lambda _: None)
    """
)


@pytest.mark.slow
def test_a_killed_tokenize_step_is_not_cached_and_the_executor_reruns_it(tmp_path):
    from defaults import default_tokenize, default_tokenizer, stdlib_corpus
    from keel.executor.run import run_steps
    from keel.executor.status import SUCCESS, read_status

    prefix = str(tmp_path / "outputs")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_GRAPH, prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=REPO, text=True, start_new_session=True)
    try:
        assert any(line.strip() == "WRITTEN" for line in iter(proc.stdout.readline, ""))  # after the data steps' lines
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (tokenized,) = (tmp_path / "outputs" / "tokenized").iterdir()
    assert read_status(str(tokenized)).state != SUCCESS

    corpus = stdlib_corpus(max_bytes=250_000, validation_fraction=0.1)  # the same declaration, in this process
    cache = default_tokenize("stdlib", corpus, default_tokenizer("bpe", corpus, vocab_size=512), seq_len=16)
    report = run_steps([cache], prefix=prefix, lease_timeout=2.0, echo=lambda _: None)
    assert report.ok and report.ran == ["tokenized/stdlib"]
    assert read_status(str(tokenized)).state == SUCCESS
    assert len(load_token_cache(str(tokenized), "train", seq_len=16)) > 1024


_MIXED = "abc déjà vu straße 日本語の文字 😀🚀 e\u0301 <|endoftext|> \n"


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory):
    """Documents of mostly non-ASCII text and a byte-level BPE of a few merges: most characters span tokens."""
    import json
    import random

    from keel.data import IngestConfig, ingest_documents

    root = tmp_path_factory.mktemp("mixed")
    rng = random.Random(0)
    lines = [json.dumps({"text": "".join(rng.choice(_MIXED) for _ in range(rng.randint(1, 400)))}) for _ in range(120)]
    (root / "d.jsonl").write_text("\n".join(lines) + "\n")
    ingest_documents(IngestConfig(inputs=(str(root / "d.jsonl"),), validation_fraction=0.2, output_path=str(root / "docs")))
    train_tokenizer(TrainTokenizerConfig(documents=str(root / "docs"), vocab_size=262, output_path=str(root / "tok")))
    return str(root / "docs"), str(root / "tok")


def test_the_fast_encode_call_gives_the_ids_of_the_offset_computing_calls(inputs, mixed_inputs):
    for corpus, tok in (inputs, mixed_inputs):
        tokenizer = load_tokenizer(tok).tokenizer
        tokenizer.encode_special_tokens = True  # as the step sets it
        texts = [d.text for d in iter_documents(corpus, "train")][:8] + [_MIXED, "", "<|endoftext|>"]
        fast = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        assert fast == [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        assert fast == [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def _predicted(segments) -> np.ndarray:
    """The loss's targets, spelled out here: a token after one of its own (non-padding) document in its row."""
    segments = np.asarray(segments)
    return np.concatenate([np.zeros((len(segments), 1), bool),
                           (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)], axis=1)


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet: the character each byte is spelled with in a byte-level vocabulary."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    codes = [*printable, *(b for b in range(256) if b not in printable)]
    return {chr(c if c in printable else 256 + i - len(printable)): c for i, c in enumerate(codes)}


def _raw_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level token's bytes, read off GPT-2's byte alphabet (special tokens: none)."""
    if token_id in tokenizer.get_added_tokens_decoder():
        return b""
    return bytes(_byte_alphabet()[c] for c in tokenizer.id_to_token(token_id))


@pytest.mark.parametrize("seq_len", [7, 64])
def test_byte_counts_are_the_bytes_of_the_tokens_the_loss_predicts(mixed_inputs, tmp_path, seq_len):
    """Each sequence's count covers exactly its targets, every byte once: a row's first token and each
    document's first are context, and a character cut by a row's end counts its bytes, not U+FFFD's."""
    from keel.data.datasets import read_sequence_bytes

    out = _tokenize(tmp_path / "out", mixed_inputs, seq_len=seq_len, add_bos=True)  # bos and eos: bytes none
    tokenizer = load_tokenizer(mixed_inputs[1]).tokenizer
    stats = storage.read_json(f"{out}/tokenize.json")["splits"]
    token_sizes = np.array([len(_raw_bytes(tokenizer, i)) for i in range(tokenizer.get_vocab_size())])
    for split in ("train", "validation"):
        records = load_token_cache(out, split, seq_len=seq_len).as_sync_dataset()
        rows = records.get_batch(list(range(len(records))))
        ids, segments = (np.stack([r[field] for r in rows]) for field in ("input_ids", "segment_ids"))
        sizes = token_sizes[ids]
        predicted = _predicted(segments)
        assert read_sequence_bytes(out, split).tolist() == np.where(predicted, sizes, 0).sum(axis=1).tolist()
        assert stats[split]["bytes"] == sizes[predicted].sum() < sizes.sum()


def test_a_cut_character_counts_its_bytes_not_replacement_characters(inputs):
    from keel.data.tokenizer import SequenceBytes

    tokenizer = load_tokenizer(inputs[1]).tokenizer  # ASCII-trained: each CJK character is 3 byte tokens
    text = "".join(chr(c) for c in np.random.default_rng(0).integers(0x4E00, 0x4E00 + 3000, 700))
    ids = np.array(tokenizer.encode(text, add_special_tokens=False).ids[: 16 * 128]).reshape(16, 128)
    assert SequenceBytes(tokenizer)(ids, np.zeros_like(ids)).tolist() == [127] * 16  # all but the first byte


def test_the_decoded_counts_are_the_table_counts_without_replacement_characters(inputs, mixed_inputs):
    from tokenizers import decoders

    from keel.data.tokenizer import SequenceBytes

    rng = np.random.default_rng(0)
    for _, tok in (inputs, mixed_inputs):
        table = SequenceBytes(load_tokenizer(tok).tokenizer)
        other = load_tokenizer(tok).tokenizer
        other.decoder = decoders.Sequence([decoders.ByteLevel()])  # not a plain ByteLevel decoder: decoded
        decoding = SequenceBytes(other)
        assert not table.decodes and decoding.decodes
        vocab = table.tokenizer.get_vocab_size()
        whole = [i for i in range(vocab) if _raw_bytes(table.tokenizer, i).decode("utf-8", errors="replace") != ""
                 and "\ufffd" not in _raw_bytes(table.tokenizer, i).decode("utf-8", errors="replace")]
        segments = np.sort(rng.integers(0, 3, size=(50, 32)), axis=1)  # up to three documents a row
        ids = rng.choice(whole, size=(50, 32))
        assert np.array_equal(decoding(ids, segments), table(ids, segments))
        text = "".join(rng.choice(list(_MIXED.replace("<|endoftext|>", "")), size=5000))
        ids = np.array(table.tokenizer.encode(text, add_special_tokens=False).ids[: 50 * 32]).reshape(50, 32)
        runs = (np.diff(segments, axis=1) != 0).sum(axis=1) + 1  # characters cut by rows and documents:
        assert (np.abs(decoding(ids, segments) - table(ids, segments)) <= 3 * (runs + 1)).all()  # a few bytes


def _byte_fallback_tokenizer():
    """A Llama-style tokenizer, built by hand: SentencePiece's `▁` for spaces, a few letters and
    merges, and byte fallback, so every other character is one `<0xNN>` token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in [*"▁abcdefghijklmnopqrstuvwxyz,.é", "▁a", "ab"]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def test_decoded_counts_of_a_byte_fallback_tokenizer_are_the_predicted_tokens_bytes():
    """Rows packed as the step packs them (bos, a document, eos), cutting characters made of byte
    tokens at either end, count exactly the bytes their predicted tokens hold: each byte token one,
    each piece its UTF-8 (`▁` a space, but not the one SentencePiece puts before a document's first
    word, which its text lacks), special tokens none."""
    from keel.data.tokenizer import SequenceBytes

    tokenizer = _byte_fallback_tokenizer()
    rng = np.random.default_rng(0)
    alphabet = [*"abcdefghij klmnop qrstuv wxyz ,.\n", "é", "ü", "€", "中", "文", "😀", "ß", "ñ"]
    texts = ["".join(rng.choice(alphabet, size=rng.integers(50, 400))) for _ in range(100)]
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    documents = [np.array([bos, *e.ids, eos], np.int32) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    ids, segments = SequencePacker(64).add(documents)

    def held(token_id: int, after: int) -> int:
        piece = tokenizer.id_to_token(token_id)
        if piece in ("<unk>", "<s>", "</s>"):
            return 0
        if piece.startswith("<0x"):
            return 1
        return len(piece.replace("▁", " ").encode()) - (after == bos and piece.startswith("▁"))

    sizes = np.array([[held(t, row[j - 1] if j else -1) for j, t in enumerate(row)] for row in ids.tolist()])
    counter = SequenceBytes(tokenizer)
    assert counter.decodes
    assert counter(ids, segments).tolist() == np.where(_predicted(segments), sizes, 0).sum(axis=1).tolist()
