"""A prefill instance's rank-side half of a KV transfer: park a finished prefill's blocks, serve them, free them.

A request added with `export_kv` runs its prompt and samples its first token as any other; then,
instead of freeing its blocks, the engine core parks them here (the scheduler forgets the request,
the block manager keeps its blocks referenced) and this rank's block server (`transport.KVSource`)
answers decode ranks' pulls from them. The blocks are freed by `release`, which every rank of the DP
worker applies at the same lock-step boundary (the front broadcasts it when the decode instance
says it is done, on abort, and at the transfer timeout), so the ranks' block managers stay alike.
"""
from __future__ import annotations

import logging

from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.transport import open_source
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.records.outputs import KVExportInfo
from moe_runtime.records.sequence import Sequence

logger = logging.getLogger(__name__)


class PrefillExports:
    def __init__(self, caches: list[LayerKVCache], shard: KVShard, block_manager: BlockManager, key: TransferKey,
                 host: str):
        self.block_manager = block_manager
        self.registry = ExportRegistry()
        self.source = open_source(caches, shard, self.registry, key, host)
        self._parked: dict[str, Sequence] = {}
        self._drafting: list[tuple[Sequence, KVExportInfo]] = []   # parked this step: their drafts come after it

    @property
    def shard(self) -> KVShard:
        """This rank's shard, with its block server's endpoint."""
        return self.source.shard

    def park(self, seq: Sequence) -> KVExportInfo:
        """Keep `seq`'s prompt blocks for a decode instance (the scheduler has finished it, keeping its blocks),
        and its recurrent-state slot if the model has linear layers: it holds their states after the prompt's last
        token, which the first decode step continues from."""
        num_tokens = len(seq.prompt_token_ids)
        needed = self.block_manager.blocks_needed(num_tokens)
        self.registry.park(seq.request_id, seq.kv.block_table[:needed], num_tokens, seq.kv.state_slot)
        self._parked[seq.request_id] = seq
        info = KVExportInfo(num_tokens)
        self._drafting.append((seq, info))
        return info

    def note_drafts(self) -> None:
        """After the step's drafting: the drafts a model drafter made after each request parked in it (none with
        n-gram or no speculation), for its handle."""
        for seq, info in self._drafting:
            if seq.drafts.proposed_at == seq.num_tokens:
                info.drafts = list(seq.drafts.proposed)
        self._drafting.clear()

    def release(self, request_id: str) -> bool:
        """Free a parked request's blocks (no pull reads them after this); False if it was not parked here."""
        seq = self._parked.pop(request_id, None)
        if seq is None:
            return False
        self.registry.release(request_id)
        self.block_manager.free(seq)
        return True

    def release_all(self) -> int:
        """Free every parked request's blocks; how many there were."""
        parked = list(self._parked)
        for request_id in parked:
            self.release(request_id)
        return len(parked)

    def __len__(self) -> int:
        return len(self._parked)

    def close(self) -> None:
        self.source.close()
