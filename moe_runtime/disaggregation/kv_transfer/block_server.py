"""A prefill rank's KV block server: answers decode ranks' `PullBlocks` from its parked requests.

It runs on its own thread, beside the rank's lock-step loop, so a transfer never waits for a step
and a step never waits for a transfer: blocks of a parked request belong to no running sequence,
and `ExportRegistry` keeps them from being freed while a read is in progress. Every request is
checked against what this rank holds (layers, heads, the request's blocks, a reply size bound)
before any tensor is touched; a bad one gets an error reply and changes nothing. A hybrid model's
rank also answers `PullStates` with a parked request's recurrent states (its slot in each linear layer asked for).
"""
from __future__ import annotations

import logging
import threading

import msgspec
import torch

from moe_runtime.disaggregation.kv_transfer.cache_io import as_frame, read_blocks
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.disaggregation.kv_transfer.messages import BlocksReply, KVCodec, PullBlocks, PullStates
from moe_runtime.disaggregation.kv_transfer.registry import ExportRegistry, ParkedKV, UnknownExport
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.disaggregation.kv_transfer.sockets import CurveServer
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.layers.state_cache import LayerStateCache

logger = logging.getLogger(__name__)

MAX_REPLY_BYTES = 64 * 2**20    # one answer; pullers ask for far less (`puller.MAX_PIECE_BYTES`)
POLL_MS = 100                   # how often the serving thread checks whether it should stop


class PullRefused(ValueError):
    """A pull this rank cannot answer; the message goes back to the puller."""


class KVBlockServer:
    def __init__(self, caches: list[LayerKVCache | LayerStateCache], shard: KVShard, registry: ExportRegistry,
                 key: TransferKey, host: str):
        """`shard` describes `caches`, one per layer of its range (its endpoint is filled in here, once bound: see
        `self.shard`)."""
        self.caches = caches
        self.registry = registry
        self.codec = KVCodec()
        self._server = CurveServer(key, host)
        self.shard = msgspec.structs.replace(shard, endpoint=self._server.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()

    def _serve(self) -> None:
        socket = self._server.socket
        while not self._stop.is_set():
            if not socket.poll(POLL_MS):
                continue
            frames = socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("KV server: dropped a message of %d frames (a pull is one)", len(frames) - 1)
                continue
            try:
                pull = self.codec.decode_to_server(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("KV server: dropped an undecodable message: %s", exc)
                continue
            if not isinstance(pull, (PullBlocks, PullStates)):
                logger.warning("KV server: dropped a %s (not a pull)", type(pull).__name__)
                continue
            socket.send_multipart([frames[0], *self.answer(pull)], copy=False)

    def answer(self, pull: PullBlocks | PullStates) -> list:
        """The reply frames to `pull`: a `BlocksReply` header, then keys [and values] per layer (or conv and ssm
        states per linear layer)."""
        gather = self._gather_states if isinstance(pull, PullStates) else self._gather
        try:
            tensors = self.registry.read(pull.request_id, lambda parked: gather(pull, parked))
        except UnknownExport as exc:
            return [self.codec.encode(BlocksReply(pull_id=pull.pull_id, error=str(exc)[:1024], not_parked=True))]
        except PullRefused as exc:
            return [self.codec.encode(BlocksReply(pull_id=pull.pull_id, error=str(exc)[:1024]))]
        return [self.codec.encode(BlocksReply(pull_id=pull.pull_id)), *(as_frame(t) for t in tensors)]

    def _gather(self, pull: PullBlocks, parked: ParkedKV) -> list[torch.Tensor]:
        shard = self.shard
        first = pull.first_layer - shard.first_layer
        if pull.num_layers < 1 or first < 0 or first + pull.num_layers > len(self.caches):
            raise PullRefused(f"layers [{pull.first_layer}, +{pull.num_layers}) are not all on this rank "
                              f"(it holds [{shard.first_layer}, +{shard.num_layers}))")
        head = pull.head_start - shard.head_start
        if pull.num_heads < 1 or head < 0 or head + pull.num_heads > shard.num_heads:
            raise PullRefused(f"KV heads [{pull.head_start}, +{pull.num_heads}) are not all on this rank "
                              f"(it holds [{shard.head_start}, +{shard.num_heads}))")
        not_paged = set(range(pull.first_layer, pull.first_layer + pull.num_layers)) - set(shard.kv_layers)
        if not_paged:
            raise PullRefused(f"layers {sorted(not_paged)} keep states, not blocks")
        if pull.num_blocks < 1 or pull.first_block + pull.num_blocks > len(parked.block_ids):
            raise PullRefused(f"blocks [{pull.first_block}, +{pull.num_blocks}) outside the request's "
                              f"{len(parked.block_ids)}")
        size = shard.bytes_per_block(pull.num_heads) * pull.num_blocks * pull.num_layers
        if size > MAX_REPLY_BYTES:
            raise PullRefused(f"a reply of {size} bytes exceeds {MAX_REPLY_BYTES}: ask for fewer blocks")
        ids = torch.tensor(parked.block_ids[pull.first_block : pull.first_block + pull.num_blocks], dtype=torch.long,
                           device=self.caches[first].keys.device)
        heads = slice(head, head + pull.num_heads)
        parts: list[torch.Tensor] = []
        for layer in range(first, first + pull.num_layers):
            parts.extend(read_blocks(self.caches[layer], ids, heads))
        return parts

    def _gather_states(self, pull: PullStates, parked: ParkedKV) -> list[torch.Tensor]:
        shard = self.shard
        missing = sorted(set(pull.layers) - set(shard.state_layers))
        if missing:
            raise PullRefused(f"layers {missing[:8]} are not linear-attention layers of this rank")
        if parked.state_slot < 0:
            raise PullRefused("the request holds no recurrent-state slot here")
        size = shard.bytes_per_state() * len(pull.layers)
        if size > MAX_REPLY_BYTES:
            raise PullRefused(f"a reply of {size} bytes exceeds {MAX_REPLY_BYTES}: ask for fewer layers")
        parts: list[torch.Tensor] = []
        for layer in pull.layers:
            parts.extend(self.caches[layer - shard.first_layer].read_slot(parked.state_slot))
        return parts
