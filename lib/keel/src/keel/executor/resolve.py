"""Swap placeholders for concrete paths: what a step's function actually receives."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from keel.executor import storage
from keel.executor.graph import rebuilt
from keel.executor.step import External, OutputOf, Step, ThisOutput


def resolve_config(config: Any, own_output: str, path_of: Callable[[Step | External], str]) -> Any:
    """The config with `this_output()` -> own_output and `output_of(step)`/`Step` -> that step's path."""

    def walk(value: Any) -> Any:
        if isinstance(value, ThisOutput):
            return storage.join(own_output, value.subpath)
        if isinstance(value, OutputOf):
            return storage.join(path_of(value.step), value.subpath)
        if isinstance(value, (Step, External)):
            return path_of(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for f in dataclasses.fields(value):
                old = getattr(value, f.name)
                new = walk(old)
                if new is not old:
                    changes[f.name] = new
            if not changes:
                return value
            try:
                return dataclasses.replace(value, **changes)
            except (TypeError, ValueError):  # a field with init=False or a validating __post_init__
                clone = dataclasses.replace(value)
                for k, v in changes.items():
                    object.__setattr__(clone, k, v)
                return clone
        # a list or dict the step gets is its own: changing it must not change the declared config
        if isinstance(value, (list, tuple)):
            return rebuilt(value, [walk(v) for v in value], fresh=isinstance(value, list))
        if isinstance(value, dict):
            return rebuilt(value, {k: walk(v) for k, v in value.items()}, fresh=True)
        return value

    return walk(config)
