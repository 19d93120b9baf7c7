"""`moe-serve plan`'s answer: every layout, what it costs and gives, ranked, with its command and the why.

Rank: layouts that run and meet the SLOs first; at a QPS the fewest GPUs that serve it (then the lowest ITL),
at a concurrency the most output tokens/s per GPU (then the lowest ITL). P/D splits are tried for the best
colocated layouts (the same layout for both roles).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from moe_runtime.planner.command import Launch, disaggregated_command
from moe_runtime.planner.hardware import Hardware
from moe_runtime.planner.layouts import Candidate, enumerate_layouts, hybrid_kv_groups
from moe_runtime.planner.memory import Precision, host_tier_tokens, kv_capacity, rank_memory
from moe_runtime.planner.model_shape import ModelShape
from moe_runtime.planner.roofline import StepModel, Topology
from moe_runtime.planner.serving import (Estimate, InstanceModel, Workload, colocated_at_concurrency,
                                         colocated_at_qps, disaggregated_at_concurrency, disaggregated_at_qps)

GB = 1e9
MIB = 2**20
MAX_NUM_SEQS_CAP = 1024     # the planner's --max-num-seqs never exceeds this per DP worker
PD_TRIED = 3                # best colocated layouts tried as P/D splits


@dataclass(frozen=True)
class PlanRequest:
    model: str
    shape: ModelShape
    hardware: Hardware
    gpus_per_node: int
    nodes: int
    workload: Workload
    precision: Precision
    block_size: int = 16
    kv_cache_memory: int | None = None   # per rank; None: what the GPU's memory leaves after the weights
    kv_host_memory: int = 0              # per rank: the host tier below the device pool (0: none)

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def request_tokens(self) -> int:
        return self.workload.prompt_len + self.workload.output_len


@dataclass
class PlanRow:
    name: str
    gpus: int                   # GPUs the deployment uses (all replicas / instances)
    world: int                  # ranks per instance
    runs: bool
    reason: str = ""            # why it cannot run, or why it misses the load / SLOs
    meets_slo: bool = False
    weights_gb_per_rank: float = 0.0
    kv_bytes_per_token: int = 0          # one rank's, full layers
    kv_cache_memory: int = 0             # --kv-cache-memory
    kv_tokens: int = 0                   # one instance's
    kv_requests: int = 0                 # concurrent requests of prompt+output tokens, one instance
    host_kv_tokens_per_rank: int = 0     # tokens of evicted prefixes one rank's host tier keeps (--kv-host-memory)
    host_kv_tokens: int = 0              # ... one instance's (every DP worker's; a worker's ranks keep the same ones)
    ttft_ms: float = math.inf
    itl_ms: float = math.inf
    tok_s_per_gpu: float = 0.0
    batch_per_worker: float = 0.0
    decode_bound: str = ""               # compute | memory | communication
    decode_parts_ms: dict = field(default_factory=dict)   # a decode step's ms by bound (layers, no bubble)
    instances: int = 0
    bubble: float = 0.0
    command: str = ""
    layout: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        row = asdict(self)
        for key in ("ttft_ms", "itl_ms"):
            row[key] = None if math.isinf(row[key]) else round(row[key], 3)
        return row


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    rows: list[PlanRow]

    @property
    def winner(self) -> PlanRow | None:
        return self.rows[0] if self.rows and self.rows[0].runs else None


def make_plan(request: PlanRequest) -> Plan:
    candidates = enumerate_layouts(request.shape, request.total_gpus, request.workload.prompt_len)
    rows, models = [], {}
    for candidate in candidates:
        row, model = _colocated_row(request, candidate)
        rows.append(row)
        if model is not None:
            models[row.name] = (model, candidate)
    rows.sort(key=lambda r: _rank_key(request, r))
    if not hybrid_kv_groups(request.shape):
        tried = [r for r in rows if r.runs and r.name in models][:PD_TRIED]
        for row in tried:
            model, candidate = models[row.name]
            pd = _disaggregated_row(request, candidate, model, row)
            if pd is not None:
                rows.append(pd)
        rows.sort(key=lambda r: _rank_key(request, r))
    return Plan(request, rows)


def _rank_key(request: PlanRequest, row: PlanRow):
    if request.workload.qps is not None:
        return (not row.runs, not row.meets_slo, row.gpus, row.itl_ms)
    return (not row.runs, not row.meets_slo, -row.tok_s_per_gpu, row.itl_ms)


def _colocated_row(request: PlanRequest, candidate: Candidate) -> tuple[PlanRow, InstanceModel | None]:
    lo = candidate.layout
    row = PlanRow(candidate.name, lo.world_size, lo.world_size, False, layout=asdict(lo))
    if candidate.reason:
        row.reason = candidate.reason
        return row, None
    if lo.world_size > request.total_gpus:
        row.reason = f"needs {lo.world_size} GPUs, {request.total_gpus} given"
        return row, None
    hw, w = request.hardware, request.workload
    block_size = request.shape.block_size_for(request.block_size)
    provisional = rank_memory(request.shape, lo, request.precision, block_size)
    row.weights_gb_per_rank = provisional.weight_bytes / GB
    usable = hw.memory_bytes * (1 - hw.memory_reserve)
    budget = request.kv_cache_memory
    if budget is None:
        budget = int((usable - provisional.weight_bytes) // MIB * MIB)
    if provisional.weight_bytes > usable:
        row.reason = (f"weights {provisional.weight_bytes / GB:.1f} GB per rank > {usable / GB:.1f} GB usable of "
                      f"{hw.name}'s {hw.memory_bytes / GB:.0f} GB")
        return row, None
    # the fixed pools of windowed groups depend on --max-num-seqs: size it from a first guess, then settle
    capacity = kv_capacity(provisional, lo, budget, block_size, request.request_tokens)
    max_num_seqs = max(min(capacity.requests_per_worker, MAX_NUM_SEQS_CAP), 1)
    memory = rank_memory(request.shape, lo, request.precision, block_size, max_num_seqs,
                         w.max_num_batched_tokens)
    capacity = kv_capacity(memory, lo, budget, block_size, request.request_tokens)
    row.kv_bytes_per_token, row.kv_cache_memory = memory.kv_bytes_per_token, budget
    row.kv_tokens, row.kv_requests = capacity.tokens, capacity.requests
    row.host_kv_tokens_per_rank = host_tier_tokens(request.kv_host_memory, memory.kv_bytes_per_token, block_size)
    row.host_kv_tokens = row.host_kv_tokens_per_rank * lo.dp_size
    if capacity.requests_per_worker < 1:
        row.reason = (f"KV: {budget / GB:.2f} GB per rank holds {capacity.tokens_per_worker} tokens per worker, "
                      f"< one request's {request.request_tokens}")
        return row, None
    max_num_seqs = min(capacity.requests_per_worker, MAX_NUM_SEQS_CAP)
    step = StepModel(request.shape, lo, request.precision, hw, Topology(request.gpus_per_node))
    model = InstanceModel(step, w, max_num_seqs)
    launch = Launch(request.model, hw.device, request.precision, lo, budget, max_num_seqs, request.gpus_per_node,
                    block_size, request.kv_host_memory)
    replicas_max = request.total_gpus // lo.world_size
    if w.qps is not None:
        estimate = colocated_at_qps(model, w.qps, max(replicas_max, 1) * 64)
    else:
        estimate = colocated_at_concurrency(model, w.concurrency, replicas_max)
    _fill(row, request, estimate, model)
    row.command = launch.command(estimate.instances)
    return row, model


def _disaggregated_row(request: PlanRequest, candidate: Candidate, model: InstanceModel,
                       colocated: PlanRow) -> PlanRow | None:
    lo, w = candidate.layout, request.workload
    instances_max = request.total_gpus // lo.world_size
    kv_request = colocated.kv_bytes_per_token * lo.world_size * w.prompt_len
    link = request.hardware.link_bytes_s(crosses_nodes=True)
    if w.qps is not None:
        estimate = disaggregated_at_qps(model, w.qps, kv_request, link, max(instances_max, 2) * 64)
    elif instances_max >= 2:
        estimate = disaggregated_at_concurrency(model, w.concurrency, instances_max, kv_request, link)
    else:
        return None
    if not estimate.sustainable:
        return None
    row = PlanRow(f"P/D {colocated.name}", estimate.gpus, lo.world_size, True, layout=asdict(lo),
                  weights_gb_per_rank=colocated.weights_gb_per_rank, kv_bytes_per_token=colocated.kv_bytes_per_token,
                  kv_cache_memory=colocated.kv_cache_memory, kv_tokens=colocated.kv_tokens,
                  kv_requests=colocated.kv_requests, host_kv_tokens_per_rank=colocated.host_kv_tokens_per_rank,
                  host_kv_tokens=colocated.host_kv_tokens)
    _fill(row, request, estimate, model)
    p, d = (int(x) for x in estimate.note.split()[0:4:3])
    launch = Launch(request.model, request.hardware.device, request.precision, lo, colocated.kv_cache_memory,
                    model.cap_per_worker, request.gpus_per_node, request.shape.block_size_for(request.block_size),
                    request.kv_host_memory)
    row.command = disaggregated_command(launch, p, d)
    return row


def _fill(row: PlanRow, request: PlanRequest, estimate: Estimate, model: InstanceModel) -> None:
    w = request.workload
    row.gpus = estimate.gpus
    row.runs = True
    row.ttft_ms, row.itl_ms = estimate.ttft_s * 1000, estimate.itl_s * 1000
    row.tok_s_per_gpu = estimate.tok_s_per_gpu
    row.batch_per_worker = estimate.batch_per_worker
    parts = model.step.breakdown(max(int(math.ceil(estimate.batch_per_worker)), 1),
                                 w.prompt_len + w.output_len / 2)
    row.decode_bound = max(parts, key=parts.get)
    row.decode_parts_ms = {k: round(v * 1000, 3) for k, v in parts.items()}
    row.instances = estimate.instances
    row.bubble = model.step.bubble(max(int(math.ceil(estimate.batch_per_worker)), 1))
    reasons = []
    if not estimate.sustainable:
        reasons.append(estimate.note or "does not keep up")
    elif estimate.note:
        reasons.append(estimate.note)
    if estimate.gpus > request.total_gpus:
        reasons.append(f"needs {estimate.gpus} GPUs for the load, {request.total_gpus} given")
    row.meets_slo = (estimate.sustainable and estimate.gpus <= request.total_gpus
                     and w.meets(estimate.ttft_s, estimate.itl_s))
    if estimate.sustainable and not w.meets(estimate.ttft_s, estimate.itl_s):
        reasons.append("misses the SLO")
    row.reason = "; ".join(reasons)
