"""Prompt logprobs: during a request's prefill, each prompt token's logprob given the tokens before it.

The prefill already computes every prompt position's final hidden state, but the model projects
only the last one to logits (for sampling). For a request that asked for `prompt_logprobs`, the
positions 0..P-2 go through the LM head too (position i scores prompt token i+1), a bounded chunk of
positions at a time: a long prompt never holds more than `chunk_tokens` rows of [V] logits and
log-softmax at once, whatever its length.

They are computed once per request: a preempted request recomputes its prefill (prompt and tokens so
far) without scoring the prompt again (`Sequence.prompt_logprobs_done`).

With a vocabulary-parallel LM head (dense TP) `logits_of` all-gathers over the attention-TP group;
every rank of the group holds the same sequences and parameters, so every rank runs the same chunks
and the collectives pair up. With pipeline parallelism only the last stage has final hidden states
and scores prompts (it is also the stage that reports the outputs).
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_runtime.sampling.logprobs import PromptLogprobs
from moe_runtime.sampling.sampling_row import SamplingRow

CHUNK_LOGITS_BYTES = 64 * 2**20   # fp32 logits of one chunk of prompt positions


def chunk_tokens_for(vocab_size: int, budget_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Prompt positions per chunk so that their fp32 logits [C, V] fit `budget_bytes` (at least one)."""
    return max(1, budget_bytes // (4 * vocab_size))


def prompt_logprobs_due(seq: SamplingRow) -> bool:
    """Whether the forward about to run must score prompt positions of `seq`: it asked, has not been scored
    yet, and this forward runs prompt tokens (its whole prompt, or a chunk of it with chunked prefill; such a
    request reads nothing from the prefix cache, so its first chunk starts at the first token)."""
    return (seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done
            and seq.num_cached_tokens < len(seq.prompt_token_ids))


def join_prompt_logprobs(first: PromptLogprobs, then: PromptLogprobs) -> PromptLogprobs:
    """The logprobs of `first`'s positions followed by `then`'s (a prompt scored chunk by chunk)."""
    return PromptLogprobs(first.token_ids + then.token_ids, first.logprobs + then.logprobs, first.ranks + then.ranks,
                          first.top_token_ids + then.top_token_ids, first.top_logprobs + then.top_logprobs)


def score_prompt(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 prompt_token_ids: list[int], num_top: int, chunk_tokens: int) -> PromptLogprobs:
    """Logprobs of prompt tokens 1..P-1 from the final hidden states of positions 0..P-2.

    `hidden` [P-1, H]: row i is position i's; `logits_of` maps [C, H] to fp32 logits [C, V].
    """
    scored = PromptLogprobs([], [], [], [], [])
    num_positions = len(prompt_token_ids) - 1
    targets = torch.tensor(prompt_token_ids[1:], dtype=torch.long, device=hidden.device)   # [P-1]
    for start in range(0, num_positions, chunk_tokens):
        stop = min(start + chunk_tokens, num_positions)
        logp = logits_of(hidden[start:stop]).float().log_softmax(dim=-1)                    # [C, V]
        chosen = logp.gather(1, targets[start:stop, None])                                  # [C, 1]
        ranks = (logp > chosen).sum(dim=-1) + 1                                             # [C]
        top_values, top_ids = logp.topk(min(num_top, logp.shape[-1]), dim=-1)               # [C, N]
        scored.token_ids.extend(prompt_token_ids[start + 1 : stop + 1])
        scored.logprobs.extend(chosen[:, 0].tolist())
        scored.ranks.extend(ranks.tolist())
        scored.top_token_ids.extend(top_ids.tolist())
        scored.top_logprobs.extend(top_values.tolist())
    return scored
