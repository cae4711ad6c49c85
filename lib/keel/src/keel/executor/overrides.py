"""`--set STEP_NAME.field.sub=value`: change a config field from the command line.

The override rebuilds the step (and every step that depends on it, since their configs refer to
it) with `dataclasses.replace`, so identities follow naturally. A key that matches no field is an
error naming the closest ones.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import typing
from typing import Any

from keel.executor.graph import substitute
from keel.executor.step import External, Step, StepDeclarationError


class OverrideError(StepDeclarationError):
    """A `--set` key or value that does not fit the graph."""


def _field_paths(obj: Any, prefix: str) -> list[str]:
    out = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.append(f"{prefix}.{f.name}")
            out.extend(_field_paths(getattr(obj, f.name), f"{prefix}.{f.name}"))
    return out


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, enum.Enum):
        try:
            return type(current)[text] if text in type(current).__members__ else type(current)(text)
        except ValueError:
            raise OverrideError(f"--set {key}: {text!r} is not one of {[m.name for m in type(current)]}") from None
    if isinstance(current, str) or (current is None and not _looks_literal(text)):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if current is None:
            return text
        raise OverrideError(f"--set {key}: cannot read {text!r} as a {type(current).__name__}") from None
    if isinstance(current, bool) and not isinstance(value, bool):
        raise OverrideError(f"--set {key}: expected True or False, got {text!r}")
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if current is not None and not isinstance(value, type(current)) and not (isinstance(current, (list, tuple)) and isinstance(value, (list, tuple))):
        raise OverrideError(f"--set {key}: expected a {type(current).__name__}, got {text!r}")
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    return value


def _looks_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
        return True
    except (ValueError, SyntaxError):
        return False


def _parse_none(obj: Any, name: str, current: Any, key: str) -> Any:
    """`--set ...=None` on a field that holds a value: None when the field's annotation admits it
    (`int | None`, `Optional[int]`, `Any`), the text "None" for a plain `str` field, else an error."""
    annotation = next(f.type for f in dataclasses.fields(obj) if f.name == name)
    try:
        hint = typing.get_type_hints(type(obj))[name]
    except Exception:  # noqa: BLE001 - the annotation names something not importable here: take the user's word
        return None
    if hint in (Any, object, type(None)) or type(None) in typing.get_args(hint):
        return None
    if isinstance(current, str):
        return "None"
    written = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    raise OverrideError(f"--set {key}: field {name!r} is declared {written}, which does not admit None; "
                        f"give a value of type {type(current).__name__}, or declare the field `{written} | None`")


def _replace_path(obj: Any, parts: list[str], text: str, key: str) -> Any:
    current = getattr(obj, parts[0])
    if len(parts) > 1:
        new = _replace_path(current, parts[1:], text, key)
    elif text == "None" and current is not None:
        new = _parse_none(obj, parts[0], current, key)
    else:
        new = _parse_value(text, current, key)
    return dataclasses.replace(obj, **{parts[0]: new})


def _set_one(step: Step, parts: list[str], text: str, key: str) -> Step:
    obj = step.config
    for i, part in enumerate(parts):
        if not (dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}):
            known = _field_paths(step.config, step.name)
            close = difflib.get_close_matches(key.split("=")[0], known, n=3, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else f"; fields of {step.name}: {', '.join(known[:12])}"
            raise OverrideError(f"--set {key}: step {step.name!r} has no config field {'.'.join(parts[: i + 1])!r}{hint}")
        obj = getattr(obj, part)
    try:
        return step.with_config(_replace_path(step.config, parts, text, key))
    except OverrideError:
        raise
    except ValueError as exc:  # a config's own validation refused the new value
        raise OverrideError(f"--set {key}: {exc}") from exc


def apply_overrides(targets: list[Step | External], order: list[Step | External], assignments: list[str]) -> list[Step | External]:
    """The targets with every `STEP.field.sub=value` applied and dependents rebuilt."""
    if not assignments:
        return targets
    by_name: dict[str, list[Step]] = {}
    for step in order:
        if isinstance(step, Step):
            by_name.setdefault(step.name, []).append(step)
    replaced: dict[int, Step] = {}
    for assignment in assignments:
        key, eq, text = assignment.partition("=")
        if not eq:
            raise OverrideError(f"--set {assignment!r}: expected STEP_NAME.field=value")
        # Step names contain '.' and '/': the longest name that prefixes the key wins.
        names = [n for n in by_name if key.startswith(n + ".")]
        if not names:
            close = difflib.get_close_matches(key, [f"{n}.{p}" for n in by_name for p in [""]], n=3, cutoff=0.3)
            raise OverrideError(
                f"--set {assignment!r}: no step named like the start of {key!r}; steps: {', '.join(sorted(by_name))}"
                + (f" (closest: {', '.join(c.rstrip('.') for c in close)})" if close else "")
            )
        name = max(names, key=len)
        parts = key[len(name) + 1 :].split(".")
        for step in by_name[name]:
            current = replaced.get(id(step), step)
            replaced[id(step)] = _set_one(current, parts, text, assignment)
    return _rebuild(targets, order, replaced)


def _rebuild(targets, order, replaced: dict[int, Step]):
    """Swap replaced steps into every config that refers to them, bottom-up."""
    new: dict[int, Step | External] = {}
    for step in order:
        base = replaced.get(id(step), step)
        if isinstance(base, Step) and any(id(d) in new and new[id(d)] is not d for d in step.deps):
            base = base.with_config(substitute(base.config, new))
        new[id(step)] = base
    return [new.get(id(t), t) for t in targets]
