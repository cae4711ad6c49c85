"""A fingerprint of a step function's source, so `keel plan` can say a cached output was made by
code that has since changed.

The code is not part of a step's identity: a comment or a refactor would re-key every output, and
library upgrades would invalidate every cache. Instead each SUCCESS records the fingerprint of the
function that made it, and a cached step whose function now reads differently is still cached but
says so, with the `--force` that reruns it. The function's own source counts, and what it reads
that its source does not show, where that can differ between two functions of one source:

- a closure's cells (`maker(k)` in a sweep), and the default values of a nested function or lambda
  (`lambda c, k=k: ...`);
- for a function of an experiment file (module `__main__`, so two files' `make` share a name): its
  defaults and the module globals it names, its file's other functions and classes by their own
  fingerprints, what it imports by name, and a value with no canonical encoding (a logger) by its type.

A library function reads its module's globals, which change only with its code: its source speaks
for them, as it does for a `StepFunction` read without importing.

A `functools.partial` is the function it wraps plus its bound arguments, a callable object its
class plus its attributes, a bound method its function plus its object's attributes (a
classmethod's object is its class, bound by name): the bound values join the fingerprint (encoded
canonically, as a config is), so `partial(train, lr=0.1)` and `partial(train, lr=0.2)`, or
`Trainer(0.1).run` and `Trainer(0.2).run`, are different work to the content hash. A bound value
with no canonical encoding (an open file, a model) leaves the function without a fingerprint, as a
function without source is: such a step never reuses another name's output.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import types

from keel.executor.encoding import IdentityError, canonical_json, encode
from keel.executor.step import StepFunction


def _named(fn):
    """What names and holds the source of `fn`: `fn` itself when it has a name (a function, a
    class, a `StepFunction`), else its class (a callable object)."""
    return fn if isinstance(getattr(fn, "__qualname__", None), str) else type(fn)


def qualified_name(fn) -> str:
    """`module.qualname` of a step's function: what its content identity names. A partial is named
    after the function it wraps (its arguments are in the fingerprint), a callable object after its class."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({qualified_name(fn.func)})"
    named = _named(fn)
    return f"{named.__module__}.{named.__qualname__}"


def _shown(fn) -> str:
    """The function's short name, for messages."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_shown(fn.func)})"
    return _named(fn).__qualname__


def fingerprint(fn) -> str | None:
    """BLAKE2b of the function's source (and bound values), or None when it has none to read (a
    builtin, a REPL lambda) or a bound value has no canonical encoding.

    A `StepFunction` is read from its module's file without importing it (the planner must not pay
    for jax), and gives the same text `inspect.getsource` gives for the imported function."""
    try:
        hash(fn)
    except TypeError:  # a callable object compared by value that holds a list: nothing to cache it by
        return _fingerprint(fn)
    return _cached_fingerprint(fn)


def _fingerprint(fn) -> str | None:
    """`fingerprint` uncached: a plain function's is its source's hash (as recorded before partials
    were read), a partial's, callable object's or bound method's that of its function's plus its
    bound values."""
    if isinstance(fn, functools.partial):
        inner, bound = fingerprint(fn.func), _encoded({"args": list(fn.args), "keywords": dict(fn.keywords)})
    elif isinstance(fn, types.MethodType):
        owner = fn.__self__
        state = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else _state(owner)
        inner, bound = _function_hash(fn.__func__), None if state is _UNREADABLE else _encoded({"self": state})
    elif _named(fn) is fn:
        inner, bound = _function_hash(fn), ""
    else:
        inner, bound = _source_hash(type(fn)), _encoded(_state(fn))
    if inner is None or bound is None:
        return None
    return hashlib.blake2b(f"{inner}:{bound}".encode(), digest_size=8).hexdigest() if bound else inner


_cached_fingerprint = functools.lru_cache(maxsize=None)(_fingerprint)


def _function_hash(fn, seen: frozenset = frozenset()) -> str | None:
    """A function's source hash, joined by what it reads that its source does not show (`_reads`)."""
    inner = _source_hash(fn)
    if inner is None or not isinstance(fn, types.FunctionType):
        return inner
    try:
        reads = _reads(fn, seen | {fn})
    except _Unreadable:
        return None
    return hashlib.blake2b(f"{inner}:{reads}".encode(), digest_size=8).hexdigest() if reads else inner


class _Unreadable(Exception):
    """A closure cell or default with no canonical encoding: which value did the work cannot be told."""


def _reads(fn: types.FunctionType, seen: frozenset) -> str:
    """Canonical JSON of the values `fn` reads from outside its source ('' when none)."""
    experiment = fn.__module__ == "__main__"
    reads = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            reads[f"closure {name}"] = _read(cell.cell_contents, seen, strict=True)
        except ValueError:  # a cell not yet filled: nothing read yet
            continue
    if experiment or "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        if fn.__defaults__:
            reads["defaults"] = [_read(value, seen, strict=True) for value in fn.__defaults__]
        if fn.__kwdefaults__:
            reads["keyword defaults"] = {k: _read(v, seen, strict=True) for k, v in fn.__kwdefaults__.items()}
    if experiment:
        for name in sorted(_names(fn.__code__) & fn.__globals__.keys()):
            value = fn.__globals__[name]
            if not isinstance(value, types.ModuleType) and value is not fn:
                reads[f"global {name}"] = _read(value, seen, strict=False)
    return canonical_json(reads) if reads else ""


def _names(code: types.CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it mention."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _read(value, seen: frozenset, *, strict: bool):
    """One read value's canonical form: another function of an experiment file or a closure by its
    fingerprint, a class of the experiment file by its source, anything else importable by name, a
    config value as it is encoded; a value with no canonical encoding by its type (a global), or
    not at all (`strict`: a closure cell or default)."""
    if isinstance(value, types.FunctionType) and (value.__module__ == "__main__" or value.__closure__):
        found = _function_hash(value, seen) if value not in seen else "recursive"
        if found is not None:
            return {"function": found}
        if strict:
            raise _Unreadable(value)
        return {"imported": qualified_name(value)}
    if isinstance(value, type) and value.__module__ == "__main__":
        return {"class": _source_hash(value) or value.__qualname__}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, functools.partial)):
        return {"imported": qualified_name(value)}
    encoded = _encoded(value)
    if encoded is not None:
        return {"value": encoded}
    if strict:
        raise _Unreadable(value)
    return {"type": f"{type(value).__module__}.{type(value).__qualname__}"}


def _source_hash(fn) -> str | None:
    try:
        source = fn.source() if isinstance(fn, StepFunction) else inspect.getsource(fn)
    except (OSError, TypeError, SyntaxError, ValueError):  # ValueError: not UTF-8; running the step says what is wrong
        return None
    return hashlib.blake2b(source.encode(), digest_size=8).hexdigest()


_UNREADABLE = object()


def _state(obj):
    """A callable object's attributes: the object itself when it is a dataclass (its fields, as a
    config's are encoded), else its `__dict__`; unreadable (`__slots__`) without one."""
    if dataclasses.is_dataclass(obj):
        return obj
    return getattr(obj, "__dict__", _UNREADABLE)


def _encoded(value) -> str | None:
    """The canonical JSON of bound values, or None when one has no canonical encoding (nor has a
    step: its output would be a dependency the graph does not know)."""
    def no_step(step):
        raise IdentityError(f"{step!r} is bound to a step's function")

    if value is _UNREADABLE:
        return None
    try:
        return canonical_json(encode(value, "bound", no_step))
    except IdentityError:
        return None


def describe_change(name: str, fn, recorded: str | None) -> str:
    """Why a cached output may be out of date with its step's function, or '' when it is not."""
    now = fingerprint(fn)
    if recorded is None or now is None or now == recorded:
        return ""
    return (f"{_shown(fn)} changed since this output was made "
            f"(the code is not part of the identity): `--force '^{name}$'` reruns it")
