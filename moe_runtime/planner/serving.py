"""From step times to what a user sees: TTFT, ITL and output tokens/s per GPU at the asked load.

Colocated (one kind of instance): a DP worker's steps carry its decodes and the prefill chunks of new
requests (chunked prefill), so over one request's life each worker spends b prefills and O decode steps:
  cycle = b * t_prefill(P) + O * t_decode(b),  ITL = cycle / O (prefill stalls included),
  TTFT  = t_prefill(P) / (1 - rho) + t_decode(b),  rho = the share of time spent prefilling.
At a given QPS the batch follows from Little's law, b = q_worker * (TTFT + O * ITL), solved by iteration; the
planner adds instances (replicas) until the SLOs hold. At a given concurrency the GPUs are all used and the
requests spread over the replicas.

Prefill/decode disaggregation: prefill instances only prefill (TTFT = t_prefill / (1 - rho) + the KV's trip
over the network), decode instances only decode (ITL = t_decode(b)): no prefill ever stalls a decode step,
which is what the split buys, at the price of the KV transfer and instances that cannot share the load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moe_runtime.planner.roofline import StepModel

MAX_RHO = 0.9     # prefill utilisation above this is a queue that only grows with bursts


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    qps: float | None = None
    concurrency: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    max_num_batched_tokens: int = 4096

    def meets(self, ttft_s: float, itl_s: float) -> bool:
        return ((self.ttft_ms is None or ttft_s * 1000 <= self.ttft_ms)
                and (self.itl_ms is None or itl_s * 1000 <= self.itl_ms))


@dataclass(frozen=True)
class Estimate:
    instances: int            # replicas (colocated) or prefill + decode instances
    gpus: int
    batch_per_worker: float   # running requests per DP worker (decode instances under P/D)
    ttft_s: float
    itl_s: float
    output_tok_s: float       # the whole deployment's
    sustainable: bool
    note: str = ""

    @property
    def tok_s_per_gpu(self) -> float:
        return self.output_tok_s / self.gpus if self.gpus else 0.0


@dataclass(frozen=True)
class InstanceModel:
    """One instance's times: its step model and the most requests a DP worker runs at once."""

    step: StepModel
    workload: Workload
    cap_per_worker: int       # min(--max-num-seqs, requests its KV holds)

    @property
    def dp(self) -> int:
        return self.step.layout.dp_size

    @property
    def world(self) -> int:
        return self.step.layout.world_size

    def prefill_s(self) -> float:
        """One prompt through chunked prefill (chunks of at most max_num_batched_tokens)."""
        p, budget = self.workload.prompt_len, self.workload.max_num_batched_tokens
        chunks = math.ceil(p / budget)
        n = p / chunks
        return chunks * self.step.step_seconds(int(math.ceil(n)), (p - n) / 2, decode=False)

    def decode_s(self, batch: float) -> float:
        context = self.workload.prompt_len + self.workload.output_len / 2
        return self.step.step_seconds(max(int(math.ceil(batch)), 1), context, decode=True)


def colocated_at_qps(model: InstanceModel, qps: float, max_instances: int) -> Estimate:
    """The fewest replicas meeting the SLOs at `qps` (searched up to `max_instances`, then reported as needed)."""
    t_pf = model.prefill_s()
    last, first_sustainable = None, None
    for replicas in _replica_counts(max_instances):
        estimate = _colocated_qps_once(model, qps, replicas, t_pf)
        last = estimate
        if estimate.sustainable and model.workload.meets(estimate.ttft_s, estimate.itl_s):
            return estimate
        first_sustainable = first_sustainable or (estimate if estimate.sustainable else None)
        if first_sustainable and estimate.batch_per_worker <= 1.05:   # more replicas no longer shorten a step
            break
    return first_sustainable or last


def _colocated_qps_once(model: InstanceModel, qps: float, replicas: int, t_pf: float) -> Estimate:
    w = model.workload
    q_worker = qps / (replicas * model.dp)
    rho = q_worker * t_pf
    gpus = replicas * model.world
    if rho >= MAX_RHO:
        return Estimate(replicas, gpus, 0, math.inf, math.inf, 0.0, False, f"prefill {rho:.0%} busy")
    batch, ttft, itl = 1.0, t_pf, model.decode_s(1)
    for _ in range(30):
        t_dec = model.decode_s(batch)
        itl = t_dec / (1 - rho)
        ttft = t_pf / (1 - rho) + t_dec
        new = max(q_worker * (ttft + w.output_len * itl), 1.0)
        if abs(new - batch) < 0.01 * batch:
            batch = new
            break
        batch = new
    if batch > model.cap_per_worker:
        return Estimate(replicas, gpus, batch, ttft, itl, 0.0, False,
                        f"{batch:.0f} running requests per worker > {model.cap_per_worker} it holds")
    return Estimate(replicas, gpus, batch, ttft, itl, qps * w.output_len, True)


def colocated_at_concurrency(model: InstanceModel, concurrency: int, replicas: int) -> Estimate:
    w = model.workload
    per_worker = concurrency / (replicas * model.dp)
    batch = max(min(per_worker, model.cap_per_worker), 1.0)
    t_pf, t_dec = model.prefill_s(), model.decode_s(batch)
    cycle = batch * t_pf + w.output_len * t_dec
    rate = replicas * model.dp * batch * w.output_len / cycle
    queued = max(per_worker - batch, 0.0)
    ttft = t_pf + t_dec + queued * cycle / batch
    note = f"{queued:.0f} requests per worker wait for KV or a batch slot" if queued >= 1 else ""
    return Estimate(replicas, replicas * model.world, batch, ttft, cycle / w.output_len, rate, True, note)


def disaggregated_at_qps(model: InstanceModel, qps: float, kv_bytes_per_request: float, link_bytes_s: float,
                         max_instances: int) -> Estimate:
    """The fewest prefill instances meeting TTFT and decode instances meeting ITL, each searched on its own."""
    w = model.workload
    t_pf = model.prefill_s()
    transfer = kv_bytes_per_request / link_bytes_s
    prefill = None
    for p in _replica_counts(max_instances):
        rho = qps / (p * model.dp) * t_pf
        if rho < MAX_RHO:
            prefill = (p, t_pf / (1 - rho) + transfer)
            if w.ttft_ms is None or (prefill[1] + model.decode_s(1)) * 1000 <= w.ttft_ms:
                break
    decode = None
    for d in _replica_counts(max_instances):
        q_worker = qps / (d * model.dp)
        batch = 1.0
        for _ in range(30):
            batch = max(q_worker * w.output_len * model.decode_s(batch), 1.0)
        itl = model.decode_s(batch)
        if batch <= model.cap_per_worker:
            decode = (d, batch, itl)
            if w.itl_ms is None or itl * 1000 <= w.itl_ms:
                break
    if prefill is None or decode is None:
        return Estimate(0, 0, 0, math.inf, math.inf, 0.0, False, "no instance count keeps up")
    (p, ttft), (d, batch, itl) = prefill, decode
    instances = p + d
    return Estimate(instances, instances * model.world, batch, ttft + itl, itl, qps * w.output_len, True,
                    f"{p} prefill + {d} decode instances")


def disaggregated_at_concurrency(model: InstanceModel, concurrency: int, instances: int,
                                 kv_bytes_per_request: float, link_bytes_s: float) -> Estimate:
    """`instances` split into p prefill and the rest decode, the split with the most output tokens/s."""
    w = model.workload
    t_pf = model.prefill_s()
    transfer = kv_bytes_per_request / link_bytes_s
    best = None
    for p in range(1, instances):
        d = instances - p
        batch = max(min(concurrency / (d * model.dp), model.cap_per_worker), 1.0)
        itl = model.decode_s(batch)
        demand = d * model.dp * batch / (w.output_len * itl)      # requests/s the decode side finishes
        supply = MAX_RHO * p * model.dp / t_pf                    # ... and the prefill side can start
        rate = min(demand, supply)
        rho = rate / (p * model.dp) * t_pf
        estimate = Estimate(instances, instances * model.world, batch, t_pf / max(1 - rho, 1 - MAX_RHO) + transfer
                            + itl, itl, rate * w.output_len, True, f"{p} prefill + {d} decode instances")
        if best is None or estimate.output_tok_s > best.output_tok_s:
            best = estimate
    return best


def _replica_counts(limit: int):
    n = 1
    while n <= limit:
        yield n
        n = n + 1 if n < 8 else int(n * 1.25) + 1
