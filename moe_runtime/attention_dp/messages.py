"""Every message between the front process and the worker ranks, as msgspec structs (msgpack).

The control plane decodes only these types: a tagged union per direction, so a payload that is
not one of them is a `msgspec.DecodeError`/`ValidationError`, never an object of the sender's
choosing (no pickle anywhere). Engine values that travel here (`EngineConfig`, `SamplingParams`,
`TokenDelta`, `WorkerStats`, `PrefixCacheEvents`, `RebalanceEvent`, `ImportSpec`) are plain
dataclasses of numbers, strings, lists and dicts (and nested plain dataclasses: a request's
`StructuredOutputSpec`), which msgspec decodes field by field with their declared types; an `AddRequest`'s
`SamplingParams` travels as only the fields it sets (`AddRequestOnWire`, sampling_params_wire.py). A
request's values were checked once, at the front's admission; the ranks trust them. Tensors never travel
here: the expert-load report carries its tables as nested lists (`ExpertLoadTables`).
"""
from __future__ import annotations

from typing import Union

import msgspec

from moe_runtime.load_balancer.rebalance_event import RebalanceEvent
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.disaggregation.import_spec import ImportSpec
from moe_runtime.disaggregation.kv_transfer.shard import KVShard
from moe_runtime.records.outputs import TokenDelta
from moe_runtime.moe.routed_experts import RoutingShape
from moe_runtime.kv_blocks.prefix_cache import PrefixCacheEvents
from moe_runtime.attention_dp.sampling_params_wire import SamplingParamsWire, params_from_wire, params_to_wire
from moe_runtime.sampling.params import SamplingParams
from moe_runtime.engine.sleep_mode import ResidentMemory
from moe_runtime.engine.weight_update_group import GroupAddress, TensorSpec as WeightTensorSpec
from moe_runtime.engine.weight_updates import SlotChecksum


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of every control-plane message; the class name is the wire tag."""


# ---- rank -> front, first: who it is; front -> rank, the answer ---------------------------------
class Hello(Message):
    rank: int
    pid: int
    host: str


class WorkerSetup(Message):
    """The front's answer to Hello: everything a rank needs to build its share of the engine."""

    config: EngineConfig
    world_size: int
    rendezvous: str          # torch.distributed init_method: file://<private dir> on one node, env:// across nodes
    master_addr: str
    master_port: int
    num_threads: int
    log_level: int
    loopback_only: bool      # one node: every socket of the job on 127.0.0.1 (gloo/NCCL pairs too)
    generation: int = 0      # > 0: this rank replaces a lost one and joins the others' re-formation as this generation
    # No secret travels here: a P/D instance's ranks read the KV transfer key as the front does (its process
    # arguments for the ranks it spawns, the key file or environment variable elsewhere), so whoever holds the
    # control key still holds nothing else.


# ---- front -> ranks (every rank gets each command, or its marker, and applies it at the same lock-step boundary)
class AddRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dp_rank: int
    export_kv: bool = False        # prefill instance: park its KV blocks after its first token
    resumed_token_ids: list[int] = []   # tokens it generated on ranks since lost: recomputed, then continued


class AddRequestOnWire(Message, tag="AddRequest", omit_defaults=True):
    """`AddRequest` as the codec writes and reads it: its params in their wire form, only the fields the request
    sets (attention_dp/sampling_params_wire.py), and its own fields at their defaults left out. Nothing else
    sees this type."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParamsWire
    dp_rank: int
    export_kv: bool = False
    resumed_token_ids: list[int] = []


class ImportRequest(Message):
    """Decode instance: a request prefilled elsewhere; the worker's ranks allocate blocks and pull its KV."""

    spec: ImportSpec
    dp_rank: int


class AdmittedElsewhere(Message):
    """What the ranks of every other DP worker get in place of an `AddRequest` or `ImportRequest`: a request was
    admitted on another worker. It carries nothing (the prompt goes only to the ranks that run it), but it
    counts in the lock-step agreement on commands, so every rank steps from the same boundary."""


class ActivateImport(Message):
    """Every rank of the worker reported the import's KV in place: it decodes from the next step."""

    request_id: str
    dp_rank: int


class ReleaseExport(Message):
    """Prefill instance: free a parked request's blocks (its decode instance has them, or the timeout passed)."""

    request_id: str
    dp_rank: int


class AbortRequest(Message):
    request_id: str
    finish_reason: str = "abort"   # "stop": the front saw a stop string; "error": it failed the request


class SnapshotExpertLoad(Message):
    """Every rank sums its expert-load counts with the others; each stage's first rank reports."""


class RebalanceNow(Message):
    """Plan and migrate now. `fail_on_rank` injects a migration failure there (fault-injection tests)."""

    fail_on_rank: int | None = None


class ResetPrefixCache(Message):
    """Every DP worker forgets its cached KV blocks (blocks in use stay with their requests)."""


class UpdateWeights(Message):
    """New weights, applied by every rank at one step boundary (moe_runtime/engine/weight_updates.py): from the
    checkpoint directory `path` (`partial`: plain tensors an update from tensors wrote there, some of the model's),
    or, `specs` given, from the trainer's broadcast over the weight-update group. Tensors never travel here: only
    their names, dtypes and shapes."""

    update_id: int
    path: str = ""
    partial: bool = False
    specs: list[WeightTensorSpec] = []
    checksums: bool = False   # each rank reports its expert slots' checksums
    whole: bool = False       # refused unless it carries every tensor (the weights were lost: front/weight_sync.py)


class InitWeightUpdateGroup(Message):
    """Every rank joins the trainer's weight-update group (engine/weight_update_group.py)."""

    update_id: int
    address: GroupAddress


class SleepEngine(Message):
    """Free the KV pool (level 1: weights to host memory; level 2: dropped) (engine/sleep_mode.py)."""

    update_id: int
    level: int


class WakeUpEngine(Message):
    update_id: int
    reload: bool = False   # after level 2: load the checkpoint again


class Shutdown(Message):
    pass


class Reform(Message):
    """Ranks were lost: the `members` (ranks, as they said Hello, in their new rank order) leave their process
    groups, drop their requests (the front resumes them), meet in `rendezvous` as generation `generation`, place
    the experts no member holds, and answer WorkerReady (moe_runtime/processes/reform.py). Taken at once, outside
    the lock-step agreement (the job it would agree over has lost a rank), unless `agreed`."""

    generation: int
    members: list[int]
    rendezvous: str
    interrupted: bool = False   # the front sent this rank its interrupt signal first (processes/collective_interrupt.py)
    joiners: list[int] = []     # members starting afresh (replacements): the others mirror their start's collectives
    agreed: bool = False        # a healthy job (ranks coming back): taken at a lock-step boundary, like a command


Command = Union[AddRequest, AbortRequest, SnapshotExpertLoad, RebalanceNow, ResetPrefixCache, Shutdown,
                ImportRequest, ActivateImport, ReleaseExport, AdmittedElsewhere, Reform, UpdateWeights,
                InitWeightUpdateGroup, SleepEngine, WakeUpEngine]


# ---- worker -> front -----------------------------------------------------------------------------
class WorkerReady(Message):
    rank: int
    dp_rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    expert_bytes: int          # bytes of routed-expert weights resident on this rank
    total_expert_bytes: int    # bytes of routed-expert weights in the whole model
    weight_bytes: int = 0      # bytes of all weights resident on this rank
    pp_rank: int = 0
    kv_shard: KVShard | None = None   # P/D instances: its share of the KV cache (and, prefill, its block server)
    generation: int = 0        # the job's re-formations so far (Reform.generation)
    routing: RoutingShape | None = None   # the whole model's MoE routing (every stage's layers): routing replay


class StepOutputs(Message):
    """One step of one DP worker: per request that advanced, only what is new (never the prompt, the
    tokens sent before or text: the front detokenizes). A request that asked for prompt logprobs gets
    them once, in its first delta (`PromptLogprobs`: lists of numbers)."""

    rank: int
    dp_rank: int
    deltas: list[TokenDelta]
    stats: WorkerStats
    sent_at: float = 0.0       # the rank's wall clock when it sent these (the front's latency accounting)
    cache_events: PrefixCacheEvents | None = None   # the prefix cache's changes since the last report (routing)


class KVImported(Message):
    """Decode instance: this rank's pull of an import ended (every rank of the worker sends one)."""

    rank: int
    request_id: str
    error: str | None = None   # None: its KV is in place
    num_bytes: int = 0
    seconds: float = 0.0
    recomputable: bool = False  # after an error: the decode side may compute the prompt itself instead (a failed
                                # transfer, not a failed grammar)


class ExpertLoadTables(msgspec.Struct, kw_only=True):
    """`load_balancer.ExpertLoadSnapshot` as lists (see its `to_dict` / `from_dict`)."""

    counts: list[list[int]]          # [L, E]
    totals: list[list[int]]          # [L, E]
    rank_load: list[list[float]]     # [L, W]
    balancedness: list[float]        # [L]
    max_over_mean: list[float]       # [L]
    window: int
    steps: int
    placement: list[list[int]]       # [L, P]


class ExpertLoadReport(Message):
    tables: ExpertLoadTables | None  # one pipeline stage, summed over its ranks; None without MoE layers
    stage: int = 0


class RebalanceReport(Message):
    event: RebalanceEvent      # merged over the pipeline stages; its index counts the rebalances before it


class AdminDone(Message):
    """One rank's answer to UpdateWeights, InitWeightUpdateGroup, SleepEngine or WakeUpEngine (every rank sends one)."""

    rank: int
    update_id: int
    error: str | None = None
    broken: bool = False                 # failed while writing: the weights are mixed (engine/weight_updates.py)
    tensors: int = 0                     # tensors this rank loaded
    complete: bool = False               # the update carried every tensor of the model: none is left from before
    memory: ResidentMemory | None = None
    checksums: list[SlotChecksum] = []


class WorkerFailed(Message):
    rank: int
    error: str
    traceback: str = ""
    generation: int = 0          # the job's generation it failed in (a failure of an earlier one is stale)
    awaiting_reform: bool = False   # alive, out of its process groups, waiting for Reform or Shutdown


Report = Union[WorkerReady, StepOutputs, ExpertLoadReport, RebalanceReport, WorkerFailed, KVImported, AdminDone]


class MessageCodec:
    """msgpack encoding of messages, and one decoder per direction that accepts only that direction's types."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_front = msgspec.msgpack.Decoder(Union[Hello, Report])
        on_wire = tuple(AddRequestOnWire if command is AddRequest else command for command in Command.__args__)
        self._to_rank = msgspec.msgpack.Decoder(Union[(WorkerSetup,) + on_wire])

    def encode(self, message: Message) -> bytes:
        if isinstance(message, AddRequest):
            message = AddRequestOnWire(**(msgspec.structs.asdict(message) | {"params": params_to_wire(message.params)}))
        return self._encoder.encode(message)

    def decode_to_front(self, payload: bytes) -> Message:
        """Raises msgspec.DecodeError / ValidationError on anything that is not a rank's message."""
        return self._to_front.decode(payload)

    def decode_to_rank(self, payload: bytes) -> Message:
        message = self._to_rank.decode(payload)
        if isinstance(message, AddRequestOnWire):
            message = AddRequest(**(msgspec.structs.asdict(message) | {"params": params_from_wire(message.params)}))
        return message
