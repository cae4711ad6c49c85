"""Data loss is loud: bad records above a declared share, empty outputs, a wrong text field and a
short tokenizer fail or say so, with counts and the first file:line in the step's summary.json."""

import json

import pytest

from keel.data import (
    BadRecordError,
    EmptyDataError,
    ingest_documents,
    IngestConfig,
    iter_documents,
    read_summary,
    tokenize_documents,
    train_tokenizer,
)
from keel.spec import TokenizeConfig, TrainTokenizerConfig


def _lines(path, good: int, bad_at=()):
    rows = [json.dumps({"text": f"document {i} is a fine one"}) for i in range(good)]
    for at in bad_at:
        rows.insert(at, '{"text": "cut off')
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _ingest(tmp_path, *inputs, **kwargs):
    out = str(tmp_path / "docs")
    ingest_documents(IngestConfig(inputs=tuple(inputs), output_path=out, **kwargs))
    return out


def test_bad_records_above_the_declared_fraction_fail_the_step(tmp_path):
    corpus = _lines(tmp_path / "c.jsonl", 50, bad_at=(3, 20, 40))  # 3 of 53: 5.7%
    with pytest.raises(BadRecordError, match=rf"3 of 53 records \(5.7%\) were skipped, more than "
                                             rf"IngestConfig.max_bad_fraction=0.01 allows: 3 not valid JSON \(first: {corpus}:4"):
        _ingest(tmp_path, corpus)
    assert not (tmp_path / "docs" / "documents.json").exists()
    _ingest(tmp_path, corpus, max_bad_fraction=0.06)  # declared: accepted, and counted


def test_bad_records_below_the_fraction_are_counted_on_the_console_and_in_the_summary(tmp_path, capsys):
    corpus = _lines(tmp_path / "c.jsonl", 199, bad_at=(116,))
    out = _ingest(tmp_path, corpus, validation_fraction=0.1)

    console = capsys.readouterr().out
    assert f"skipped 1 of 200 records (0.5%): 1 not valid JSON (first: {corpus}:117" in console
    summary = read_summary(out)
    assert summary["documents"] == 199 and summary["records"] == 200
    assert summary["splits"]["train"]["documents"] + summary["splits"]["validation"]["documents"] == 199
    assert list(summary["skipped"]) == ["not valid JSON"]
    assert summary["skipped"]["not valid JSON"]["count"] == 1
    assert summary["skipped"]["not valid JSON"]["first"].startswith(f"{corpus}:117: not valid JSON (")
    assert (tmp_path / "docs" / ".keel" / "summary.json").exists()  # beside the manifest


def test_a_wrong_text_field_fails_naming_the_fields_there_are(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": f"text {i}", "id": i}) + "\n" for i in range(20)))
    with pytest.raises(BadRecordError, match=r"20 of 20 records \(100.0%\).*missing text field 'text' "
                                             r"\(first: .*c.jsonl:1, fields: body, id; IngestConfig.text_field"):
        _ingest(tmp_path, str(corpus))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"text_field='text': .*p.parquet has no such column \(columns: body\)"):
        _ingest(tmp_path, str(tmp_path / "p.parquet"))


def test_a_large_input_whose_first_records_are_all_skipped_fails_before_reading_the_rest(tmp_path):
    """A wrong text_field skips every record: the step stops at the 1,000th, not after the whole corpus,
    while 999 bad records before a good one are left to the declared fraction at the end."""
    from keel.data.quality import ALL_SKIPPED_AFTER

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(3 * ALL_SKIPPED_AFTER)))
    with pytest.raises(BadRecordError, match=r"the first 1,000 records were all skipped: 1000 missing text field 'text' "
                                             r"\(first: .*c.jsonl:1, fields: body; IngestConfig.text_field names the one "
                                             r"to read\); nothing has been written"):
        _ingest(tmp_path, str(corpus))
    assert not (tmp_path / "docs" / "documents.json").exists()
    with pytest.raises(EmptyDataError, match=r"gave no documents \(3000 records: skipped 3000 of 3000"):
        _ingest(tmp_path, str(corpus), max_bad_fraction=1.0)  # a declared loss of everything: read to the end
    rows = [{"body": "x"}] * (ALL_SKIPPED_AFTER - 1) + [{"text": f"text {i}"} for i in range(2 * ALL_SKIPPED_AFTER + 1)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(BadRecordError, match=r"999 of 3000 records \(33.3%\) were skipped, more than"):
        _ingest(tmp_path, str(corpus))


def test_undecodable_bytes_are_handled_per_line_never_by_dropping_the_file(tmp_path, capsys):
    txt = tmp_path / "notes.txt"
    txt.write_bytes(b"first line\nsecond \xff line\nthird line\n")
    out = _ingest(tmp_path, str(txt), validation_fraction=0.0)
    assert [d.text for d in iter_documents(out, "train")] == ["first line\nsecond \ufffd line\nthird line\n"]
    repaired = read_summary(out)["repaired"]
    assert repaired == {"not valid UTF-8, bytes replaced with U+FFFD": {"count": 1, "first": f"{txt}:2: not valid UTF-8, bytes replaced with U+FFFD (invalid start byte at byte 7)"}}
    assert "repaired 1: 1 not valid UTF-8, bytes replaced" in capsys.readouterr().out

    out = _ingest(tmp_path, str(txt), validation_fraction=0.0, on_decode_error="skip", max_bad_fraction=0.5)
    assert [d.text for d in iter_documents(out, "train")] == ["first line\nthird line\n"]
    assert read_summary(out)["skipped"]["not valid UTF-8"]["count"] == 1

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(b'{"text": "caf\xe9"}\n' + b"".join(b'{"text": "fine %d"}\n' % i for i in range(200)))
    out = _ingest(tmp_path, str(jsonl), validation_fraction=0.0)
    assert "caf\ufffd" in {d.text for d in iter_documents(out, "train")}

    # a JSON escape of half a UTF-16 pair (an emoji cut in two) is text no UTF-8 file holds
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "emoji cut \\ud83d here"}\n' + "".join(json.dumps({"text": f"fine {i}"}) + "\n" for i in range(200)))
    out = _ingest(tmp_path, str(cut), validation_fraction=0.0)
    assert "emoji cut \ufffd here" in {d.text for d in iter_documents(out, "train")}
    assert read_summary(out)["repaired"]["unpaired UTF-16 surrogate, replaced with U+FFFD"]["count"] == 1
    out = _ingest(tmp_path, str(cut), validation_fraction=0.0, on_decode_error="skip")
    assert len(list(iter_documents(out, "train"))) == 200
    assert read_summary(out)["skipped"]["unpaired UTF-16 surrogate"]["count"] == 1


def test_an_empty_corpus_fails_the_documents_step(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EmptyDataError, match=r"IngestConfig.inputs \[.*empty.jsonl'\] gave no documents \(0 records\)"):
        _ingest(tmp_path, str(tmp_path / "empty.jsonl"))
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n' * 3)
    with pytest.raises(EmptyDataError, match=r"gave no documents \(3 records: 3 with empty text\)"):
        _ingest(tmp_path, str(tmp_path / "blank.jsonl"))
    assert not (tmp_path / "docs" / "documents.json").exists()


def test_an_empty_validation_split_is_said_when_the_documents_are_written(tmp_path, capsys):
    corpus = _lines(tmp_path / "c.jsonl", 50)
    out = _ingest(tmp_path, corpus, validation_fraction=0.01)
    summary = read_summary(out)
    assert summary["splits"]["validation"]["documents"] == 0
    assert summary["warnings"] == ["the validation split is empty: none of the 50 documents fell in "
                                   "validation_fraction=0.01 (about 0.5 expected); raise it to evaluate on this data"]
    assert "the validation split is empty" in capsys.readouterr().out


def test_a_tokenizer_trained_to_fewer_tokens_than_asked_says_so(tmp_path, capsys):
    docs = _ingest(tmp_path, _lines(tmp_path / "c.jsonl", 30), validation_fraction=0.0)
    capsys.readouterr()
    train_tokenizer(TrainTokenizerConfig(documents=docs, vocab_size=2000, output_path=str(tmp_path / "tok")))
    summary = read_summary(str(tmp_path / "tok"))
    assert summary["asked"] == 2000 and summary["vocab_size"] < 2000
    assert f"trained {summary['vocab_size']:,} tokens, fewer than the 2,000 asked (TrainTokenizerConfig.vocab_size)" \
        in capsys.readouterr().out


def test_a_tokenizer_with_no_training_documents_fails(tmp_path):
    docs = _ingest(tmp_path, _lines(tmp_path / "c.jsonl", 3), validation_fraction=0.99)  # everything in validation
    with pytest.raises(EmptyDataError, match="the train split of .* has no documents to train on"):
        train_tokenizer(TrainTokenizerConfig(documents=docs, vocab_size=300, output_path=str(tmp_path / "tok")))


def test_a_cache_with_no_whole_training_sequence_fails_the_tokenize_step(tmp_path):
    docs = _ingest(tmp_path, _lines(tmp_path / "c.jsonl", 2), validation_fraction=0.0)
    train_tokenizer(TrainTokenizerConfig(documents=docs, vocab_size=300, output_path=str(tmp_path / "tok")))
    out = tmp_path / "cache"
    with pytest.raises(EmptyDataError, match=r"gave \d+ tokens \(2 documents\), not enough for one sequence of "
                                             r"TokenizeConfig.seq_len=4096"):
        tokenize_documents(TokenizeConfig(documents=docs, tokenizer=str(tmp_path / "tok"), seq_len=4096, output_path=str(out)))
    assert not (out / "tokenize.json").exists()
