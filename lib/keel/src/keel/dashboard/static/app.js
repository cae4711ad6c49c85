// keel dashboard: draws the state document (window.KEEL_STATE, built by keel.dashboard.state) as
// plain SVG, with no library and nothing fetched from the internet. When the page is served live
// (window.KEEL_LIVE), it polls state.json and redraws, so a running step's curves grow in place.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const STATE_COLORS = {
  cached: "#c8e6c9", run: "#eeeeee", stale: "#fff59d", failed: "#ffcdd2", interrupted: "#ffe0b2",
  "running-elsewhere": "#bbdefb", external: "#d7ccc8",
};
const POLL_MS = 1500;
const LEGEND_ROW = 12;  // px between rows of a chart's legend (three names a row)
let selected = null;

function html(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function seconds(s) {
  if (s === null || s === undefined) return "-";
  return s < 120 ? `${s.toFixed(1)}s` : s < 7200 ? `${(s / 60).toFixed(1)} min` : `${(s / 3600).toFixed(1)} h`;
}

function number(v) {
  if (v === null || v === undefined) return "-";
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : v.toPrecision(4);
}

// ---------------------------------------------------------------- graph
function layers(steps) {
  const byName = Object.fromEntries(steps.map((s) => [s.name, s]));
  const depth = {};
  const visit = (name) => {
    if (depth[name] !== undefined) return depth[name];
    depth[name] = 0;
    depth[name] = Math.max(0, ...byName[name].deps.filter((d) => byName[d]).map((d) => visit(d) + 1));
    return depth[name];
  };
  steps.forEach((s) => visit(s.name));
  return depth;
}

function renderGraph(state) {
  const depth = layers(state.steps);
  const rows = {};
  const pos = {};
  const W = 250, H = 52, GAP_X = 40, GAP_Y = 12;
  for (const s of state.steps) {
    const d = depth[s.name];
    rows[d] = (rows[d] || 0) + 1;
    pos[s.name] = { x: 10 + d * (W + GAP_X), y: 10 + (rows[d] - 1) * (H + GAP_Y) };
  }
  const width = 20 + (Math.max(...Object.values(depth)) + 1) * (W + GAP_X);
  const height = 20 + Math.max(...Object.values(rows)) * (H + GAP_Y);
  const root = svg("svg", { width, height, id: "graph-svg" });
  for (const s of state.steps) {
    for (const d of s.deps) {
      if (!pos[d]) continue;
      const a = pos[d], b = pos[s.name];
      root.append(svg("path", { d: `M${a.x + W},${a.y + H / 2} C${a.x + W + GAP_X / 2},${a.y + H / 2} ${b.x - GAP_X / 2},${b.y + H / 2} ${b.x},${b.y + H / 2}`, fill: "none", stroke: "#90a4ae" }));
    }
  }
  for (const s of state.steps) {
    const p = pos[s.name];
    const g = svg("g", { class: "node" + (s.name === selected ? " selected" : ""), "data-step": s.name, "data-state": s.state, transform: `translate(${p.x},${p.y})` });
    g.append(svg("rect", { width: W, height: H, rx: 4, fill: STATE_COLORS[s.state] || "#fff", stroke: "#546e7a" }));
    g.append(svg("text", { x: 6, y: 15, "font-weight": 600 }, s.name));
    const timing = nodeTiming(s);
    g.append(svg("text", { x: 6, y: 30, class: "state" }, s.state + timing));
    g.append(svg("text", { x: 6, y: 44, fill: "#666" }, s.output_path.split("/").slice(-1)[0]));
    g.append(svg("title", {}, `${s.name}\n${s.output_path}${s.reason ? "\n" + s.reason : ""}`));
    g.addEventListener("click", () => { selected = s.name; render(window.KEEL_STATE); });
    root.append(g);
  }
  document.getElementById("graph").replaceChildren(root);
}

// How long it took, or since when it runs; an attempt on record that neither ended nor runs died
// (its launcher was killed: `keel status` says "died while RUNNING"), and is not shown as running.
function nodeTiming(s) {
  if (s.duration_s !== null) return ` · ${seconds(s.duration_s)}`;
  if (!s.started) return "";
  const since = new Date(s.started * 1000).toLocaleTimeString();
  return s.state === "running-elsewhere" ? ` · since ${since}` : ` · attempt ${s.attempt} died (started ${since})`;
}

function renderDetails(state) {
  const box = document.getElementById("details");
  const s = state.steps.find((x) => x.name === selected);
  if (!s) return;
  const facts = [["state", s.state], ["why", s.reason || "-"], ["what", s.description || "-"], ["output", s.output_path], ["attempt", s.attempt ?? "-"],
    ["started", s.started ? new Date(s.started * 1000).toISOString() : "-"], ["duration", seconds(s.duration_s)],
    ["depends on", s.deps.join(", ") || "-"]];
  const table = html("table", { class: "facts" }, ...facts.map(([k, v]) => html("tr", {}, html("td", {}, k), html("td", {}, String(v)))));
  const config = html("table", { class: "config" }, ...Object.entries(s.config).map(([k, v]) =>
    html("tr", {}, html("td", {}, k), html("td", {}, typeof v === "number" ? number(v) : JSON.stringify(v)))));
  box.replaceChildren(html("h3", { id: "details-name" }, s.name), table,
    html("h3", {}, "config (identity fields; execution-only ones left out)"), config,
    html("h3", {}, "log tail"), html("pre", { id: "log-tail" }, s.log_tail || "(no log yet)"));
}

// ---------------------------------------------------------------- charts
// series: [{name, points: [[x, y]], dots, dash}]; marks: [{step, label, kind}]; band: {low, high, label}.
// A null y (NaN or infinite in the run's record: JSON has neither) is not drawn. The legend takes
// as many rows as it needs, and the plot moves down (and the chart grows) by the rows past the first.
function chart(key, title, allSeries, { marks = [], band = null, xEnd = -Infinity, width = 430, height = 210 } = {}) {
  const series = allSeries.map((s) => ({ ...s, points: s.points.filter((p) => Number.isFinite(p[1])) }));
  const extra = LEGEND_ROW * Math.max(0, Math.ceil(series.length / 3) - 1);
  const L = 58, R = 10, T = 30 + extra, B = 24;
  height += extra;
  const root = svg("svg", { class: "chart", "data-chart": key, width, height });
  root.append(svg("text", { x: L, y: 12, class: "title" }, title));
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) {
    root.append(svg("text", { x: L, y: height / 2 }, "no data yet"));
    return root;
  }
  // The x axis spans the data (to `xEnd`, the run's newest step, at least), not marks ahead of it:
  // a phase 300,000 steps on squeezed the curve into its first pixels. Extremes by a loop: a spread
  // of 150,000 numbers into Math.min overflows the stack.
  let [x0, x1] = extent(pts.map((p) => p[0]));
  x1 = Math.max(x1, xEnd);
  let [y0, y1] = extent(pts.map((p) => p[1]).concat(band ? [band.low, band.high] : []));
  marks = marks.filter((m) => m.step >= x0 && m.step <= x1);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (width - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (height - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    root.append(svg("line", { x1: L, x2: width - R, y1: Y(y), y2: Y(y), stroke: "#eee" }));
    root.append(svg("text", { x: L - 4, y: Y(y) + 3, "text-anchor": "end" }, number(y)));
  }
  for (let i = 0; i <= 4; i++) {
    const x = x0 + ((x1 - x0) * i) / 4;
    root.append(svg("text", { x: X(x), y: height - 8, "text-anchor": "middle" }, Math.round(x)));
  }
  root.append(svg("rect", { x: L, y: T, width: width - L - R, height: height - T - B, fill: "none", stroke: "#bbb" }));
  if (band) {
    root.append(svg("rect", { class: "band", x: L, width: width - L - R, y: Y(band.high), height: Math.max(1, Y(band.low) - Y(band.high)), fill: "#ffcc80", opacity: 0.45 }));
    root.append(svg("text", { x: width - R - 4, y: Y(band.high) - 3, "text-anchor": "end" }, band.label));
  }
  for (const m of marks) {
    const x = X(m.step);
    root.append(svg("line", { class: `mark ${m.kind}`, x1: x, x2: x, y1: T, y2: height - B, stroke: { checkpoint: "#b0bec5", rollback: "#c62828" }[m.kind] || "#455a64", "stroke-dasharray": "3,3" }));
    root.append(svg("text", { x: x + 2, y: T + 8, transform: `rotate(90 ${x + 2} ${T + 8})` }, m.label));
  }
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    const line = svg("polyline", { "data-series": s.name, "data-points": s.points.length, fill: "none", stroke: color, "stroke-width": 1.4,
      points: s.points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") });
    if (s.dash) line.setAttribute("stroke-dasharray", "4,2");
    root.append(line);
    if (s.dots) s.points.forEach((p) => root.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color })));
    root.append(svg("text", { x: L + 4 + (i % 3) * 125, y: 24 + Math.floor(i / 3) * LEGEND_ROW, "data-legend": s.name, fill: color }, s.name.length > 22 ? "…" + s.name.slice(-21) : s.name));
  });
  return root;
}

function extent(values) {
  let low = Infinity, high = -Infinity;
  for (const v of values) { if (v < low) low = v; if (v > high) high = v; }
  return [low, high];
}

function runCharts(run) {
  const s = run.series;
  const pick = (re) => Object.keys(s).filter((k) => re.test(k));
  const loss = [{ name: "train/loss", points: s["train/loss"] || [] }];
  if (s["eval/loss"]) loss.push({ name: "eval/loss", points: s["eval/loss"], dots: true });
  pick(/^eval\/.+\/loss$/).forEach((k) => loss.push({ name: k, points: s[k], dash: true }));
  const p = run.prediction;
  const band = p ? { low: p.low, high: p.high, label: `predicted ${p.loss.toFixed(3)}` } : null;
  const marks = run.marks;
  const xEnd = extent(Object.values(s).map((points) => (points.length ? points[points.length - 1][0] : -Infinity)))[1];
  return [
    chart("loss", "loss", loss, { marks, band, xEnd }),
    chart("lr", "learning rate per optimizer group", pick(/^lr\//).map((k) => ({ name: k, points: s[k] })), { marks, xEnd }),
    chart("throughput", "tokens/s", [{ name: "throughput/tokens_per_s", points: s["throughput/tokens_per_s"] || [] }], { marks, xEnd }),
    chart("moe", "MoE health: dropped fraction, expert load balance", pick(/^moe\//).map((k) => ({ name: k, points: s[k] })), { marks, xEnd }),
  ];
}

function renderRuns(state) {
  const out = state.runs.map((run) => {
    const head = html("h3", {}, `${run.name} — ${run.state}` + (run.tokens_per_s ? ` · ${Math.round(run.tokens_per_s).toLocaleString()} tokens/s` : "")
      + (run.rollbacks ? ` · ${run.rollbacks} rollback${run.rollbacks > 1 ? "s" : ""} (spike guard)` : ""));
    if (run.prediction) {
      const last = (run.series["eval/loss"] || []).slice(-1)[0];
      const verdict = run.verdict ? (run.verdict === "within" ? "within the band" : `OUTSIDE the band (${run.verdict})`) : "judged at the end";
      head.append(" ", html("span", { class: "badge prediction " + (run.verdict && run.verdict !== "within" ? "outside" : "within"), "data-verdict": run.verdict || "" },
        `predicted ${run.prediction.loss.toFixed(4)} [${run.prediction.low.toFixed(4)}, ${run.prediction.high.toFixed(4)}]` +
        (last ? `, actual ${last[1] === null ? "not a number" : last[1].toFixed(4)}: ${verdict}` : "")));
    }
    return html("div", { class: "run", "data-run": run.name }, head, html("div", { class: "charts" }, ...runCharts(run)));
  });
  document.getElementById("runs").replaceChildren(...(out.length ? out : [html("p", { class: "hint" }, "no training steps")]));
}

function renderOverlay(state) {
  const runs = state.runs.filter((r) => Object.keys(r.series).length);
  const over = (key, dots) => runs.filter((r) => r.series[key]).map((r) => ({ name: r.name, points: r.series[key], dots }));
  const charts = html("div", { class: "charts" },
    chart("overlay-eval", "validation loss, every run", over("eval/loss", true)),
    chart("overlay-train", "train loss, every run", over("train/loss", false)),
    chart("overlay-throughput", "tokens/s, every run", over("throughput/tokens_per_s", false)));
  const table = state.comparison.table ? html("pre", { id: "compare-table" }, state.comparison.table) : html("p", { class: "hint" }, "no finished training runs to tabulate yet");
  document.getElementById("overlay").replaceChildren(charts, table);
}

function renderSheets(state) {
  const out = state.fact_sheets.map((sheet) => {
    const m = sheet.measured;
    const measured = m && `measured ${m.step_seconds.toFixed(3)} s/step (mean of the latest transport's training steps); ${m.steps_done}/${m.num_steps} steps`;
    const line = !m ? "no measured step time yet" : m.finished ? `${measured}; finished ${m.projected_end}`
      : m.projected_end ? `${measured}, ${seconds(m.remaining_s)} to go at that speed (evaluations, checkpoints and ` +
        `restarts not counted; the sheet below projects the declared facts): projected end ${m.projected_end}`
      : `${measured}; not running (${m.state}): no end projected until it runs again`;
    return html("div", { class: "sheet", "data-step": sheet.step }, html("h3", {}, sheet.step), html("p", { class: "measured" }, line), html("pre", {}, sheet.text));
  });
  document.getElementById("sheets").replaceChildren(...out);
}

function render(state) {
  window.KEEL_STATE = state;
  document.getElementById("title").textContent = `keel dashboard: ${state.experiment}`;
  renderGraph(state);
  renderDetails(state);
  renderOverlay(state);
  renderRuns(state);
  renderSheets(state);
  const when = new Date(state.generated * 1000).toLocaleTimeString();
  document.getElementById("live").textContent = window.KEEL_LIVE ? `live, updated ${when}` : `snapshot of ${when} (prefix ${state.prefix})`;
}

// Draw a state, saying so when the page cannot (a bug of this script, not a server that is down).
function show(state) {
  try {
    render(state);
  } catch (error) {
    console.error(error);
    document.getElementById("live").textContent = `render error: ${error.message} (the state was read; the page could not draw it)`;
  }
}

// The state drawn last stays on the page when a poll fails, and the page says so: a server that
// is down, or one that could not read the prefix (its reply names the error).
async function poll() {
  let state = null;
  const live = document.getElementById("live");
  try {
    const response = await fetch("state.json", { cache: "no-store" });
    if (response.ok) state = await response.json();
    else {
      const reply = await response.json().catch(() => ({}));
      live.textContent = `not updated: the state could not be read (${reply.error || `HTTP ${response.status}`}); ` +
        `showing the last state read; retrying`;
    }
  } catch (error) {
    live.textContent = `server unreachable (${error.message}); showing the last state read; retrying`;
  }
  if (state) {
    window.KEEL_LIVE = true;
    show(state);
  }
  setTimeout(poll, POLL_MS);
}

if (window.KEEL_STATE) show(window.KEEL_STATE);
else document.getElementById("live").textContent = "the state could not be read: the terminal running keel dashboard says why; retrying";
if (window.KEEL_LIVE || !window.KEEL_STATE) setTimeout(poll, POLL_MS);
