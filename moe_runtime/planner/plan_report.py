"""A plan as people read it: the ranked table, and a few sentences on why the winner wins."""
from __future__ import annotations

import math

from moe_runtime.planner.memory import ModelFootprint
from moe_runtime.planner.plan import GB, Plan, PlanRow

COLUMNS = ("#", "layout", "GPUs", "W GB/rank", "KV tok/inst", "KV req", "TTFT ms", "ITL ms", "tok/s/GPU", "bound",
           "note")
HOST_COLUMN = "host tok/inst"   # beside "KV tok/inst" with --kv-host-memory: the evicted prefixes host memory keeps


def table(plan: Plan, top: int) -> str:
    r = plan.request
    w = r.workload
    load = f"{w.qps:g} req/s" if w.qps is not None else f"{w.concurrency} concurrent"
    slo = "".join([f", TTFT <= {w.ttft_ms:g} ms" if w.ttft_ms else "", f", ITL <= {w.itl_ms:g} ms" if w.itl_ms else ""])
    head = (f"{r.shape.architecture}: {r.shape.total_params / 1e9:.1f}B params ({r.shape.active_params / 1e9:.1f}B "
            f"active), {r.precision.dtype}{' + ' + r.precision.quantization if r.precision.quantization not in (None, 'none') else ''}; "
            f"{r.nodes} x {r.gpus_per_node} {r.hardware.name}; {w.prompt_len} + {w.output_len} tokens, {load}{slo}")
    running = [row for row in plan.rows if row.runs][:top]
    refused = [row for row in plan.rows if not row.runs]
    lines = [head, footprint_line(ModelFootprint.of(r.shape, r.precision), r.precision.dtype), ""]
    columns, cells = _with_host_column(r.kv_host_memory > 0, COLUMNS,
                                       [_cells(i + 1, row) for i, row in enumerate(running)],
                                       [row.host_kv_tokens for row in running])
    cells = [columns] + cells
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns) - 1)]
    for c in cells:
        lines.append("  ".join(v.ljust(widths[i]) for i, v in enumerate(c[:-1])) + "  " + c[-1])
    lines.append("")
    for i, row in enumerate(running[:3]):
        lines.append(f"#{i + 1} {row.name}: {row.command}")
    if refused:
        lines.append("")
        lines.append(f"cannot run ({len(refused)}), e.g.:")
        seen = set()
        for row in refused:
            key = row.reason.split(":")[0][:40]
            if key not in seen and len(seen) < 6:
                seen.add(key)
                lines.append(f"  {row.name}: {row.reason}")
    return "\n".join(lines)


def _cells(rank: int, row: PlanRow) -> tuple[str, ...]:
    ms = lambda v: "-" if math.isinf(v) else f"{v:.0f}" if v >= 100 else f"{v:.1f}"  # noqa: E731
    flag = "" if row.meets_slo else "x "
    return (f"{rank}", row.name, str(row.gpus), f"{row.weights_gb_per_rank:.1f}", f"{row.kv_tokens:,}",
            str(row.kv_requests), ms(row.ttft_ms), ms(row.itl_ms), f"{row.tok_s_per_gpu:.0f}", row.decode_bound,
            flag + row.reason)


def _with_host_column(shown: bool, columns: tuple[str, ...], cells: list[tuple[str, ...]],
                      host_tokens: list[int]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The table with the host tier's tokens per instance after the device's (only with --kv-host-memory)."""
    if not shown:
        return columns, cells
    at = columns.index("KV tok/inst") + 1
    return ((*columns[:at], HOST_COLUMN, *columns[at:]),
            [(*c[:at], f"{tokens:,}", *c[at:]) for c, tokens in zip(cells, host_tokens)])


def footprint_line(footprint: ModelFootprint, dtype: str) -> str:
    """The numbers the question starts from: the whole model's weights and its KV bytes per token."""
    windowed = (f" (+ {footprint.windowed_kv_bytes_per_token / 1024:.1f} KiB in windowed layers, up to their window)"
                if footprint.windowed_kv_bytes_per_token else "")
    return (f"Whole model: weights {footprint.weight_bytes / GB:.1f} GB; KV cache "
            f"{footprint.kv_bytes_per_token / 1024:.1f} KiB per token in {dtype}{windowed}")


def explain(plan: Plan) -> str:
    """The winner in the planner's terms: memory, KV, what bounds decode, and why not the runner-up or fewer GPUs."""
    win = plan.winner
    if win is None:
        reasons = "; ".join(sorted({row.reason for row in plan.rows})[:3])
        return f"No layout runs this model on these GPUs: {reasons}"
    r, w = plan.request, plan.request.workload
    parts = win.decode_parts_ms
    lines = [
        f"Winner: {win.name} on {win.gpus} GPUs ({win.instances} x {win.world} ranks)"
        + ("" if win.meets_slo else ", though it misses the asked load or SLOs") + ".",
        f"Weights are {win.weights_gb_per_rank:.1f} GB per rank, leaving {win.kv_cache_memory / GB:.1f} GB of KV "
        f"cache per rank: {win.kv_tokens:,} tokens per instance at {win.kv_bytes_per_token / 1024:.1f} KiB per token "
        f"per rank, {win.kv_requests} requests of {w.prompt_len}+{w.output_len} tokens at once.",
        *([_host_tier_sentence(r.kv_host_memory, win)] if r.kv_host_memory > 0 else []),
        f"Decode at {win.batch_per_worker:.0f} running requests per DP worker is {win.decode_bound}-bound "
        f"(per step: compute {parts['compute']:.2f} ms, memory {parts['memory']:.2f} ms, communication "
        f"{parts['communication']:.2f} ms{f', bubble {win.bubble:.0%}' if win.bubble else ''}): ITL "
        f"{win.itl_ms:.1f} ms, TTFT {win.ttft_ms:.0f} ms, {win.tok_s_per_gpu:.0f} output tok/s per GPU.",
    ]
    runner = next((row for row in plan.rows[1:] if row.runs), None)
    if runner is not None:
        lines.append(f"Runner-up {runner.name}: {runner.gpus} GPUs, ITL {runner.itl_ms:.1f} ms, "
                     f"{runner.tok_s_per_gpu:.0f} tok/s per GPU, {runner.decode_bound}-bound"
                     + (f" ({runner.reason})" if runner.reason else "") + ".")
    smaller = [row for row in plan.rows if row.world < win.world and "P/D" not in row.name]
    if smaller:
        best = smaller[0]
        lines.append(f"Fewer ranks per instance, e.g. {best.name}: "
                     + (best.reason if best.reason else f"ITL {best.itl_ms:.1f} ms, "
                        f"{best.tok_s_per_gpu:.0f} tok/s per GPU") + ".")
    return "\n".join(lines)


def _host_tier_sentence(host_bytes: int, row: PlanRow) -> str:
    ratio = f", {row.host_kv_tokens / row.kv_tokens:.1f}x the device's" if row.kv_tokens else ""
    return (f"Host tier: {host_bytes / GB:.1f} GB per rank keeps {row.host_kv_tokens_per_rank:,} tokens of evicted "
            f"prefixes per rank, {row.host_kv_tokens:,} per instance{ratio} (loaded back instead of recomputed; a "
            "hybrid model's state snapshots share it and are not counted).")
