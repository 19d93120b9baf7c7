// The expert-load dashboard: polls /dashboard/state and redraws the plotly charts in place.
// A failed poll (server restarting, network) shows the error and retries with backoff; an
// unhealthy engine (a dead rank) is shown from the state itself. Nothing here needs a reload.
"use strict";

(() => {
  const REQUEST_TIMEOUT_MS = 4000;
  const MAX_RETRY_MS = 5000;
  const MAX_CELL_TEXT = 2048;           // cells up to which the heatmap prints its numbers
  const PLOT_CONFIG = { displaylogo: false, responsive: true, displayModeBar: "hover" };
  const RANK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"];

  const dashboard = { state: null, renders: 0, failures: 0, instance: null, view: "logical", restarts: 0 };
  window.moeDashboard = dashboard;      // for people (and tests) poking at the page

  const $ = (id) => document.getElementById(id);
  const range = (n) => Array.from({ length: n }, (_, i) => i);
  const rankColor = (r) => RANK_COLORS[r % RANK_COLORS.length];
  const chartTitle = (text) => ({ text, x: 0.01, xanchor: "left" });   // left: clear of the mode bar
  const fmt = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

  // ---- polling -----------------------------------------------------------------------------

  async function fetchJSON(url, options = {}) {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
    try {
      // against the origin, not the page URL: a page opened with the key in its URL (user:key@host)
      // must not put it into every request URL (fetch refuses those); the browser sends it by itself
      const response = await fetch(new URL(url, window.location.origin),
                                   { cache: "no-store", signal: controller.signal, ...options });
      const body = await response.json().catch(() => null);
      if (!response.ok) {
        const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
        const error = new Error(message);
        error.status = response.status;
        throw error;
      }
      return body;
    } catch (err) {
      if (err.name === "AbortError") throw new Error(`no answer within ${REQUEST_TIMEOUT_MS / 1000} s`);
      throw err;
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    let next;
    try {
      const state = await fetchJSON("/dashboard/state");
      if (dashboard.instance !== null && state.instance !== dashboard.instance) {
        dashboard.restarts += 1;
        delete $("rebalance-button").dataset.result;   // an old rebalance result says nothing about this server
      }
      dashboard.instance = state.instance;
      dashboard.failures = 0;
      render(state);
      next = state.poll_interval_ms;
    } catch (err) {
      dashboard.failures += 1;
      next = Math.min(500 * 2 ** Math.min(dashboard.failures - 1, 4), MAX_RETRY_MS);
      const why = err instanceof TypeError ? "server unreachable" : err.message;
      setStatus("error", `disconnected (${why}); retrying in ${(next / 1000).toFixed(1)} s`);
    }
    setTimeout(poll, next);
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.className = `status ${kind}`;
    el.textContent = text;
  }

  // ---- rendering ---------------------------------------------------------------------------

  function render(state) {
    dashboard.state = state;
    const time = new Date(state.now * 1000).toLocaleTimeString();
    if (state.health.healthy && state.health.degraded) {
      setStatus("pending", `degraded: ${state.health.detail}`);
    } else if (state.health.healthy) {
      const restarted = dashboard.restarts ? ` · reconnected after a server restart` : "";
      setStatus("ok", `live · ${time}${restarted}`);
    } else {
      setStatus("error", `engine unhealthy: ${state.health.detail}`);
    }
    renderSummary(state);
    const load = state.expert_load;
    $("no-expert-load").hidden = load !== null;
    for (const el of document.querySelectorAll(".load-only")) el.hidden = load === null;
    if (load !== null) {
      renderLayerChoice(load);
      renderHeatmap(load);
      renderRankLoad(load);
      renderPlacement(load);
    }
    renderTimeline(state);
    renderTiers(state.workers);
    renderRebalanceControls(state.rebalance);
    dashboard.renders += 1;
  }

  function renderSummary(state) {
    const load = state.expert_load;
    const timeline = state.timeline;
    const last = timeline.t.length - 1;
    $("summary-steps").textContent = load ? load.steps : "–";
    $("summary-window").textContent = load ? load.window : "–";
    $("summary-balancedness").textContent = last >= 0 && timeline.balancedness_mean[last] !== null
      ? `${fmt(timeline.balancedness_mean[last])} / ${fmt(timeline.balancedness_min[last])}` : "–";
    $("summary-tokens").textContent = last >= 0 ? fmt(timeline.generation_tokens_per_s[last], 1) : "–";
    const running = state.workers.reduce((s, w) => s + w.running, 0);
    const waiting = state.workers.reduce((s, w) => s + w.waiting, 0);
    $("summary-requests").textContent = `${running} / ${waiting}`;
    const queried = state.workers.reduce((s, w) => s + (w.prefix_cache_queries || 0), 0);
    const hit = state.workers.reduce((s, w) => s + (w.prefix_cache_hits || 0), 0);
    $("summary-prefix-cache").textContent = queried > 0 ? `${fmt(100 * hit / queried, 1)}% of ${queried}` : "–";
    $("summary-rebalances").textContent = state.rebalance.events_available ? state.rebalance.events.length : "n/a";
  }

  function renderLayerChoice(load) {
    const select = $("placement-layer");
    if (select.options.length !== load.num_layers) {
      const chosen = Math.min(Number(select.value) || 0, load.num_layers - 1);
      select.replaceChildren(...range(load.num_layers).map((l) => new Option(`MoE layer ${l}`, String(l))));
      select.value = String(chosen);
    }
  }

  function renderHeatmap(load) {
    const layers = range(load.num_layers);
    const showText = load.num_layers * Math.max(load.num_experts, load.num_slots) <= MAX_CELL_TEXT;
    let trace;
    const layout = {
      title: chartTitle(""),
      margin: { t: 40, r: 20, b: 50, l: 70 },
      yaxis: { title: { text: "MoE layer" }, autorange: "reversed", tickmode: "array", tickvals: layers,
               ticktext: layers.map(String) },
      uirevision: dashboard.view,
    };
    if (dashboard.view === "logical") {
      trace = {
        type: "heatmap", z: load.counts, x: range(load.num_experts), y: layers,
        customdata: load.replicas, colorscale: "YlOrRd", reversescale: true,
        colorbar: { title: { text: "tokens" } },
        hovertemplate: "layer %{y} · expert %{x}<br>%{z} tokens in the window<br>%{customdata} replica(s)<extra></extra>",
      };
      layout.title.text = `Tokens per logical expert over the last ${load.window} steps`;
      layout.xaxis = { title: { text: "logical expert" }, tickmode: "linear", dtick: load.num_experts > 64 ? 16 : 1 };
    } else {
      const labels = load.placement.map((row, l) => row.map((e, s) => [e, load.slot_rank[s], load.replicas[l][e]]));
      trace = {
        type: "heatmap", z: load.slot_load, x: range(load.num_slots), y: layers, customdata: labels,
        text: load.placement.map((row, l) => row.map((e) => (load.replicas[l][e] > 1 ? `e${e}*` : `e${e}`))),
        colorscale: "YlOrRd", reversescale: true, colorbar: { title: { text: "tokens (est.)" } },
        hovertemplate: "layer %{y} · slot %{x} on rank %{customdata[1]}<br>expert %{customdata[0]}, " +
          "%{customdata[2]} replica(s)<br>≈%{z:.1f} tokens (split evenly over replicas)<extra></extra>",
      };
      layout.title.text = "Tokens per physical slot (e<i>n</i>* = a replicated expert); ranks separated";
      layout.xaxis = {
        title: { text: "physical slot" }, tickmode: "array",
        tickvals: range(load.num_ranks).map((r) => (r + 0.5) * load.slots_per_rank - 0.5),
        ticktext: range(load.num_ranks).map((r) => `rank ${r}`),
      };
      layout.shapes = range(load.num_ranks - 1).map((r) => ({
        type: "line", xref: "x", yref: "paper", x0: (r + 1) * load.slots_per_rank - 0.5,
        x1: (r + 1) * load.slots_per_rank - 0.5, y0: 0, y1: 1, line: { color: "#1d2330", width: 2 },
      }));
    }
    if (showText) trace.texttemplate = dashboard.view === "logical" ? "%{z}" : "%{text}";
    Plotly.react("heatmap", [trace], layout, PLOT_CONFIG);
  }

  function renderRankLoad(load) {
    const layers = range(load.num_layers);
    const traces = range(load.num_ranks).map((r) => ({
      type: "bar", name: `rank ${r}`, x: layers, y: layers.map((l) => load.rank_load[l][r]),
      marker: { color: rankColor(r) },
      hovertemplate: `rank ${r} · layer %{x}<br>%{y:.1f} tokens<extra></extra>`,
    }));
    traces.push({
      type: "scatter", mode: "lines+markers", name: "balancedness (mean/max)", x: layers, y: load.balancedness,
      yaxis: "y2", line: { color: "#1d2330" }, hovertemplate: "layer %{x}: balancedness %{y:.3f}<extra></extra>",
    });
    Plotly.react("rank-load", traces, {
      title: chartTitle("Tokens per rank per MoE layer (window)"),
      barmode: "group", margin: { t: 40, r: 60, b: 50, l: 60 },
      xaxis: { title: { text: "MoE layer" }, tickmode: "linear", dtick: 1 },
      yaxis: { title: { text: "tokens" } },
      yaxis2: { title: { text: "balancedness" }, overlaying: "y", side: "right", range: [0, 1.05] },
      legend: { orientation: "h", y: -0.25 }, uirevision: "rank-load",
    }, PLOT_CONFIG);
  }

  function renderPlacement(load) {
    const layer = Number($("placement-layer").value) || 0;
    const perRank = load.slots_per_rank;
    const ranks = range(load.num_ranks);
    const experts = ranks.map((r) => range(perRank).map((i) => load.placement[layer][r * perRank + i]));
    const copies = experts.map((row) => row.map((e) => load.replicas[layer][e]));
    const maxCopies = Math.max(2, ...copies.flat());
    Plotly.react("placement", [{
      type: "heatmap", z: copies, x: range(perRank), y: ranks, zmin: 1, zmax: maxCopies,
      text: experts.map((row) => row.map((e) => `e${e}`)), texttemplate: "%{text}",
      customdata: experts.map((row, r) => row.map((e, i) => [r * perRank + i, load.counts[layer][e]])),
      colorscale: [[0, "#e8eef7"], [0.001, "#fdd0a2"], [1, "#f58518"]],   // 1 copy pale, replicas orange
      colorbar: { title: { text: "copies" }, dtick: 1 },
      hovertemplate: "rank %{y} · local slot %{x} (physical %{customdata[0]})<br>expert %{text}, " +
        "%{z} cop(ies)<br>%{customdata[1]} tokens to this expert in the window<extra></extra>",
    }], {
      title: chartTitle(`Experts each rank holds (layer ${layer}; orange = replicated)`),
      margin: { t: 40, r: 20, b: 40, l: 60 },
      xaxis: { title: { text: "local slot" }, tickmode: "linear", dtick: 1 },
      yaxis: { title: { text: "rank" }, autorange: "reversed", tickmode: "linear", dtick: 1 },
      uirevision: `placement-${layer}`,
    }, PLOT_CONFIG);
    const replicated = range(load.num_experts).filter((e) => load.replicas[layer][e] > 1).map((e) => {
      const holders = ranks.filter((r) => experts[r].includes(e));
      return `e${e} ×${load.replicas[layer][e]} (ranks ${holders.join(", ")})`;
    });
    $("placement-replicas").textContent = replicated.length ? `replicated: ${replicated.join("; ")}` : "no replicas in this layer";
  }

  function renderTimeline(state) {
    const tl = state.timeline;
    const x = tl.t.map((t) => new Date(t * 1000));
    const workers = state.workers.map((w) => w.dp_rank);
    const perWorker = (column, w) => tl[column].map((row) => (w < row.length ? row[w] : null));
    const traces = [
      { name: "balancedness min", y: tl.balancedness_min, yaxis: "y", line: { color: "#c0392b" } },
      { name: "balancedness mean", y: tl.balancedness_mean, yaxis: "y", line: { color: "#1d2330" } },
      { name: "generated tokens/s", y: tl.generation_tokens_per_s, yaxis: "y2", line: { color: "#6a3d9a" } },
      { name: "prompt tokens/s", y: tl.prompt_tokens_per_s, yaxis: "y2", line: { color: "#cab2d6" } },
    ];
    workers.forEach((w, i) => {
      traces.push({ name: `running dp${w}`, y: perWorker("running", i), yaxis: "y3", line: { color: rankColor(i) } });
      traces.push({ name: `waiting dp${w}`, y: perWorker("waiting", i), yaxis: "y3",
                    line: { color: rankColor(i), dash: "dot" } });
      traces.push({ name: `KV usage dp${w}`, y: perWorker("kv_usage", i), yaxis: "y4", line: { color: rankColor(i) } });
    });
    for (const trace of traces) Object.assign(trace, { type: "scatter", mode: "lines", x });

    const events = state.rebalance.events;
    const eventTime = (e) => new Date(e.started_at * 1000);
    const eventLabel = (e) => (e.ok ? `rebalance #${e.index}: ${e.experts_moved} experts moved, ${fmt(e.duration_s, 2)} s`
                                    : `rebalance #${e.index} failed: ${e.error}`);
    if (events.length) {
      traces.push({
        type: "scatter", mode: "markers", name: "rebalance", yaxis: "y", x: events.map(eventTime),
        y: events.map((e) => e.balancedness_after), text: events.map(eventLabel),
        marker: { symbol: "triangle-down", size: 12, color: events.map((e) => (e.ok ? "#54a24b" : "#c0392b")) },
        hovertemplate: "%{text}<br>balancedness after %{y:.3f}<extra></extra>",
      });
    }
    const layout = {
      title: chartTitle("Over time (one sample per refresh; ▼ and dotted lines: rebalances)"),
      margin: { t: 40, r: 20, b: 40, l: 70 }, showlegend: true, legend: { orientation: "v" },
      xaxis: { type: "date", anchor: "y4" },
      yaxis: { domain: [0.79, 1], title: { text: "balancedness" }, range: [0, 1.05] },
      yaxis2: { domain: [0.53, 0.74], title: { text: "tokens/s" }, rangemode: "tozero" },
      yaxis3: { domain: [0.27, 0.48], title: { text: "requests" }, rangemode: "tozero" },
      yaxis4: { domain: [0, 0.22], title: { text: "KV usage" }, range: [0, 1.05] },
      shapes: events.map((e) => ({
        type: "line", xref: "x", yref: "paper", x0: eventTime(e), x1: eventTime(e), y0: 0, y1: 1,
        line: { color: e.ok ? "#54a24b" : "#c0392b", dash: "dot", width: 2 },
      })),
      annotations: events.map((e) => ({
        xref: "x", yref: "paper", x: eventTime(e), y: 1, yanchor: "bottom", showarrow: false,
        text: e.ok ? `${e.experts_moved} moved · ${fmt(e.duration_s, 2)} s` : "failed", font: { size: 10 },
      })),
      uirevision: "timeline",
    };
    Plotly.react("timeline", traces, layout, PLOT_CONFIG);
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = Number(n) || 0, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
  }

  function cell(tag, text) {
    const el = document.createElement(tag);
    el.textContent = text;
    return el;
  }

  // One block per DP worker with tiers: requests loading, tokens found in the tiers, and per tier (fastest first)
  // an occupancy bar, entries, hits, loaded bytes and errors. Hidden while no worker has a tier.
  function renderTiers(workers) {
    const withTiers = workers.filter((w) => (w.kv_tiers || []).length > 0);
    $("kv-tiers").hidden = withTiers.length === 0;
    const blocks = withTiers.map((w) => {
      const block = document.createElement("div");
      block.className = "tier-worker";
      block.dataset.dpRank = String(w.dp_rank);
      const head = cell("div", `dp${w.dp_rank} · ${w.loading} request(s) loading · ` +
                        `${w.kv_tier_hit_tokens} prompt tokens found in the tiers`);
      head.className = "tier-summary";
      const table = document.createElement("table");
      const header = document.createElement("tr");
      for (const title of ["tier", "occupancy", "used / capacity", "entries", "hits", "loaded", "errors"]) {
        header.append(cell("th", title));
      }
      table.append(header);
      for (const t of w.kv_tiers) {
        const row = document.createElement("tr");
        row.dataset.tier = t.name;
        const bar = document.createElement("span");
        bar.className = "occupancy";
        bar.title = `${fmt(100 * t.occupancy, 1)}% full`;
        const fill = document.createElement("span");
        fill.style.width = `${Math.min(100, 100 * t.occupancy).toFixed(1)}%`;
        bar.append(fill);
        const barCell = document.createElement("td");
        barCell.append(bar, ` ${fmt(100 * t.occupancy, 1)}%`);
        row.append(cell("td", t.name), barCell, cell("td", `${bytes(t.used_bytes)} / ${bytes(t.capacity_bytes)}`),
                   cell("td", String(t.entries)), cell("td", String(t.hits)), cell("td", bytes(t.loaded_bytes)),
                   cell("td", String(t.errors)));
        table.append(row);
      }
      block.append(head, table);
      return block;
    });
    $("kv-tiers-workers").replaceChildren(...blocks);
  }

  function renderRebalanceControls(rebalance) {
    const button = $("rebalance-button");
    if (!button.dataset.busy) button.disabled = !rebalance.available;
    button.title = rebalance.available ? "plan a new placement from the current window and migrate now" : rebalance.reason;
    if (!button.dataset.result && !button.dataset.busy) {
      $("rebalance-note").textContent = rebalance.available ? "" : `not available: ${rebalance.reason}`;
    }
  }

  // ---- actions -----------------------------------------------------------------------------

  async function rebalanceNow() {
    const button = $("rebalance-button");
    button.dataset.busy = "1";
    button.disabled = true;
    $("rebalance-note").textContent = "rebalancing…";
    try {
      const headers = {};
      const key = sessionStorage.getItem("moe-api-key");
      if (key) headers.Authorization = `Bearer ${key}`;
      let body;
      try {
        body = await fetchJSON("/dashboard/rebalance", { method: "POST", headers });
      } catch (err) {
        if (err.status !== 401) throw err;
        const typed = window.prompt("This server needs its API key to rebalance:");
        if (!typed) throw err;
        sessionStorage.setItem("moe-api-key", typed);
        body = await fetchJSON("/dashboard/rebalance", { method: "POST", headers: { Authorization: `Bearer ${typed}` } });
      }
      const e = body.event;
      $("rebalance-note").textContent = e.ok
        ? `rebalance #${e.index}: ${e.experts_moved} experts moved in ${fmt(e.duration_s, 2)} s, ` +
          `balancedness ${fmt(e.balancedness_before)} → ${fmt(e.balancedness_after)}`
        : `rebalance #${e.index} failed: ${e.error}`;
    } catch (err) {
      $("rebalance-note").textContent = `rebalance failed: ${err.message}`;
    } finally {
      button.dataset.result = "1";
      delete button.dataset.busy;
      button.disabled = false;
    }
  }

  function redraw() {
    if (dashboard.state !== null) render(dashboard.state);
  }

  for (const radio of document.querySelectorAll("input[name=view]")) {
    radio.addEventListener("change", () => { dashboard.view = radio.value; redraw(); });
  }
  $("placement-layer").addEventListener("change", redraw);
  $("rebalance-button").addEventListener("click", rebalanceNow);
  poll();
})();
