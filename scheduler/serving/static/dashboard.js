/* SmartExit live SLA dashboard (docs/serving.md, Dashboard).
 *
 * Polls dashboard/data (scheduler/serving/dashboard.py Dashboard.data) once a second, asking only for
 * the rows after the last one it holds (?since=), and draws them with uPlot (vendored, MIT).
 * Auth: the page and its data share the cookie /dashboard?key= set, so this script never holds a key.
 * window.smartexitDashboard exposes the state for tests and the console.
 */
"use strict";
(function () {
  const POLL_MS = 1000;
  const HEIGHT = 220;
  const C = { p50: "#2e86de", p95: "#e67e22", p99: "#c0392b", sla: "#1d2330", a: "#1e8449", b: "#8e44ad",
              c: "#16a085", fallback: "rgba(192, 57, 43, 0.14)", event: "rgba(192, 57, 43, 0.8)" };
  const state = { cols: null, points: 600, data: null, polls: 0, errors: [], charts: {}, exitChart: null };

  const $ = (id) => document.getElementById(id);
  const fmt = (v, digits = 1, unit = "") => (v == null ? "–" : `${Number(v).toFixed(digits)}${unit}`);
  const last = (arr) => { for (let i = arr.length - 1; i >= 0; i--) if (arr[i] != null) return arr[i]; return null; };

  window.smartexitDashboard = {
    get polls() { return state.polls; },
    get errors() { return state.errors.slice(); },
    get data() { return state.data; },
    get charts() { return state.charts; },
    /** rows held, or (with a column name) how many of them have a value in that column */
    points(name) { return state.cols == null ? 0 : (name ? state.cols[name].filter((v) => v != null).length
                                                              : state.cols.t.length); },
    /** the newest value of a column (null when it has none) */
    value(name) { return state.cols == null ? null : last(state.cols[name]); },
  };

  // -- charts -------------------------------------------------------------------------------------
  function width(el) { return Math.max(300, el.clientWidth || 520); }

  /** a time chart: series [{label, key (a column, or a function of the columns), color, scale, dash}] */
  function timeChart(id, series, axes, hooks) {
    const el = $(id);
    const scales = { x: { time: true } };
    for (const s of series) scales[s.scale || "y"] = scales[s.scale || "y"] || { auto: true };
    if (axes.yRange) scales.y = { range: axes.yRange };
    const opts = {
      width: width(el), height: HEIGHT, scales, hooks: hooks || {},
      series: [{}].concat(series.map((s) => ({ label: s.label, stroke: s.color, width: s.width || 1.5,
                                                scale: s.scale || "y", dash: s.dash, spanGaps: false,
                                                value: (u, v) => fmt(v, s.digits == null ? 1 : s.digits) }))),
      axes: [{}, { label: axes.y, scale: "y", size: 60 }].concat(
        axes.y2 ? [{ label: axes.y2, scale: "y2", side: 1, grid: { show: false }, size: 60 }] : []),
      legend: { live: true },
    };
    const chart = new uPlot(opts, [[]].concat(series.map(() => [])), el);
    state.charts[id] = { chart, series, el };
    return chart;
  }

  function shadeFallbacks(u) {  // red bands where a replica's learned policy handed control to its heuristic
    const cols = state.cols;
    if (!cols) return;
    const { ctx, bbox } = u;
    ctx.save();
    for (let i = 0; i < cols.t.length; i++) {
      const x0 = u.valToPos(cols.t[i], "x", true);
      const x1 = i + 1 < cols.t.length ? u.valToPos(cols.t[i + 1], "x", true) : x0 + 2;
      if (cols.fallback[i] === 1) {
        ctx.fillStyle = C.fallback;
        ctx.fillRect(x0, bbox.top, Math.max(1, x1 - x0), bbox.height);
      }
      if (cols.fallback_events[i] > 0) {
        ctx.fillStyle = C.event;
        ctx.fillRect(x0 - 1, bbox.top, 2, bbox.height);
      }
    }
    ctx.restore();
  }

  function exitChart(layers) {
    const el = $("chart-exits");
    el.textContent = "";
    const idx = layers.map((_, i) => i);
    const bars = uPlot.paths.bars;
    const opts = {
      width: width(el), height: HEIGHT,
      scales: { x: { time: false, range: [-0.6, layers.length - 0.4] }, y: { range: [0, 1] } },
      series: [{ label: "layer", value: (u, i) => (i == null ? "–" : String(layers[i])) },
               { label: "last window", stroke: C.p50, fill: "rgba(46, 134, 222, 0.6)", width: 1,
                 paths: bars({ size: [0.38, 60], align: -1 }), points: { show: false },
                 value: (u, v) => fmt(v == null ? null : 100 * v, 1, "%") },
               { label: "since start", stroke: C.b, fill: "rgba(142, 68, 173, 0.45)", width: 1,
                 paths: bars({ size: [0.38, 60], align: 1 }), points: { show: false },
                 value: (u, v) => fmt(v == null ? null : 100 * v, 1, "%") }],
      axes: [{ label: "exit layer", splits: () => idx, values: (u, splits) => splits.map((i) => layers[i] ?? "") },
             { label: "share of tokens", size: 60, values: (u, splits) => splits.map((v) => `${Math.round(100 * v)}%`) }],
    };
    state.exitChart = { chart: new uPlot(opts, [idx, idx.map(() => null), idx.map(() => null)], el), layers, el };
  }

  function build() {
    const sla = (k) => (cols) => cols.t.map(() => state.data.sla[k]);
    timeChart("chart-ttft", [
      { label: "p50", key: "ttft_p50_ms", color: C.p50 }, { label: "p95", key: "ttft_p95_ms", color: C.p95 },
      { label: "p99", key: "ttft_p99_ms", color: C.p99 },
      { label: "SLA", key: sla("ttft_ms"), color: C.sla, dash: [6, 4], width: 1 }], { y: "ms" });
    timeChart("chart-tpot", [
      { label: "p50", key: "tpot_p50_ms", color: C.p50 }, { label: "p95", key: "tpot_p95_ms", color: C.p95 },
      { label: "p99", key: "tpot_p99_ms", color: C.p99 },
      { label: "SLA", key: sla("tpot_ms"), color: C.sla, dash: [6, 4], width: 1 }], { y: "ms" });
    timeChart("chart-sla", [
      { label: "SLA attainment", key: "sla_attainment", color: C.a, digits: 3 },
      { label: "goodput (req/s)", key: "goodput_rps", color: C.b, scale: "y2", digits: 2 }],
      { y: "attainment", y2: "req/s", yRange: [0, 1.05] });
    timeChart("chart-tps", [{ label: "tokens/s", key: "tokens_per_s", color: C.c }], { y: "tokens/s" });
    timeChart("chart-sched", [
      { label: "prefill budget (tokens/step)", key: "prefill_budget", color: C.p50, digits: 0 },
      { label: "admission limit (sequences)", key: "admission_limit", color: C.p95, scale: "y2", digits: 0 }],
      { y: "tokens", y2: "sequences" }, { drawClear: [shadeFallbacks] });
    timeChart("chart-queue", [
      { label: "waiting", key: "queue", color: C.p99, digits: 0 },
      { label: "running", key: "running", color: C.a, digits: 0 }], { y: "requests" });
    const eps = (cols) => cols.t.map(() => (state.data.audit || {}).epsilon ?? null);
    timeChart("chart-audit", [
      { label: "false-exit rate", key: "false_exit_rate", color: C.p50, digits: 5 },
      { label: "upper bound", key: "false_exit_upper", color: C.p95, digits: 5 },
      { label: "epsilon", key: eps, color: C.sla, dash: [6, 4], width: 1, digits: 4 }], { y: "rate" });
    timeChart("chart-power", [
      { label: "power (W)", key: "watts", color: C.p95, digits: 2 },
      { label: "temperature (°C)", key: "temperature_c", color: C.p99, scale: "y2" }], { y: "W", y2: "°C" });
    timeChart("chart-energy", [{ label: "J/token", key: "joules_per_token", color: C.b, digits: 4 }], { y: "J" });
  }

  // -- data ---------------------------------------------------------------------------------------
  function merge(d) {
    state.points = d.points;
    if (state.cols == null) state.cols = Object.fromEntries(Object.keys(d.series).map((k) => [k, []]));
    for (const [k, v] of Object.entries(d.series)) {
      const col = state.cols[k].concat(v);
      state.cols[k] = col.length > state.points ? col.slice(col.length - state.points) : col;
    }
  }

  function render() {
    const d = state.data, cols = state.cols;
    for (const { chart, series } of Object.values(state.charts)) {
      chart.setData([cols.t].concat(series.map((s) => (typeof s.key === "function" ? s.key(cols) : cols[s.key]))));
    }
    const ex = d.exit_layers;
    if (state.exitChart == null || String(state.exitChart.layers) !== String(ex.layers)) exitChart(ex.layers);
    const share = (counts) => { const n = counts.reduce((a, b) => a + b, 0); return counts.map((c) => (n ? c / n : null)); };
    state.exitChart.chart.setData([ex.layers.map((_, i) => i), share(ex.recent), share(ex.total)]);

    $("sla").textContent = `TTFT ${fmt(d.sla.ttft_ms, 0)} ms, TPOT ${fmt(d.sla.tpot_ms, 0)} ms`;
    const att = last(cols.sla_attainment);
    $("attainment").textContent = att == null ? "–" : `${(100 * att).toFixed(1)}%`;
    $("attainment").className = `value ${att == null ? "" : att >= 0.99 ? "ok" : "bad"}`;
    $("goodput").textContent = fmt(last(cols.goodput_rps), 2, " req/s");
    $("tps").textContent = fmt(last(cols.tokens_per_s), 1);
    $("window").textContent = fmt(d.window_s, 0);
    $("tick").textContent = String(d.tick_s);
    renderPolicies(d.scheduler);
    renderPower(d.power, cols);
    renderAudit(d.audit);
    const t = last(cols.t);
    $("status").textContent = `${d.replicas} replica${d.replicas === 1 ? "" : "s"}; updated ${
      t == null ? "–" : new Date(1000 * t).toLocaleTimeString()}`;
    $("status").className = "status";
  }

  function renderPolicies(sched) {
    const rows = Object.entries(sched || {});
    const table = $("policies");
    table.textContent = "";
    const anyFallback = rows.some(([, s]) => s.active !== s.policy);
    $("policy").textContent = rows.length === 0 ? "–" :
      [...new Set(rows.map(([, s]) => (s.active === s.policy ? s.policy : `${s.policy} → ${s.active}`)))].join(", ");
    $("policy").className = `value ${anyFallback ? "bad" : ""}`;
    if (rows.length === 0) return;
    const head = table.insertRow();
    for (const h of ["replica", "policy", "in control", "fallbacks", "online updates"]) {
      const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
    }
    for (const [rid, s] of rows) {
      const tr = table.insertRow();
      if (s.active !== s.policy) tr.className = "fallback";
      for (const v of [rid, s.policy, s.active === s.policy ? s.active : `${s.active} (fallback)`, s.fallbacks, s.updates]) {
        tr.insertCell().textContent = v == null ? "–" : String(v);
      }
    }
  }

  function renderAudit(audit) {
    const a = audit || {}, pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(2)}%`);
    const rows = Object.entries(a.replicas || {});
    const fell = rows.some(([, r]) => r.fallback);
    $("false-exits").textContent = !a.audited ? "none audited" :
      `${pct(a.rate)} (≤ ${pct(a.upper)}) of ${a.audited} tokens; ε ${pct(a.epsilon)}${fell ? ", fell back" : ""}`;
    const over = fell || (a.epsilon != null && a.rate > a.epsilon);
    $("false-exits").className = `value ${!a.audited ? "" : over ? "bad" : "ok"}`;
    const table = $("audits");
    table.textContent = "";
    if (rows.length === 0) return;
    const head = table.insertRow();
    for (const h of ["replica", "requests audited whole", "mean rate", "p-value (H0: > ε)", "certified", "fallback"]) {
      const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
    }
    for (const [rid, r] of rows) {
      const q = r.requests || {};
      const tr = table.insertRow();
      if (r.fallback) tr.className = "fallback";
      const p = q.requests && q.p_value != null ? Number(q.p_value).toPrecision(2) : null;
      for (const v of [rid, q.requests, q.requests ? pct(q.mean) : null, p,
                       q.requests ? (q.certified ? "yes" : "not yet") : null, r.fallback ? "yes" : "no"]) {
        tr.insertCell().textContent = v == null ? "–" : String(v);
      }
    }
  }

  function renderPower(power, cols) {
    const show = power.available;
    for (const [chartId, reasonId] of [["chart-power", "power-reason"], ["chart-energy", "energy-reason"]]) {
      $(chartId).hidden = !show;
      $(reasonId).hidden = show;
      $(reasonId).textContent = show ? "" : `No power chart: ${power.reason}.`;
    }
    const w = last(cols.watts), temp = last(cols.temperature_c);
    $("power-now").textContent = !show ? "no sensor" :
      `${fmt(w, 1, " W")}${temp == null ? "" : `, ${fmt(temp, 0, " °C")}`}`;
  }

  async function poll() {
    let next = POLL_MS;
    try {
      const since = state.cols && state.cols.t.length ? `?since=${last(state.cols.t)}` : "";
      const resp = await fetch(`dashboard/data${since}`, { cache: "no-store", credentials: "same-origin" });
      if (resp.status === 401) {
        $("banner").hidden = false;
        $("banner").textContent = "Not authorized: open /dashboard?key=<your API key> again.";
        next = 5 * POLL_MS;
      } else if (!resp.ok) {
        throw new Error(`dashboard/data answered ${resp.status}`);
      } else {
        const d = await resp.json();
        state.data = d;
        merge(d);
        if (Object.keys(state.charts).length === 0) build();
        render();
        $("banner").hidden = true;
        state.polls += 1;
      }
    } catch (err) {
      state.errors.push(String(err));
      $("status").textContent = `no data: ${err.message || err}`;
      $("status").className = "status stale";
    }
    setTimeout(poll, next);
  }

  window.addEventListener("resize", () => {
    for (const { chart, el } of Object.values(state.charts)) chart.setSize({ width: width(el), height: HEIGHT });
    if (state.exitChart) state.exitChart.chart.setSize({ width: width(state.exitChart.el), height: HEIGHT });
  });
  poll();
})();
