"""The declaration side of keel: steps, placeholders and execution-only fields.

An experiment file builds a graph out of `Step`s whose configs are frozen dataclasses. Paths are
not known when the file is written, so configs hold placeholders (`this_output()`, `output_of(...)`)
that the executor swaps for concrete strings just before a step's function runs. Nothing here
imports anything heavy: declaring a graph must stay instant.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import importlib.machinery
import math
import pathlib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, runtime_checkable

from keel.executor.collector import no_cycle_collection
from keel.executor.resources import Resources

EXECUTION_ONLY = "keel.execution_only"
_NAME_RE = re.compile(r"^[a-z0-9_.\-]+(/[a-z0-9_.\-]+)*$")


class StepDeclarationError(ValueError):
    """A step, its name or its config is declared in a way keel cannot run."""


@dataclass(frozen=True)
class ThisOutput:
    """Placeholder for the running step's own output directory (plus an optional sub path)."""

    subpath: str = ""


@dataclass(frozen=True, eq=False)
class OutputOf:
    """Placeholder for a dependency's output directory (plus a sub path); it is the graph's edge."""

    step: "Step | External"
    subpath: str = ""


def this_output(subpath: str = "") -> Any:
    """Field default (or value) that resolves to the step's own output directory."""
    return ThisOutput(subpath)


def output_of(step: "Step | External", subpath: str = "") -> Any:
    """The path of `step`'s output (joined with `subpath`); using it makes `step` a dependency."""
    if not isinstance(step, (Step, External)):
        raise StepDeclarationError(f"output_of() takes a Step or External, got {type(step).__name__}")
    return OutputOf(step, subpath.strip("/"))


def execution_only(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field that never counts toward a step's identity.

    Use it for how a step runs (parallelism, logging and checkpoint cadence, devices), never for
    what it computes: changing it reuses the cached output. A step's output held here (`output_of`)
    orders the run (the step runs after it) without keying this one: remaking it reruns nothing.
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata[EXECUTION_ONLY] = True
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata, **kwargs)


@runtime_checkable
class ReadsFiles(Protocol):
    """A config whose step reads files keel does not make: their fingerprints join its identity
    (`keel.executor.inputs`), so an edited input makes the step stale."""

    def input_files(self) -> dict[str, str]:
        """{name in the identity: url} of every outside file the step reads."""


@runtime_checkable
class DerivesIdentity(Protocol):
    """A config whose execution-only fields still decide part of what its step computes (a training
    step's layout decides which routed tokens a fixed-capacity transport drops): that part joins
    its identity, so changing it cannot reuse an output computed otherwise, while the rest of those
    fields stays free to change."""

    def derived_identity(self) -> dict:
        """What the execution-only fields decide about the results, as plain values; {} for nothing."""


@runtime_checkable
class DeclaresDevices(Protocol):
    """A config whose step must see particular devices (a training step's racks): the environment
    each of its processes starts with."""

    def process_env(self, processes: int = 1) -> dict[str, str]: ...


@runtime_checkable
class ReportsProgress(Protocol):
    """A config whose step can say how far it got, read from its output while it runs (`keel status`)."""

    def progress(self, output_path: str, running: bool = True) -> str | None: ...


def is_execution_only(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(EXECUTION_ONLY, False))


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name.split("/"):
        raise StepDeclarationError(
            f"invalid step name {name!r}: use lowercase letters, digits and '_.-', segments joined "
            "by '/', no '..' segment and no leading '/' (e.g. 'tutorial/numbers')"
        )
    return name


@dataclass(frozen=True)
class StepFunction:
    """A step function named by `"package.module:function"`, imported only when the step runs.

    The runtime packages (`keel.train`, `keel.model`, `keel.data`, `keel.trained`) import jax,
    Levanter and tokenizers at their top, so declaring a step that runs one of their functions must
    not import it: `keel plan` would spend seconds on imports for functions it never calls. A step's
    identity and code fingerprint read the same name and source as for the imported function.
    """

    target: str

    def __post_init__(self):
        module, sep, name = self.target.partition(":")
        if not sep or not module or not name.isidentifier():
            raise StepDeclarationError(f"StepFunction({self.target!r}): give 'package.module:function'")
        # what functools.wraps sets on a wrapper: error messages, identity and logs name the function
        object.__setattr__(self, "__module__", module)
        object.__setattr__(self, "__qualname__", name)

    def resolve(self) -> Callable[[Any], Any]:
        """The function itself (imports its module, without the cycle collector: `keel.train.step`
        imported in 5.98 s instead of 6.99 s, medians of 5 interleaved processes)."""
        with no_cycle_collection():
            module = importlib.import_module(self.__module__)
        return getattr(module, self.__qualname__)

    def __call__(self, config: Any) -> Any:
        return self.resolve()(config)

    def source(self) -> str:
        """The function's source, decorators included, read from its module's file without importing
        the module or its package."""
        spec, search = None, None
        for part in self.__module__.split("."):
            spec = importlib.machinery.PathFinder.find_spec(part, search)
            if spec is None:
                raise OSError(f"{self.target}: module {self.__module__!r} not found")
            search = spec.submodule_search_locations
        with open(spec.origin, encoding="utf-8") as f:
            text = f.read()
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == self.__qualname__:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return "".join(text.splitlines(keepends=True)[first - 1:node.end_lineno])
        raise OSError(f"{self.target}: no function {self.__qualname__!r} at the top of {spec.origin}")


class Step:
    """One node of the graph: `fn(config)` writes its results under the step's output path.

    The config is a frozen dataclass; every field except `execution_only` ones is part of the
    step's identity, and every `output_of`/`Step` found inside it (at any depth) is a dependency.
    A `Step` used directly as a config value stands for its output path.

    `isolated=True` runs the step in a child process of its own (steps that import jax, hold
    devices or a wandb run); its environment is the launcher's plus `config.process_env(processes=1)`
    when the config defines it (e.g. the simulated device count its hardware declares). A cluster
    job of the step gets `config.process_env(processes=resources.replicas)` in every replica.

    How it runs, never part of its identity:
    - `no_outputs=True`: the step's effect is elsewhere (a check, a notification); without it a
      step that writes no file under its output path is FAILED, not an empty SUCCESS.
    - `retries=Retries(on_failure=N, on_preemption=M)`: attempts after the first, within one
      `keel run`; a step that resumes (training, from its newest checkpoint) continues each time.
    - `progress_timeout_s`: an isolated step whose heartbeat (`keel.executor.heartbeat.beat()`,
      touched by every training step and every event a training run prints: a compile finished,
      an evaluation, a checkpoint) is older than this is killed with its process group (on a
      cluster, its job is terminated) and counted as preempted. Set it above the longest single
      piece of work: the first compile, one evaluation or checkpoint save, a cluster job's setup.
    """

    __slots__ = ("name", "fn", "config", "resources", "description", "isolated", "no_outputs", "retries",
                 "progress_timeout_s", "_deps")

    def __init__(
        self,
        name: str,
        fn: Callable[[Any], Any],
        config: Any,
        *,
        resources: Resources | None = None,
        description: str | None = None,
        isolated: bool = False,
        no_outputs: bool = False,
        retries: "Retries | None" = None,
        progress_timeout_s: float | None = None,
    ):
        self.name = validate_name(name)
        if not callable(fn):
            raise StepDeclarationError(f"step {name!r}: fn must be callable, got {type(fn).__name__}")
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            raise StepDeclarationError(f"step {name!r}: config must be a dataclass instance, got {type(config).__name__}")
        check_finite(config, name)
        check_types(config, name)
        if retries is not None and not isinstance(retries, Retries):
            raise StepDeclarationError(f"step {name!r}: retries must be Retries(on_failure=N, on_preemption=M), got {retries!r}")
        if progress_timeout_s is not None and not (isinstance(progress_timeout_s, (int, float)) and progress_timeout_s > 0):
            raise StepDeclarationError(f"step {name!r}: progress_timeout_s={progress_timeout_s!r}: give a number of seconds > 0, or None")
        if progress_timeout_s is not None and not isolated:
            raise StepDeclarationError(f"step {name!r}: progress_timeout_s needs isolated=True (only a step in a process "
                                       "of its own can be killed and resumed)")
        self.fn = fn
        self.config = config
        self.resources = resources
        self.description = description
        self.isolated = isolated
        self.no_outputs = no_outputs
        self.retries = retries or Retries()
        self.progress_timeout_s = progress_timeout_s
        self._deps: tuple[Step | External, ...] | None = None

    @property
    def deps(self) -> "tuple[Step | External, ...]":
        """Direct dependencies, in order of first appearance in the config."""
        if self._deps is None:
            found: dict[Step | External, None] = {}  # steps hash by identity
            for target in _references(self.config):
                if target is not self:
                    found[target] = None
            self._deps = tuple(found)
        return self._deps

    @property
    def keyed_deps(self) -> "tuple[Step | External, ...]":
        """The dependencies its identity reads (not those held only in `execution_only` fields, which
        order the run without keying the output: a ladder's prediction, say): what it is made from."""
        return tuple({target: None for target in _references(self.config, keyed_only=True) if target is not self})

    def with_config(self, config: Any) -> "Step":
        return Step(self.name, self.fn, config, resources=self.resources, description=self.description,
                    isolated=self.isolated, no_outputs=self.no_outputs, retries=self.retries,
                    progress_timeout_s=self.progress_timeout_s)

    def __repr__(self) -> str:
        return f"Step({self.name!r})"


@dataclass(frozen=True)
class Retries:
    """Attempts a step gets after its first within one `keel run`: `on_failure` after it raised
    (or its process failed), `on_preemption` after its process was killed from outside (SIGKILL,
    a spot VM's end) or stopped making progress. Then it is FAILED, naming every attempt."""

    on_failure: int = 0
    on_preemption: int = 0

    def __post_init__(self):
        for name in ("on_failure", "on_preemption"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise StepDeclarationError(f"Retries({name}={value!r}): give a whole number >= 0")


class External:
    """Data that exists outside keel (a bucket path, a shared cache) named as a graph input.

    Its identity is its name, its path and either its `version` or, without one, the fingerprints
    of the files under its path (`keel.executor.inputs`: size and content hash of local files, the
    store's object version of remote ones), so data edited in place makes its dependents stale.
    Declare a version for data too large to list on every plan or not reachable from the machine
    that plans; keel never produces it.
    """

    __slots__ = ("name", "path", "version", "description")

    def __init__(self, name: str, path: str, *, version: str | None = None, description: str | None = None):
        self.name = validate_name(name)
        if not isinstance(path, str) or not path:
            raise StepDeclarationError(f"external {name!r}: path must be a non-empty string")
        from keel.executor.storage import trim  # fsspec's import waits for a graph that reads files

        self.path = trim(path)
        if version is not None and not (isinstance(version, str) and version.strip()):
            raise StepDeclarationError(f"external {name!r}: version={version!r} says nothing of the data: give a non-empty "
                                       "string that changes when the data does (e.g. version='2024-06'), or leave version "
                                       "out to fingerprint the files under its path")
        self.version = version
        self.description = description

    deps: tuple = ()

    def __repr__(self) -> str:
        return f"External({self.name!r}, {self.path!r})"


def check_finite(config: Any, step_name: str) -> None:
    """Refuse NaN and infinite numbers anywhere in a config: they never mean what was intended."""
    stack: list[tuple[str, Any]] = [("config", config)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise StepDeclarationError(f"step {step_name!r}: {where}={value!r} is not a finite number: give a finite value")
        if isinstance(value, (Step, External, OutputOf, ThisOutput)):
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack.extend((f"{where}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())


_SCALARS = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


def _checkable(hint: Any) -> bool:
    """Whether `_admits` can judge values against the annotation (scalars, Literal, unions of them)."""
    if hint in _SCALARS:
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return True
    return origin in (typing.Union, types.UnionType) and any(_checkable(a) for a in typing.get_args(hint))


@dataclasses.dataclass(frozen=True)
class _FieldCheck:
    name: str
    hint: Any  # its annotation when `_admits` can judge it, else None
    holds_output: bool  # its default is `this_output()`
    wants_float: bool  # declared float (or float | None): an int given to it is made a float


@functools.lru_cache(maxsize=None)
def _field_checks(cls: type) -> tuple[_FieldCheck, ...]:
    """Per field of a config class, what `check_types` checks. Worked out once per class: declaring
    10,000 steps must stay fast."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable forward reference: nothing to check against
        hints = {}
    checks = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        floats = hint is float or typing.get_origin(hint) in (typing.Union, types.UnionType) and set(
            typing.get_args(hint)) == {float, type(None)}
        checks.append(_FieldCheck(f.name, hint if hint is not None and _checkable(hint) else None,
                                  isinstance(f.default, ThisOutput), floats))
    return tuple(checks)


def _admits(hint: Any, value: Any) -> bool | None:
    """Whether a value fits a scalar, Literal or Optional annotation; None when no part of the
    annotation can judge it (a class, a container)."""
    if hint in _SCALARS:
        return isinstance(value, _SCALARS[hint]) and not (hint is float and isinstance(value, bool))
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_admits(arg, value) if arg is not type(None) else value is None for arg in typing.get_args(hint)]
        return True if any(verdicts) else None if None in verdicts else False
    return None


def check_types(config: Any, step_name: str) -> None:
    """Refuse a config value of the wrong scalar type (`n="100"` for `n: int`) when the step is
    declared, naming the field: inside the step it would fail far from the mistake, or not at all;
    and a path given to a field declared `this_output()`: the step would write outside keel's reach.
    An int given to a float field is made that float, so that `lr=1` and `--set ...lr=1` (1.0) are
    one identity."""
    stack: list[tuple[str, Any]] = [("config", config)]
    while stack:
        where, obj = stack.pop()
        for check in _field_checks(type(obj)):
            name, hint, holds_output = check.name, check.hint, check.holds_output
            value = getattr(obj, name)
            if check.wants_float and type(value) is int:
                object.__setattr__(obj, name, float(value))
                continue
            if isinstance(value, (Step, External, OutputOf, ThisOutput)):
                continue
            if holds_output:
                raise StepDeclarationError(f"step {step_name!r}: {where}.{name}={value!r}, but the field is where keel puts "
                                           "the step's outputs (declared this_output()): leave it out, or pass --prefix to "
                                           "put every output elsewhere")
            if hint is not None:
                if _admits(hint, value) is False:
                    shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
                    raise StepDeclarationError(f"step {step_name!r}: {where}.{name}={value!r} is a {type(value).__name__}, "
                                               f"but the field is declared {shown}: give a value of that type")
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                stack.append((f"{where}.{name}", value))


@functools.cache
def _field_names(config_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(config_type))


@functools.cache
def _keyed_field_names(config_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(config_type) if not is_execution_only(f))


PLAIN, ENUM, FLOAT, OUTPUT_OF, STEP, THIS_OUTPUT, PATH, DATACLASS, SEQUENCE, DICT = (
    "plain", "enum", "float", "output_of", "step", "this_output", "path", "dataclass", "sequence", "dict")


@functools.cache
def value_kind(value_type: type) -> str | None:
    """What a config value of this type is, decided once per type: identity encodes by it
    (`encoding.encode`) and the dependency walk follows it (`_references`); a 10,000-step plan
    meets ~70,000 values, and a chain of isinstance checks per value cost it 0.1 s. The order is
    the rule: an Enum that is also an int is an enum, a bool is plain. None: no known kind."""
    for kind, bases in ((PLAIN, (type(None), bool, str)), (ENUM, enum.Enum), (PLAIN, int), (FLOAT, float),
                        (OUTPUT_OF, OutputOf), (STEP, (Step, External)), (THIS_OUTPUT, ThisOutput),
                        (PATH, pathlib.PurePath)):
        if issubclass(value_type, bases):
            return kind
    if dataclasses.is_dataclass(value_type):
        return DATACLASS
    if issubclass(value_type, (list, tuple)):
        return SEQUENCE
    if issubclass(value_type, dict):
        return DICT
    return None


def _references(config: Any, keyed_only: bool = False) -> list["Step | External"]:
    """Every step a config refers to (`output_of` or the step itself), depth first, in field order:
    dataclass fields (with `keyed_only`, only those identity reads: not `execution_only` ones),
    list/tuple items, dict values."""
    fields_of = _keyed_field_names if keyed_only else _field_names
    found = []
    stack = [config]
    while stack:
        value = stack.pop()
        kind = value_kind(type(value))
        if kind is OUTPUT_OF:
            found.append(value.step)
        elif kind is STEP:
            found.append(value)
        elif kind is DATACLASS:
            stack.extend([getattr(value, name) for name in reversed(fields_of(type(value)))])
        elif kind is SEQUENCE:
            stack.extend(reversed(value))
        elif kind is DICT:
            stack.extend(reversed(list(value.values())))
    return found
