"""The house's layers: every package imports only the ones under it, and nothing imports in a circle.

    keel.executor          steps, identity, paths, status, plan, run (no jax, no keel package above it)
    keel.spec              the declaration layer: what an experiment states and `keel plan` reads
    keel.data  keel.model  keel.mesh     runtime on the declarations
    keel.train             the training step, on the model, mesh and data
    keel.trained           what reads a finished run (eval, sample, compare, ladder)
    keel.plan              the planner's fact sheet, render and twin
    keel.dashboard, keel.cli, then the `keel` package itself (Step, main, ...) and the console script

An AST scan, so it sees imports inside functions too (a lazy import is still a dependency).

The machine-learning stack (jax, Levanter, Haliax, Equinox, optax, tokenizers) is imported at the
top of the runtime modules that use it, never inside a function (one exception, named with its
reason: `LAZY_ON_PURPOSE`); what `keel plan` imports (the experiments' `defaults`, `keel.plan`,
`keel.cli`, the dashboard) reaches none of those modules: a step whose function needs the stack
names it with `keel.StepFunction("module:function")`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "lib" / "keel" / "src"
LAYERS = [
    {"keel.executor"},
    {"keel.spec"},
    {"keel.data", "keel.model", "keel.mesh"},
    {"keel.train"},
    {"keel.trained"},
    {"keel.plan"},
    {"keel.dashboard"},
    {"keel.cli"},
    {"keel.cli_entry", "keel"},
]
SPEC_MAY_IMPORT = {"fsspec"}  # besides the standard library and keel.executor
ML_STACK = {"jax", "jaxlib", "levanter", "haliax", "equinox", "optax", "tokenizers"}
RUNTIME = {"keel.data", "keel.model", "keel.mesh", "keel.train", "keel.trained"}
LAZY_ON_PURPOSE = {("keel.data.datasets", "levanter.store.cache")}
"""Function-level imports of the stack that are not about planning: Levanter's cache builder module
is needed only to read a cache it sharded, and importing it costs every training start 0.8 s."""
PLANNER_ROOTS = ["keel", "keel.cli", "keel.plan", "keel.dashboard", "keel.spec"]
DEFAULTS = Path(__file__).resolve().parents[1] / "defaults"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules imported at module level, everything imported anywhere), keel's by module name."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        return []

    top = {t for node in tree.body for t in targets(node)}
    anywhere = {t for node in ast.walk(tree) for t in targets(node)}
    return top, anywhere


def _package(module: str) -> str:
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def _graph():
    modules = _modules()
    top, anywhere = {}, {}
    for name, path in modules.items():
        top[name], anywhere[name] = _imports(name, path, modules)
    return modules, top, anywhere


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, or None."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if root in state:
            continue
        stack, path = [(root, iter(sorted(graph[root])))], [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in graph:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_every_package_imports_only_the_layers_under_it():
    modules, _, anywhere = _graph()
    level = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    wrong = []
    for name, imported in anywhere.items():
        mine = _package(name)
        assert mine in level, f"{mine} is in no layer of {__name__}.LAYERS: place it"
        for target in imported:
            if target.startswith("keel") and _package(target) != mine and level[_package(target)] >= level[mine]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_in_a_circle():
    modules, top, anywhere = _graph()
    keel_only = {name: {t for t in imported if t in modules and t != name} for name, imported in anywhere.items()}
    assert _cycle({n: {t for t in top[n] if t in modules and t != n} for n in modules}) is None
    # lazy imports too: a function-level import that closes a circle is still a circle
    assert (found := _cycle(keel_only)) is None, " -> ".join(found)


def test_the_declaration_layer_imports_no_runtime():
    _, _, anywhere = _graph()
    stdlib = set(sys.stdlib_module_names)
    for name, imported in anywhere.items():
        if _package(name) != "keel.spec":
            continue
        for target in imported:
            root = target.split(".")[0]
            assert root in stdlib or root in SPEC_MAY_IMPORT or target.startswith(("keel.spec", "keel.executor")), \
                f"{name} imports {target}: the declaration layer imports the standard library and keel.executor only"


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import statement inside a function or method of `path`."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    out.append((node.lineno, node.module or ""))
    return out


def test_runtime_modules_import_the_ml_stack_at_their_top():
    modules = _modules()
    lazy = [f"{name}:{line} imports {target} inside a function"
            for name, path in modules.items() if _package(name) in RUNTIME
            for line, target in _function_level_imports(path)
            if target.split(".")[0] in ML_STACK and (name, target) not in LAZY_ON_PURPOSE]
    assert not lazy, "move these to the module's top (the planner names the step function instead):\n" + "\n".join(lazy)


def test_what_the_planner_imports_reaches_no_module_that_imports_the_ml_stack():
    modules, top, _ = _graph()
    for path in DEFAULTS.glob("*.py"):  # the experiments' defaults: keel's modules they import at their top
        name = "defaults" if path.name == "__init__.py" else f"defaults.{path.stem}"
        top[name] = {t for t in _imports(name, path, modules)[0] if t in modules or t.startswith("defaults")}
    heavy = {name for name, path in modules.items()
             if any(t.split(".")[0] in ML_STACK for t in _imports(name, path, {})[0])}
    assert heavy & {n for n in modules if _package(n) == "keel.train"}, "the scan finds no heavy module: it is broken"

    def parents(name: str) -> list[str]:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    via: dict[str, str] = {}
    todo = PLANNER_ROOTS + sorted(n for n in top if n.startswith("defaults"))
    for root in todo:
        via.setdefault(root, "")
    while todo:
        name = todo.pop()
        for target in [*top.get(name, ()), *parents(name)]:
            if target not in via and (target in modules or target in top):
                via[target] = name
                todo.append(target)
    reached = sorted(heavy & set(via))

    def chain(name: str) -> str:
        out = [name]
        while via.get(out[-1]):
            out.append(via[out[-1]])
        return " <- ".join(out)

    assert not reached, "the planner imports the ML stack through:\n" + "\n".join(chain(n) for n in reached)
