"""Runs one scheduled batch through the model: builds the flattened inputs and attention metadata,
owns the paged KV cache tensors, returns next-token logits per sequence."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_runtime.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    batch: AttentionBatch
    last_token_index: torch.Tensor  # [B] int64: row of each sequence's last new token


def kv_blocks_for_budget(model, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    per_token = sum(spec.bytes_per_token(dtype) for spec in model.kv_cache_specs())
    return max(budget_bytes // (per_token * block_size), 0)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.caches = [
            LayerKVCache.allocate(spec, num_blocks, block_size, dtype, device) for spec in model.kv_cache_specs()
        ]
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, block_size, self.cache_bytes() / 2**20)

    def cache_bytes(self) -> int:
        total = 0
        for cache in self.caches:
            total += cache.keys.numel() * cache.keys.element_size()
            if cache.values is not None:
                total += cache.values.numel() * cache.values.element_size()
        return total

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        bs = self.block_size
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            tokens = seq.all_token_ids[start:end]
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
            query_start.append(query_start[-1] + end - start)
        max_blocks = max((len(seq.block_table) for seq in seqs), default=1) or 1
        block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        dev = self.device
        batch = AttentionBatch(
            query_lens=query_lens,
            context_lens=context_lens,
            query_start=query_start,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=block_tables.to(dev),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_size=bs,
        )
        last = torch.tensor([s - 1 for s in query_start[1:]], dtype=torch.long, device=dev)
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            batch, last,
        )

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits [B, V] (fp32); marks every sequence's tokens as cached."""
        inputs = self.prepare(seqs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.batch, self.caches)  # [T, H]
        for seq in seqs:
            seq.num_cached_tokens = seq.num_tokens
        return self.model.logits(hidden[inputs.last_token_index])
