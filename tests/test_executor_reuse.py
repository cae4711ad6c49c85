"""Content addressing across names: the same work declared under two names runs once."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import fsspec

from keel import Step, output_of, this_output
from keel.cli import console_main
from keel.executor.plan import CACHED, RUN, Graph, plan_graph
from keel.executor.run import run_steps

CALLS: list[str] = []


@dataclass(frozen=True)
class Text:
    text: str
    source: str | None = None
    output_path: str = this_output()


def write(config: Text) -> None:
    CALLS.append(config.text)
    prefix = ""
    if config.source:
        with fsspec.open(config.source) as f:
            prefix = f.read().decode()
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "out.txt"), "w") as f:
        f.write(prefix + config.text)


def shout(config: Text) -> None:  # the same config type, another function: other work
    write(Text(config.text.upper(), config.source, config.output_path))


def chain(first: str, second: str, fn=write) -> Step:
    a = Step(first, fn, Text("a"))
    return Step(second, write, Text("b", source=output_of(a, "out.txt")))


def test_the_same_work_under_another_name_is_cached_at_the_first_output(tmp_path):
    prefix = str(tmp_path)
    CALLS.clear()
    report = run_steps([chain("exp1/a", "exp1/b")], prefix, echo=lambda _: None)
    assert report.ok and CALLS == ["a", "b"]

    # a second experiment names the same two steps differently: nothing is computed again
    second = chain("exp2/renamed-a", "exp2/renamed-b")
    graph = Graph([second], prefix)
    plans = {p.name: p for p in plan_graph(graph)}
    assert plans["exp2/renamed-a"].state == CACHED and plans["exp2/renamed-a"].reused_from == "exp1/a"
    assert plans["exp2/renamed-a"].reason == "the same work as exp1/a: its output is reused"
    assert plans["exp2/renamed-a"].output_path.rsplit("/", 1)[-1].startswith("a-")  # exp1/a's folder
    assert plans["exp2/renamed-b"].reused_from == "exp1/b"  # its dependency is the same work, so it is too
    CALLS.clear()
    assert run_steps([second], prefix, echo=lambda _: None).ok and CALLS == []

    # other work (another function, or another config) under a name never seen is not reused
    other = {p.name: p for p in plan_graph(Graph([chain("exp3/a", "exp3/b", fn=shout)], prefix))}
    assert other["exp3/a"].state == RUN and other["exp3/a"].reused_from is None
    assert other["exp3/b"].state == RUN  # its input is another output


def test_a_damaged_or_deleted_original_is_not_reused(tmp_path):
    prefix = str(tmp_path)
    run_steps([chain("exp1/a", "exp1/b")], prefix, echo=lambda _: None)
    original = next(p for p in plan_graph(Graph([chain("exp1/a", "exp1/b")], prefix)) if p.name == "exp1/a").output_path
    with open(os.path.join(original, "out.txt"), "w") as f:
        f.write("damaged in place")
    plans = {p.name: p for p in plan_graph(Graph([chain("x/a", "x/b")], prefix))}
    assert plans["x/a"].state == RUN and plans["x/a"].reused_from is None
    assert plans["x/b"].reused_from == "exp1/b"  # intact, and the same work: reading x/a's output would make it again
    CALLS.clear()
    assert run_steps([chain("x/a", "x/b")], prefix, echo=lambda _: None).ok and CALLS == ["a"]
    # x/a's fresh output is what the index names now; the damaged one is left as it was
    again = {p.name: p for p in plan_graph(Graph([chain("y/a", "y/b")], prefix))}
    assert again["y/a"].reused_from == "x/a"


_EXPERIMENT = """from dataclasses import dataclass
import os
import re
from keel import Step, main, output_of, this_output


@dataclass(frozen=True)
class C:
    source: object = None
    output_path: str = this_output()


def make(config: C) -> None:
    os.makedirs(config.output_path, exist_ok=True)
    open(os.path.join(config.output_path, 'out.txt'), 'w').write({body!r})


def copy(config: C) -> None:
    os.makedirs(config.output_path, exist_ok=True)
    text = open(config.source).read()
    open(os.path.join(config.output_path, 'out.txt'), 'w').write('copied ' + text)


{steps}
"""


def _experiment(path, body: str, steps: str) -> str:
    """An experiment file whose `make` writes `body` (and whose `copy` copies its source), declaring `steps`."""
    path.write_text(_EXPERIMENT.format(body=body, steps=steps))
    return str(path)


def test_two_experiment_files_own_functions_of_one_name_are_not_the_same_work(tmp_path, capsys):
    def experiment(name: str, step: str, body: str) -> str:
        return _experiment(tmp_path / f"{name}.py", body, f"if __name__ == '__main__':\n    main([Step({step!r}, make, C())])")

    prefix = str(tmp_path / "out")
    assert console_main(["run", experiment("exp1", "x/a", "hello"), "--prefix", prefix]) == 0
    # both files' `make` is `__main__.make` with an equal config, but it writes something else
    assert console_main(["run", experiment("exp3", "x/z", "something else"), "--prefix", prefix]) == 0
    assert "1 ran, 0 reused, 0 cached" in capsys.readouterr().out
    assert [p.read_text() for p in sorted((tmp_path / "out" / "x").glob("*/out.txt"))] == ["hello", "something else"]
    # a third file whose `make` reads as the first one's does the same work: it is reused
    assert console_main(["run", experiment("exp4", "x/y", "hello"), "--prefix", prefix]) == 0
    assert "0 ran, 0 reused, 1 cached" in capsys.readouterr().out


def test_an_output_made_by_old_code_is_not_indexed_as_the_new_codes_work(tmp_path, capsys):
    """A step whose function changed stays cached under its own name (a note says so); the index
    must not file that old output under the new code's content hash, where another experiment
    doing the new work would be served it."""
    def experiment(name: str, step: str, body: str) -> str:
        return _experiment(tmp_path / f"{name}.py", body, f"a = Step({step + '/a'!r}, make, C())\n"
                           f"b = Step({step + '/b'!r}, copy, C(source=output_of(a, 'out.txt')))\n"
                           "if __name__ == '__main__':\n    main([b])")

    prefix = str(tmp_path / "out")
    assert console_main(["run", experiment("v1", "first", "version 1"), "--prefix", prefix]) == 0
    assert console_main(["run", experiment("v1_edited", "first", "version 2"), "--prefix", prefix]) == 0
    assert "0 ran, 0 reused, 2 cached" in capsys.readouterr().out  # the edit alone does not rerun it
    assert console_main(["run", experiment("v2", "second", "version 2"), "--prefix", prefix]) == 0
    assert "2 ran, 0 reused, 0 cached" in capsys.readouterr().out
    assert [p.read_text() for p in sorted((tmp_path / "out" / "second").glob("b-*/out.txt"))] == ["copied version 2"]


def test_an_entry_whose_output_a_forced_rerun_remade_with_other_code_is_not_reused(tmp_path, capsys):
    """`--force` reruns a step under edited code in its own folder: the old code's index entry still
    names that folder, whose output is now the new code's work, so the old work under another name
    runs (the entry is checked against the content hash its output's step.json records)."""
    def experiment(name: str, step: str, body: str) -> str:
        return _experiment(tmp_path / f"{name}.py", body, f"if __name__ == '__main__':\n    main([Step({step!r}, make, C())])")

    prefix = str(tmp_path / "out")
    assert console_main(["run", experiment("v1", "x/a", "version 1"), "--prefix", prefix]) == 0
    assert console_main(["run", experiment("v2", "x/a", "version 2"), "--prefix", prefix, "--force", "x/a"]) == 0
    assert [p.read_text() for p in (tmp_path / "out" / "x").glob("a-*/out.txt")] == ["version 2"]
    capsys.readouterr()
    assert console_main(["run", experiment("v1_again", "x/b", "version 1"), "--prefix", prefix]) == 0
    assert "1 ran, 0 reused, 0 cached" in capsys.readouterr().out
    assert [p.read_text() for p in (tmp_path / "out" / "x").glob("b-*/out.txt")] == ["version 1"]


def test_an_output_that_force_makes_again_in_this_run_is_not_reused_by_another_step(tmp_path):
    """`--force` empties a step's output before it runs again: a step of the same work under another
    name in the same run must not read that folder meanwhile, so it runs under its own name."""
    prefix = str(tmp_path)
    assert run_steps([chain("exp1/a", "exp1/b")], prefix, echo=lambda _: None).ok
    both = [chain("exp1/a", "exp1/b"), chain("exp2/a", "exp2/b")]
    plans = {p.name: p for p in plan_graph(Graph(both, prefix), force=re.compile("^exp1/a$"))}
    assert plans["exp1/a"].state == RUN and plans["exp2/a"].state == RUN, plans["exp2/a"]
    assert "the same work as exp1/a, which --force makes again" in plans["exp2/a"].reason
    assert plans["exp2/a"].output_path != plans["exp1/a"].output_path
    CALLS.clear()
    report = run_steps(both, prefix, echo=lambda _: None, force="^exp1/a$")
    assert report.ok and sorted(CALLS) == ["a", "a"]


def test_an_index_that_cannot_be_written_leaves_the_step_finished_and_says_so(tmp_path):
    """The index is a cache: a failed write (a quota, a store error; here its folder is a file) is
    named on the console, and the step that finished stays SUCCESS for the run and its dependents."""
    (tmp_path / ".keel").mkdir()
    (tmp_path / ".keel" / "content").write_text("")
    said: list[str] = []
    made = Step("one/text", write, Text("hello"))
    report = run_steps([Step("one/use", write, Text("use", source=output_of(made, "out.txt")))], str(tmp_path), echo=said.append)
    assert report.ok, report.failures
    warned = [line for line in said if line.startswith("[keel] warn  one/text: not indexed for reuse")]
    assert warned and "FileExistsError" in warned[0] and f"until {tmp_path}/.keel/content can be written" in warned[0]
    assert run_steps([made], str(tmp_path), echo=said.append).ok  # cached: indexing it again fails again
    assert [p.state for p in plan_graph(Graph([made], str(tmp_path)))] == [CACHED]


def test_a_cached_output_whose_record_a_crash_tore_stays_cached_and_is_not_indexed(tmp_path):
    """A step.json torn by a machine crash (it is not fsynced) cannot say what work its output is:
    indexing the finished outputs skips it, as reuse does, instead of raising a bare JSON error
    before anything runs."""
    import shutil

    from keel.executor.status import RECORD, keel_path

    prefix = str(tmp_path)
    made = Step("one/text", write, Text("hello"))
    assert run_steps([made], prefix, echo=lambda _: None).ok
    record = keel_path(Graph([made], prefix).path(made), RECORD)
    with open(record) as f:
        text = f.read()
    with open(record, "w") as f:
        f.write(text[: len(text) // 2])
    shutil.rmtree(tmp_path / ".keel" / "content")  # the entry lost too: indexing reads the record
    CALLS.clear()
    report = run_steps([made], prefix, echo=lambda _: None)
    assert report.ok and CALLS == [], report.failures
    assert [p.state for p in plan_graph(Graph([made], prefix))] == [CACHED]
    assert not (tmp_path / ".keel" / "content").exists() or not list((tmp_path / ".keel" / "content").iterdir())
