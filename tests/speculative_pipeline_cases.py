"""What the pipeline speculation tests run on each rank of the gloo pool: one engine core per rank, built for a
layout with a model drafter, generating greedily in lock-step, each sequence's drafts checked after every step
against a naive reference of the drafter (tests/mtp_checkpoints.py, tests/eagle3_checkpoints.py) on every stage:
the last stage's own drafts and, on the others, those its broadcast brought."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from context_parallel_cases import _anyone_busy
from engine_helpers import greedy
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.model_config import load_hf_config
from moe_runtime.engine.core import EngineCore
from moe_runtime.processes.distributed import build_parallel_context


@dataclass
class DraftedRun:
    tokens: dict[int, list[int]]   # prompt index -> greedy tokens, for the prompts of this rank's DP worker
    compared: int                  # drafts checked against the reference (one per sequence and step)
    drafted: int                   # the worker's counters (the last stage's; zeros on the others)
    verify_steps: int


def drafted_on_rank(path: str, speculative: dict, make_reference, reference_args: tuple, prompts: list[list[int]],
                    new_tokens: int, **layout) -> DraftedRun:
    """Greedy tokens of the prompts this rank's DP worker takes (prompt i: worker i % dp), from an engine core of
    this rank in `layout` (EngineConfig fields) drafting by `speculative`, its drafts after every step equal to
    `make_reference(*reference_args).drafts(tokens, k)`' prefix."""
    settings = dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=16) | layout
    config = EngineConfig(model=path, device="cpu", dtype="float32", speculative_config=speculative, **settings)
    parallel = build_parallel_context(config.layout(), dist.get_rank(), torch.device("cpu"),
                                      load_hf_config(path).num_hidden_layers)
    core = EngineCore(config, parallel)
    reference, k = make_reference(*reference_args), speculative["num_speculative_tokens"]
    mine = [i for i in range(len(prompts)) if i % parallel.dp_size == parallel.dp_rank]
    for index in mine:
        core.add_request(str(index), list(prompts[index]), greedy(new_tokens))
    seqs = list(core._sequences.values())
    compared = 0
    while _anyone_busy(core.has_unfinished()):
        core.step() if core.has_unfinished() else core.execute(None)
        for seq in seqs:
            if seq.is_finished or seq.drafts.proposed_at != seq.num_tokens:
                continue
            expected = reference.drafts(seq.all_token_ids, k)
            assert 1 <= len(seq.drafts.proposed) and seq.drafts.proposed == expected[: len(seq.drafts.proposed)], (
                f"rank {parallel.rank}, request {seq.request_id} after {seq.num_tokens} tokens: "
                f"{seq.drafts.proposed} vs {expected}")
            compared += 1
    worker = core.worker_stats()
    core.shutdown()
    return DraftedRun({int(seq.request_id): seq.output_token_ids for seq in seqs}, compared,
                      worker.spec_draft_tokens, worker.spec_verify_steps)
