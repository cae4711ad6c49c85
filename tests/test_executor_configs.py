"""What a step's config holds reaches its function as declared: a NamedTuple stays a NamedTuple, a
list or dict subclass keeps its class, with only the placeholders inside swapped for paths; and an
External's version is a string that says something."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from keel import External, Step, output_of, this_output
from keel.executor.graph import substitute
from keel.executor.plan import EXTERNAL, Graph, plan_graph
from keel.executor.resolve import resolve_config
from keel.executor.run import run_steps
from keel.executor.step import StepDeclarationError


class Span(NamedTuple):
    start: int
    end: int


class Source(NamedTuple):
    path: object
    weight: int


class Tags(list):
    pass


class Table(collections.OrderedDict):
    pass


@dataclass(frozen=True)
class Cfg:
    span: Span = Span(0, 10)
    source: object = None
    tags: object = field(default_factory=lambda: Tags(["a"]))
    table: object = field(default_factory=lambda: Table(x=1))
    output_path: str = this_output()


SEEN: list[Cfg] = []


def record(config: Cfg) -> None:
    SEEN.append(config)
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "out.txt"), "w") as f:
        f.write(f"{type(config.span).__name__} {config.span.end - config.span.start}")


def test_a_named_tuple_reaches_the_step_as_itself(tmp_path):
    SEEN.clear()
    assert run_steps([Step("c/a", record, Cfg())], str(tmp_path), echo=lambda _: None).ok
    [config] = SEEN
    assert type(config.span) is Span and config.span.end == 10
    assert type(config.tags) is Tags and type(config.table) is Table


def test_resolving_keeps_unchanged_containers_and_rebuilds_changed_ones_with_their_own_class():
    dep = Step("c/dep", record, Cfg())
    config = Cfg(source=Source(output_of(dep, "x.txt"), 2), tags=Tags(["a", output_of(dep)]), table=Table(p=dep, n=1))
    resolved = resolve_config(config, "/out/c-1", lambda step: "/out/dep-1")
    assert resolved.span is config.span  # nothing to swap: the same object
    assert type(resolved.source) is Source and resolved.source == Source("/out/dep-1/x.txt", 2)
    assert type(resolved.tags) is Tags and resolved.tags == ["a", "/out/dep-1"]
    assert type(resolved.table) is Table and list(resolved.table.items()) == [("p", "/out/dep-1"), ("n", 1)]
    assert config.tags[1].step is dep and config.table["p"] is dep  # the declared config is left as it was
    plain = Cfg(tags=["a"], table={"n": 1})
    again = resolve_config(plain, "/out/c-1", lambda step: "/out/dep-1")
    assert again.tags == ["a"] and again.tags is not plain.tags and again.table is not plain.table  # the step's own


def test_substituting_steps_keeps_container_classes():
    old, new = Step("c/dep", record, Cfg()), Step("c/dep", record, Cfg())
    config = Cfg(source=Source(old, 2), tags=Tags([old]), table=Table(p=old))
    swapped = substitute(config, {id(old): new})
    assert type(swapped.source) is Source and swapped.source.path is new and swapped.source.weight == 2
    assert type(swapped.tags) is Tags and swapped.tags[0] is new
    assert type(swapped.table) is Table and swapped.table["p"] is new
    assert swapped.span is config.span
    untouched = Cfg(source=Source("/data", 1))
    assert substitute(untouched, {id(old): new}) is untouched  # no step inside: the same config


@pytest.mark.parametrize("version", ["", "   ", 3])
def test_an_external_with_an_empty_or_non_string_version_is_refused(tmp_path, version):
    with pytest.raises(StepDeclarationError, match=r"external 'raw': version=.* give a non-empty string .* or leave version out"):
        External("raw", str(tmp_path), version=version)


def test_an_external_version_is_shown_in_the_plan(tmp_path):
    data = External("raw", str(tmp_path / "nothing-here"), version="v2")
    plans = {p.name: p for p in plan_graph(Graph([Step("c/a", record, Cfg(source=output_of(data)))], str(tmp_path)))}
    assert plans["raw"].state == EXTERNAL and plans["raw"].reason == "version v2"
