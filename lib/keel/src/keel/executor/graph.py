"""The graph behind a list of target steps: every reachable step, in dependency order."""

from __future__ import annotations

from keel.executor.step import External, Step, StepDeclarationError


class CycleError(StepDeclarationError):
    """The steps depend on each other in a circle."""


def topological_order(targets: list[Step | External]) -> list[Step | External]:
    """Every step reachable from `targets`, each after all of its dependencies."""
    order: list[Step | External] = []
    state: dict[int, int] = {}  # 1 = on the current path, 2 = done
    for root in targets:
        if state.get(id(root)) == 2:
            continue
        # Iterative depth-first search: (node, iterator over its deps); graphs can be 10,000 deep.
        path: list[Step | External] = [root]
        stack = [(root, iter(root.deps))]
        state[id(root)] = 1
        while stack:
            node, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                path.pop()
                state[id(node)] = 2
                order.append(node)
                continue
            seen = state.get(id(dep))
            if seen == 1:
                cycle = path[path.index(dep):] + [dep]
                raise CycleError("dependency cycle: " + " -> ".join(s.name for s in cycle))
            if seen is None:
                state[id(dep)] = 1
                path.append(dep)
                stack.append((dep, iter(dep.deps)))
    return order
