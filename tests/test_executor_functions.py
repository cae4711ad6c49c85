"""A step's function: a plain function, a `functools.partial`, a callable object, a bound method.
Each runs, caches and has a content hash (its bound arguments or state included), and two steps under one name
that run different functions are refused, not merged."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest

from keel import Step, output_of, this_output
from keel.executor import code, reuse
from keel.executor.identity import Identities
from keel.executor.plan import CACHED, RUN, Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.step import StepDeclarationError


@dataclass(frozen=True)
class Cfg:
    n: int
    output_path: str = this_output()


@dataclass(frozen=True)
class Pair:
    first: object
    second: object
    output_path: str = this_output()


def write(path: str, text: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "out.txt"), "w") as f:
        f.write(text)


def scaled(config: Cfg, scale: int = 1) -> None:
    write(config.output_path, str(config.n * scale))


def other(config: Cfg, scale: int = 1) -> None:
    write(config.output_path, f"other {config.n * scale}")


class Scaler:
    """A callable object: its class is the function, its attributes are bound like a partial's."""

    def __init__(self, scale: int):
        self.scale = scale

    def __call__(self, config: Cfg) -> None:
        write(config.output_path, str(config.n * self.scale))


class Multiplier:
    """A bound method's object is bound like a partial's arguments; a classmethod's, its class."""

    scale = 1

    def __init__(self, scale: int):
        self.scale = scale

    def write(self, config: Cfg) -> None:
        write(config.output_path, str(config.n * self.scale))

    @classmethod
    def write_at_class_scale(cls, config: Cfg) -> None:
        write(config.output_path, str(config.n * cls.scale))


class Doubler(Multiplier):
    scale = 2


def pair(config: Pair) -> None:
    write(config.output_path, "pair")


def quiet(_):
    pass


def read(path: str) -> str:
    with open(os.path.join(path, "out.txt")) as f:
        return f.read()


BOUND = {"partial": lambda s: functools.partial(scaled, scale=s), "callable-object": Scaler,
         "bound-method": lambda s: Multiplier(s).write}


@pytest.mark.parametrize("fn", [make(2) for make in BOUND.values()], ids=list(BOUND))
def test_a_partial_or_a_callable_object_runs_and_is_cached(tmp_path, fn):
    step = Step("f/a", fn, Cfg(3))
    report = run_steps([step], str(tmp_path), echo=lambda _: None)
    assert report.ok and report.ran == ["f/a"]
    [plan] = plan_graph(Graph([step], str(tmp_path)))
    assert read(plan.output_path) == "6"
    assert plan.state == CACHED and plan.reason == ""  # the recorded fingerprint is the one planned
    assert run_steps([step], str(tmp_path), echo=lambda _: None).ran == []


def test_the_names_of_a_partial_and_a_callable_object():
    assert code.qualified_name(functools.partial(scaled, scale=2)) == f"functools.partial({__name__}.scaled)"
    assert code.qualified_name(Scaler(2)) == f"{__name__}.Scaler"
    assert code.qualified_name(Multiplier(2).write) == f"{__name__}.Multiplier.write"


@pytest.mark.parametrize("make", list(BOUND.values()), ids=list(BOUND))
def test_bound_arguments_and_object_state_are_part_of_the_content_hash(make):
    def content(fn):
        return Identities().content_hash(Step("f/a", fn, Cfg(3)))

    assert content(make(2)) == content(make(2))  # two objects, one work: encoded by value, not by id
    assert content(make(2)) != content(make(5))
    assert code.fingerprint(make(2)) == code.fingerprint(make(2)) != code.fingerprint(make(5))


def test_a_classmethod_is_bound_to_its_class():
    assert code._fingerprint(Multiplier.write_at_class_scale) == code._fingerprint(Multiplier.write_at_class_scale)  # uncached
    assert code.fingerprint(Multiplier.write_at_class_scale) != code.fingerprint(Doubler.write_at_class_scale)
    assert code.qualified_name(Doubler.write_at_class_scale) == f"{__name__}.Multiplier.write_at_class_scale"


@pytest.mark.parametrize("make", list(BOUND.values()), ids=list(BOUND))
def test_the_same_bound_work_under_another_name_is_reused_and_other_work_is_not(tmp_path, make):
    prefix = str(tmp_path)
    assert run_steps([Step("one/a", make(2), Cfg(3))], prefix, echo=lambda _: None).ok
    [same] = plan_graph(Graph([Step("two/a", make(2), Cfg(3))], prefix))
    assert same.state == CACHED and same.reused_from == "one/a"
    [changed] = plan_graph(Graph([Step("three/a", make(5), Cfg(3))], prefix))
    assert changed.state == RUN and changed.reused_from is None


def test_a_function_without_readable_source_or_state_is_never_reused():
    unreadable = [
        functools.partial(len),  # a builtin: no source
        functools.partial(scaled, scale=object()),  # a bound value with no canonical encoding
        Scaler(object()),
        Multiplier(object()).write,
    ]
    for fn in unreadable:
        assert code.fingerprint(fn) is None, fn
        assert not reuse.reusable(Step("f/a", fn, Cfg(1)))
        Identities().content_hash(Step("f/a", fn, Cfg(1)))  # still hashed: planning such a step works


def test_two_steps_with_one_name_and_config_but_other_functions_are_refused():
    graph = Graph([Step("use", pair, Pair(Step("gen", scaled, Cfg(1)), Step("gen", scaled, Cfg(1))))], "memory://fns")
    assert [s.name for s in graph.order] == ["gen", "use"]  # one function declared twice: one step
    with pytest.raises(StepDeclarationError, match=rf"two different steps are named 'gen' \(fn: {__name__}.scaled -> {__name__}.other\); rename"):
        Graph([Step("use", pair, Pair(Step("gen", scaled, Cfg(1)), Step("gen", other, Cfg(1))))], "memory://fns")
    differ = Pair(Step("gen", functools.partial(scaled, scale=2), Cfg(1)), Step("gen", functools.partial(scaled, scale=3), Cfg(1)))
    with pytest.raises(StepDeclarationError, match=r"two different steps are named 'gen' \(fn: the source or bound arguments "
                                                   rf"of functools.partial\({__name__}.scaled\) differ\)"):
        Graph([Step("use", pair, differ)], "memory://fns")


def test_two_steps_with_one_name_and_function_still_merge_when_they_are_partials():
    twice = Pair(Step("gen", functools.partial(scaled, scale=2), Cfg(1)), Step("gen", functools.partial(scaled, scale=2), Cfg(1)))
    graph = Graph([Step("use", pair, twice)], "memory://fns")
    assert [s.name for s in graph.order] == ["gen", "use"]
    assert graph.order[1].config.first is graph.order[1].config.second is graph.order[0]


def test_a_dependency_with_another_function_under_a_reused_name_is_refused_end_to_end(tmp_path):
    a, b = Step("gen", scaled, Cfg(1)), Step("gen", other, Cfg(1))
    with pytest.raises(StepDeclarationError, match="two different steps are named 'gen'"):
        run_steps([Step("use", quiet, Pair(output_of(a), output_of(b)), no_outputs=True)], str(tmp_path), echo=lambda _: None)


def scale_maker(scale: int):
    def make(config: Cfg) -> None:
        write(config.output_path, str(config.n * scale))
    return make


LAMBDAS = [lambda config, k=k: write(config.output_path, str(config.n * k)) for k in (2, 10)]


@pytest.mark.parametrize("made", [scale_maker, lambda k: LAMBDAS[(2, 10).index(k)]], ids=["closure", "lambda-default"])
def test_functions_of_one_source_that_read_other_values_are_other_work(tmp_path, made):
    """A sweep's functions made by one maker share their source: the closure's cell or the lambda's
    default says which work each did."""
    prefix = str(tmp_path)
    assert run_steps([Step("sweep/scale2", made(2), Cfg(3))], prefix, echo=lambda _: None).ok
    [other_scale] = plan_graph(Graph([Step("sweep/scale10", made(10), Cfg(3))], prefix))
    assert other_scale.state == RUN and other_scale.reused_from is None
    [same_scale] = plan_graph(Graph([Step("again/scale2", made(2), Cfg(3))], prefix))
    assert same_scale.state == CACHED and same_scale.reused_from == "sweep/scale2"
    assert code.fingerprint(scale_maker(object())) is None  # a cell with no canonical encoding: never reused


EXPERIMENT = '''
import logging
import os
from dataclasses import dataclass

from keel import Step, this_output

logger = logging.getLogger("experiment")
SCALE = {scale}


@dataclass(frozen=True)
class C:
    n: int
    output_path: str = this_output()


def scaled(n):
    return n * SCALE


def make(config: C) -> None:
    logger.info("making")
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "out.txt"), "w") as f:
        f.write(str({call}))


step = Step("{name}", make, C(3))
'''


def _experiment(tmp_path, name: str, scale: int, call: str = "config.n * SCALE") -> Step:
    """A step declared in an experiment file, loaded as `keel run` loads one: as `__main__`."""
    import runpy

    path = tmp_path / f"{name.replace('/', '_')}_{scale}_{abs(hash(call))}.py"
    path.write_text(EXPERIMENT.format(scale=scale, name=name, call=call))
    return runpy.run_path(str(path), run_name="__main__")["step"]


@pytest.mark.parametrize("call", ["config.n * SCALE", "scaled(config.n)"], ids=["global", "helper-reading-a-global"])
def test_two_experiment_files_whose_function_reads_another_global_are_other_work(tmp_path, call):
    prefix = str(tmp_path / "out")
    first = _experiment(tmp_path, "a/numbers", 2, call)
    assert code.fingerprint(first.fn) is not None  # a logger global is read by its type: still reusable
    assert run_steps([first], prefix, echo=lambda _: None).ok
    [other_scale] = plan_graph(Graph([_experiment(tmp_path, "b/numbers", 10, call)], prefix))
    assert other_scale.state == RUN and other_scale.reused_from is None
    [same_scale] = plan_graph(Graph([_experiment(tmp_path, "c/numbers", 2, call)], prefix))
    assert same_scale.state == CACHED and same_scale.reused_from == "a/numbers"
