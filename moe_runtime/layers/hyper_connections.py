"""Manifold-constrained hyper-connections (DeepSeek-V4; transformers' DeepseekV4HyperConnection / HyperHead).

The residual is `hc_mult` streams per token, [T, n, H]. Before a block (attention or MLP) a hyper-connection reads
all streams (flattened, weightless RMS-normed, one linear map `fn` plus `base`, scaled per output kind by `scale`)
into three mixes: `pre` [T, n] collapses the streams into the block's input, `post` [T, n] spreads the block's
output back over the streams, and `comb` [T, n, n], made doubly stochastic by Sinkhorn-Knopp iterations, mixes the
old streams into the new: new[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]. The hyper head collapses
the streams once more (its own `pre` mix) before the final norm. All mixes are computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normed_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:  # [T, n, H] -> [T, M] fp32
    flat = streams.reshape(streams.shape[0], streams.shape[1] * streams.shape[2]).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.float())


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, device):
        super().__init__()
        n = self.n = hc_mult
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), requires_grad=False)

        self.fn = param((2 + n) * n, n * hidden_size)
        self.base = param((2 + n) * n)
        self.scale = param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed block input [T, H])."""
        n = self.n
        pre_w, post_w, comb_w = _normed_mixes(streams, self.fn, self.norm_eps).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:   # [T, n, H], [T, H] -> [T, n, H]
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float, device):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32, device=device),
                               requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:   # [T, n, H] -> [T, H]
        pre = torch.sigmoid(_normed_mixes(streams, self.fn, self.norm_eps) * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
