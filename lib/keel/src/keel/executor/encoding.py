"""Canonical JSON of config values: what an identity (and a step function's bound values) hashes.

The encoding is stable across processes, hash seeds and machines; changing it re-keys every
output, so `tests/test_executor_identity.py` pins golden hashes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

from keel.executor.step import (DATACLASS, DICT, ENUM, FLOAT, OUTPUT_OF, PATH, PLAIN, SEQUENCE, STEP, THIS_OUTPUT,
                                StepDeclarationError, is_execution_only, value_kind)


class IdentityError(StepDeclarationError):
    """A config value that has no canonical encoding."""


@functools.cache
def _identity_fields(config_type: type) -> tuple[str, ...]:
    """The names of a dataclass's fields that count toward identity (all but `execution_only` ones)."""
    return tuple(f.name for f in dataclasses.fields(config_type) if not is_execution_only(f))


def encode(value: Any, where: str, dep_hash) -> Any:
    """The canonical JSON form of a config value; `where` is its field path for error messages."""
    kind = value_kind(type(value))
    if kind is PLAIN:
        return value
    if kind is DATACLASS:
        out: dict[str, Any] = {"__class__": type(value).__qualname__}
        for name in _identity_fields(type(value)):
            out[name] = encode(getattr(value, name), f"{where}.{name}", dep_hash)
        return out
    if kind is SEQUENCE:
        return [encode(v, f"{where}[{i}]", dep_hash) for i, v in enumerate(value)]
    if kind is FLOAT:
        # repr is the shortest string that round-trips exactly; a float never collides with an int. A
        # float subclass (numpy's float64) is its value: its own repr names the class, and numpy's changed.
        return {"__float__": repr(float(value))}
    if kind is ENUM:
        return {"__enum__": f"{type(value).__qualname__}.{value.name}"}
    if kind is OUTPUT_OF:
        return {"__output_of__": dep_hash(value.step), "subpath": value.subpath}
    if kind is STEP:
        return {"__output_of__": dep_hash(value), "subpath": ""}
    if kind is THIS_OUTPUT:
        return {"__this_output__": value.subpath}
    if kind is PATH:
        return {"__path__": value.as_posix()}
    if kind is DICT:
        for k in value:
            if not isinstance(k, str):
                raise IdentityError(f"{where}: dict keys must be strings, got {type(k).__name__} key {k!r}")
            if k.startswith("__") and k.endswith("__"):  # {"__float__": "1.0"} would encode as the float 1.0
                raise IdentityError(f"{where}: dict key {k!r} is a name the encoding keeps for its own markers "
                                    "(__float__, __class__, ...): rename the key")
        return {k: encode(value[k], f"{where}.{k}", dep_hash) for k in sorted(value)}
    raise IdentityError(
        f"{where}: a value of type {type(value).__name__} has no canonical encoding; use a dataclass, "
        "enum, number, string, bool, None, list/tuple, dict with string keys, path or a placeholder"
    )


def canonical_json(payload: Any) -> str:
    """Sorted keys, no spaces, ASCII: the text an identity hashes."""
    return _canonical(payload)


def _no_default(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not canonical JSON")  # `encode` hands over no such value


def one_line_encoder(*, sort_keys: bool, separators: tuple[str, str], default: Callable[[Any], Any]) -> Callable[[Any], str]:
    """`json.dumps` with these settings (ASCII, on one line) as one encoder built once, for values
    encoded by the thousand. `JSONEncoder.encode` builds a new C encoder (and a dict for circular
    checks) on every call: 7 of the 10 us a step's canonical JSON cost in a 10,000-step plan. Values
    are not checked for cycles: callers encode trees they build afresh. Where CPython's C encoder is
    missing or takes other arguments, the standard one does the same; `tests/test_executor_identity.py`
    holds the two to one text."""
    standard = json.JSONEncoder(sort_keys=sort_keys, separators=separators, ensure_ascii=True, default=default).encode
    item, key = separators
    try:  # (markers, default, encoder, indent, key_separator, item_separator, sort_keys, skipkeys, allow_nan)
        encoder = json.encoder.c_make_encoder(None, default, json.encoder.encode_basestring_ascii, None, key, item,
                                              sort_keys, False, True)
    except TypeError:  # no C encoder (None), or one that takes other arguments
        return standard
    return lambda value: "".join(encoder(value, 0))


_canonical = one_line_encoder(sort_keys=True, separators=(",", ":"), default=_no_default)
