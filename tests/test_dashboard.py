"""`keel dashboard` in a real browser (Debian's Chromium driven by Playwright): the page of a finished
experiment (graph states, a step's config, staleness and log, every run's charts with one point
per logged step, the overlay, the fact sheets), the same page exported as static files, and a
running step whose curve grows without a reload. Training is a stand-in that writes what a
training step records (metrics.jsonl, checkpoints), so the test takes seconds, not minutes."""

import http.client
import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from dashboard_browser import browser_page, keel_command, local_only, node_states, points, serving
from keel.cli import console_main, load_experiment
from keel.executor.plan import Graph, plan_graph
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parent.parent
STEPS = 12

_EXPERIMENT = textwrap.dedent(
    """
    import json, os, time
    from defaults import default_compare, default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, TrainConfig

    SECONDS_PER_STEP = float(os.environ.get("FAKE_SECONDS_PER_STEP", "0"))
    LR = float(os.environ.get("FAKE_LR_A", "0.5"))

    def pretend_to_train(config):
        # What the loop records, in order: evaluations (mean and per component), then per step the
        # train loss, LRs, MoE health, throughput and transport (switching at half way), a checkpoint at the end.
        lr, steps = config.train.optimizer.lr, config.train.num_steps
        path = os.path.join(config.output_path, "metrics.jsonl")
        def write(row):
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\\n")
        write({"step": 0, "eval/code/loss": 7.1, "eval/prose/loss": 6.9, "eval/loss": 7.0})
        for s in range(steps):
            write({"step": s, "train/loss": 7.0 - lr * s / steps, "lr/adamw": lr * (1 - s / steps),
                   "moe/dropped_fraction": 0.01, "moe/router_balance": 1.1, "throughput/tokens_per_s": 1000.0,
                   "transport": "ring" if s < steps // 2 else "fixed_all_to_all"})
            if (s + 1) % 6 == 0:
                loss = 6.5 - lr * (s + 1) / steps
                write({"step": s + 1, "eval/code/loss": loss + 0.1, "eval/prose/loss": loss - 0.1, "eval/loss": loss})
            time.sleep(SECONDS_PER_STEP)
        os.makedirs(os.path.join(config.output_path, "checkpoints", f"step-{steps}"))
        print(f"pretend training of lr {lr} done")

    def run(name, lr, steps):
        train = TrainConfig(batch_size=2, seq_len=8, num_steps=steps, optimizer=AdamWConfig(lr=lr))
        step = default_train(name, data=External("cache", "/nowhere", version="v1"), model=tiny_moe, train=train)
        return step.__class__(step.name, pretend_to_train, step.config)

    runs = [run("dash/a", LR, STEPS), run("dash/b", 0.25, STEPS)]
    if __name__ == "__main__":
        main([default_compare("dash", runs=runs)] if not os.environ.get("FAKE_RUNNING") else [run("dash/live", 0.5, 400)])
    """
).replace("STEPS)", f"{STEPS})")


def _graph(experiment: str, prefix: str, **env) -> Graph:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Graph(load_experiment(experiment), prefix)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_the_page_of_a_finished_experiment_live_and_exported(tmp_path):
    experiment = str(tmp_path / "dash_exp.py")
    Path(experiment).write_text(_EXPERIMENT)
    prefix = str(tmp_path / "out")
    done = subprocess.run([*keel_command(), "run", experiment, "--prefix", prefix], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # a user's run: what the step prints lands in its log.txt
    assert done.returncode == 0, done.stdout + done.stderr
    graph = _graph(experiment, prefix)
    expected = {p.name: p.state for p in plan_graph(graph)}
    run_a = next(s for s in graph.steps() if s.name == "train/dash/a")
    logged = len(latest_by_step(read_metrics(os.path.join(graph.path(run_a), METRICS_FILE)), "train/loss"))

    with serving(experiment, graph) as url, browser_page() as page:
        page.goto(url)
        assert node_states(page) == expected and set(expected.values()) == {"cached", "external"}
        for run in ("train/dash/a", "train/dash/b"):  # one point per logged step; components and marks drawn
            assert points(page, run, "loss", "train/loss") == logged == STEPS
            assert points(page, run, "loss", "eval/loss") == 3
            assert points(page, run, "loss", "eval/code/loss") == points(page, run, "loss", "eval/prose/loss") == 3
            assert points(page, run, "lr", "lr/adamw") == STEPS
            assert points(page, run, "moe", "moe/dropped_fraction") == STEPS
            marks = page.locator(f'.run[data-run="{run}"] svg[data-chart="loss"] line.mark')
            assert sorted(marks.evaluate_all("ls => ls.map(l => l.classList[1])")) == ["checkpoint", "transport"]
        overlay = page.locator('svg[data-chart="overlay-eval"] polyline')
        assert overlay.evaluate_all("ls => ls.map(l => l.dataset.series)") == ["train/dash/a", "train/dash/b"]
        assert "| train/dash/a |" in page.inner_text("#compare-table") and "- tokens/s:" in page.inner_text("#compare-table")
        sheets = page.locator(".sheet")
        assert sheets.evaluate_all("s => s.map(x => x.dataset.step)") == ["train/dash/a", "train/dash/b"]
        assert "== fact sheet: train/dash/a" in sheets.first.inner_text()
        assert "s/step (mean of the latest transport's training steps); 12/12 steps; finished 20" in sheets.first.locator(".measured").inner_text()
        page.click('g.node[data-step="train/dash/a"]')  # a step's details: identity config and log tail
        details = page.inner_text("#details")
        assert "train.optimizer.lr" in details and "train.seq_len" in details and "pretend training of lr 0.5 done" in details
        assert "topology" not in details  # execution-only fields are not part of the config shown
        assert not local_only(page.requested) and not page.errors
        # a request naming another host (a page elsewhere that resolves its name here) gets nothing
        port = int(url.rsplit(":", 1)[1].strip("/"))
        for host, code in ((f"attacker.example:{port}", 403), (f"localhost:{port}", 200)):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                connection.request("GET", "/state.json", headers={"Host": host})
                response = connection.getresponse()
                assert (response.status, b"train/dash/a" in response.read()) == (code, code == 200), host
            finally:
                connection.close()

    # The same run with another learning rate: the page says it is stale, and why.
    stale = _graph(experiment, prefix, FAKE_LR_A="0.75")
    with serving(experiment, stale) as url, browser_page() as page:
        page.goto(url)
        assert node_states(page)["train/dash/a"] == "stale"
        page.click('g.node[data-step="train/dash/a"]')
        assert "config.train.optimizer.lr: 0.5 -> 0.75" in page.inner_text("#details")

    # `keel dashboard --out DIR`: the same page as files, opened from disk with no server.
    out = tmp_path / "shared"
    assert console_main(["dashboard", experiment, "--prefix", prefix, "--out", str(out)]) == 0
    with browser_page() as page:
        page.goto((out / "index.html").as_uri())
        assert node_states(page) == expected
        assert points(page, "train/dash/a", "loss", "train/loss") == STEPS
        assert page.locator(".sheet").count() == 2
        assert not local_only(page.requested) and not page.errors

    # --out names any fsspec folder: an object store gets the same files (never a local folder named "memory:")
    import fsspec

    assert console_main(["dashboard", experiment, "--prefix", prefix, "--out", "memory://dash-export"]) == 0
    store = fsspec.filesystem("memory")
    exported = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {p.removeprefix("/dash-export/") for p in store.find("/dash-export")} == exported
    for name in exported - {"state.js"}:
        assert store.cat(f"/dash-export/{name}") == (out / name).read_bytes(), name
    assert b"train/dash/a" in store.cat("/dash-export/state.js") and not (REPO / "memory:").exists()


def test_a_running_steps_curve_grows_without_reloading(tmp_path):
    experiment = str(tmp_path / "dash_exp.py")
    Path(experiment).write_text(_EXPERIMENT)
    prefix = str(tmp_path / "out")
    env = {"FAKE_RUNNING": "1", "FAKE_SECONDS_PER_STEP": "0.3"}
    graph = _graph(experiment, prefix, **env)
    live = graph.path(next(s for s in graph.steps() if s.name == "train/dash/live"))
    metrics = Path(live) / METRICS_FILE
    proc = subprocess.Popen([*keel_command(), "run", experiment, "--prefix", prefix], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("train/loss") >= 2):
            time.sleep(0.2)
        assert metrics.exists(), "the stand-in training step never started"
        with serving(experiment, graph) as url, browser_page() as page:
            page.goto(url)
            assert node_states(page)["train/dash/live"] == "running-elsewhere"
            first = points(page, "train/dash/live", "loss", "train/loss")
            requests = len(page.requested)
            page.wait_for_function(
                f"""() => Number(document.querySelector('.run[data-run="train/dash/live"] svg[data-chart="loss"] '
                    + 'polyline[data-series="train/loss"]').dataset.points) >= {first + 3}""", timeout=60_000)
            assert not any(u.endswith("/") or u.endswith("index.html") for u in page.requested[requests:])  # no reload
            measured = page.locator('.sheet[data-step="train/dash/live"] .measured').inner_text()
            assert "to go at that speed (evaluations, checkpoints and restarts not counted" in measured, measured
            assert ": projected end " in measured, measured
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] >= first + 3
    # killed, it is no longer running: its sheet projects no end (its lease names a process that is gone)
    from keel.dashboard import build_state

    def live_sheet():
        return next(s for s in build_state(experiment, graph)["fact_sheets"] if s["step"] == "train/dash/live")["measured"]

    deadline = time.monotonic() + 60  # until the killed process is reaped: a zombie still answers kill(pid, 0)
    while (measured := live_sheet())["state"] == "running-elsewhere" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert measured["state"] != "running-elsewhere" and measured["projected_end"] is None, measured


_HAND_WRITTEN = textwrap.dedent(
    """
    from defaults import default_scaling_ladder, default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, TrainConfig

    data = External("cache", "/nowhere", version="v1")
    train = TrainConfig(batch_size=2, seq_len=8, num_steps=4, optimizer=AdamWConfig(lr=0.5))
    ladder = default_scaling_ladder("hand", data=data, model=tiny_moe, train=train, sizes=(32, 48, 64, 96), steps=(2, 3, 4, 6),
                                    target=(128, 4))  # its prediction.json is written by hand
    run = default_train("hand", data=data, model=ladder.target_model, train=ladder.target_train,
                        predicted_loss=ladder.prediction)
    if __name__ == "__main__":
        main([run])
    """
)
LR_GROUPS = 7


def _hand_written(tmp_path) -> tuple[str, Graph]:
    """A 4-step run written by hand: 7 optimizer groups (a legend of three rows), a final evaluation
    that is NaN, a declared prediction, and a second attempt whose launcher died (step.json only)."""
    experiment = tmp_path / "hand_exp.py"
    experiment.write_text(_HAND_WRITTEN)
    graph = _graph(str(experiment), str(tmp_path / "out"))
    fit = Path(graph.path(next(s for s in graph.steps() if s.name == "ladder/hand")))
    fit.mkdir(parents=True)
    (fit / "prediction.json").write_text(json.dumps({"target": "hidden 128, 4 steps", "compute": 1e9, "loss": 5.0, "low": 4.5,
                                                     "high": 5.5, "band": 0.95, "method": "by hand", "law": "-"}))
    output = Path(graph.path(next(s for s in graph.steps() if s.name == "train/hand")))
    (output / ".keel").mkdir(parents=True)
    (output / ".keel" / "step.json").write_text(json.dumps({"name": "train/hand", "attempt": 2, "started": time.time() - 60}))
    rows = [{"step": 0, "eval/loss": 7.0}]
    rows += [{"step": s, "train/loss": 6.0 - s / 10, "throughput/tokens_per_s": 1000.0, "transport": "ring",
              **{f"lr/group{g}": 0.01 * g for g in range(LR_GROUPS)}} for s in range(4)]
    rows += [{"step": 4, "eval/loss": float("nan")}]
    (output / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN as NaN
    return str(experiment), graph


def _check_hand_written_page(page) -> None:
    assert not page.errors, page.errors
    assert node_states(page)["train/hand"] == "run"
    node = page.text_content('g.node[data-step="train/hand"] text.state')
    assert node.startswith("run · attempt 2 died (started "), node  # not "since ...": it does not run
    head = page.inner_text('.run[data-run="train/hand"] h3')
    assert "predicted 5.0000 [4.5000, 5.5000], actual not a number" in head, head
    assert points(page, "train/hand", "loss", "eval/loss") == 1  # the NaN evaluation is not drawn at y=0
    chart = page.locator('.run[data-run="train/hand"] svg[data-chart="lr"]')
    legends = chart.locator("text[data-legend]").evaluate_all("ts => ts.map(t => [+t.getAttribute('x'), +t.getAttribute('y')])")
    assert len(legends) == len({tuple(p) for p in legends}) == LR_GROUPS  # no two names on one spot
    top = float(chart.locator("rect").first.get_attribute("y"))
    assert sorted({y for _, y in legends}) == [24, 36, 48] and top > 48  # three rows, all above the plot


def test_a_hand_written_run_nan_loss_many_legends_and_a_dead_launcher(tmp_path):
    """A NaN final evaluation (null in the state) neither crashes the page nor plots at 0; a legend
    of seven names takes three rows; a step whose launcher died is not drawn as running; a page that
    cannot draw a state says so, rather than that the server is unreachable."""
    experiment, graph = _hand_written(tmp_path)
    with serving(experiment, graph) as url, browser_page() as page:
        page.goto(url)
        _check_hand_written_page(page)
        page.route("**/state.json", lambda route: route.fulfill(status=200, content_type="application/json", body='{"steps": 1}'))
        page.wait_for_function("() => document.getElementById('live').textContent.startsWith('render error: ')", timeout=10_000)
    out = tmp_path / "shared"
    assert console_main(["dashboard", experiment, "--prefix", str(tmp_path / "out"), "--out", str(out)]) == 0
    with browser_page() as page:
        page.goto((out / "index.html").as_uri())
        _check_hand_written_page(page)


_LONG = textwrap.dedent(
    """
    from defaults import default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, Mixture, MixturePhase, TrainConfig

    caches = {name: External(name, f"/nowhere/{name}", version="v1") for name in ("a", "b")}
    phases = (MixturePhase(0, {"a": 1.0}), MixturePhase(100_000, {"b": 1.0}), MixturePhase(400_000, {"a": 1.0}))
    train = TrainConfig(batch_size=2, seq_len=8, num_steps=500_000, optimizer=AdamWConfig(lr=0.5))
    run = default_train("long", data=Mixture(caches, phases, block_size=2), model=tiny_moe, train=train)
    if __name__ == "__main__":
        main([run])
    """
)
LONG_STEPS, SPIKE = 150_000, (77_777, 50.0)


def test_a_long_run_is_sent_thinned_with_its_spike_both_rollbacks_and_phases_where_read(tmp_path):
    """A run 150,000 steps into 500,000 (the hero logs every step of 390,251): each series is sent
    thinned to its extremes per stretch (whole, one poll was 45 MB), the spike kept; two rollbacks at
    one step are two (keyed by step, one was lost); a phase starts at the step that reads its batch,
    two steps early after two skipped batches; the x axis ends at the data, not at a phase 250,000
    steps ahead (the curve was squeezed into its first pixels); and a page sent a series of 200,000
    points draws it (Math.min(...points) overflowed the stack: "render error" for every section)."""
    from keel.dashboard import build_state
    from keel.dashboard.state import MAX_POINTS

    experiment = tmp_path / "long_exp.py"
    experiment.write_text(_LONG)
    graph = _graph(str(experiment), str(tmp_path / "out"))
    output = Path(graph.path(next(s for s in graph.steps() if s.name == "train/long")))
    output.mkdir(parents=True)
    rows = [{"step": s, "train/loss": SPIKE[1] if s == SPIKE[0] else 5.0 - s / 1e6} for s in range(LONG_STEPS)]
    rows[6:6] = [{"step": 5, "spike/rollback_from": 5, "spike/skipped_batch": batch} for batch in (5, 6)]
    (output / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))

    run = next(r for r in build_state(str(experiment), graph)["runs"] if r["name"] == "train/long")
    loss = run["series"]["train/loss"]
    assert len(loss) <= MAX_POINTS + 2 and loss[0] == (0, 5.0) and loss[-1][0] == LONG_STEPS - 1 and SPIKE in loss
    assert run["rollbacks"] == 2
    assert [m["label"] for m in run["marks"] if m["kind"] == "rollback"] == ["rollback: skipped batch 5", "rollback: skipped batch 6"]
    assert {m["label"]: m["step"] for m in run["marks"] if m["kind"] == "phase"} == {"phase 1": 99_998, "phase 2": 399_998}

    with serving(str(experiment), graph) as url, browser_page() as page:
        page.goto(url)
        chart = f'.run[data-run="train/long"] svg[data-chart="loss"]'
        assert points(page, "train/long", "loss", "train/loss") == len(loss)
        ticks = page.locator(f"{chart} text[text-anchor=middle]").evaluate_all("ts => ts.map(t => +t.textContent)")
        assert max(ticks) == LONG_STEPS - 1, ticks
        drawn = page.locator(f"{chart} line.mark").evaluate_all("ls => ls.map(l => l.classList[1])")
        assert sorted(drawn) == ["phase", "rollback", "rollback"], drawn  # phase 2 lies ahead of the data
        assert not page.errors, page.errors

        whole = json.loads(page.evaluate("() => JSON.stringify(window.KEEL_STATE)"))
        next(r for r in whole["runs"] if r["name"] == "train/long")["series"]["train/loss"] = [[s, 5.0] for s in range(200_000)]
        page.route("**/state.json", lambda route: route.fulfill(status=200, content_type="application/json", body=json.dumps(whole)))
        page.wait_for_function(f"""() => Number(document.querySelector('{chart} polyline[data-series="train/loss"]')
            .dataset.points) === 200000""", timeout=30_000)
        assert page.inner_text("#live").startswith("live, updated") and not page.errors, page.errors


def test_a_slow_state_build_waits_five_times_its_length_before_the_next(monkeypatch):
    """Every poll rebuilt a state older than a second: a build of 2 s (a long run on an object store)
    followed the last at once, a core kept busy for as long as a tab stayed open; each poll encoded
    the document again. The clock is the test's, so nothing here depends on the machine's speed."""
    import keel.dashboard.server as server

    clock, builds = [0.0], []

    def build_state(experiment, graph):
        builds.append(clock[0])
        clock[0] += 2.0  # the build takes 2 s
        return {"built": len(builds)}

    monkeypatch.setattr(server.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(server, "build_state", build_state)
    cached = server._Cached("exp.py", graph=None)
    seen = []
    while clock[0] < 30:
        seen.append(json.loads(cached.get())["built"])
        clock[0] += 1.5  # the page polls every 1.5 s
    assert builds == [0.0, 12.5, 25.0]  # 10 s after each 2 s build ended, at the first poll past it
    assert seen.count(1) == 7 and seen[-1] == 3


def test_port_80_answers_the_bare_host_a_browser_sends():
    """A browser leaves the port out of Host on port 80: 127.0.0.1 and localhost are this server's
    names there; another host is still refused. (The server is bound elsewhere and told it is on 80:
    binding 80 needs root.)"""
    from keel.dashboard import make_server
    import threading

    server = make_server("exp.py", graph=None, port=0)
    port, server.server_address = server.server_port, ("127.0.0.1", 80)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        for host, code in (("127.0.0.1", 200), ("localhost", 200), ("attacker.example", 403), ("127.0.0.1:80", 200)):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                connection.request("GET", "/static/style.css", headers={"Host": host})
                assert connection.getresponse().status == code, host
            finally:
                connection.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_state_that_cannot_be_read_mid_run_is_said_over_the_last_one_drawn(tmp_path, monkeypatch):
    """A poll whose state the server cannot build (a record torn mid-write) left the page showing
    "live, updated ..." over old curves, the error on the terminal only."""
    import keel.dashboard.server as server

    experiment, graph = _hand_written(tmp_path)
    built, broken = server.build_state, {"now": False}

    def build_state(*args):
        if broken["now"]:
            raise RuntimeError("train/hand's step.json is torn")
        return built(*args)

    monkeypatch.setattr(server, "build_state", build_state)
    with serving(experiment, graph) as url, browser_page() as page:
        page.goto(url)
        page.wait_for_function("() => document.getElementById('live').textContent.startsWith('live, updated')")
        broken["now"] = True
        page.wait_for_function("() => document.getElementById('live').textContent.startsWith('not updated')")
        said = page.inner_text("#live")
        assert "the state could not be read (RuntimeError: train/hand's step.json is torn)" in said, said
        assert points(page, "train/hand", "loss", "train/loss") == 4, "the last state read stays drawn"
        assert not page.errors, page.errors
        broken["now"] = False  # readable again: the page is live again
        page.wait_for_function("() => document.getElementById('live').textContent.startsWith('live, updated')")


def test_a_port_that_cannot_be_bound_is_an_error_naming_it(monkeypatch, capsys):
    """Permission denied on a port below 1024 (as a user; root may bind it) was a traceback."""
    import errno

    import keel.dashboard.server as server

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(server, "make_server", refused)
    assert server.serve("exp.py", None, 80) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: --port 80: cannot listen on 127.0.0.1:80 (Permission denied): pass --port ")


def test_a_log_tail_is_read_from_the_end_and_a_byte_that_is_no_utf8_does_not_fail_the_page(tmp_path):
    """The page read every step's whole log.txt on each poll, strictly as UTF-8: one stray byte (a
    character cut between two writes) made every poll a 500."""
    from keel.dashboard.state import LOG_TAIL_BYTES, LOG_TAIL_LINES, _log_tail

    log = tmp_path / ".keel" / "log.txt"
    log.parent.mkdir()
    lines = [f"[train] step {i}: loss {5 - i / 1e4:.4f}" for i in range(10_000)]
    log.write_bytes(("\n".join(lines) + "\n").encode() + b"cut here \xe2\x82\n")
    assert log.stat().st_size > 4 * LOG_TAIL_BYTES
    tail = _log_tail(str(tmp_path)).splitlines()
    assert len(tail) == LOG_TAIL_LINES and tail[:-1] == lines[-(LOG_TAIL_LINES - 1):] and tail[-1] == "cut here \ufffd"
    assert _log_tail(str(tmp_path / "never-ran")) == ""
