"""How the front talks to the engine core: one interface, two implementations.

- `InProcessClient` (`inprocess_client.py`): one rank, its `EngineCore` in this process;
- `RankClient` (`rank_client.py`): worker ranks in other processes (or on other nodes), over ZeroMQ.

Either way the front sends the control plane's commands (`attention_dp.messages`: `AddRequest`,
`AbortRequest`, ...) and takes in the same rank messages (`StepOutputs`, `KVImported`,
`ExpertLoadReport`, `RebalanceReport`), so admission, output processing, routing and the P/D halves
exist once, in `Front`; so do the request operations (`Front.abort`, `health`, `stats`: an abort reaches
the ranks as an `AbortRequest`, the stats come in `StepOutputs`), which no client declares. A client is driven
one of two ways, never both: `receive` (a caller that blocks: `LLM`, tests, benchmarks) or `attach` (an asyncio
loop: the server).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from moe_runtime.attention_dp.messages import Message
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.moe.routed_experts import RoutingShape
from moe_runtime.front.rank_reform import ReformOutcome


@dataclass(frozen=True)
class CoreShape:
    """What the front must know of the core it drives (every rank reported it when it was ready)."""

    block_size: int
    num_kv_blocks: int                       # per DP worker (the smallest any rank has)
    max_model_len: int
    vocab_size: int
    pp_size: int
    worker_ranks: dict[int, list[int]]       # DP worker -> its ranks (every stage), in rank order
    kv_shards: dict[int, KVShard | None]     # rank -> its share of the KV cache (P/D instances), else None
    routing: RoutingShape | None = None      # the model's MoE routing (routing replay's arrays)

    @property
    def dp_size(self) -> int:
        return len(self.worker_ranks)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.worker_ranks.values())

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


class EngineCoreClient(Protocol):
    shape: CoreShape
    tokenizer: object
    reformable: bool     # a lost rank can be absorbed by the others (`reform`) instead of a restart of the job

    def send(self, command: Message, only_worker: int | None = None) -> None:
        """`command` to every rank, in order with every other command. With `only_worker`, only that DP
        worker's ranks get it and the others a fixed-size `AdmittedElsewhere` (a prompt goes only where it runs).
        Raises `EngineDeadError` when the core is gone."""
        ...

    def receive(self, timeout: float) -> list[Message]:
        """Blocking driver: what the core has for the front, waiting up to `timeout` seconds for the first
        message (an in-process core runs one step here). Raises `EngineDeadError` when the core is gone."""
        ...

    def pending(self) -> list[Message]:
        """Blocking driver: the messages that already arrived, without waiting or stepping a core."""
        ...

    def attach(self, on_messages: Callable[[list[Message]], None], on_lost: Callable[[str], None]) -> None:
        """Loop driver: from now on the running asyncio loop gets each batch of messages as it arrives, and
        `on_lost(reason)` once when the core is gone. `receive` must not be used after this."""
        ...

    def detach(self) -> None:
        """Stop delivering to the loop (before shutting down)."""
        ...

    def reform(self) -> ReformOutcome:
        """After `on_lost` or `EngineDeadError`, where `reformable`: the ranks left go on without the lost ones (or
        take back ranks that returned), and `shape` is theirs (blocking); how many came back or were lost. Raises
        `front.rank_reform.ReformFailed` when they cannot."""
        ...

    def shutdown(self) -> None: ...
