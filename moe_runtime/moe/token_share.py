"""Each attention-TP rank dispatches only its share of its DP worker's tokens.

Inside a DP attention worker of several ranks (attention TP) the worker's tokens are replicated
on every one of them. Sending each token from every rank would multiply the MoE traffic by the
TP size, so rank r of the worker dispatches rows [r * ceil(T/tp), (r + 1) * ceil(T/tp)) and the
worker's ranks all-gather the results afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TokenShare:
    size: int    # ranks of the DP attention worker (attention TP)
    rank: int    # this rank among them
    group: Any   # their data group

    def rows(self, num_tokens: int) -> slice:
        """The rows of the worker's [T, ...] tensors this rank dispatches."""
        per_rank = -(-num_tokens // self.size)
        return slice(min(self.rank * per_rank, num_tokens), min((self.rank + 1) * per_rank, num_tokens))

    def gather(self, y_share: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [share, H] -> [T, H]
        if self.size == 1:
            return y_share
        per_rank = -(-num_tokens // self.size)
        padded = y_share.new_zeros(per_rank, y_share.shape[1])  # [ceil(T/tp), H]
        padded[: y_share.shape[0]] = y_share
        gathered = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(gathered, padded, group=self.group)
        return torch.cat(gathered, dim=0)[:num_tokens]
