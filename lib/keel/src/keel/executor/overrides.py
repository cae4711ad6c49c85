"""`--set STEP_NAME:field.sub=value`: change a config field from the command line.

The step name ends at the colon, so names holding dots (`train/lr_sweep/lr1.0`) are unambiguous.
The older `STEP_NAME.field=value` is read where it can mean one thing only: a step name without
dots that is the only name prefixing the key; otherwise it is an error that gives the colon form.

The value is decoded as the field's declared type by draccus (text as written: a list of texts
keeps its items untyped); the overrides rebuild the step (and every step that depends on it, since
their configs refer to it) with `dataclasses.replace`, every assignment to one config at once, so
its own checks see the new values together and identities follow naturally. A key that matches no
field is an error naming the closest ones; a dependent that refuses the change is named with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Protocol

from keel.executor.graph import substitute
from keel.executor.step import External, OutputOf, Step, StepDeclarationError, ThisOutput


class OverrideError(StepDeclarationError):
    """A `--set` key or value that does not fit the graph."""


def _field_paths(obj: Any, prefix: str) -> list[str]:
    out = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.append(f"{prefix}.{f.name}")
            out.extend(_field_paths(getattr(obj, f.name), f"{prefix}.{f.name}"))
    return out


def _declared_type(obj: Any, name: str, current: Any) -> Any:
    """The field's annotation as a type (`int | None`, `tuple[str, ...]`, a dataclass, an Enum);
    the current value's type when the annotation names something not importable here."""
    try:
        return typing.get_type_hints(type(obj))[name]
    except Exception:  # noqa: BLE001 - e.g. a forward reference to a class this module cannot see
        return type(current) if current is not None else Any


def _tuple_as_list(text: str) -> str:
    """A Python tuple written as the value (`()`, `(a, b)`) in YAML's list syntax (`[]`, `[a, b]`)."""
    stripped = text.strip()
    return f"[{stripped[1:-1]}]" if stripped.startswith("(") and stripped.endswith(")") else text


def _members(declared: Any) -> list:
    """The types a field may hold: a union's members but None (`int | None`: [int]), else itself."""
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(declared) if a is not type(None)]
    return [declared]


def _is_texts(declared: Any) -> bool:
    """A tuple or list of strings (`tuple[str, ...]`, `list[str] | None`)."""
    inner = _members(declared)
    return len(inner) == 1 and typing.get_origin(inner[0]) in (tuple, list) and set(typing.get_args(inner[0])) <= {str, ...}


def _innermost(exc: BaseException) -> str:
    """The message of the error at the bottom of `exc`'s chain: what a config's own check said,
    under the decoder's "couldn't instantiate" wrapping."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__


def _parse_value(obj: Any, name: str, text: str, key: str) -> Any:
    """`text` as the field's declared type, decoded by draccus (Levanter's config parser) from YAML
    syntax: `3`, `1e-3`, `true`, `ring`, `[a, b]`, `{start_step: 0, transport: ring}`. Text stays
    as written: a `str` field takes the whole value, a sequence of strings its items untyped (YAML
    would read `no` as false and a version `1.10` as 1.1)."""
    import yaml
    from draccus.parsers.decoding import decode

    current = getattr(obj, name)
    declared = _declared_type(obj, name, current)
    if declared is str or set(typing.get_args(declared)) == {str, type(None)}:
        return text  # `None` is handled before
    written = _tuple_as_list(text)
    if _is_texts(declared):
        if not (written.strip().startswith("[") and written.strip().endswith("]")):
            raise OverrideError(f"--set {key}: {name} holds several texts: write them as a list, e.g. "
                                f"{key.partition('=')[0]}=[{text}]")
        try:
            items = yaml.load(written, Loader=yaml.BaseLoader)  # every item a string, as written
        except yaml.YAMLError as exc:
            raise OverrideError(f"--set {key}: cannot read {text!r} as a list of texts ({_innermost(exc)})") from None
        odd = [item for item in items if not isinstance(item, str)]
        if odd:
            raise OverrideError(f"--set {key}: {odd[0]!r} is not one text: quote an item that holds ': ' or brackets")
        return tuple(items) if typing.get_origin(declared) is not list else list(items)
    try:
        raw = yaml.safe_load(written)
    except yaml.YAMLError:
        raw = text
    if isinstance(raw, bool) and not _admits_bool(declared):
        raise OverrideError(f"--set {key}: YAML reads {text!r} as the boolean {str(raw).lower()}, but {name} is declared "
                            f"{_shown(declared)}, which would take it as {int(raw)}: write the {_shown(declared)} you mean, "
                            f"e.g. {key.partition('=')[0]}={int(raw)}")
    kinds = _members(declared)
    configs = [t for t in kinds if dataclasses.is_dataclass(t)]
    if configs and len(configs) == len(kinds) and not isinstance(raw, dict):
        field = key.partition("=")[0]
        example = next((f.name for f in dataclasses.fields(current)), "FIELD") if dataclasses.is_dataclass(current) else "FIELD"
        raise OverrideError(f"--set {key}: {name} is a config ({' or '.join(c.__name__ for c in configs)}), not one value: "
                            f"set one of its fields ({field}.{example}=...) or give the whole config as a mapping of "
                            f"its fields ({field}={{{example}: ...}})")
    try:
        return decode(declared, raw)
    except Exception as exc:  # noqa: BLE001 - draccus raises its own DecodingError, or the config's ValueError
        shown = _shown(declared)
        article = "an" if shown[:1].lower() in "aeiou" else "a"
        raise OverrideError(f"--set {key}: cannot read {text!r} as {article} {shown} ({_innermost(exc)})") from None


def _shown(declared: Any) -> str:
    return getattr(declared, "__name__", None) or str(declared).replace("typing.", "")


def _admits_bool(declared: Any) -> bool:
    """Whether a field of this type may hold a bool (`bool`, `bool | None`, `Any`): YAML reads
    true/yes/on as one, and draccus would turn it into 1 for an int or float field, which Python's
    own `replace(num_layers=True)` refuses."""
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return any(_admits_bool(arg) for arg in typing.get_args(declared))
    return declared in (bool, Any, object)


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


def _apply(obj: Any, changes: list[tuple[list[str], str, str]]) -> Any:
    """`obj` with every (field path, text, --set) change applied: one `dataclasses.replace` per
    config, so its own checks see all of its new values together, whatever their order."""
    leaves: dict[str, tuple[str, str]] = {}
    deeper: dict[str, list[tuple[list[str], str, str]]] = {}
    for parts, text, key in changes:
        if len(parts) == 1:
            leaves[parts[0]] = (text, key)
        else:
            deeper.setdefault(parts[0], []).append((parts[1:], text, key))
    for name in set(leaves) & set(deeper):
        raise OverrideError(f"--set {leaves[name][1]} and --set {deeper[name][0][2]} both change {name}: give it whole, "
                            "or set its fields one by one")
    new = {name: _parse_none(obj, name, getattr(obj, name), key) if text == "None" else _parse_value(obj, name, text, key)
           for name, (text, key) in leaves.items()}
    new.update({name: _apply(getattr(obj, name), subs) for name, subs in deeper.items()})
    return dataclasses.replace(obj, **new)


def _check_path(step: Step, parts: list[str], key: str) -> None:
    """Refuse a field path the step's config does not have, or one keel fills in."""
    obj, reached = step.config, []
    for part in parts:
        if isinstance(obj, (ThisOutput, OutputOf)):  # not a config to reach into: keel fills the whole path in
            break
        if obj is None and reached:
            raise OverrideError(f"--set {key}: {step.name}'s {'.'.join(reached)} is None, so it has no field {part!r}: "
                                f"set it whole, e.g. --set {step.name}:{'.'.join(reached)}={{{part}: ...}}")
        if not (dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}):
            known = [f"{step.name}:{p[1:]}" for p in _field_paths(step.config, "")]
            close = difflib.get_close_matches(f"{step.name}:{'.'.join(parts)}", known, n=3, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else f"; fields of {step.name}: {', '.join(known[:12])}"
            raise OverrideError(f"--set {key}: step {step.name!r} has no config field "
                                f"{'.'.join(parts[: len(reached) + 1])!r}{hint}")
        obj = getattr(obj, part)
        reached.append(part)
    if isinstance(obj, (ThisOutput, OutputOf, Step, External)):
        raise OverrideError(f"--set {key}: {'.'.join(reached)} is a path keel fills in ({_placeholder(obj)}): a step writes "
                            "only under its own output; pass --prefix to put every output elsewhere")


@typing.runtime_checkable
class ChecksResources(Protocol):
    """A config that must agree with its step's declared resources (a training step's topology)."""

    def resources_problem(self, resources: Any) -> str | None: ...


@typing.runtime_checkable
class NotesOverrides(Protocol):
    """A config that can say what an override changed beyond the fields set (a training step whose
    positions stay at their steps when its length changes)."""

    def override_notes(self, before: Any) -> list[str]: ...


def _set_all(step: Step, changes: list[tuple[list[str], str, str]], notes: list[str]) -> Step:
    """`step` with `changes` applied; the resources are declared with the step, not set here, so
    the new config is checked against them: a layout they cannot run would fail only at dispatch.
    What the change does beyond its fields, by the config's own account, is added to `notes`."""
    for parts, _, key in changes:
        _check_path(step, parts, key)
    keys = " --set ".join(key for _, _, key in changes)
    try:
        new = step.with_config(_apply(step.config, changes))
    except OverrideError:
        raise
    except ValueError as exc:  # a config's own validation refused the new values
        raise OverrideError(f"--set {keys}: {exc}") from exc
    problem = new.config.resources_problem(new.resources) if isinstance(new.config, ChecksResources) else None
    if problem:
        raise OverrideError(f"--set {keys}: {problem}")
    if isinstance(new.config, NotesOverrides) and type(new.config) is type(step.config):
        notes.extend(f"--set {keys}: {note}" for note in new.config.override_notes(step.config))
    return new


def _placeholder(value: Any) -> str:
    if isinstance(value, ThisOutput):
        return "this_output()"
    return f"the output of {(value.step if isinstance(value, OutputOf) else value).name}"


def apply_overrides(targets: list[Step | External], order: list[Step | External], assignments: list[str],
                    notes: list[str] | None = None) -> list[Step | External]:
    """The targets with every `STEP:field.sub=value` applied and dependents rebuilt; what a changed
    config says the change does beyond its fields (`NotesOverrides`) is added to `notes`."""
    if not assignments:
        return targets
    by_name: dict[str, list[Step]] = {}
    for step in order:
        if isinstance(step, Step):
            by_name.setdefault(step.name, []).append(step)
    changes: dict[str, list[tuple[list[str], str, str]]] = {}
    seen: dict[str, str] = {}
    for assignment in assignments:
        key, eq, text = assignment.partition("=")
        if not eq:
            raise OverrideError(f"--set {assignment!r}: expected STEP_NAME:field=value")
        name, parts = _split_key(key, assignment, by_name)
        target = f"{name}:{'.'.join(parts)}"
        if target in seen:
            raise OverrideError(f"--set {target} is given twice ({seen[target]!r} and {assignment!r}): keep the one you mean")
        seen[target] = assignment
        changes.setdefault(name, []).append((parts, text, assignment))
    said: list[str] = []
    replaced = {id(step): _set_all(step, changes[name], said) for name in changes for step in by_name[name]}
    if notes is not None:
        notes.extend(dict.fromkeys(said))  # a step declared twice under its name says it once
    return _rebuild(targets, order, replaced, assignments)


def names_a_step(assignment: str, names: set[str]) -> bool:
    """Whether `STEP:field=value` (or an unambiguous `STEP.field=value`) names one of `names`."""
    key = assignment.partition("=")[0]
    if ":" in key:
        return key.partition(":")[0] in names
    return any(key.startswith(name + ".") for name in names)


def _split_key(key: str, assignment: str, by_name: dict[str, list[Step]]) -> tuple[str, list[str]]:
    """(step name, field path) of `STEP:field.sub`, or of an unambiguous `STEP.field.sub`."""
    if ":" in key:
        name, _, path = key.partition(":")
        if name not in by_name:
            close = difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.3)
            raise OverrideError(f"--set {assignment!r}: no step named {name!r}; steps: {', '.join(sorted(by_name))}"
                                + (f" (closest: {', '.join(close)})" if close else ""))
        if not path:
            raise OverrideError(f"--set {assignment!r}: name a field after the colon, e.g. {name}:train.num_steps=100")
        return name, path.split(".")
    names = [n for n in by_name if key.startswith(n + ".")]
    if not names:
        close = difflib.get_close_matches(key, list(by_name), n=3, cutoff=0.3)
        raise OverrideError(
            f"--set {assignment!r}: expected STEP_NAME:field=value; no step named like the start of {key!r}; "
            f"steps: {', '.join(sorted(by_name))}" + (f" (closest: {', '.join(close)})" if close else ""))
    if len(names) > 1 or "." in names[0]:
        name = max(names, key=len)
        raise OverrideError(f"--set {assignment!r}: {' and '.join(sorted(names))} could each start this key; write the "
                            f"step name, a colon, then the field: --set {name}:{key[len(name) + 1:]}={assignment.partition('=')[2]}")
    return names[0], key[len(names[0]) + 1:].split(".")


def _rebuild(targets, order, replaced: dict[int, Step], assignments: list[str]):
    """Swap replaced steps into every config that refers to them, bottom-up; a dependent whose own
    checks refuse what the change made of it is an error naming both."""
    new: dict[int, Step | External] = {}
    for step in order:
        base = replaced.get(id(step), step)
        if isinstance(base, Step) and any(id(d) in new and new[id(d)] is not d for d in step.deps):
            try:
                base = base.with_config(substitute(base.config, new))
            except (ValueError, TypeError) as exc:
                raise OverrideError(f"--set {' --set '.join(assignments)} changes what {step.name} depends on, and "
                                    f"{step.name} refuses it: {exc} (change {step.name} too: --set {step.name}:FIELD=...)") from exc
        new[id(step)] = base
    return [new.get(id(t), t) for t in targets]
