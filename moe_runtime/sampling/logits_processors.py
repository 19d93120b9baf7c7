"""What the sampling parameters do to a batch's logits before a token is chosen, one tensor op per step each.

Every function takes the whole batch's logits [B, V] and the batch's sequences; per-row
parameters become [B] tensors (neutral values in rows that did not ask), token histories become one
[B, V] count tensor built with a single scatter. No Python loop does tensor math per request: the
loops below only gather numbers into lists. Each step is skipped when no row of the batch uses it.

Semantics (vLLM's and OpenAI's):
- min_tokens: while a request has fewer output tokens, its stop tokens (EOS unless ignore_eos, and
  its stop_token_ids) are forbidden. The ban never leaves a row with nothing: a grammar that allows
  only stopping wins (the row keeps its logits as they were before the ban);
- logit_bias: {token id: bias} added to the logits (-100 all but bans a token, +100 all but forces it);
- repetition_penalty (transformers' rule): a token that occurs in the prompt or the output so far has
  its logit divided by the penalty when positive, multiplied by it when negative;
- frequency_penalty and presence_penalty (OpenAI's rule), over the output tokens only:
  logit -= frequency_penalty * count + presence_penalty * (count > 0);
- min_p (after temperature): tokens whose probability is below min_p times the top token's are dropped.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable

import torch

from moe_runtime.sampling.sampling_row import SamplingRow


def row_tensor(seqs: list[SamplingRow], value: Callable[[SamplingRow], float], device) -> torch.Tensor:
    """[B] float32: one parameter per row."""
    return torch.tensor([float(value(seq)) for seq in seqs], dtype=torch.float32, device=device)


def token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's list (one scatter for the whole batch)."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)               # [B]
    if int(lengths.sum()) == 0:
        return counts
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64, device=device)  # [N]
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)       # [N]
    counts.view(-1).scatter_add_(0, rows * vocab + tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts


def ban_stop_tokens_below_min_tokens(logits: torch.Tensor, seqs: list[SamplingRow],
                                     eos_token_ids: Iterable[int]) -> torch.Tensor:
    """logits [B, V] with each row's stop tokens at -inf while it has fewer than min_tokens outputs."""
    eos = list(eos_token_ids)
    pairs = [(row, token) for row, seq in enumerate(seqs)
             if len(seq.output_token_ids) < seq.params.min_tokens
             for token in (seq.params.stop_token_ids + ([] if seq.params.ignore_eos else eos))]
    if not pairs:
        return logits
    vocab = logits.shape[-1]
    rows = torch.tensor([r for r, t in pairs if t < vocab], dtype=torch.int64, device=logits.device)
    tokens = torch.tensor([t for r, t in pairs if t < vocab], dtype=torch.int64, device=logits.device)
    banned = logits.index_put((rows, tokens), torch.tensor(-math.inf, device=logits.device))      # [B, V]
    keeps_a_token = torch.isfinite(banned).any(dim=-1, keepdim=True)                            # [B, 1]
    return torch.where(keeps_a_token, banned, logits)


def add_logit_bias(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """logits [B, V] plus each row's {token: bias}."""
    triples = [(row, token, bias) for row, seq in enumerate(seqs) for token, bias in seq.params.logit_bias.items()]
    if not triples:
        return logits
    rows, tokens, biases = zip(*triples)
    device = logits.device
    return logits.index_put((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                            torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def penalty_counts(seqs: list[SamplingRow], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, V] output counts, [B, V] prompt counts) the penalties read: outputs of rows with any penalty, prompts
    of rows with a repetition penalty (empty rows elsewhere)."""
    outputs = [seq.output_token_ids if seq.params.penalized else [] for seq in seqs]
    prompts = [seq.prompt_token_ids if seq.params.repetition_penalty != 1.0 else [] for seq in seqs]
    return token_counts(outputs, vocab, device), token_counts(prompts, vocab, device)


def penalize(logits: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
             output_counts: torch.Tensor, prompt_counts: torch.Tensor) -> torch.Tensor:
    """logits [B, V] after repetition (tokens in prompt or output), frequency and presence (output) penalties,
    each [B]; neutral values (1, 0, 0) leave a row exactly as it was. No data-dependent branch: traceable."""
    seen = (prompt_counts + output_counts) > 0                                                   # [B, V]
    repetition = repetition[:, None]                                                             # [B, 1]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).float()


def apply_penalties(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """logits [B, V] after the rows' penalties (unchanged when no row has one)."""
    if not any(seq.params.penalized for seq in seqs):
        return logits
    device = logits.device
    return penalize(logits, row_tensor(seqs, lambda s: s.params.repetition_penalty, device),
                    row_tensor(seqs, lambda s: s.params.frequency_penalty, device),
                    row_tensor(seqs, lambda s: s.params.presence_penalty, device),
                    *penalty_counts(seqs, logits.shape[-1], device))


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scaled logits [S, V] (after temperature) without the tokens below min_p [S] x the top probability."""
    if not bool((min_p > 0).any()):
        return scaled
    return min_p_masked(scaled, min_p)


def min_p_masked(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`apply_min_p` without the host check (traceable): min_p 0 gives a -inf threshold, nothing dropped."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    threshold = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]               # [S, 1]
    return scaled.masked_fill(scaled < threshold, -math.inf)
