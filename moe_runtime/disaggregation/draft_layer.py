"""A model drafter's KV layer in a P/D transfer (the MTP layer, an EAGLE-3 head: `speculative/mtp.py`).

The drafter keeps a KV cache of its own in the sequence's blocks, written by its pass over every true position
after each step. On a decode instance an imported prompt's positions were computed elsewhere, so their drafter
rows exist only where the prefill instance drafted with the same method: there the drafter runs over the prompt
like the target (a parked request's last rows too, `Sequence.parked`), its rows travel as one more layer after the
model's last (`KVShard.drafter`), and its drafts after the first token travel in the handle (`KVHandle.first_drafts`)
so the decode side's first step already verifies them. With both, the decode side drafts exactly what one instance
drafts. Without them (a prefill instance that does not draft, or with another method) only the model's layers move
and the decode side drafts from drafter rows never written over the prompt: worse drafts, the same output
(verification keeps every token the target's).

The drafter's layer travels only where its cache has the shape of the model's (every layer of a shard is alike,
`KVShard.of`): an EAGLE-3 head whose heads differ from the target's, or that every rank keeps whole under attention
TP, stays out of transfers, with a log line. And only on the rank holding the model's last layer: the drafter's
index in the shard is the model's layer count.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_runtime.layers.kv_cache import KVCacheSpec
from moe_runtime.speculative.speculation import Speculation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferredLayers:
    """The layers a rank's KV transfers move: the model's it owns, then the drafter's when it travels."""

    specs: list              # their cache specs, in layer order
    caches: list             # their caches (`LayerKVCache`, a hybrid model's `LayerStateCache`s)
    drafter: str = ""        # the speculative method whose drafter layer is the last ("": none)

    @classmethod
    def of(cls, specs: list, caches: list, speculation: Speculation | None,
           holds_last_layer: bool) -> "TransferredLayers":
        """`specs`, `caches`: the model layers this rank owns; `speculation`: the engine's (None: off);
        `holds_last_layer`: this rank owns the model's last layer."""
        drafter = speculation.local_model_drafter() if speculation is not None else None
        if drafter is None or not holds_last_layer:
            return cls(list(specs), list(caches))
        method = speculation.config.method
        spec = drafter.layer.kv_cache_spec()
        if spec not in [model_spec for model_spec in specs if isinstance(model_spec, KVCacheSpec)]:
            logger.info("speculative_config method %r: the drafter's KV layer (%s) is not shaped like the model's, "
                        "so P/D transfers leave it out (drafts on a decode instance are worse, the output the same)",
                        method, spec)
            return cls(list(specs), list(caches))
        return cls([*specs, spec], [*caches, drafter.cache], method)
