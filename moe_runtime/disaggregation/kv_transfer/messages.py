"""What crosses the KV sockets between instances, as msgspec structs (msgpack); tensors as raw frames.

A decode rank asks a prefill rank's block server for one piece (`PullBlocks`: a request's blocks
[first_block, +num_blocks) of layers [first_layer, +num_layers), KV heads [head_start, +num_heads));
the answer is a `BlocksReply` header followed by one frame per layer for its keys (and one for its
values), each `[num_blocks, block_size, num_heads, dim]` in the stored cache dtype, C order. A hybrid
model's recurrent states come apart (`PullStates`: a request's states of some linear-attention layers): the
answer is a `BlocksReply` header and, per layer, its convolution state `[channels, width]` (cache dtype) and
its delta-rule state `[heads, Dk, Dv]` (float32) of the request's slot. DeepSeek-V4's layers travel in their own
frames (`KVShard.compressed_layers`): a block's rows are its compressed entries, a state its window and carried
projections. A decode front tells a prefill
front it may free a request's blocks with `ReleaseKV`. Each side
decodes only its own direction's types, every field bounded: no pickle, nothing of the sender's
choosing is built.
"""
from __future__ import annotations

from typing import Annotated, Union

import msgspec

RequestId = Annotated[str, msgspec.Meta(max_length=256)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
MAX_STATE_LAYERS = 4096        # linear-attention layers asked for in one pull


class KVMessage(msgspec.Struct, tag=True, kw_only=True):
    """Base of the KV wire messages; the class name is the wire tag."""


class PullBlocks(KVMessage):
    request_id: RequestId      # the request's id on the prefill instance
    pull_id: Count             # echoed in the reply: the puller matches answers to questions
    first_layer: Count
    num_layers: Count
    head_start: Count
    num_heads: Count
    first_block: Count         # index into the request's block table
    num_blocks: Count


class PullStates(KVMessage):
    request_id: RequestId
    pull_id: Count
    layers: Annotated[tuple[Count, ...], msgspec.Meta(min_length=1, max_length=MAX_STATE_LAYERS)]


class BlocksReply(KVMessage):
    pull_id: Count
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""   # "" = the frames follow
    not_parked: bool = False   # the request is not parked here: not yet (this rank is a step behind the one
                               # that reported it), or no more (released, timed out); the puller asks again


class ReleaseKV(KVMessage):
    request_id: RequestId


class KVCodec:
    """msgpack encoding, one decoder per direction."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_server = msgspec.msgpack.Decoder(Union[PullBlocks, PullStates, ReleaseKV])
        self._to_client = msgspec.msgpack.Decoder(BlocksReply)

    def encode(self, message: KVMessage) -> bytes:
        return self._encoder.encode(message)

    def decode_to_server(self, payload: bytes) -> PullBlocks | PullStates | ReleaseKV:
        """Raises msgspec.DecodeError / ValidationError on anything else."""
        return self._to_server.decode(payload)

    def decode_reply(self, payload: bytes) -> BlocksReply:
        return self._to_client.decode(payload)
