"""`keel run|plan|status|gc|compare|dashboard EXPERIMENT.py [options]`, and `python EXPERIMENT.py run|plan|...`.

An experiment file ends with `keel.main([steps])`, optionally with named scalings of its graph
(`keel.main([hero], scales={"tiny": twin})`, selected with `--scale tiny`). Run as a script, `main`
parses the command line and acts. Run through the `keel` console script, the file is executed as `__main__` while a
collector is active, so `main` only hands its steps back and the console script acts on them; `plan`, `gc`
and `compare` use that to gather the steps of several experiments at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import linecache
import os
import re
import reprlib
import runpy
import shlex
import signal
import sys
import traceback
from collections.abc import Iterable

from keel.executor import storage
from keel.executor.encoding import one_line_encoder
from keel.executor.lease import TIMEOUT_ENV, current_lease, timeout_problem
from keel.executor.overrides import apply_overrides, names_a_step
from keel.executor.plan import FAILED_STATE, INTERRUPTED_STATE, RUN, RUNNING_ELSEWHERE, Graph, StepPlan, plan_graph
from keel.executor.status import KEEL_DIR, RECORD, RUNNING
from keel.executor.step import External, ReportsProgress, Step, StepDeclarationError

COMMANDS = ("run", "plan", "status", "gc", "compare", "dashboard")
_collecting: list[tuple[list, dict]] | None = None
_declared_scales: set[str] = set()  # the scales the experiments loaded declare (for the --scale hint)


class UsageError(ValueError):
    """A command-line option keel cannot use, such as a `--force` that is not a regular expression."""


class ExperimentError(StepDeclarationError):
    """The experiment file raised while it was read (a typo, a bad value, a missing import): its
    message names the file and line, shows the line and the exception, without a traceback."""


# Mistakes in the experiment or the command line: one `keel: error: ...` line and exit code 2.
USER_ERRORS = (StepDeclarationError, storage.PrefixError, UsageError)


def _parser(prog: str, with_experiment: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Plan, run and cache a declared graph of steps.")
    p.add_argument("command", choices=COMMANDS)
    if with_experiment:
        p.add_argument("experiments", nargs="+", metavar="EXPERIMENT.py", help="experiment file(s); plan, gc and compare take several")
    p.add_argument("--prefix", default=None, help="where outputs live (default: $KEEL_PREFIX, else ./outputs)")
    p.add_argument("--force", metavar="REGEX", help="rerun matching steps even if cached")
    p.add_argument("--only", metavar="REGEX", help="run matching steps and whatever of their ancestry is missing")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="STEP:field=value", help="override a config field (the colon ends the step name)")
    p.add_argument("--max-concurrent", type=int, default=8, metavar="N", help="steps running at once (of them, those in processes of their own: at most one per core)")
    p.add_argument("--cluster", default=None, metavar="URL", help="send steps with resources to this Iris cluster (default: $KEEL_CLUSTER)")
    p.add_argument("--scale", default=None, metavar="NAME", help="use the experiment's graph scaled as NAME (e.g. tiny)")
    p.add_argument("--json", action="store_true", help="machine-readable plan/status")
    p.add_argument("--yes", action="store_true", help="gc: really delete")
    p.add_argument("--port", type=int, default=8765, help="dashboard: serve on 127.0.0.1:PORT")
    p.add_argument("--out", default=None, metavar="DIR", help="dashboard: write the page as static files to DIR instead")
    return p


_OPTION_USERS = {"yes": ("gc",), "force": ("run", "plan", "status"), "only": ("run", "plan", "status", "compare"),
                 "max_concurrent": ("run",), "cluster": ("run",), "json": ("plan", "status", "compare"),
                 "port": ("dashboard",), "out": ("dashboard",)}
"""The commands each option means something to: given to another command, it is refused, not ignored."""


def _prefix(args) -> str:
    if args.prefix == "":
        raise UsageError("--prefix is empty: give a folder or an fsspec URL (or leave --prefix out for $KEEL_PREFIX, else ./outputs)")
    # `~` is the user's home even where the shell left it (`--prefix=~/out`, KEEL_PREFIX='~/out')
    return os.path.expanduser(args.prefix or os.environ.get("KEEL_PREFIX") or "outputs")


def _check_options(args) -> None:
    """Refuse an option the command would ignore, and values no run can use."""
    defaults = vars(_parser("keel", with_experiment=False).parse_args([args.command]))
    for option, users in _OPTION_USERS.items():
        if getattr(args, option) != defaults[option] and args.command not in users:
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} does nothing for `keel {args.command}` (it applies to: {', '.join(users)}); leave it out")
    if (problem := timeout_problem(os.environ.get(TIMEOUT_ENV))) is not None:
        raise UsageError(problem)
    if args.max_concurrent < 1:
        raise UsageError(f"--max-concurrent {args.max_concurrent}: give at least 1 (steps running at once)")
    if args.out is not None and args.port != defaults["port"]:
        raise UsageError(f"--port {args.port} does nothing with --out {args.out} (the page is written there, not served): "
                         "leave one of them out")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: give a TCP port from 1 to 65535 (0 picks a free one)")


def console_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser("keel", with_experiment=True).parse_args(argv)
    args.again = "keel " + shlex.join(argv)
    try:
        step_lists = [load_experiment(path, args.scale) for path in args.experiments]
        args.scales = sorted(_declared_scales)
        if args.command not in ("gc", "compare", "plan") and len(step_lists) > 1:
            raise StepDeclarationError(f"keel {args.command} takes one experiment file, got {len(step_lists)}")
        return _act(args, step_lists)
    except USER_ERRORS as exc:
        print(f"keel: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """Whoever read the output stopped (`keel plan ... | head`): end quietly, with the status of a
    tool that SIGPIPE ended, and nothing more written to the closed pipe at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def load_experiment(path: str, scale: str | None = None) -> list:
    """The steps an experiment file hands to `keel.main` (or its `scale` of them), without running them."""
    global _collecting
    if not os.path.exists(path):
        raise StepDeclarationError(f"experiment file {path} does not exist")
    previous, _collecting = _collecting, []
    saved_argv = sys.argv
    try:
        sys.argv = [path]
        try:
            runpy.run_path(path, run_name="__main__")
        except StepDeclarationError:
            raise
        except Exception as exc:  # noqa: BLE001 - any mistake in the file is the user's to fix: say where
            raise ExperimentError(_where_it_failed(path, exc)) from None
        if not _collecting:
            raise StepDeclarationError(f"{path} never called keel.main([...]) under `if __name__ == '__main__':`")
        _declared_scales.update(name for _, scales in _collecting for name in scales)
        return [s for steps, scales in _collecting for s in _scaled(steps, scales, scale, path)]
    finally:
        sys.argv = saved_argv
        _collecting = previous


def _where_it_failed(path: str, exc: BaseException) -> str:
    """`FILE:LINE: Type: message` and the line itself, at the experiment file's deepest frame (or
    where a syntax error is), for an exception raised while the file ran."""
    target = os.path.abspath(path)
    if isinstance(exc, SyntaxError) and exc.filename and os.path.abspath(exc.filename) == target:
        where, lineno, detail = path, exc.lineno, exc.msg
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == target]
        lineno = frames[-1].lineno if frames else None
        where, detail = path, (str(exc) or "(no message)") + _closest_fields(exc, target)
        if isinstance(exc, SyntaxError) and exc.filename:  # in a module the experiment imports
            detail = f"{exc.msg} ({exc.filename}:{exc.lineno})"
    text = (linecache.getline(target, lineno).strip() if lineno else "")
    head = f"{where}:{lineno}: " if lineno else f"{where}: "
    return head + f"{type(exc).__name__}: {detail}" + (f"\n    {lineno} | {text}" if text else "")


_UNKNOWN_KEYWORD = re.compile(r"^(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'$")


def _closest_fields(exc: BaseException, target: str) -> str:
    """For a config built with a field it does not have (`TrainConfig(batch_sise=16)`), the fields
    it does have that are closest, as a `--set` with that typo names them; '' otherwise."""
    found = _UNKNOWN_KEYWORD.match(str(exc)) if isinstance(exc, TypeError) else None
    if found is None:
        return ""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__) if os.path.abspath(frame.f_code.co_filename) == target]
    cls = frames[-1].f_globals.get(found.group(1)) if frames else None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return ""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    close = difflib.get_close_matches(found.group(2), names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else f"; {cls.__name__}'s fields are {', '.join(names)}"


def script_error(exc: BaseException, shown: str, main_file: str) -> str | None:
    """What `python EXP.py CMD` says of an exception that reached the top of the experiment file
    `main_file` (shown as `shown`), as `keel CMD EXP.py` says it; None (keep the traceback) for a
    KeyboardInterrupt and the like, for an exception raised elsewhere, and for one raised while
    keel acted on the graph (a fault in keel, not in the file: `keel CMD EXP.py` shows it whole)."""
    if not isinstance(exc, Exception):
        return None
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    if not any(os.path.abspath(f.f_code.co_filename) == os.path.abspath(main_file) for f in frames):
        return None
    if any(f.f_code is _act.__code__ for f in frames):
        return None
    if isinstance(exc, StepDeclarationError):
        return str(exc)
    path = shown if os.path.abspath(shown) == os.path.abspath(main_file) else main_file
    return _where_it_failed(path, exc)


def _scaled(steps, scales: dict, scale: str | None, where: str) -> list:
    if scale is None:
        return list(steps)
    if scale not in scales:
        known = ", ".join(sorted(scales)) or "none"
        raise StepDeclarationError(f"--scale {scale}: {where} declares no such scale (declared: {known}); "
                                   "pass scales={name: function returning steps} to keel.main")
    try:
        made = scales[scale]()
    except StepDeclarationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a mistake in the scale's function is the file's: say where
        raise ExperimentError(_where_it_failed(where, exc)) from None
    if not isinstance(made, (list, tuple)) or not all(isinstance(s, (Step, External)) for s in made):
        raise StepDeclarationError(f"--scale {scale}: {where}'s scales[{scale!r}]() returned {type(made).__name__}; "
                                   "return a list of steps, as keel.main takes")
    return list(made)


def experiment_main(steps, argv: list[str] | None = None, scales: dict | None = None) -> int:
    """What `keel.main(steps)` does: hand the steps to `keel`, or act on this script's own argv.
    Run as a script, a mistake in the file ends in one `keel: error:` block (`script_error`)."""
    scales = dict(scales or {})
    if _collecting is not None:
        _collecting.append((_targets(steps), scales))
        return 0
    own_argv = sys.argv[1:] if argv is None else argv
    args = _parser(os.path.basename(sys.argv[0]) or "experiment", with_experiment=False).parse_args(own_argv)
    args.again = shlex.join(["python", sys.argv[0], *own_argv])
    args.scales = sorted(scales)
    try:
        code = _act(args, [_scaled(_targets(steps), scales, args.scale, sys.argv[0])])
    except USER_ERRORS as exc:
        print(f"keel: error: {exc}", file=sys.stderr)
        code = 2
    except BrokenPipeError:
        code = _reader_gone()
    if argv is None:
        sys.exit(code)
    return code


def _targets(steps) -> list:
    """The steps given to `keel.main`, checked to be one flat list of Steps and Externals: a nested
    list or a `dict.values()` inside it would fail deep in the planner, in a traceback."""
    if isinstance(steps, (Step, External, str, dict)) or not isinstance(steps, Iterable):
        raise StepDeclarationError(f"keel.main: got a {type(steps).__name__}, not a list of steps: pass "
                                   "keel.main([step, ...]) (the steps to make; what they depend on is found)")
    steps = list(steps)
    for i, item in enumerate(steps):
        if not isinstance(item, (Step, External)):
            raise StepDeclarationError(f"keel.main: item {i} is a {type(item).__name__} ({reprlib.repr(item)}), not a Step or "
                                       "External: pass one flat list, keel.main([step, ...]), unpacking a collection of "
                                       "steps into it: keel.main([*steps]) or keel.main([*steps.values()])")
    return steps


def _graphs(args, step_lists: list[list]) -> list[Graph]:
    """Each experiment file's graph under the prefix, with the `--set`s naming its steps applied;
    with several files, a `--set` goes to the files that have its step, and one that names a step
    of none is an error listing every file's steps."""
    if len(step_lists) == 1:
        return [_graph(args, step_lists[0], args.overrides)]
    declared = [Graph(steps, _prefix(args)) for steps in step_lists]
    names = [{s.name for s in graph.order if isinstance(s, Step)} for graph in declared]
    for assignment in args.overrides:
        if not any(names_a_step(assignment, mine) for mine in names):
            steps = ", ".join(sorted(set().union(*names)))
            raise UsageError(f"--set {assignment!r}: no step of the {len(step_lists)} experiment files is named so; their "
                             f"steps: {steps}")
    return [_graph(args, steps, [a for a in args.overrides if names_a_step(a, mine)])
            for steps, mine in zip(step_lists, names)]


def _graph(args, steps, overrides: list[str]) -> Graph:
    """The graph under the prefix with the `overrides` (`--set`) applied; the steps whose output they
    moved record them (`Graph.overrides`), so gc can tell their outputs from abandoned ones. What an
    override does beyond its fields (a training step's positions staying put) is a warning."""
    graph = Graph(steps, _prefix(args))
    if overrides:
        declared = {s.name: graph.path(s) for s in graph.steps()}
        notes: list[str] = []
        graph = Graph(apply_overrides(graph.targets, graph.order, overrides, notes), _prefix(args))
        for note in notes:
            print(f"keel: warning: {note}", file=sys.stderr)
        graph.overrides = {s.name: list(overrides) for s in graph.steps() if declared.get(s.name) != graph.path(s)}
    return graph


def _regex(option: str, text: str | None) -> re.Pattern | None:
    try:
        return re.compile(text) if text else None
    except re.error as exc:
        raise UsageError(f"{option} {text!r}: not a regular expression ({exc}); escape special characters, e.g. {re.escape(text)!r}") from None


def _act(args, step_lists: list[list]) -> int:
    """Validate everything that can be wrong before a step runs (options, graph, prefix), then act."""
    _check_options(args)
    force = _regex("--force", args.force)
    only = _regex("--only", args.only)
    graphs = _graphs(args, step_lists)
    for option, pattern in (("--only", only), ("--force", force)):
        if pattern is not None and not any(pattern.search(s.name) for graph in graphs for s in graph.order):
            names = ", ".join(s.name for s in graphs[0].order)
            raise UsageError(f"{option} {pattern.pattern!r} matches no step; the experiment's steps: {names}")
    storage.check_prefix(_prefix(args), write=args.command == "run" or (args.command == "gc" and args.yes))
    if args.command == "gc":  # with --set, what the files declare is reached too
        declared = [Graph(steps, _prefix(args)) for steps in step_lists] if args.overrides else []
        return _gc(args, graphs + declared)
    if args.command == "compare":
        from keel.trained.compare import compare_finished

        sources = getattr(args, "experiments", [sys.argv[0]])
        return compare_finished(list(zip(sources, graphs)), _regex("--only", args.only), as_json=args.json)
    if args.command == "dashboard":
        from keel.dashboard import export, serve

        source = getattr(args, "experiments", [sys.argv[0]])[0]
        if args.out:
            print(export(source, graphs[0], args.out))
            return 0
        return serve(source, graphs[0], args.port)
    if args.command == "plan" and len(graphs) > 1:
        ignored = [flag for flag, value in (("--only", args.only), ("--force", args.force)) if value]
        if ignored:  # the variants' table covers each graph whole
            raise UsageError(f"{' and '.join(ignored)} does nothing when `keel plan` compares several experiments; "
                             "plan one file to use it")
        return _plan_variants(args, graphs)
    graph = graphs[0]
    # what `run --only` looks at: the matching steps and their ancestry (None: every step)
    selected = set(_with_ancestry([s for s in graph.order if only.search(s.name)])) if only is not None else None
    if args.command == "run":
        _check_fits(_fact_sheets(graph, selected))  # the training steps' declaration and memory checks, before any step runs
        return _run(args, graph, force, only)  # the runner refuses to start steps that read an empty External
    plans = plan_graph(graph, force)
    if selected is not None:
        plans = [p for p in plans if p.step in selected]
    sheets = _fact_sheets(graph, selected) if args.command == "plan" else []
    if args.json:
        print(_plan_json(plans, sheets))
    else:
        print(render_table(plans, graph, timings=args.command == "status"))
        for sheet in sheets:
            print()
            print(sheet["text"])
    _check_fits(sheets)  # a plan that does not fit at its peak exits non-zero, after printing why
    return 0


def _with_ancestry(steps: list) -> list:
    """`steps` and every step they depend on, directly or not (what `run --only` looks at)."""
    found: dict[int, object] = {}
    stack = list(steps)
    while stack:
        step = stack.pop()
        if id(step) not in found:
            found[id(step)] = step
            stack.extend(step.deps)
    return list(found.values())


def _check_fits(sheets: list[dict]) -> None:
    if sheets:
        from keel.plan import check_fits

        check_fits(sheets)


def _plan_variants(args, graphs: list[Graph]) -> int:
    """`keel plan A.py B.py`: one table of every training step's headline figures, side by side."""
    from keel.plan import render_variants, variant_row
    from keel.trained.compare import short_names

    files = short_names(args.experiments)  # basenames, unless two files share one (v1/exp.py, v2/exp.py)
    sheets = [(f"{files[path]}: {s['step']}", s) for path, graph in zip(args.experiments, graphs)
              for s in _fact_sheets(graph)]
    rows = [variant_row(label, sheet) for label, sheet in sheets]
    print(json.dumps({"variants": rows}, indent=1, default=str) if args.json else render_variants(rows))
    _check_fits([sheet for _, sheet in sheets])
    return 0


def _plan_json(plans: list[StepPlan], sheets: list[dict]) -> str:
    """The `--json` document: one line per step (compact: the indenting encoder is pure Python and
    would be a fifth of a 10,000-step plan's time), the fact sheets indented."""
    line = one_line_encoder(sort_keys=False, separators=(", ", ": "), default=str)  # json.dumps's, built once
    steps = ",\n ".join(line({**p.to_json(), **({"warnings": p.status.warnings} if p.status and p.status.warnings else {})})
                         for p in plans)
    return f'{{"steps": [\n {steps}\n],\n"fact_sheets": {json.dumps(sheets, indent=1, default=str)}}}'


def _fact_sheets(graph: Graph, selected: set | None = None) -> list[dict]:
    """Fact sheets of the graph's training steps, or of those among `selected` (keel.plan, imported
    here: jax-free, but not needed by every command)."""
    from keel.plan import fact_sheets_for

    return fact_sheets_for(graph, selected)


def _attempted(plan: StepPlan) -> bool:
    """Whether the step has an attempt to report progress of: running, interrupted, failed, or one
    whose launcher died mid-run (state `run` with a RUNNING record whose lease expired)."""
    died = plan.state == RUN and plan.status is not None and plan.status.state == RUNNING
    return died or plan.state in (RUNNING_ELSEWHERE, INTERRUPTED_STATE, FAILED_STATE)


def render_table(plans: list[StepPlan], graph: Graph, timings: bool = False) -> str:
    rows = []
    for p in plans:
        extra = ""
        if timings and p.status is not None and p.status.duration is not None:
            extra = f" [{p.status.duration:.2f}s, attempt {p.status.attempt}]"
        res = f" ({p.step.resources.describe()})" if getattr(p.step, "resources", None) else ""
        reason = f"  <- {p.reason}" if p.reason else ""
        rows.append(f"{p.state:<17} {p.name}{res}\n{'':<17}   {p.output_path}{extra}{reason}")
        if timings and p.status is not None and p.status.warnings:
            rows.extend(f"{'':<17}   warning: {w}" for w in p.status.warnings)
        if timings and _attempted(p):
            config = getattr(p.step, "config", None)
            shown = (config.progress(p.output_path, running=p.state == "running-elsewhere")
                     if isinstance(config, ReportsProgress) else None)
            if shown:
                rows.append(f"{'':<17}   {shown}")
        if timings and p.status is not None and getattr(getattr(p.step, "config", None), "predicted_loss", None):
            from keel.trained.ladder import status_line  # the prediction, and the run's loss against it

            rows.append(f"{'':<17}   {status_line(graph, p) or 'prediction declared, not made yet'}")
    counts: dict[str, int] = {}
    for p in plans:
        counts[p.state] = counts.get(p.state, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    return "\n".join(rows + [f"-- {len(plans)} steps: {summary}"])


def _run(args, graph: Graph, force: re.Pattern | None, only: re.Pattern | None) -> int:
    from keel.executor.cluster import ClusterUnreachable, NoProject, cluster_client, in_iris_job
    from keel.executor.run import Runner

    url = args.cluster or os.environ.get("KEEL_CLUSTER")
    uses_cluster = bool(url) or in_iris_job()  # a driver inside an Iris job uses that cluster
    on_cluster = [s.name for s in graph.steps() if getattr(s, "resources", None) is not None] if uses_cluster else []
    if on_cluster and not storage.is_shared_between_processes(graph.prefix):
        print(f"keel: error: --prefix {graph.prefix} lives in this process's memory, where the cluster's workers cannot "
              f"write {on_cluster[0]}'s outputs (it declares resources=): give a prefix they reach (gs://, s3://, or a "
              "folder every worker mounts)", file=sys.stderr)
        return 2
    try:
        cluster = cluster_client(url) if uses_cluster else None
    except (ClusterUnreachable, NoProject) as exc:
        print(f"keel: error: {exc}", file=sys.stderr)
        return 2
    runner = Runner(graph, cluster=cluster, max_concurrent=args.max_concurrent, force=force)
    with contextlib.ExitStack() as stack:
        if url:
            stack.callback(cluster.shutdown)
        report = runner.run(only)
    reused = f"{len(report.reused)} reused" + (" (finished by another launcher while this one waited)" if report.reused else "")
    print(f"[keel] {len(report.ran)} ran, {reused}, "
          f"{sum(p.state == 'cached' for p in report.plans)} cached, {len(report.failures)} failed, {len(report.blocked)} skipped"
          + (f", {len(report.interrupted)} interrupted, {len(report.not_started)} not started" if report.interrupted or report.not_started else "")
          + (f"; {len(report.warned)} finished with warnings (below)" if report.warned else ""))
    for warned in report.warned:
        print(f"keel: warning: {warned}", file=sys.stderr)
    for failure in report.failures:
        print(f"keel: {failure}", file=sys.stderr)
        if "TopologyError" in failure.error and args.scale is None and getattr(args, "scales", None):
            print(f"keel: this machine lacks the devices the step's topology declares; the experiment declares smaller "
                  f"scales ({', '.join(args.scales)}): try `{args.again} --scale {args.scales[0]}`", file=sys.stderr)
    if report.interrupted or report.not_started:
        for stopped in report.interrupted:
            print(f"keel: {stopped}", file=sys.stderr)
        if report.not_started:
            print(f"keel: not started: {', '.join(report.not_started)}", file=sys.stderr)
        print(f"keel: interrupted; run the same command again ({args.again}) to resume from the last checkpoints", file=sys.stderr)
        from keel.executor.interrupt import EXIT_INTERRUPTED

        return EXIT_INTERRUPTED
    return 0 if report.ok else 1


def _gc(args, graphs: list[Graph]) -> int:
    """List (and with --yes delete) outputs under the prefix that none of the `graphs` reach (the
    experiments as declared and, with `--set`, as changed).

    Kept whatever it finds: an output made with `--set` (only the same `--set` reaches it), one an
    External of the experiments reads (or lies inside), and one whose step is running right now."""
    prefix = _prefix(args)
    fs, root = storage.split(prefix)
    reached, read = set(), set()
    for graph in graphs:  # a step that reuses another name's output reaches that output
        for p in plan_graph(graph):
            (reached if isinstance(p.step, Step) else read).add(storage.split(p.output_path)[1])
    found = _outermost(_recorded_outputs(fs, root), reached)
    unreached, kept = [], []
    for path in (p for p in found if p not in reached):
        overrides = _recorded_overrides(fs, path)
        external = next((e for e in read if e == path or e.startswith(f"{path}/") or path.startswith(f"{e}/")), None)
        holder = current_lease(fs.unstrip_protocol(path))
        why = (f"made with --set {' --set '.join(overrides)}; gc with the same --set reaches it, or delete it by hand"
               if overrides else f"an External reads {external}" if external is not None
               else f"running now: lease held by {holder.describe()}" if holder is not None and holder.is_live() else None)
        if why is None:
            unreached.append(path)
        else:
            kept.append(path)
            print(f"{'kept':>14}  {path} ({why})")
    total = 0
    for path in unreached:
        size = int(fs.du(path, total=True))
        total += size
        print(f"{size:>14,d}  {path}")
    print(f"-- {len(unreached)} unreached output(s), {total:,d} bytes" + ("" if args.yes else " (pass --yes to delete)")
          + (f"; {len(kept)} kept" if kept else ""))
    if args.yes:
        for path in unreached:
            fs.rm(path, recursive=True)
        print(f"-- deleted {len(unreached)}")
    return 0


def _recorded_outputs(fs, root: str) -> list[str]:
    """Every folder under `root` that holds a step's record. Listed, not globbed: a `[`, `*` or `?`
    in the prefix is part of its name, where a glob would read a pattern and reach the outputs of
    another prefix (`--prefix runs[12]` matching `runs1/` and `runs2/`)."""
    marker = f"/{KEEL_DIR}/{RECORD}"
    return sorted({p[:-len(marker)] for p in fs.find(root) if p.endswith(marker)})


def _outermost(found: list[str], reached: set[str]) -> list[str]:
    """The found outputs inside no reached output and no other found one. A record nested in an
    output is a copy the step made (an export of its dependency's folder): part of that output, to
    keep with it or delete with it, not an output of its own."""
    outputs = reached | set(found)
    return [path for path in found if not any(path[:i] in outputs for i, c in enumerate(path) if c == "/" and i)]


def _recorded_overrides(fs, output_path: str) -> list[str]:
    """The `--set` assignments an output was made with (its step.json records them), else []."""
    try:
        record = json.loads(fs.cat_file(f"{output_path}/{KEEL_DIR}/{RECORD}"))
    except (OSError, ValueError):
        return []
    overrides = record.get("overrides") if isinstance(record, dict) else None
    return [str(o) for o in overrides] if isinstance(overrides, list) else []
