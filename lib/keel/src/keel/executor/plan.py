"""What a run would do, step by step, without doing it: the heart of `keel plan` and `keel status`.

States: `cached` (finished, manifest verified; or the same work finished under another name, whose
output it reuses: `reuse.py`), `run` (never ran, or must rerun: the reason says
why), `stale` (an earlier run of the same step name exists with another identity; the reason names
the input files that changed, then gives a field-level diff), `failed` (the last attempt failed;
the next run retries it), `interrupted` (stopped on request, e.g. Ctrl-C; the next run resumes it),
`running-elsewhere` (another launcher holds a live lease) and `external` (data keel does not make).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Container
from dataclasses import dataclass, field

from keel.executor import code, reuse, storage
from keel.executor import lease as leases
from keel.executor.collector import no_cycle_collection
from keel.executor.graph import substitute, topological_order
from keel.executor.identity import Identities, output_path
from keel.executor.inputs import describe_change
from keel.executor.status import FAILED, INTERRUPTED, SUCCESS, Status, output_digest, read_record, read_status, verify_manifest
from keel.executor.step import External, Step, StepDeclarationError

CACHED, RUN, STALE, FAILED_STATE, RUNNING_ELSEWHERE, EXTERNAL = "cached", "run", "stale", "failed", "running-elsewhere", "external"
INTERRUPTED_STATE = "interrupted"
EMPTY_EXTERNAL = "no files at this path: `keel run` refuses to start the steps that read it"


@dataclass
class StepPlan:
    step: Step | External
    output_path: str
    state: str
    reason: str = ""
    deps: list[str] = field(default_factory=list)
    status: Status | None = None
    reused_from: str | None = None
    """The step name whose finished output this one reuses (the same work under another name)."""
    remade_inputs: bool = False
    """A finished output this run makes again because a step it read is made again (in this run,
    or since it was made): a rerun starts clean, and only a newer output than `status`'s counts
    as another launcher having done it."""

    @property
    def name(self) -> str:
        return self.step.name

    def to_json(self) -> dict:
        out = {"name": self.name, "output_path": self.output_path, "state": self.state, "reason": self.reason, "deps": self.deps}
        if self.reused_from is not None:
            out["reused_from"] = self.reused_from
        if isinstance(self.step, Step) and self.step.resources is not None:
            out["resources"] = self.step.resources.describe()
        if self.status is not None and self.status.duration is not None:
            out["duration_s"] = round(self.status.duration, 3)
        return out


class Graph:
    """The resolved graph of an experiment under one prefix: order, identities and output paths.

    Building it hashes every step, so a cycle or an unencodable value is refused before anything
    runs, and gives each step name one step: equal declarations merge, different ones are an error.
    """

    def __init__(self, targets: list[Step | External], prefix: str):
        self.targets = list(targets)
        self.prefix = storage.trim(prefix) if "://" in prefix else os.path.abspath(prefix)
        with no_cycle_collection():
            self.order = topological_order(self.targets)
            self.identities = Identities()
            for step in self.order:
                self.identities.hash(step)
            self._merge_same_names()
        self._paths: dict[Step | External, str] = {}
        self.overrides: dict[str, list[str]] = {}
        """Step name -> the `--set` assignments that changed its identity (recorded in its step.json)."""

    def _merge_same_names(self) -> None:
        """Steps declared twice with one identity (say, a shared default built in two places) become
        one object, so the plan shows and the run executes it once; two different steps under one
        name are refused: `--set NAME.field=...` and the outputs listing could not tell them apart."""
        if len({s.name for s in self.order}) == len(self.order):
            return
        first: dict[str, Step | External] = {}
        new: dict[int, Step | External] = {}
        for step in self.order:
            kept = first.setdefault(step.name, step)
            if kept is not step:
                diff = diff_functions(kept, step) + diff_payloads(self.identities.payload(kept), self.identities.payload(step))
                if diff:
                    raise StepDeclarationError(f"two different steps are named {step.name!r} ({'; '.join(diff)}); "
                                               "rename one of them: step names must be unique in a graph")
                new[id(step)] = new[id(kept)]
            elif isinstance(step, Step) and any(new[id(d)] is not d for d in step.deps):
                new[id(step)] = step.with_config(substitute(step.config, new))
            else:
                new[id(step)] = step
        self.targets = [new[id(t)] for t in self.targets]
        self.order = list({id(s): s for s in new.values()}.values())

    def path(self, step: Step | External) -> str:
        found = self._paths.get(step)
        if found is None:
            found = self._paths[step] = output_path(self.prefix, step, self.identities)
        return found

    def reuse(self, step: Step, path: str) -> None:
        """Point `step` (and the configs of its dependents) at another finished output of the same work."""
        self._paths[step] = path

    def steps(self) -> list[Step]:
        return [s for s in self.order if isinstance(s, Step)]


class _Listings:
    """Directory listings cached for one planning pass: one `ls` per parent folder, not per step."""

    def __init__(self) -> None:
        self._names: dict[str, set[str]] = {}
        self._indexed: dict[str, bool] = {}

    def names(self, folder: str) -> set[str]:
        names = self._names.get(folder)
        if names is None:
            names = self._names[folder] = set(storage.list_names(folder))
        return names

    def any_indexed(self, prefix: str) -> bool:
        """Whether the content index under `prefix` holds any entry (asked once per step)."""
        found = self._indexed.get(prefix)
        if found is None:
            found = self._indexed[prefix] = bool(self.names(reuse.index(prefix)))
        return found

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        """The folder that lists `url`, and its base name. A store's root keeps its `scheme://`
        (`memory://a-1` lies in `memory://`, not `memory:/`), as `storage.join` builds it."""
        scheme, sep, rest = url.partition("://")
        if not sep:
            folder, _, base = url.rpartition("/")
            return folder or ("/" if url.startswith("/") else ""), base  # `/a-1`: directly under the local root
        folder, _, base = rest.rpartition("/")
        return f"{scheme}{sep}{folder}", base

    def exists(self, url: str) -> bool:
        parent, base = self.split(url)
        return base in self.names(parent)

    def earlier_runs(self, url: str) -> list[str]:
        parent, base = self.split(url)
        stem = base.rsplit("-", 1)[0] + "-"
        return [storage.join(parent, n) for n in self.names(parent)
                if n.startswith(stem) and n != base and re.fullmatch(r"[0-9a-f]+", n[len(stem):])]


def plan_step(graph: Graph, step: Step | External, force: re.Pattern | None = None, listings: _Listings | None = None,
              rerun: Container[str] = ()) -> StepPlan:
    """The state of one step under the graph's prefix, checked exactly as a cache hit is. `rerun`:
    the outputs this run empties and makes again (its forced steps'), which no other step may reuse."""
    listings = listings or _Listings()
    path = graph.path(step)
    deps = [graph.path(d) for d in step.deps]
    if isinstance(step, External):
        if step.version is not None:  # as its identity reads it: a version stands for its files
            return StepPlan(step, path, EXTERNAL, f"version {step.version}", deps)
        files = graph.identities.payload(step)["inputs"]
        described = f"{len(files)} files fingerprinted" if files else EMPTY_EXTERNAL
        return StepPlan(step, path, EXTERNAL, described, deps)
    status = read_status(path) if listings.exists(path) else None
    forced = bool(force and force.search(step.name))
    if status is None and not forced and reuse.reusable(step) and listings.any_indexed(graph.prefix):
        content = graph.identities.content_hash(step)
        same = reuse.find(graph.prefix, content, path) if listings.exists(reuse.entry(graph.prefix, content)) else None
        if same is not None and same.output_path in rerun:
            return StepPlan(step, path, RUN, f"the same work as {same.name}, which --force makes again in this run: it "
                            "runs under its own name", deps)
        if same is not None:
            graph.reuse(step, same.output_path)
            return StepPlan(step, same.output_path, CACHED, f"the same work as {same.name}: its output is reused", deps,
                            same.status, reused_from=same.name)
    if status is None:
        earlier = _closest_record(listings.earlier_runs(path))
        if earlier is not None:
            record, against = earlier
            diff = "; ".join(diff_identities(record["identity"], graph.identities.payload(step))) or "identity changed"
            return StepPlan(step, path, STALE, f"{diff} (against {against})" if against else diff, deps)
        return StepPlan(step, path, RUN, "forced" if forced else "never ran", deps)
    if status.state == SUCCESS:
        problem = verify_manifest(path, status, no_outputs=step.no_outputs)
        if problem is not None:
            return StepPlan(step, path, RUN, f"cache entry invalid: {problem}", deps, status)
        if forced:
            return StepPlan(step, path, RUN, "forced (--force)", deps, status)
        return StepPlan(step, path, CACHED, code.describe_change(step.name, step.fn, status.code), deps, status)
    if status.state == FAILED:
        return StepPlan(step, path, FAILED_STATE, f"attempt {status.attempt} failed: {status.error}", deps, status)
    if status.state == INTERRUPTED:
        return StepPlan(step, path, INTERRUPTED_STATE, f"attempt {status.attempt}: {status.error}", deps, status)
    holder = leases.current_lease(path)
    if holder is not None and holder.is_live():
        return StepPlan(step, path, RUNNING_ELSEWHERE, f"lease held by {holder.describe()}", deps, status)
    return StepPlan(step, path, RUN, f"attempt {status.attempt} died while {status.state} (lease expired)", deps, status)


def plan_graph(graph: Graph, force: re.Pattern | None = None) -> list[StepPlan]:
    listings = _Listings()
    with no_cycle_collection():
        rerun = {graph.path(s) for s in graph.steps() if force.search(s.name)} if force else set()
        plans: dict[Step | External, StepPlan] = {}
        for s in graph.order:
            plan = plan_step(graph, s, force, listings, rerun)
            if plan.state == CACHED and plan.reused_from is None and isinstance(s, Step):
                why = inputs_made_again(s, plan.status, plans)
                if why:
                    plan = StepPlan(s, plan.output_path, RUN, why, plan.deps, plan.status, remade_inputs=True)
            plans[s] = plan
        return list(plans.values())


def inputs_made_again(step: Step, status: Status, plans: dict) -> str:
    """Why a finished output may be out of date with the steps it read ('' when it is not): one of
    them is made again in this run (`--force`, a damaged output; the runner keeps this output when
    that gives the same content, `Runner._inputs_unchanged`), or was made again with other content
    after it (a forced step run alone, `--only`). Its identity cannot say so: an input made again
    keeps its path."""
    for dep in step.keyed_deps:
        if not isinstance(dep, Step):
            continue
        made = plans.get(dep)
        if made is None:
            continue
        if made.state != CACHED:
            cause = "after its own input" if made.remade_inputs else made.reason or made.state
            return f"its input {dep.name} is made again in this run ({cause}): it runs again unless that output comes out the same"
        recorded = (status.inputs or {}).get(dep.name)
        if recorded is not None and made.status is not None and output_digest(made.status) != recorded:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(made.status.finished))
            return f"its input {dep.name} was made again ({when}) after this output: it runs again on the new one"
    return ""


def _closest_record(paths: list[str]) -> tuple[dict, str] | None:
    """The earlier run of a step that a stale one is best told apart from, and what it is when not
    the newest finished output ('' then): that, made without `--set`, before one made with it,
    before an attempt that did not finish (a failed attempt or a one-off `--set` would list changes
    the file never had)."""
    best, best_rank = None, None
    for p in paths:
        record = read_record(p)
        if record is None or not isinstance(record.get("identity"), dict) or not isinstance(record.get("provenance", {}), dict):
            continue  # not a record keel wrote: it cannot say what changed
        status = read_status(p)
        rank = (status is not None and status.state == SUCCESS, "overrides" not in record,
                record.get("provenance", {}).get("time", 0))
        if best_rank is None or rank > best_rank:
            best, best_rank = record, rank
    if best is None:
        return None
    finished, plain, _ = best_rank
    if finished and plain:
        return best, ""
    what = "the newest finished output" if finished else "the newest attempt, which did not finish"
    return best, what + ("" if plain else ", made with --set")


def _display(value) -> str:
    if isinstance(value, dict) and "__float__" in value:
        return value["__float__"]
    if isinstance(value, dict) and "__output_of__" in value:
        return f"output_of(<{value['__output_of__']}>{'/' + value['subpath'] if value['subpath'] else ''})"
    if isinstance(value, dict) and "__enum__" in value:
        return value["__enum__"]
    return json.dumps(value, sort_keys=True)


def diff_identities(old: dict, new: dict) -> list[str]:
    """What changed between two identity payloads: input files by name (added, removed, edited),
    then config fields (`diff_payloads`)."""
    old_inputs, new_inputs = old.get("inputs") or {}, new.get("inputs") or {}
    changed = [describe_change(name, old_inputs.get(name), new_inputs.get(name))
               for name in sorted(old_inputs.keys() | new_inputs.keys()) if old_inputs.get(name) != new_inputs.get(name)]
    rest = diff_payloads({k: v for k, v in old.items() if k != "inputs"}, {k: v for k, v in new.items() if k != "inputs"})
    return changed + rest


def diff_payloads(old, new, where: str = "") -> list[str]:
    """Field-level differences between two identity payloads, e.g. `config.lr: 0.003 -> 0.001`."""
    if isinstance(old, dict) and isinstance(new, dict) and not ({"__float__", "__output_of__", "__enum__"} & (old.keys() | new.keys())):
        out = []
        for key in sorted(old.keys() | new.keys()):
            sub = f"{where}.{key}" if where else key
            if key not in old:
                out.append(f"{sub}: (absent) -> {_display(new[key])}")
            elif key not in new:
                out.append(f"{sub}: {_display(old[key])} -> (absent)")
            else:
                out.extend(diff_payloads(old[key], new[key], sub))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in diff_payloads(a, b, f"{where}[{i}]")]
    if old != new:
        suffix = " (dependency changed)" if isinstance(new, dict) and "__output_of__" in new else ""
        return [f"{where}: {_display(old)} -> {_display(new)}{suffix}"]
    return []


def diff_functions(old: Step | External, new: Step | External) -> list[str]:
    """How two steps' functions differ, e.g. `fn: exp.make_a -> exp.make_b`: an identity payload
    leaves the function out (changing code keeps its outputs), but two steps under one name that
    run different functions are two steps, not one declared twice."""
    if not (isinstance(old, Step) and isinstance(new, Step)) or old.fn is new.fn:
        return []
    before, after = code.qualified_name(old.fn), code.qualified_name(new.fn)
    if before != after:
        return [f"fn: {before} -> {after}"]
    if code.fingerprint(old.fn) != code.fingerprint(new.fn):
        return [f"fn: the source or bound arguments of {after} differ"]
    return []


def select(plans: list[StepPlan], only: re.Pattern | None) -> set[int]:
    """ids of the steps a run must execute: not cached/external, and (with --only) matching or needed."""
    todo = {id(p.step) for p in plans if p.state not in (CACHED, EXTERNAL)}
    if only is None:
        return todo
    chosen: set[int] = set()
    stack = [p.step for p in plans if only.search(p.name)]
    while stack:
        step = stack.pop()
        if id(step) in todo and id(step) not in chosen:
            chosen.add(id(step))
            stack.extend(step.deps)
    return chosen


__all__ = ["CACHED", "EMPTY_EXTERNAL", "EXTERNAL", "FAILED_STATE", "INTERRUPTED_STATE", "Graph", "RUN", "RUNNING_ELSEWHERE", "STALE", "StepPlan", "plan_graph", "plan_step", "select"]
