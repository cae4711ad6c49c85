"""The graph behind a list of target steps: every reachable step, in dependency order."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Container

from keel.executor.step import External, OutputOf, Step, StepDeclarationError


class CycleError(StepDeclarationError):
    """The steps depend on each other in a circle."""

    def __init__(self, cycle: list[Step | External]):
        super().__init__("dependency cycle: " + " -> ".join(s.name for s in cycle)
                         + "; a step cannot depend on its own output: remove the reference that closes the loop")


def topological_order(targets: list[Step | External], done: Container[Step | External] = ()) -> list[Step | External]:
    """Every step reachable from `targets`, each after all of its dependencies; steps in `done` are
    left out and not walked (identity hashing passes the steps it already knows).

    Steps and Externals hash by identity, so they key the walk's dicts themselves: `id()` raises
    an audit event, which costs a call into every audit hook the process has (keel's write watch,
    JAX's), and a 10,000-step plan made 189,000 of them."""
    order: list[Step | External] = []
    state: dict[Step | External, int] = {}  # 1 = on the current path, 2 = done
    for root in targets:
        if state.get(root) == 2:
            continue
        # Iterative depth-first search: (node, iterator over its deps); graphs can be 10,000 deep.
        path: list[Step | External] = [root]
        stack = [(root, iter(root.deps))]
        state[root] = 1
        while stack:
            node, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                path.pop()
                state[node] = 2
                order.append(node)
                continue
            seen = state.get(dep)
            if seen == 1:
                raise CycleError(path[path.index(dep):] + [dep])
            if seen is None and dep not in done:
                state[dep] = 1
                path.append(dep)
                stack.append((dep, iter(dep.deps)))
    return order


def substitute(value: Any, new: dict[int, Any]) -> Any:
    """`value` with every step (or `output_of` target) whose id is in `new` swapped for its
    replacement; unchanged parts are kept as they are, so untouched configs stay the same objects.
    Fields a dataclass derives itself (`init=False`) are left to its `__post_init__`."""
    if isinstance(value, (Step, External)):
        return new.get(id(value), value)
    if isinstance(value, OutputOf):
        target = new.get(id(value.step), value.step)
        return value if target is value.step else OutputOf(target, value.subpath)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: substitute(getattr(value, f.name), new) for f in dataclasses.fields(value) if f.init}
        if all(changes[k] is getattr(value, k) for k in changes):
            return value
        return dataclasses.replace(value, **{k: v for k, v in changes.items() if v is not getattr(value, k)})
    if isinstance(value, (list, tuple)):
        return rebuilt(value, [substitute(v, new) for v in value])
    if isinstance(value, dict):
        return rebuilt(value, {k: substitute(v, new) for k, v in value.items()})
    return value


def rebuilt(container: list | tuple | dict, items: list | dict, *, fresh: bool = False) -> Any:
    """`container` itself when every item of `items` is its own (unless `fresh`: a new container
    even then), else a container of its class holding `items`: a NamedTuple, an OrderedDict or a
    list subclass in a config must reach the step as what it was declared (`span.end`, not a plain
    tuple's AttributeError)."""
    old, now = (container.values(), items.values()) if isinstance(container, dict) else (container, items)
    if not fresh and all(a is b for a, b in zip(old, now)):
        return container
    kind = type(container)
    if kind in (list, tuple, dict):
        return kind(items)
    if isinstance(container, tuple):  # a NamedTuple takes its items as arguments
        return kind._make(items) if hasattr(kind, "_make") else kind(items)
    clone = copy.copy(container)  # a list or dict subclass: its class and attributes, new items
    for key in (items if isinstance(items, dict) else range(len(items))):
        clone[key] = items[key]
    return clone
