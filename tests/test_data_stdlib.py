"""The built-in stdlib corpus: deterministic, capped, and keyed by the Python version."""

import os
import platform
import sysconfig

import pytest

from defaults import stdlib_corpus
from keel.data import StdlibCorpusConfig, build_stdlib_corpus, iter_documents, read_index
from keel.data.stdlib_corpus import stdlib_files
from keel.executor.identity import Identities


def _build(path, **kwargs):
    build_stdlib_corpus(StdlibCorpusConfig(output_path=str(path), **kwargs))
    return str(path)


def test_stdlib_corpus_is_deterministic_and_capped(tmp_path):
    first = _build(tmp_path / "a", max_bytes=400_000, validation_fraction=0.1)
    second = _build(tmp_path / "b", max_bytes=400_000, validation_fraction=0.1)

    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files_a)

    index = read_index(first)
    total = sum(s["bytes"] for s in index["splits"].values())
    documents = sum(s["documents"] for s in index["splits"].values()) + index["empty_documents"]
    root = sysconfig.get_paths()["stdlib"]
    next_file = stdlib_files(include_tests=True)[documents]
    assert total <= 400_000 < total + len(open(f"{root}/{next_file}", "rb").read())  # stops at the first overflow
    train_ids = [d.id for d in iter_documents(first, "train")]
    assert train_ids == sorted(train_ids) and train_ids[0].startswith("stdlib/")
    assert index["splits"]["validation"]["documents"] > 0
    assert [d.id for d in iter_documents(second, "train")] == train_ids


def test_stdlib_corpus_reads_real_sources_in_sorted_order(tmp_path):
    out = _build(tmp_path, max_files=5, validation_fraction=0.0)
    docs = list(iter_documents(out, "train"))
    expected = stdlib_files(include_tests=True)[:5]
    root = sysconfig.get_paths()["stdlib"]
    assert [d.id for d in docs] == [f"stdlib/{f}" for f in expected if open(f"{root}/{f}").read()]
    assert all(d.text == open(f"{root}/{d.id.removeprefix('stdlib/')}", encoding="utf-8").read() for d in docs)
    assert not any("/test/" in f for f in stdlib_files(include_tests=False))
    assert not any("site-packages" in f for f in stdlib_files(include_tests=True))


def test_python_version_is_part_of_the_identity_and_checked_at_run_time(tmp_path):
    step = stdlib_corpus(max_bytes=1000)
    assert step.config.python_version == platform.python_version()
    other = step.with_config(StdlibCorpusConfig(python_version="3.99.0", max_bytes=1000))
    identities = Identities()
    assert identities.hash(step) != identities.hash(other)
    assert identities.hash(step) == Identities().hash(stdlib_corpus(max_bytes=1000))

    with pytest.raises(RuntimeError, match="3.99.0's standard library but this step runs on"):
        build_stdlib_corpus(StdlibCorpusConfig(python_version="3.99.0", output_path=str(tmp_path)))


def test_declaring_the_data_chain_imports_nothing_heavy():
    import subprocess
    import sys

    code = (
        "import sys; from defaults.data import default_tokenize, default_tokenizer, stdlib_corpus\n"
        "corpus = stdlib_corpus(max_bytes=1000)\n"
        "default_tokenize('s', corpus, default_tokenizer('t', corpus), seq_len=16)\n"
        "print(sorted(m for m in ('jax', 'levanter', 'tokenizers', 'datasets', 'pyarrow', 'numpy') if m in sys.modules))"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "[]"


def test_the_corpus_holds_no_file_the_python_build_wrote_for_this_machine():
    """`_sysconfigdata_*.py` and `config-<version>-<platform>/` hold this install's prefix and flags,
    under names that differ by platform: one identity's corpus would differ between machines."""
    root = sysconfig.get_paths()["stdlib"]
    built = [name for name in os.listdir(root) if name.startswith(("_sysconfigdata_", "config-"))]
    assert built, "this Python has no build files to leave out: the test checks nothing here"
    files = stdlib_files(include_tests=True)
    assert not [f for f in files if f.split("/")[0] in built] and "sysconfig.py" in files


def test_families_are_never_empty_and_asking_for_more_than_there_are_packages_is_refused():
    """An empty family given as `packages` reads the whole library, the general corpus's packages
    too: asking for more families than packages left gave one (and fewer families than asked)."""
    from keel.data import stdlib_families
    from keel.data.stdlib_corpus import top_level

    packages = sorted({top_level(f) for f in stdlib_files(False)})
    general = StdlibCorpusConfig(packages=tuple(packages[:-4]))
    families = stdlib_families(4, disjoint_from=general)
    assert [name for family in families for name in family] == packages[-4:] and all(families)
    with pytest.raises(ValueError, match=r"stdlib_families\(count=6\): give 1 to 4, the top-level packages left after "
                                         r"disjoint_from's"):
        stdlib_families(6, disjoint_from=general)
    with pytest.raises(ValueError, match=rf"stdlib_families\(count=0\): give 1 to {len(packages)}, the top-level packages left$"):
        stdlib_families(0)
