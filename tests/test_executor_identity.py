"""Identity: golden hashes, what counts and what does not, and canonical encoding."""

import enum
import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from keel import External, Step, execution_only, output_of, this_output
from keel.executor.graph import CycleError, topological_order
from keel.executor.encoding import IdentityError
from keel.executor.identity import Identities
from keel.executor.plan import Graph
from keel.executor.step import StepDeclarationError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    lr: float
    tags: tuple = ()


@dataclass(frozen=True)
class Config:
    n: int
    inner: Inner = Inner(0.003)
    color: Color = Color.RED
    mapping: dict = field(default_factory=lambda: {"b": 1, "a": [1.5, None, True]})
    where: pathlib.PurePosixPath = pathlib.PurePosixPath("data/x")
    output_path: str = this_output()
    workers: int = execution_only(default=2)


def noop(config):
    pass


def graph_hashes(*steps):
    ids = Identities()
    return [ids.hash(s) for s in steps]


def test_golden_hashes():
    # Changing these re-keys every user's outputs: a breaking change, never a casual edit.
    a = Step("golden/a", noop, Config(n=1))
    b = Step("golden/b", noop, Config(n=2, inner=Inner(1e-3, ("x", output_of(a, "f.txt")))))
    ext = External("golden/ext", "gs://bucket/cache", version="v1")
    c = Step("golden/c", noop, Config(n=3, mapping={"data": ext}))
    assert graph_hashes(a, b, ext, c) == GOLDEN


GOLDEN = ["1bbe4b33ff", "f2cb005aef", "172deaaa77", "955dddc10d"]


def test_hash_stable_across_processes_and_hash_seeds():
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from test_executor_identity import *;"
        "a = Step('golden/a', noop, Config(n=1));"
        "print(graph_hashes(a)[0])"
    )
    seen = set()
    for seed in ("0", "1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, cwd=pathlib.Path(__file__).parent.parent)
        seen.add(out.stdout.strip())
    assert seen == {GOLDEN[0]}


def test_execution_only_fields_do_not_count():
    base = Step("x/a", noop, Config(n=1))
    assert graph_hashes(base) == graph_hashes(Step("x/a", noop, Config(n=1, workers=64)))
    assert graph_hashes(base) != graph_hashes(Step("x/a", noop, Config(n=2)))
    assert graph_hashes(base) != graph_hashes(Step("x/b", noop, Config(n=1)))


@dataclass(frozen=True)
class Layout:
    n: int
    shards: int = execution_only(default=1)
    spare: int = execution_only(default=0)

    def derived_identity(self) -> dict:
        return {"shards": self.shards} if self.shards > 1 else {}  # what the shards decide about the result


def test_what_execution_only_fields_decide_about_the_results_counts():
    """`DerivesIdentity`: the config says what its execution-only fields decide; that joins the
    identity and the content (a step of another name doing that same work still reuses it)."""
    ids = Identities()
    plain = Step("x/a", noop, Layout(1))
    assert "derived" not in ids.payload(plain)  # {}: the payload of a config that derives nothing
    assert ids.hash(plain) == ids.hash(Step("x/a", noop, Layout(1, spare=5)))  # decides nothing
    assert ids.hash(plain) != ids.hash(Step("x/a", noop, Layout(1, shards=4)))
    assert ids.hash(Step("x/a", noop, Layout(1, shards=4))) == ids.hash(Step("x/a", noop, Layout(1, shards=4, spare=5)))
    assert ids.content_hash(Step("x/a", noop, Layout(1, shards=4))) == ids.content_hash(Step("x/b", noop, Layout(1, shards=4)))
    assert ids.content_hash(Step("x/a", noop, Layout(1, shards=4))) != ids.content_hash(Step("x/a", noop, Layout(1, shards=2)))

def test_resources_never_count():
    from keel import Resources

    assert graph_hashes(Step("x/a", noop, Config(n=1))) == graph_hashes(Step("x/a", noop, Config(n=1), resources=Resources.with_gpu("H100", 8)))


def test_floats_exact_and_distinct_from_ints():
    h = lambda v: graph_hashes(Step("x/f", noop, Config(n=1, inner=Inner(v))))[0]  # noqa: E731
    assert h(0.1) != h(0.1 + 1e-17 * 10)
    assert h(0.30000000000000004) != h(0.3)
    tagged = lambda v: graph_hashes(Step("x/f", noop, Config(n=1, inner=Inner(0.1, (v,)))))[0]  # noqa: E731
    assert tagged(1.0) != tagged(1)  # a field not declared float keeps what it was given
    import numpy as np

    assert h(np.logspace(-3, -1, 3)[0]) == h(0.001)  # a sweep's numpy float is its value, whatever numpy's repr


def test_an_int_given_to_a_float_field_is_that_float():
    """`lr: float = 1` in a file and `--set ...lr=1` (read as 1.0) are one identity: the int is made
    the float its field declares, in the config the step runs."""
    inner = Inner(1)
    assert graph_hashes(Step("x/f", noop, Config(n=1, inner=inner))) == graph_hashes(Step("x/f", noop, Config(n=1, inner=Inner(1.0))))
    assert type(inner.lr) is float


def test_changing_a_dependency_rekeys_descendants_only():
    root = Step("g/root", noop, Config(n=1))
    child = Step("g/child", noop, Config(n=2, inner=Inner(0.1, (root,))))
    other = Step("g/other", noop, Config(n=3))
    root2 = Step("g/root", noop, Config(n=10))
    child2 = Step("g/child", noop, Config(n=2, inner=Inner(0.1, (root2,))))
    before = graph_hashes(root, child, other)
    after = graph_hashes(root2, child2, Step("g/other", noop, Config(n=3)))
    assert before[0] != after[0] and before[1] != after[1] and before[2] == after[2]


def test_dependencies_inferred_through_nesting():
    a = Step("n/a", noop, Config(n=1))
    b = Step("n/b", noop, Config(n=1))
    c = Step("n/c", noop, Config(n=1))
    ext = External("n/ext", "memory://somewhere")
    # a step's config nested in another config, holding its own placeholders
    nested = Config(n=5, inner=Inner(0.1, ({"deep": [output_of(b)]},)))
    d = Step("n/d", noop, Config(n=2, inner=Inner(0.2, (output_of(a, "x"), nested))), description="nested")
    e = Step("n/e", noop, Config(n=3, mapping={"step": c, "ext": ext, "d": d}))
    assert set(d.deps) == {a, b}
    assert set(e.deps) == {c, ext, d}
    order = topological_order([e])
    assert order.index(a) < order.index(d) < order.index(e) and order.index(b) < order.index(d)


def test_cycle_detection_names_the_cycle():
    box: list = []
    a = Step("cyc/a", noop, Config(n=1, mapping={"x": box}))
    b = Step("cyc/b", noop, Config(n=2, mapping={"x": output_of(a)}))
    box.append(output_of(b))
    a._deps = None  # the list was mutated after the step was declared
    with pytest.raises(CycleError, match=r"cyc/a -> cyc/b -> cyc/a|cyc/b -> cyc/a -> cyc/b"):
        topological_order([b])


def test_unencodable_values_name_the_field():
    @dataclass(frozen=True)
    class Bad:
        fn: object = None

    step = Step("bad/a", noop, Config(n=1, mapping={"k": Bad(fn=lambda: 1)}))
    with pytest.raises(IdentityError, match=r"bad/a\.config\.mapping\.k\.fn.*function"):
        graph_hashes(step)
    with pytest.raises(IdentityError, match="dict keys must be strings"):
        graph_hashes(Step("bad/b", noop, Config(n=1, mapping={1: 2})))
    # a key named like the encoding's markers would make {"__float__": "1.0"} the float 1.0
    with pytest.raises(IdentityError, match=r"bad/c\.config\.mapping: dict key '__float__' is a name the encoding keeps"):
        graph_hashes(Step("bad/c", noop, Config(n=1, mapping={"__float__": "1.0"})))


@pytest.mark.parametrize("name", ["Upper/x", "/lead", "a/../b", "sp ace", "", "a//b", "x/"])
def test_bad_names_rejected(name):
    with pytest.raises(StepDeclarationError, match="invalid step name"):
        Step(name, noop, Config(n=1))


@pytest.mark.parametrize("name", ["a", "tutorial/numbers", "hero/data/cell-003", "v1.2_x/y-z"])
def test_good_names_accepted(name):
    assert Step(name, noop, Config(n=1)).name == name


def test_output_path_layout():
    step = Step("tutorial/numbers", noop, Config(n=1))
    graph = Graph([step], "memory://bucket/prefix/")
    path = graph.path(step)
    assert path.startswith("memory://bucket/prefix/tutorial/numbers-")
    assert len(path.rsplit("-", 1)[1]) >= 8
    local = Graph([step], "rel/outputs")
    assert local.path(step).startswith("/") and "/rel/outputs/tutorial/numbers-" in local.path(step)


def test_config_must_be_a_dataclass_instance():
    with pytest.raises(StepDeclarationError, match="dataclass instance"):
        Step("x/y", noop, {"n": 1})
    with pytest.raises(StepDeclarationError, match="dataclass instance"):
        Step("x/y", noop, Config)


def test_a_step_function_whose_module_does_not_parse_has_no_fingerprint(tmp_path, monkeypatch):
    """Planning reads the function's source to say whether it changed; a module with a syntax
    error (or not UTF-8) gives none, instead of a traceback from the planner."""
    from keel import StepFunction
    from keel.executor.code import fingerprint

    (tmp_path / "half_written.py").write_text("def train(config):\n    return (\n")
    (tmp_path / "latin1.py").write_bytes("# caf\xe9\ndef train(config):\n    pass\n".encode("latin-1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fingerprint(StepFunction("half_written:train")) is None
    assert fingerprint(StepFunction("latin1:train")) is None


def test_a_step_function_named_by_module_has_the_identity_and_fingerprint_of_the_function_itself():
    """`StepFunction("module:function")` lets a graph name a function whose module imports jax
    without importing it: nothing about the step may differ from passing the function."""
    from keel import StepFunction
    from keel.executor.code import fingerprint

    named = StepFunction(f"{__name__}:noop")
    by_name, direct = Step("a/b", named, Config(n=1)), Step("a/b", noop, Config(n=1))
    ids = Identities()
    assert ids.hash(by_name) == ids.hash(direct) and ids.content_hash(by_name) == ids.content_hash(direct)
    assert fingerprint(named) == fingerprint(noop) is not None
    assert named.__qualname__ == "noop" and named.resolve() is noop
    for bad in ("no_colon", "mod:", ":fn", "mod:not an identifier"):
        with pytest.raises(StepDeclarationError, match="package.module:function"):
            StepFunction(bad)
    code = ("import sys; from keel import StepFunction; from keel.executor.code import fingerprint; "
            "assert fingerprint(StepFunction('keel.train.step:train_step')); "
            "print(sorted(m for m in ('jax', 'levanter', 'keel.train', 'keel.train.step') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr  # read, never imported


def test_the_canonical_text_is_the_standard_encoders_for_every_kind_of_value():
    from keel.executor.encoding import canonical_json, encode, one_line_encoder

    standard = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    a = Step("golden/a", noop, Config(n=1))
    values = [Config(n=3, inner=Inner(1e-3, ("x", output_of(a, "f.txt"))), mapping={"z": [1, None, True], "a": "ünï\n\"q\"\ud800"}),
              {"b": {"d": 2**70, "c": -0.0}, "a": [[], {}]}, "\u2028", None, False, 1.5e300]
    plan_line = one_line_encoder(sort_keys=False, separators=(", ", ": "), default=str)  # `keel plan --json`'s
    for value in values:
        payload = encode(value, "v", lambda step: "h")
        assert canonical_json(payload) == standard.encode(payload)
        assert plan_line(payload) == json.dumps(payload, default=str)
    assert plan_line({"b": pathlib.Path("/x"), "a": float("inf")}) == json.dumps({"b": pathlib.Path("/x"), "a": float("inf")}, default=str)
