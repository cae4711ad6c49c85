"""Ingestion: every file format, HF datasets' local loaders, bad-record reporting, the stable split."""

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from keel.data import BadRecordError, HfDatasetSpec, IngestConfig, ingest_documents, iter_documents, read_index, split_of

TEXTS = ["first document", "second: ünïcödé ✓", "third\nhas two lines", "fourth\u2028with a line separator"]


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _all_documents(path):
    return {d.id: d.text for split in ("train", "validation") for d in iter_documents(path, split)}


def _ingest(tmp_path, name="out", **kwargs):
    out = str(tmp_path / name)
    ingest_documents(IngestConfig(output_path=out, **kwargs))
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_each_record_format_is_ingested_with_its_text_field(tmp_path, suffix):
    records = [{"body": t, "n": i} for i, t in enumerate(TEXTS)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        raw = _jsonl(records)
        compress = {".jsonl": lambda b: b, ".jsonl.gz": gzip.compress, ".jsonl.zst": zstandard.compress}[suffix]
        path.write_bytes(compress(raw))

    out = _ingest(tmp_path, inputs=(str(path),), text_field="body", validation_fraction=0.5)

    assert _all_documents(out) == {f"data{suffix}:{i + 1}": t for i, t in enumerate(TEXTS)}
    index = read_index(out)
    splits = index["splits"]
    assert splits["train"]["documents"] + splits["validation"]["documents"] == len(TEXTS)
    assert splits["train"]["bytes"] + splits["validation"]["bytes"] == sum(len(t.encode()) for t in TEXTS)
    for doc_id in _all_documents(out):
        expected = split_of(doc_id, 0.5)
        assert doc_id in {d.id for d in iter_documents(out, expected)}


@pytest.mark.parametrize("read_size", [7, 4096, 1 << 20])
def test_a_zst_reader_gives_every_byte_once_whatever_the_read_size(read_size):
    """Frames larger and smaller than a compressed read (64 KiB), an empty one, any read size:
    the bytes come out whole and in order (each read takes from an offset into what is ready)."""
    import io

    from keel.data.ingest import _Zstd

    parts = [bytes(range(256)) * 1000, b"", b"tail of one frame", bytes(7) * 300_000]
    raw = io.BytesIO(b"".join(zstandard.compress(p) for p in parts))
    reader, out = _Zstd(raw, "parts.zst"), bytearray()
    buffer = bytearray(read_size)
    while n := reader.readinto(buffer):
        out += buffer[:n]
    assert bytes(out) == b"".join(parts)


def test_a_zst_file_of_several_frames_is_read_to_its_end(tmp_path):
    records = [{"text": f"document {i} " * 50} for i in range(3000)]
    frames = b"".join(zstandard.compress(_jsonl(records[i:i + 700])) for i in range(0, 3000, 700))  # concatenated
    (tmp_path / "many.jsonl.zst").write_bytes(frames)
    out = _ingest(tmp_path, inputs=(str(tmp_path / "many.jsonl.zst"),), validation_fraction=0.0)
    assert len(_all_documents(out)) == 3000


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]  # an interrupted download


@pytest.mark.parametrize("suffix, write", [
    (".jsonl.gz", lambda path, raw: path.write_bytes(_cut(gzip.compress(raw)))),
    (".jsonl.zst", lambda path, raw: path.write_bytes(_cut(zstandard.compress(raw)))),
    (".parquet", lambda path, raw: path.write_bytes(_cut(_parquet_bytes(raw)))),
])
def test_an_input_file_cut_short_fails_the_step_naming_the_file(tmp_path, suffix, write):
    """zstd's stream reader read a cut `.zst` as a shorter file: 1,417 of 3,000 records were kept,
    the cut line was one bad record of many, and the step succeeded."""
    raw = _jsonl({"text": f"document {i} " * 20} for i in range(3000))
    path = tmp_path / f"cut{suffix}"
    write(path, raw)
    with pytest.raises(RuntimeError, match=rf"{path} could not be read \(.*\); fetch or write it again, or leave it out"):
        _ingest(tmp_path, inputs=(str(path),), validation_fraction=0.0)
    assert not (tmp_path / "out" / "documents.json").exists()


def _parquet_bytes(raw: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in raw.splitlines()]), sink)
    return sink.getvalue().to_pybytes()


def test_txt_files_are_one_document_each_from_a_sorted_glob(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("bee")
    (tmp_path / "in" / "sub" / "a.txt").write_text("ay\nay")
    (tmp_path / "in" / "skip.md").write_text("not matched")

    out = _ingest(tmp_path, inputs=(str(tmp_path / "in" / "**" / "*.txt"),), validation_fraction=0.0)

    assert [(d.id, d.text) for d in iter_documents(out, "train")] == [("b.txt:1", "bee"), ("sub/a.txt:1", "ay\nay")]


def test_hf_datasets_local_json_and_parquet_loaders(tmp_path):
    records = [{"text": t} for t in TEXTS]
    (tmp_path / "d.jsonl").write_bytes(_jsonl(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")

    for builder, file in (("json", "d.jsonl"), ("parquet", "d.parquet")):
        spec = HfDatasetSpec(builder, data_files=(str(tmp_path / file),))
        out = _ingest(tmp_path, name=builder, hf_dataset=spec, validation_fraction=0.0)
        assert _all_documents(out) == {f"hf:{builder}/train/{file}:{i + 1}": t for i, t in enumerate(TEXTS)}


def test_a_file_a_datasets_builder_cannot_parse_is_named_with_the_way_to_skip_its_bad_records(tmp_path):
    """Arrow parses a json builder's file whole and its error names no file: the step says which,
    and that `inputs=` (not the builder) skips and counts a bad record, as `on_bad_record` asks."""
    from keel.data.ingest import BadInputFileError

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n" + json.dumps({"text": "good"}) + "\n")
    spec = HfDatasetSpec("json", data_files=(str(bad),))
    with pytest.raises(BadInputFileError, match=rf"{re.escape(str(bad))} could not be read by the datasets 'json' builder "
                                                r"\(ArrowInvalid: .*\); a file builder reads a file whole, so "
                                                r"IngestConfig.on_bad_record cannot skip one bad record in it: .*inputs"):
        _ingest(tmp_path, name="bad", hf_dataset=spec, validation_fraction=0.0)
    out = _ingest(tmp_path, name="as-input", inputs=(str(bad),), validation_fraction=0.0, max_bad_fraction=0.5)  # skipped, counted
    assert list(_all_documents(out).values()) == ["good"]


def test_a_file_added_before_another_in_hf_data_files_moves_none_of_its_documents_draws(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(_jsonl([{"text": f"bee {i}"} for i in range(40)]))
    (tmp_path / "a.jsonl").write_bytes(_jsonl([{"text": f"ay {i}"} for i in range(40)]))

    def splits(name, *files):
        spec = HfDatasetSpec("json", data_files=tuple(str(tmp_path / f) for f in files))
        out = _ingest(tmp_path, name=name, hf_dataset=spec, validation_fraction=0.3)
        return {d.id: split for split in ("train", "validation") for d in iter_documents(out, split)}

    before, after = splits("v1", "b.jsonl"), splits("v2", "a.jsonl", "b.jsonl")  # a.jsonl streams first now
    assert 0 < sum(s == "validation" for s in before.values()) < 40
    assert {i: s for i, s in after.items() if "/b.jsonl:" in i} == before


def _bad_input(tmp_path):
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"other": "no text field"}),
        "",
        json.dumps({"text": 7}),
        json.dumps({"text": "good two"}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_records_are_skipped_counted_and_reported_with_file_and_line(tmp_path):
    path = _bad_input(tmp_path)

    out = _ingest(tmp_path, inputs=(str(path),), validation_fraction=0.0, max_bad_fraction=0.75)

    assert sorted(_all_documents(out).values()) == ["good one", "good two"]
    report = read_index(out)["bad_records"]
    assert report["count"] == 3
    assert [e.split(": ", 1)[0] for e in report["examples"]] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "missing text field 'text'" in report["examples"][1]


def test_bad_records_fail_the_step_when_configured(tmp_path):
    path = _bad_input(tmp_path)
    with pytest.raises(BadRecordError, match=rf"{path}:2: not valid JSON"):
        _ingest(tmp_path, inputs=(str(path),), on_bad_record="fail")


def test_bad_parquet_rows_and_invalid_utf8_text(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": None}]), tmp_path / "p.parquet")
    (tmp_path / "t.txt").write_bytes(b"line one\nline \xff two\n")

    out = _ingest(tmp_path, inputs=(str(tmp_path / "p.parquet"), str(tmp_path / "t.txt")), validation_fraction=0.0,
                  max_bad_fraction=0.5)

    assert list(_all_documents(out).values()) == ["ok", "line one\nline \ufffd two\n"]  # the bad byte replaced
    assert read_index(out)["bad_records"]["examples"] == [f"{tmp_path}/p.parquet:2: text field 'text' not a string (NoneType)"]


def test_parquet_text_that_is_not_utf8_is_repaired_or_skipped_as_declared(tmp_path):
    """Parquet does not check a string column's bytes: a row that is not UTF-8 failed the step with
    a bare UnicodeDecodeError naming no file, whatever on_decode_error said."""
    column = pa.array([b"good text", b"bad \xff byte", b"more good"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), tmp_path / "p.parquet")
    inputs = (str(tmp_path / "p.parquet"),)
    repaired = _ingest(tmp_path, "repaired", inputs=inputs, validation_fraction=0.0)
    assert list(_all_documents(repaired).values()) == ["good text", "bad \ufffd byte", "more good"]
    skipped = _ingest(tmp_path, "skipped", inputs=inputs, validation_fraction=0.0, on_decode_error="skip", max_bad_fraction=0.5)
    assert list(_all_documents(skipped).values()) == ["good text", "more good"]
    assert read_index(skipped)["bad_records"]["examples"][0].startswith(f"{tmp_path}/p.parquet:2: not valid UTF-8")


@pytest.mark.parametrize("name, data, why", [
    ("small.jsonl", _jsonl([{"body": "one record"}]), "missing text field 'text'"),
    ("note.txt", "UTF-16 text\n".encode("utf-16-le"), "not text"),
], ids=["one-record-jsonl", "binary-txt"])
def test_a_file_of_one_record_that_is_skipped_fails_the_step_too(tmp_path, name, data, why):
    (tmp_path / "notes.txt").write_text("".join(f"note {i}\n" for i in range(5000)))
    (tmp_path / name).write_bytes(data)
    with pytest.raises(BadRecordError, match=rf"the only record of .*{name} was skipped \(1 {why}"):
        _ingest(tmp_path, inputs=(str(tmp_path / "notes.txt"), str(tmp_path / name)), validation_fraction=0.0)


def test_a_file_whose_every_record_is_skipped_fails_even_when_other_inputs_dilute_the_share(tmp_path):
    """A .txt file counts each line toward max_bad_fraction's share: beside a 5,000-line file, 40
    JSON records without the text field were 0.8% of the records, under the default 1%, and the
    step succeeded with one document of 41."""
    (tmp_path / "notes.txt").write_text("".join(f"note {i}\n" for i in range(5000)))
    (tmp_path / "recs.jsonl").write_bytes(_jsonl({"body": f"record {i}"} for i in range(40)))
    inputs = (str(tmp_path / "notes.txt"), str(tmp_path / "recs.jsonl"))
    with pytest.raises(BadRecordError, match=r"every one of the 40 records of .*recs.jsonl was skipped \(40 missing "
                       r"text field 'text'\).*fix the file or the config reading it"):
        _ingest(tmp_path, inputs=inputs, validation_fraction=0.0)
    assert not (tmp_path / "out" / "documents.json").exists()
    assert len(_all_documents(_ingest(tmp_path, "read", inputs=inputs, validation_fraction=0.0, text_field="body"))) == 41
    # a few bad records of a file are the share's to judge, as before
    (tmp_path / "recs.jsonl").write_bytes(_jsonl([{"text": "kept"}, {"body": "dropped"}]))
    assert list(_all_documents(_ingest(tmp_path, "some", inputs=inputs[1:], validation_fraction=0.0,
                                       max_bad_fraction=0.5)).values()) == ["kept"]


def test_split_is_a_stable_function_of_the_document_id(tmp_path):
    ids = [f"doc-{i}" for i in range(4000)]
    validation = [i for i in ids if split_of(i, 0.1) == "validation"]
    assert 300 < len(validation) < 500
    assert validation == [i for i in ids if split_of(i, 0.1) == "validation"]

    # adding documents never moves the earlier ones between splits
    (tmp_path / "a.jsonl").write_bytes(_jsonl({"text": f"t{i}"} for i in range(50)))
    small = _ingest(tmp_path, name="small", inputs=(str(tmp_path / "a.jsonl"),), validation_fraction=0.3)
    (tmp_path / "b.jsonl").write_bytes(_jsonl({"text": f"u{i}"} for i in range(50)))
    both = _ingest(tmp_path, name="both", inputs=(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")),
                   validation_fraction=0.3)
    small_validation = {d.id for d in iter_documents(small, "validation")}
    both_validation = {d.id for d in iter_documents(both, "validation")}
    assert small_validation and small_validation == {i for i in both_validation if i.startswith("a.jsonl")}


def test_shards_are_cut_by_size_and_rewritten_on_rerun(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl({"text": "x" * 100 + str(i)} for i in range(40)))
    out = _ingest(tmp_path, inputs=(str(tmp_path / "a.jsonl"),), shard_bytes=1000, validation_fraction=0.0)
    shards = read_index(out)["splits"]["train"]["shards"]
    assert len(shards) == 4
    before = {s: (tmp_path / "out" / s).read_bytes() for s in shards}

    (tmp_path / "out" / "train" / "docs-00009.jsonl.zst").write_bytes(b"left by an interrupted attempt")
    _ingest(tmp_path, inputs=(str(tmp_path / "a.jsonl"),), shard_bytes=1000, validation_fraction=0.0)

    assert sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == sorted(s.split("/")[1] for s in shards)
    assert {s: (tmp_path / "out" / s).read_bytes() for s in shards} == before


def test_bad_declarations_fail_before_reading(tmp_path):
    with pytest.raises(ValueError, match="exactly one of `inputs`"):
        IngestConfig()
    with pytest.raises(ValueError, match="on_bad_record must be one of"):
        IngestConfig(inputs=("x.jsonl",), on_bad_record="ignore")
    with pytest.raises(ValueError, match="validation_fraction"):
        IngestConfig(inputs=("x.jsonl",), validation_fraction=1.5)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv has an unsupported format"):
        _ingest(tmp_path, inputs=(str(tmp_path / "data.csv"),))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        _ingest(tmp_path, inputs=(str(tmp_path / "none" / "*.jsonl"),))
    assert not (tmp_path / "out" / "documents.json").exists()


def test_paths_declared_as_one_string_or_a_path_object(tmp_path):
    """One string was split into characters ('/', 't', ...) by the `ingest` default, and a
    `pathlib.Path` input was left out of the identity, then failed in the run with an AttributeError."""
    from defaults.data import ingest, stdlib_corpus
    from keel.data import StdlibCorpusConfig
    from keel.data.stdlib_corpus import corpus_files
    from keel.executor.identity import Identities

    with pytest.raises(ValueError, match=r"IngestConfig.inputs must be a tuple of paths or globs, not one str: use \('/d/a.jsonl',\)"):
        ingest("x", "/d/a.jsonl")
    with pytest.raises(ValueError, match=r"HfDatasetSpec.data_files must be a tuple .*not one str: use \('a.json',\)"):
        HfDatasetSpec("json", data_files="a.json")
    with pytest.raises(ValueError, match=r"IngestConfig.inputs\[1\] is a int \(3\): give a path or glob"):
        IngestConfig(inputs=("a.jsonl", 3))
    with pytest.raises(ValueError, match=r"StdlibCorpusConfig.packages must be a tuple of package names, got 'json': use \('json',\)"):
        stdlib_corpus(packages="json")
    with pytest.raises(ValueError, match=r"'emial' is no top-level package or module .*did you mean 'email'"):
        corpus_files(StdlibCorpusConfig(packages=("json", "emial")))

    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    step = ingest("p", (data,))  # a Path: read, and fingerprinted like its text
    assert step.config.inputs == (str(data),) and step.config.input_files() == {str(data): str(data)}
    before = Identities().hash(step)
    data.write_text(json.dumps({"text": "two"}) + "\n")
    assert Identities().hash(ingest("p", (data,))) != before


def test_a_validation_draw_that_copies_training_documents_goes_to_train_unless_told_otherwise(tmp_path):
    """Each held-out draw gets a near-copy among the training documents (its lines reordered, their
    spacing and case changed): by default it moves to train, counted; with
    near_duplicate_overlap=None it stays held out."""
    originals = [f"module {i}\n" + "\n".join(f"def function_{i}_{j}(argument): return {j} * argument" for j in range(6))
                 for i in range(400)]
    path = tmp_path / "code.jsonl"
    path.write_text(_jsonl({"text": t} for t in originals).decode())
    held_ids = {d_id for d_id in (f"code.jsonl:{n}" for n in range(1, 401)) if split_of(d_id, 0.2) == "validation"}
    # every held-out original gets a copy appended, in train unless its own draw holds it out too
    copies = ["\n".join(reversed(originals[int(i.split(":")[1]) - 1].upper().replace(" ", "  ").splitlines()))
              for i in sorted(held_ids)]
    path.write_text(_jsonl({"text": t} for t in originals + copies).decode())
    default = _ingest(tmp_path, "default", inputs=(str(path),), validation_fraction=0.2)
    kept = _ingest(tmp_path, "kept", inputs=(str(path),), validation_fraction=0.2, near_duplicate_overlap=None)
    held_out = {d.id for d in iter_documents(kept, "validation")}
    moved = {d.id for d in iter_documents(default, "validation")} ^ held_out
    # an original held out with its copy trained on moves; one whose copy is held out too stays
    copy_trained = {i for n, i in enumerate(sorted(held_ids))
                    if split_of(f"code.jsonl:{401 + n}", 0.2) == "train"}
    assert moved == copy_trained and len(moved) > 40
    assert read_index(default)["splits"]["train"]["documents"] == read_index(kept)["splits"]["train"]["documents"] + len(moved)
    from keel.data import read_summary
    assert read_summary(default)["near_duplicates_kept_out_of_validation"]["count"] == len(moved)
    with pytest.raises(ValueError, match=r"IngestConfig.near_duplicate_overlap=0: give a share of a document's lines "
                                         r"in \(0, 1\], or None"):
        IngestConfig(inputs=(str(path),), near_duplicate_overlap=0)


def test_the_training_line_index_decides_as_a_set_of_the_lines_would_across_its_chunks(monkeypatch):
    import random

    from keel.data.documents import TrainingLines, normalised_lines

    monkeypatch.setattr(TrainingLines, "CHUNK", 7)  # many chunks, lines repeated within and across them
    rng = random.Random(0)
    vocabulary = [f"line number {i} of the shared pool" for i in range(300)]
    training = ["\n".join(rng.choices(vocabulary[:200], k=rng.randint(1, 12))) for _ in range(80)]
    index, lines = TrainingLines(), set()
    for text in training:
        index.add(text)
        lines |= normalised_lines(text)
    assert len(index._chunks) > 10
    for _ in range(300):
        text = "\n".join(rng.choices(vocabulary, k=rng.randint(0, 10)))
        mine = normalised_lines(text)
        for overlap in (0.25, 0.5, 1.0):
            assert index.near_duplicate(text, overlap) == (bool(mine) and len(mine & lines) >= overlap * len(mine))


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8-sig")
    (tmp_path / "note.txt").write_text("a note saved by a Windows editor", encoding="utf-8-sig")
    out = _ingest(tmp_path, inputs=(str(tmp_path / "notes.jsonl"), str(tmp_path / "note.txt")), validation_fraction=0.0)
    assert _all_documents(out) == {**{f"notes.jsonl:{i}": t for i, t in enumerate(TEXTS, start=1)},
                                   "note.txt:1": "a note saved by a Windows editor"}


def test_no_line_index_is_built_where_nothing_can_be_held_out_or_none_is_asked_for(tmp_path, monkeypatch):
    from keel.data.documents import TrainingLines

    path = tmp_path / "data.jsonl"
    path.write_text(_jsonl({"text": f"document {i}\nwith a second line {i}"} for i in range(200)).decode())
    monkeypatch.setattr(TrainingLines, "add", lambda *_: pytest.fail("indexed training lines nobody looks up"))
    _ingest(tmp_path, "all_train", inputs=(str(path),), validation_fraction=0.0)
    kept = _ingest(tmp_path, "kept", inputs=(str(path),), validation_fraction=0.3, near_duplicate_overlap=None)
    assert read_index(kept)["splits"]["validation"]["documents"] == sum(
        split_of(f"data.jsonl:{n}", 0.3) == "validation" for n in range(1, 201))


def test_a_duplicate_id_is_refused_by_name_within_a_batch_and_across_merged_batches(monkeypatch):
    from keel.data.documents import DocumentIds, id_digest

    def add(ids, doc_id):
        ids.add(doc_id, id_digest(doc_id))

    monkeypatch.setattr(DocumentIds, "BATCH", 5)  # batches of 5, merged as they pile up
    ids = DocumentIds()
    for i in range(103):
        add(ids, f"data.jsonl:{i}")
    ids.seal()
    assert sum(len(c) for c in ids._chunks) == 103 and len(ids._chunks) <= 5  # merged, none lost
    with pytest.raises(ValueError, match=r"duplicate document id 'data.jsonl:1000'"):
        add(ids, "data.jsonl:1000")
        add(ids, "data.jsonl:1000")  # in the same batch: refused at once
    for earlier in ("data.jsonl:0", "data.jsonl:57", "data.jsonl:102"):
        again = DocumentIds()
        for i in range(103):
            add(again, f"data.jsonl:{i}")
        with pytest.raises(ValueError, match=rf"duplicate document id '{earlier}'"):
            for i in range(1001, 1009):  # the repeat lands mid-batch; it is found when its batch seals
                add(again, earlier if i == 1003 else f"data.jsonl:{i}")
            again.seal()


def test_a_document_set_with_a_duplicate_id_writes_no_index(tmp_path):
    from keel.data.documents import Document, write_documents
    from keel.data.quality import RecordLog

    docs = [Document(f"d{i}", f"text {i}") for i in range(50)] + [Document("d7", "another text")]
    with pytest.raises(ValueError, match=r"duplicate document id 'd7'"):
        write_documents(str(tmp_path / "set"), docs, validation_fraction=0.2, shard_bytes=1 << 20,
                        log=RecordLog("test"), source={}, what="a test")
    assert not (tmp_path / "set" / "documents.json").exists()


def test_held_out_draws_come_back_from_their_spill_exactly_and_in_order(tmp_path):
    texts = [f"held {i}: ünïcödé ✓ \ud800 a lone surrogate, \"quoted\"\nline two {i}\u2028" for i in range(400)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))  # escaped, as JSON allows
    checked = _ingest(tmp_path, "checked", inputs=(str(path),), validation_fraction=0.3)  # validation spilled, then read back
    direct = _ingest(tmp_path, "direct", inputs=(str(path),), validation_fraction=0.3, near_duplicate_overlap=None)
    spilled = [(d.id, d.text) for d in iter_documents(checked, "validation")]
    assert len(spilled) > 50 and spilled == [(d.id, d.text) for d in iter_documents(direct, "validation")]


def test_an_empty_split_warns_with_its_real_cause_and_fix(tmp_path):
    """Files sharing a license header: every validation draw is a 'near-copy' of training text and
    is kept in train, and raising validation_fraction (what the warning said) cannot help. A split
    that leaves train empty said nothing until tokenizing failed."""
    from keel.data import read_summary

    header = "".join(f"# licensed under the example license, line {i} of the shared header\n" for i in range(12))
    for i in range(60):
        (tmp_path / f"mod{i:02d}.txt").write_text(header + f"def function_{i}(value):\n    return value * {i * 7919}\n")
    out = _ingest(tmp_path, "boilerplate", inputs=(str(tmp_path / "*.txt"),), validation_fraction=0.2)
    [warning] = read_summary(out)["warnings"]
    assert re.match(r"the validation split is empty: all \d+ documents drawn for it are near-copies of training documents "
                    r"\(at least 50% of their lines appear in training text\).*raise near_duplicate_overlap", warning), warning
    out = _ingest(tmp_path, "no-train", inputs=(str(tmp_path / "mod0*.txt"),), validation_fraction=0.99,
                  near_duplicate_overlap=None)
    assert read_summary(out)["warnings"] == ["the train split is empty: all 10 documents are in validation "
                                             "(validation_fraction=0.99); lower it (or give more documents) to tokenize "
                                             "this set for training"]


def test_a_hugging_face_source_that_cannot_say_what_it_reads_is_refused_when_declared():
    """A file builder with no files failed at run time saying the files held no text; a hub dataset
    with no revision kept one identity while the hub's data changed."""
    with pytest.raises(ValueError, match=r"HfDatasetSpec\('json'\) is a file builder with no data_files"):
        HfDatasetSpec("json")
    with pytest.raises(ValueError, match=r"HfDatasetSpec\('someone/corpus'\) is a hub dataset with no revision: pin one"):
        HfDatasetSpec("someone/corpus")
    assert HfDatasetSpec("someone/corpus", revision="abc123").revision == "abc123"


def test_an_input_whose_name_is_not_utf8_is_refused_naming_it(tmp_path):
    """Document ids name their file, and ids are UTF-8: the step died on a bare UnicodeEncodeError."""
    from keel.data.ingest import BadInputFileError

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "ok.txt").write_text("fine")
    with open(os.path.join(os.fsencode(folder), b"caf\xe9.txt"), "w") as f:  # a Latin-1 name, as bytes
        f.write("caf\u00e9")
    with pytest.raises(BadInputFileError, match=r"IngestConfig.inputs: the name of .*caf\\udce9\.txt' is not UTF-8, so its "
                                                r"documents' ids cannot name it: rename the file"):
        _ingest(tmp_path, inputs=(str(folder / "*.txt"),), validation_fraction=0.0)
