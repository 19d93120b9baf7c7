// The dashboard's plan view: asks /dashboard/plan (the planner's ranked layouts for the served model on this
// server's hardware, or the GPU kind and counts picked in the form) and fills the table; the served layout's
// row is highlighted. Planning is on demand (a button), not polled: the answer changes only with the form.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ms = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
  const planView = { answer: null, error: null, requests: 0 };
  window.moePlan = planView;            // for people (and tests) poking at the page

  function query() {
    const params = new URLSearchParams();
    for (const input of $("plan-form").querySelectorAll("input, select")) {
      if (input.value !== "") params.set(input.name, input.value);
    }
    return params;
  }

  function cell(row, text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
  }

  function render(answer) {
    const q = answer.query;
    const servedRank = answer.rows.findIndex((r) => r.served);
    $("plan-note").textContent = `${answer.architecture}, ${answer.dtype}: ${q.nodes} x ${q.gpus_per_node} ` +
      `${answer.gpu}; ${q.prompt_len} + ${q.output_len} tokens, ` +
      (q.qps !== null ? `${q.qps} req/s` : `${q.concurrency} concurrent`) +
      (servedRank >= 0 ? `; the served layout ranks #${servedRank + 1}` : "; the served layout is not among these");
    $("plan-calibration").textContent = answer.calibration || "";   // how to calibrate this CPU, when it is not
    $("plan-explanation").textContent = answer.explanation;
    const body = $("plan-table").querySelector("tbody");
    body.replaceChildren();
    answer.rows.forEach((r, i) => {
      const tr = document.createElement("tr");
      if (r.served) tr.className = "served";
      cell(tr, r.runs ? String(i + 1) : "–");
      cell(tr, r.name + (r.served ? " (served)" : ""));
      cell(tr, String(r.gpus));
      cell(tr, r.weights_gb_per_rank.toFixed(2));
      cell(tr, r.kv_tokens.toLocaleString());
      cell(tr, ms(r.ttft_ms));
      cell(tr, ms(r.itl_ms));
      cell(tr, r.tok_s_per_gpu.toFixed(0));
      cell(tr, r.decode_bound);
      cell(tr, r.runs ? r.command + (r.reason ? ` (${r.reason})` : "") : r.reason, "command");
      body.appendChild(tr);
    });
  }

  async function plan(event) {
    if (event) event.preventDefault();
    $("plan-button").disabled = true;
    $("plan-note").textContent = "planning…";
    planView.requests += 1;
    try {
      const response = await fetch(new URL(`/dashboard/plan?${query()}`, window.location.origin),
                                   { cache: "no-store" });
      const body = await response.json().catch(() => null);
      if (!response.ok) throw new Error(body && body.error ? body.error.message : `HTTP ${response.status}`);
      planView.answer = body;
      planView.error = null;
      if ($("plan-gpu").options.length === 1) {
        for (const name of body.gpu_choices) $("plan-gpu").add(new Option(name, name));
      }
      render(body);
    } catch (err) {
      planView.error = String(err.message || err);
      $("plan-note").textContent = `plan failed: ${planView.error}`;
    } finally {
      $("plan-button").disabled = false;
    }
  }

  $("plan-form").addEventListener("submit", plan);
  plan();
})();
