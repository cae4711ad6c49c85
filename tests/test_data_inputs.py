"""Input contents are part of identity: an edited, added or removed input file makes its step and
everything downstream stale, with the file named, and a run rebuilds only what depends on it."""

import json
import os

import pytest

from defaults import default_tokenize, default_tokenizer, ingest
from keel import External
from keel.cli import console_main
from keel.data import iter_documents
from keel.executor import inputs
from keel.executor.identity import Identities
from keel.executor.plan import EMPTY_EXTERNAL, Graph, plan_graph
from keel.executor.run import run_steps


@pytest.fixture(autouse=True)
def keel_cache(tmp_path, monkeypatch):
    """A fresh fingerprint memo per test (keel's cache folder is otherwise ~/.cache/keel)."""
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "keel-cache"))
    monkeypatch.setattr(inputs, "_memo", inputs._HashMemo())


def _corpus(path, n, word="hello"):
    path.write_text("".join(json.dumps({"text": f"document {i} says {word} to the tokens {i % 7}"}) + "\n"
                            for i in range(n)))
    return str(path)


def _graph(tmp_path):
    a = ingest("a", (str(tmp_path / "a.jsonl"),), validation_fraction=0.2)
    b = ingest("b", (str(tmp_path / "b.jsonl"),), validation_fraction=0.2)
    return [default_tokenizer("a-bpe", a, vocab_size=300), b]


def _states(targets, prefix):
    return {p.name: (p.state, p.reason) for p in plan_graph(Graph(targets, prefix))}


def test_editing_one_line_makes_the_step_and_its_dependents_stale_and_reruns_only_them(tmp_path):
    _corpus(tmp_path / "a.jsonl", 40)
    _corpus(tmp_path / "b.jsonl", 40)
    prefix = str(tmp_path / "outputs")
    assert run_steps(_graph(tmp_path), prefix, echo=lambda _: None).ok

    size = os.path.getsize(tmp_path / "a.jsonl")
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    lines[7] = json.dumps({"text": "an edited seventh line"}) + "\n"
    (tmp_path / "a.jsonl").write_text("".join(lines))

    states = _states(_graph(tmp_path), prefix)
    edited = os.path.getsize(tmp_path / "a.jsonl")
    assert states["documents/a"] == ("stale", f"input {tmp_path}/a.jsonl: changed ({size:,} -> {edited:,} bytes)")
    assert states["tokenizers/a-bpe"][0] == "stale" and "(dependency changed)" in states["tokenizers/a-bpe"][1]
    assert states["documents/b"] == ("cached", "")

    report = run_steps(_graph(tmp_path), prefix, echo=lambda _: None)
    assert report.ok and sorted(report.ran) == ["documents/a", "tokenizers/a-bpe"]
    graph = Graph(_graph(tmp_path), prefix)
    documents = next(s for s in graph.order if s.name == "documents/a")
    texts = {d.text for split in ("train", "validation") for d in iter_documents(graph.path(documents), split)}
    assert "an edited seventh line" in texts


def test_a_file_added_to_or_removed_from_a_glob_is_named_and_the_old_identity_comes_back(tmp_path):
    (tmp_path / "in").mkdir()
    _corpus(tmp_path / "in" / "one.jsonl", 20)
    prefix = str(tmp_path / "outputs")

    def graph():
        return [ingest("globbed", (str(tmp_path / "in" / "*.jsonl"),), validation_fraction=0.0)]

    assert run_steps(graph(), prefix, echo=lambda _: None).ok
    _corpus(tmp_path / "in" / "two.jsonl", 5)
    assert _states(graph(), prefix)["documents/globbed"] == ("stale", f"input {tmp_path}/in/two.jsonl: added")
    assert run_steps(graph(), prefix, echo=lambda _: None).ran == ["documents/globbed"]

    (tmp_path / "in" / "two.jsonl").unlink()
    assert _states(graph(), prefix)["documents/globbed"] == ("cached", "")  # the first run's output, by content
    (tmp_path / "in" / "one.jsonl").unlink()
    _corpus(tmp_path / "in" / "two.jsonl", 5)
    state, reason = _states(graph(), prefix)["documents/globbed"]
    assert state == "stale" and f"input {tmp_path}/in/one.jsonl: removed" in reason


def test_fingerprints_are_content_hashes_memoised_by_path_size_and_mtime(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path / "a.jsonl", 30)
    step = ingest("a", (corpus,))
    first = Identities().hash(step)
    hashed = []
    real = inputs.sha256_file
    monkeypatch.setattr(inputs, "sha256_file", lambda path: hashed.append(path) or real(path))

    assert Identities().hash(step) == first and hashed == []  # memo hit: nothing read
    monkeypatch.setattr(inputs, "_memo", inputs._HashMemo())  # a new process: the memo file is read back
    assert Identities().hash(step) == first and hashed == []

    os.utime(corpus, ns=(1, 1))  # a touch (or a fresh clone) changes the mtime, not the identity
    assert Identities().hash(step) == first and hashed == [corpus]
    _corpus(tmp_path / "a.jsonl", 30, word="howdy")  # same size, other bytes
    assert Identities().hash(step) != first


def test_input_version_stands_for_the_files(tmp_path):
    corpus = _corpus(tmp_path / "a.jsonl", 10)
    pinned = Identities().hash(ingest("a", (corpus,), input_version="v1"))
    _corpus(tmp_path / "a.jsonl", 12)
    assert Identities().hash(ingest("a", (corpus,), input_version="v1")) == pinned
    assert Identities().hash(ingest("a", (corpus,), input_version="v2")) != pinned
    assert "inputs" not in Identities().payload(ingest("a", (corpus,), input_version="v1"))


def test_remote_inputs_are_fingerprinted_by_size_and_store_version_without_reading_them(tmp_path, monkeypatch):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/keel-test-inputs/a.jsonl", b'{"text": "one"}\n')
    step = ingest("remote", ("memory://keel-test-inputs/a.jsonl",))
    monkeypatch.setattr(inputs, "sha256_file", lambda path: pytest.fail(f"a remote file was read: {path}"))
    payload = Identities().payload(step)["inputs"]
    assert set(payload) == {"memory://keel-test-inputs/a.jsonl"}
    assert payload["memory://keel-test-inputs/a.jsonl"]["size"] == 16 and "created" in payload["memory://keel-test-inputs/a.jsonl"]
    before = Identities().hash(step)
    fs.pipe_file("/keel-test-inputs/a.jsonl", b'{"text": "two"}\n')  # same size, a new object
    assert Identities().hash(step) != before
    fs.rm("/keel-test-inputs", recursive=True)


def test_an_external_without_a_version_is_fingerprinted_but_not_its_keel_folder(tmp_path):
    root = tmp_path / "cache"
    (root / "train").mkdir(parents=True)
    (root / "train" / "part-0").write_bytes(b"abc")
    (root / ".keel").mkdir()
    (root / ".keel" / "status").write_text("RUNNING")

    def ext_hash(**kwargs):
        return Identities().hash(External("shared/cache", str(root), **kwargs))

    first = ext_hash()
    (root / ".keel" / "status").write_text("SUCCESS")  # keel's bookkeeping is not the data
    assert ext_hash() == first
    (root / "train" / "part-0").write_bytes(b"abd")
    assert ext_hash() != first
    assert ext_hash(version="v1") == ext_hash(version="v1") != ext_hash()
    missing = External("shared/none", str(tmp_path / "none"))
    assert [p.reason for p in plan_graph(Graph([missing], str(tmp_path / "out")))] == [EMPTY_EXTERNAL]


def test_a_tokenizer_given_by_path_is_fingerprinted_so_rewriting_it_makes_the_caches_stale(tmp_path):
    from tokenizers import Tokenizer, models

    folder = tmp_path / "tok"
    folder.mkdir()

    def write_tokenizer(vocab):
        Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))

    write_tokenizer({"[UNK]": 0, "a": 1})
    docs = ingest("d", (_corpus(tmp_path / "a.jsonl", 5),))
    by_folder = default_tokenize("t", docs, str(folder))
    by_file = default_tokenize("t", docs, str(folder / "tokenizer.json"))
    made = default_tokenize("t", docs, default_tokenizer("bpe", docs, vocab_size=300))
    hub = default_tokenize("t", docs, "some-org/some-tokenizer")  # no such folder: a hub name, no files

    def hashes():
        return [Identities().hash(s) for s in (by_folder, by_file, made, hub)]

    assert by_folder.config.input_files() == {str(folder / "tokenizer.json"): str(folder / "tokenizer.json")}
    first = hashes()
    write_tokenizer({"[UNK]": 0, "b": 1})  # the same path, another vocabulary
    second = hashes()
    assert [a != b for a, b in zip(first, second)] == [True, True, False, False]
    (folder / "tokenizer_config.json").write_text('{"eos_token": "b"}')  # its special tokens count too
    assert Identities().hash(by_folder) != second[0]


def test_keel_plan_names_a_missing_input_before_anything_runs(tmp_path, capsys):
    experiment = tmp_path / "exp.py"
    experiment.write_text(
        "from defaults import ingest\nfrom keel import main\n"
        f"docs = ingest('mine', ({str(tmp_path / 'missing.jsonl')!r},))\n"
        "if __name__ == '__main__':\n    main([docs])\n"
    )
    assert console_main(["plan", str(experiment), "--prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "step 'documents/mine'" in err and "missing.jsonl' matches no file" in err
    assert "input_version" in err and "relative path" not in err


def test_a_relative_input_that_matches_nothing_names_the_directory_it_was_read_from(tmp_path, capsys, monkeypatch):
    experiment = tmp_path / "exp.py"
    experiment.write_text("from defaults import ingest\nfrom keel import main\n"
                          "docs = ingest('mine', ('data/*.jsonl',))\nif __name__ == '__main__':\n    main([docs])\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert console_main(["plan", str(experiment), "--prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"'data/*.jsonl' matches no file (a relative path, read from the working directory {tmp_path / 'elsewhere'})" in err


def test_the_data_files_of_a_hugging_face_builder_count_and_a_hub_dataset_is_pinned_by_its_revision(tmp_path):
    from keel.data import HfDatasetSpec

    corpus = _corpus(tmp_path / "d.jsonl", 10)
    step = ingest("hf", hf_dataset=HfDatasetSpec("json", data_files=(corpus,)))
    before = Identities().hash(step)
    _corpus(tmp_path / "d.jsonl", 11)
    assert Identities().hash(step) != before
    hub = ingest("hub", hf_dataset=HfDatasetSpec("someone/corpus", data_files=("data/train-*.parquet",), revision="abc"))
    assert "inputs" not in Identities().payload(hub)  # its data_files live in the hub repository, not here
