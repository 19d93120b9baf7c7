"""A P/D instance's rank end of the KV transfer, opened once its model and KV cache exist.

A prefill instance's rank serves its parked blocks (`PrefillExports`: the block server); a decode instance's rank
pulls into its own (`DecodeImports` over a sink); any other engine has neither. What travels is this rank's share
of the cache (`KVShard`): the layers it holds, and a model drafter's layer when the last stage runs one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.disaggregation.decode_imports import DecodeImports
from moe_runtime.disaggregation.draft_layer import TransferredLayers
from moe_runtime.disaggregation.import_grammars import ImportGrammars
from moe_runtime.disaggregation.kv_transfer.puller import PullResult
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.transport import open_sink
from moe_runtime.disaggregation.prefill_exports import PrefillExports
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.sampling.structured_output.grammar_waits import GrammarWaits
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.speculative.speculation import Speculation


@dataclass
class TransferEnds:
    exports: PrefillExports | None = None   # --disaggregation-mode prefill: parked KV, its block server
    imports: DecodeImports | None = None    # --disaggregation-mode decode: KV pulled from prefill ranks

    @classmethod
    def open(cls, config: EngineConfig, key: TransferKey | None, parallel: ParallelContext, model: torch.nn.Module,
             caches: list, speculation: Speculation | None, block_manager: BlockManager, dtype: torch.dtype,
             num_hidden_layers: int, grammar_waits: GrammarWaits, wake: Callable[[], None]) -> "TransferEnds":
        """`caches`: the runner's layer caches; `wake` (called from the sink's thread): a pull landed."""
        if config.disaggregation_mode == "none":
            return cls()
        key = key or TransferKey.shared(config.kv_transfer_key_file)
        first_layer = parallel.stage_layers[0] if parallel.stage_layers else 0
        specs = model.kv_cache_specs()
        layers = TransferredLayers.of(specs, caches, speculation, first_layer + len(specs) == num_hidden_layers)
        shard = KVShard.of(layers.specs, first_layer, config.block_size, dtype, drafter=layers.drafter)
        if config.disaggregation_mode == "prefill":
            return cls(exports=PrefillExports(layers.caches, shard, block_manager, key, config.kv_transfer_host))
        sink = open_sink(layers.caches, shard, key, on_landed=wake)
        return cls(imports=DecodeImports(shard, sink, block_manager, parallel.worker_rank,
                                         config.kv_transfer_timeout_s, ImportGrammars(grammar_waits)))

    def shard(self) -> KVShard | None:
        """This rank's share of the KV cache, as a KV transfer names it (None: not a P/D instance)."""
        if self.exports is not None:
            return self.exports.shard
        return self.imports.local if self.imports is not None else None

    def take_landed(self) -> list[PullResult]:
        """Imports whose pull ended on this rank since the last call (ok or with an error), each once; one with
        a grammar only once that compiled too (or failed: the outcome then carries its error)."""
        return self.imports.take_landed() if self.imports is not None else []
