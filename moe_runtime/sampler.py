"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.sequence import Sequence, TokenLogprob


@dataclass
class SampleResult:
    token_ids: list[int]                       # [B]
    logprobs: list[TokenLogprob | None]        # [B], None where the request did not ask


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k (0 = off) and nucleus top-p (1 = off) with -inf."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)     # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]           # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                            # probability mass of better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False                                                    # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:  # logits [B, V] fp32
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)                                # [B]
        chosen = greedy_ids.clone()
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            params = [seqs[i].params for i in sampled_rows]
            temperature = torch.tensor([p.temperature for p in params], device=logits.device)
            top_k = torch.tensor([max(p.top_k, 0) for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            scaled = apply_top_k_top_p(logits[rows] / temperature[:, None], top_k, top_p)
            probs = scaled.softmax(dim=-1)                                 # [S, V]
            for row_in_subset, row in enumerate(sampled_rows):
                generator = seqs[row].generator
                chosen[row] = torch.multinomial(probs[row_in_subset].cpu(), 1, generator=generator)[0]
        token_ids = chosen.tolist()
        return SampleResult(token_ids, self._logprobs(logits, seqs, token_ids))

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(seqs)
        if not wanted:
            return result
        logp = logits[wanted].log_softmax(dim=-1)                          # [W, V]
        for j, row in enumerate(wanted):
            n = seqs[row].params.logprobs
            top_values, top_ids = logp[j].topk(n) if n else (logp[j][:0], logp[j][:0].long())
            result[row] = TokenLogprob(
                token_id=token_ids[row],
                logprob=float(logp[j, token_ids[row]]),
                top={int(t): float(v) for t, v in zip(top_ids.tolist(), top_values.tolist())},
            )
        return result
