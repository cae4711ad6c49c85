"""Two experiment files that declare the same data chain share its outputs: the second tokenizes nothing."""

import json
import os
import textwrap

from keel.cli import console_main, load_experiment
from keel.executor.run import run_steps

_CHAIN_A = """
    from defaults import default_tokenize, default_tokenizer, stdlib_corpus
    corpus = stdlib_corpus(max_bytes=200_000, validation_fraction=0.1)
    tokenizer = default_tokenizer("stdlib-bpe-512", corpus, vocab_size=512)
    cache = default_tokenize("stdlib", corpus, tokenizer, seq_len=64)
"""
# the same chain, written differently (keyword order, names, imports)
_CHAIN_B = """
    import defaults
    docs = defaults.stdlib_corpus(validation_fraction=0.1, max_bytes=200_000)
    tok = defaults.default_tokenizer("stdlib-bpe-512", docs, vocab_size=512)
    tokens = defaults.default_tokenize("stdlib", docs, tok, seq_len=64, batch_documents=3)  # execution-only
"""
_CONSUMER = """
    from dataclasses import dataclass
    import json
    import fsspec
    from keel import Step, main, this_output

    @dataclass(frozen=True)
    class CountConfig:
        cache: str
        label: str
        output_path: str = this_output()

    def count(config):
        with fsspec.open(config.cache + "/tokenize.json") as f:
            sequences = json.load(f)["splits"]["train"]["sequences"]
        with fsspec.open(config.output_path + "/count.txt", "w") as f:
            f.write(f"{config.label} {sequences}")

    consumer = Step("{name}/count", count, CountConfig({cache}, "{name}"))
    if __name__ == "__main__":
        main([consumer])
"""


def _experiment(tmp_path, name, chain, cache_var):
    path = tmp_path / f"{name}.py"
    consumer = _CONSUMER.replace("{name}", name).replace("{cache}", cache_var)
    path.write_text(textwrap.dedent(chain) + textwrap.dedent(consumer))
    return str(path)


def test_a_second_experiment_reuses_the_first_ones_data_chain(tmp_path, capsys):
    prefix = str(tmp_path / "outputs")
    first = _experiment(tmp_path, "first", _CHAIN_A, "cache")
    second = _experiment(tmp_path, "second", _CHAIN_B, "tokens")

    report = run_steps(load_experiment(first), prefix=prefix, echo=lambda _: None)
    assert report.ok and set(report.ran) == {"documents/stdlib", "tokenizers/stdlib-bpe-512", "tokenized/stdlib", "first/count"}
    tokenized = next(p.output_path for p in report.plans if p.name == "tokenized/stdlib")
    written = os.path.getmtime(f"{tokenized}/tokenize.json")

    capsys.readouterr()
    assert console_main(["plan", second, "--prefix", prefix, "--json"]) == 0
    plan = {s["name"]: s for s in json.loads(capsys.readouterr().out)["steps"]}
    assert {name: s["state"] for name, s in plan.items()} == {
        "documents/stdlib": "cached", "tokenizers/stdlib-bpe-512": "cached", "tokenized/stdlib": "cached", "second/count": "run",
    }
    assert plan["tokenized/stdlib"]["output_path"] == tokenized

    report = run_steps(load_experiment(second), prefix=prefix, echo=lambda _: None)
    assert report.ok and report.ran == ["second/count"]
    assert {p.name for p in report.plans if p.state == "cached"} == {"documents/stdlib", "tokenizers/stdlib-bpe-512", "tokenized/stdlib"}
    assert os.path.getmtime(f"{tokenized}/tokenize.json") == written
