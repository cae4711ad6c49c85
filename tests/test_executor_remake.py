"""A finished output whose input is made again is made again too: an input keeps its path (and its
dependents their identity) when `--force` remakes it, so keel compares when each input was made
with what the output recorded (`Status.inputs`)."""

from __future__ import annotations

import json
import re
import os
from dataclasses import dataclass

from keel import Step, execution_only, output_of, this_output
from keel.executor.plan import CACHED, RUN, Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.status import output_digest, read_status

MADE = {"count": 0}


@dataclass(frozen=True)
class Source:
    output_path: str = this_output()


@dataclass(frozen=True)
class Derived:
    source: str
    output_path: str = this_output()


def draw(config: Source) -> None:
    MADE["count"] += 1  # a step whose output differs each time it is made (an edited function, a new draw)
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "value.json"), "w") as f:
        json.dump(MADE["count"], f)


def copy(config: Derived) -> None:
    with open(config.source) as f:
        value = json.load(f)
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "value.json"), "w") as f:
        json.dump(value, f)


def chain():
    source = Step("r/source", draw, Source())
    middle = Step("r/middle", copy, Derived(output_of(source, "value.json")))
    return source, middle, Step("r/last", copy, Derived(output_of(middle, "value.json")))


def values(prefix: str, steps) -> list[int]:
    graph = Graph(list(steps), prefix)
    return [json.load(open(os.path.join(graph.path(s), "value.json"))) for s in steps]


def quiet(_):
    pass


def test_forcing_a_step_makes_every_step_after_it_again_from_a_clean_start(tmp_path):
    prefix, steps = str(tmp_path), chain()
    assert run_steps([steps[-1]], prefix, echo=quiet).ok
    first = values(prefix, steps)
    assert first[0] == first[1] == first[2]
    leftover = os.path.join(Graph(list(steps), prefix).path(steps[1]), "stale.txt")
    open(leftover, "w").close()  # what the old attempt left (an old checkpoint): a remade output starts clean
    planned = {p.name: p for p in plan_graph(Graph([steps[-1]], prefix), force=re.compile("^r/source$"))}
    assert planned["r/middle"].state == RUN and "its input r/source is made again in this run" in planned["r/middle"].reason
    assert planned["r/last"].state == RUN and "its input r/middle is made again in this run (after its own input)" in planned["r/last"].reason
    report = run_steps([steps[-1]], prefix, force="^r/source$", echo=quiet)
    assert report.ok and report.ran == ["r/source", "r/middle", "r/last"]
    again = values(prefix, steps)
    assert again[0] == again[1] == again[2] != first[0]
    assert not os.path.exists(leftover)
    assert [p.state for p in plan_graph(Graph([steps[-1]], prefix))] == [CACHED] * 3


def test_an_input_made_again_in_an_earlier_run_makes_the_output_after_it_stale(tmp_path):
    """`--force` of one step with `--only` remakes it alone: the next plan says which outputs read
    the old one, and the next run makes them again."""
    prefix, steps = str(tmp_path), chain()
    assert run_steps([steps[-1]], prefix, echo=quiet).ok
    assert run_steps([steps[-1]], prefix, force="^r/source$", only="^r/source$", echo=quiet).ran == ["r/source"]
    planned = {p.name: p for p in plan_graph(Graph([steps[-1]], prefix))}
    assert planned["r/source"].state == CACHED
    assert planned["r/middle"].state == RUN and "its input r/source was made again (" in planned["r/middle"].reason
    assert planned["r/last"].state == RUN and "its input r/middle is made again in this run (after its own input)" in planned["r/last"].reason
    assert run_steps([steps[-1]], prefix, echo=quiet).ran == ["r/middle", "r/last"]
    assert len(set(values(prefix, steps))) == 1
    middle = Graph(list(steps), prefix).path(steps[1])
    assert read_status(middle).inputs == {"r/source": output_digest(read_status(Graph(list(steps), prefix).path(steps[0])))}


def fixed(config: Source) -> None:
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "value.json"), "w") as f:
        json.dump(7, f)


def test_an_input_made_again_with_the_same_content_keeps_the_outputs_after_it(tmp_path):
    """A deterministic step forced (its code edited without changing what it makes), or a damaged
    output restored: the steps after it read the same bytes, so their outputs are kept."""
    prefix = str(tmp_path)
    source = Step("r/source", fixed, Source())
    middle = Step("r/middle", copy, Derived(output_of(source, "value.json")))
    last = Step("r/last", copy, Derived(output_of(middle, "value.json")))
    assert run_steps([last], prefix, echo=quiet).ok
    made = read_status(Graph([last], prefix).path(last)).finished
    said: list[str] = []
    report = run_steps([last], prefix, force="^r/source$", echo=said.append)
    assert report.ran == ["r/source"] and report.reused == ["r/middle", "r/last"], said
    assert "[keel] keep  r/middle: its inputs were made again with the content it read" in said
    assert read_status(Graph([last], prefix).path(last)).finished == made
    assert [p.state for p in plan_graph(Graph([last], prefix))] == [CACHED] * 3


EDITED = '''
import os
from dataclasses import dataclass
from keel import Step, this_output


@dataclass(frozen=True)
class C:
    output_path: str = this_output()


def make(config):
    os.makedirs(config.output_path, exist_ok=True)
    open(os.path.join(config.output_path, "n.txt"), "w").write("{value}")


step = Step("r/edited", make, C())
'''


def test_keel_run_names_a_cached_output_whose_function_changed_since(tmp_path):
    """`keel plan` notes it; `keel run`, which keeps the output, says so too, with the `--force`."""
    import runpy

    prefix = str(tmp_path / "out")
    for value in (1, 2):
        (tmp_path / f"v{value}.py").write_text(EDITED.format(value=value))
    said: list[str] = []
    assert run_steps([runpy.run_path(str(tmp_path / "v1.py"), run_name="__main__")["step"]], prefix, echo=said.append).ok
    assert not [line for line in said if line.startswith("[keel] note")]
    report = run_steps([runpy.run_path(str(tmp_path / "v2.py"), run_name="__main__")["step"]], prefix, echo=said.append)
    assert report.ok and not report.ran
    assert "[keel] note  r/edited: make changed since this output was made (the code is not part of the identity): " \
           "`--force '^r/edited$'` reruns it" in said


@dataclass(frozen=True)
class Ordered:
    n: int
    after: object = execution_only(default=None)  # what it runs after, not what it is made from
    output_path: str = this_output()


def note(config: Ordered) -> None:
    os.makedirs(config.output_path, exist_ok=True)
    open(os.path.join(config.output_path, "n.txt"), "w").write(str(config.n))


def test_a_step_held_only_in_an_execution_only_field_orders_the_run_and_remakes_nothing(tmp_path):
    """A ladder's prediction, say: the training step runs after it, but is not made from it."""
    prefix = str(tmp_path)
    source = Step("r/source", draw, Source())
    after = Step("r/after", note, Ordered(1, after=output_of(source, "value.json")))
    assert after.deps == (source,) and after.keyed_deps == ()
    assert run_steps([after], prefix, echo=quiet).ran == ["r/source", "r/after"]
    assert run_steps([after], prefix, force="^r/source$", echo=quiet).ran == ["r/source"]
    assert [p.state for p in plan_graph(Graph([after], prefix))] == [CACHED, CACHED]
