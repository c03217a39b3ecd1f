// The live dashboard: poll v1/status about once a second, keep a rolling window of samples
// per series in the page, and draw each chart as inline SVG. No libraries, no network beyond
// this API. Each chart's <svg> carries data-points / data-series so a test can read them back.
"use strict";

const WINDOW_S = 300;   // seconds of history kept; the x axis grows to it from the first sample
const MIN_SPAN_S = 5;
const POLL_MS = 1000;
const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#79c0ff",
                 "#56d364", "#e3b341", "#ff7b72", "#39c5cf"];
const SVG_NS = "http://www.w3.org/2000/svg";

// chart id -> Map(series name -> [[t, value], ...])
const history = { queue: new Map(), kv: new Map(), drift: new Map() };

function push(chart, name, t, value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return;
  const series = history[chart];
  if (!series.has(name)) series.set(name, []);
  series.get(name).push([t, value]);
}

function prune(now) {
  for (const series of Object.values(history)) {
    for (const [name, pts] of series) {
      while (pts.length && pts[0][0] < now - WINDOW_S) pts.shift();
      if (!pts.length) series.delete(name);
    }
  }
}

function el(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v) {
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (Number.isInteger(v)) return String(v);
  return v.toFixed(2);
}

let firstT = null;  // time of the first sample this page saw

function span(now) {
  const seen = firstT === null ? 0 : now - firstT;
  return Math.min(WINDOW_S, Math.max(MIN_SPAN_S, seen));
}

// Draw one chart: axes, four grid lines, one polyline per series, a legend.
function draw(id, series, now, fixedMax) {
  const svg = document.getElementById(id);
  const W = 600, H = 240, L = 48, R = 8, T = 10, B = 40;
  svg.replaceChildren();
  let maxV = 0, points = 0;
  for (const pts of series.values()) for (const [, v] of pts) { maxV = Math.max(maxV, v); points++; }
  const yMax = fixedMax !== undefined ? fixedMax : niceMax(maxV);
  const spanS = span(now);
  const x = (t) => L + (W - L - R) * (1 - (now - t) / spanS);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, yMax) / yMax);
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    svg.append(el("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    svg.append(el("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v)));
  }
  for (const s of [spanS, spanS / 2, 0]) {
    const anchor = s === spanS ? "start" : s === 0 ? "end" : "middle";
    svg.append(el("text", { x: x(now - s), y: H - B + 14, "text-anchor": anchor },
                  s === 0 ? "now" : `-${Math.round(s)}s`));
  }
  let i = 0, legendX = L;
  for (const [name, pts] of series) {
    const color = PALETTE[i++ % PALETTE.length];
    const coords = pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    if (coords.length === 1) coords.push(`${(x(pts[0][0]) + 2).toFixed(1)},${y(pts[0][1]).toFixed(1)}`);
    svg.append(el("polyline", { class: "line", stroke: color, points: coords.join(" "),
                                "data-series": name }));
    svg.append(el("rect", { x: legendX, y: H - 14, width: 10, height: 10, fill: color }));
    const label = `${name} ${fmt(pts[pts.length - 1][1])}`;
    svg.append(el("text", { x: legendX + 14, y: H - 5 }, label));
    legendX += 24 + label.length * 6.5;
  }
  if (!series.size) {
    svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  }
  svg.dataset.points = String(points);
  svg.dataset.series = String(series.size);
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.append(td);
}

function pct(v) { return v === null || v === undefined ? "—" : (100 * v).toFixed(1) + "%"; }
function secs(v) { return v === null || v === undefined ? "—" : v.toFixed(1) + " s"; }
function num(v) { return v === null || v === undefined ? "—" : fmt(v); }

function tables(st) {
  const oneMin = st.throughput.find((w) => w.window_s === 60) || st.throughput[0];
  const consumedSum = Object.values(st.mixture.consumed_total).reduce((a, b) => a + b, 0);
  const wbody = document.querySelector("#workloads tbody");
  wbody.replaceChildren();
  for (const w of st.workloads) {
    const row = document.createElement("tr");
    cell(row, w.workload);
    cell(row, num(w.depth));
    cell(row, num(w.requeued));
    cell(row, secs(w.oldest_pending_age_s));
    cell(row, num(w.finished_total));
    cell(row, num(w.failed_total), w.failed_total ? "bad" : undefined);
    cell(row, num(w.consumed_total));
    cell(row, pct(st.mixture.target[w.workload]));
    cell(row, consumedSum ? pct(w.consumed_total / consumedSum) : "—");
    cell(row, oneMin ? (oneMin.by_workload[w.workload] || 0).toFixed(2) : "—");
    cell(row, oneMin ? fmt(Math.round(oneMin.tokens_by_workload[w.workload] || 0)) : "—");
    const lat = w.latency;
    cell(row, lat ? `${secs(lat.p50_s)} / ${secs(lat.p95_s)} / ${secs(lat.p99_s)}` : "—");
    wbody.append(row);
  }
  const bbody = document.querySelector("#backends tbody");
  bbody.replaceChildren();
  for (const b of st.backends) {
    const row = document.createElement("tr");
    cell(row, b.backend_id);
    cell(row, b.healthy ? "healthy" : "dead", b.healthy ? "ok" : "bad");
    cell(row, pct(b.kv_usage));
    cell(row, `${fmt(b.reserved_tokens)} / ${fmt(b.limit_tokens)}`);
    cell(row, b.alpha.toFixed(2));
    cell(row, num(b.sessions));
    cell(row, `${num(b.running)} / ${num(b.waiting)}`);
    cell(row, num(b.preemptions_total));
    cell(row, pct(b.prefix_hit_rate));
    cell(row, secs(b.heartbeat_age_s));
    bbody.append(row);
  }
}

function header(st) {
  document.getElementById("namespace").textContent = `namespace ${st.namespace}`;
  const lease = document.getElementById("lease");
  lease.textContent = !st.broker.lease_held ? "no active broker"
    : st.broker.policy ? `broker ${st.broker.holder} active, policy ${st.broker.policy}`
    : "broker active";
  lease.className = "tag " + (st.broker.lease_held ? "ok" : "bad");
  document.getElementById("throughput").textContent = st.throughput
    .map((w) => `${fmt(w.window_s / 60)} min: ${w.sessions_per_s.toFixed(2)} sessions/s, ` +
                `${fmt(Math.round(w.tokens_per_s))} tok/s`).join(" · ");
  const failed = st.workloads.reduce((a, w) => a + w.failed_total, 0);
  const failures = document.getElementById("failures");
  failures.textContent = `failed ${failed} · dead letters ${st.dead_letter}`;
  failures.className = "tag " + (failed || st.dead_letter ? "bad" : "ok");
  document.getElementById("updated").textContent = "updated " + new Date(st.at * 1000).toLocaleTimeString();
}

// Samples are placed at the time the page received them (the browser's clock), so the axis
// never depends on the server's clock agreeing with the browser's.
function record(st) {
  const t = Date.now() / 1000;
  if (firstT === null) firstT = t;
  firstT = Math.max(firstT, t - WINDOW_S);
  for (const w of st.workloads) push("queue", w.workload, t, w.depth);
  for (const b of st.backends) push("kv", b.backend_id, t, b.kv_usage);
  push("drift", "recent", t, st.mixture.drift_window);
  push("drift", "total", t, st.mixture.drift_total);
  redraw(t);
}

// The API's own samples of the last minutes (v1/history), so the charts start with history
// rather than at the page's first poll; each is placed by its age on the server's clock.
async function loadHistory() {
  try {
    const res = await fetch("v1/history", { cache: "no-store" });
    if (!res.ok) return;
    const h = await res.json();
    const t = Date.now() / 1000;
    for (const s of h.samples) {
      const at = t - (h.now - s.at);
      if (firstT === null || at < firstT) firstT = at;
      for (const [w, v] of Object.entries(s.queue)) push("queue", w, at, v);
      for (const [b, v] of Object.entries(s.kv)) push("kv", b, at, v);
      for (const [k, v] of Object.entries(s.drift)) push("drift", k, at, v);
    }
  } catch (err) {
    // no history: the charts start with the first poll
  }
}

function redraw(t) {
  prune(t);
  draw("chart-queue", history.queue, t);
  draw("chart-kv", history.kv, t, 1);
  draw("chart-drift", history.drift, t, Math.max(0.1, niceMax(Math.max(0,
    ...[...history.drift.values()].flat().map((p) => p[1])))));
}

async function poll() {
  try {
    const res = await fetch("v1/status", { cache: "no-store" });
    if (!res.ok) {  // the API says why ({"field", "reason"}): e.g. "redis: unavailable (...)"
      const body = await res.json().catch(() => null);
      throw new Error(body && body.reason ? body.reason : `HTTP ${res.status}`);
    }
    const st = await res.json();
    document.getElementById("updated").className = "muted";
    header(st);
    tables(st);
    record(st);
  } catch (err) {
    const updated = document.getElementById("updated");
    updated.textContent = `status unavailable: ${err.message}`;
    updated.className = "bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

loadHistory().finally(poll);
