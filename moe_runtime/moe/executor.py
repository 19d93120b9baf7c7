"""The MoE executor of one rank: logical top-k choices -> placement -> dispatch -> experts -> combine.

Every MoE layer of the model goes through it, on one rank as on many:
- registration: each MoE layer asks which logical experts this rank's slots hold before any
  rebalance (`local_expert_ids`), builds its `ExpertWeights` and registers them
  (`register_layer`, which returns the layer's row in the placement); once the model is built,
  `finish_registration` makes the placement over all registered layers, the load recorder and one
  `ModularMoE` (dispatcher x expert kernel) per step phase. No scan of the model finds layers.
- a step (`run`, the one forward of eager and captured steps): this rank's attention-TP share of
  the rows (`TokenShare`), the router's logical ids made physical slots through the `ReplicaTable`
  of this rank (built once per placement, on the step's device), the load recorder, then the
  step's `MoECore` called plainly, and the share gathered back. The core is the phase's
  `ModularMoE`; inside a captured step (torch.compiler.is_compiling(), asked in `run` and nowhere
  else here) it is the captured phase's (`_build_cores`: the pair kernel on one rank) and no wall
  clock is read. The routing record is never armed in a captured step (the runner runs a step that
  records or forces routing eagerly). `stages` is the same as a staged computation
  (moe_runtime/moe/stages.py) that yields while dispatch and combine are in flight, for two-batch
  overlap only: the model runs two micro-batches through it interleaved when `two_batch_overlap`
  is on.
- rebalancing: the live rebalancer sees the executor as `load_balancer.live_rebalancer.
  BalancedExperts`: the placement in force, the recorder, each layer's `ExpertStore` (its
  `ExpertWeights`) and `set_placement`.

Models know nothing of this: they hand their top-k to `run`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from moe_runtime.dispatch.base import LAYOUT_CONTIGUOUS, Dispatcher
from moe_runtime.dispatch.backends import BACKEND_LOCAL, PHASE_DECODE, PHASE_PREFILL
from moe_runtime.dispatch.config import DispatchConfig
from moe_runtime.dispatch.deepep import DEFAULT_DEEPEP_MODULE
from moe_runtime.dispatch.factory import backend_for, make_phase_dispatchers
from moe_runtime.kernels import KernelSet, TopK
from moe_runtime.kernels.kernel_set import cpu_kernels
from moe_runtime.load_balancer.placement import Placement, static_placement
from moe_runtime.load_balancer.recorder import ExpertLoadRecorder
from moe_runtime.load_balancer.replica_choice import ReplicaTable, choose_replicas, replica_tables
from moe_runtime.load_balancer.slot_geometry import SlotGeometry
from moe_runtime.load_balancer.survivor_placement import SlotReload, survivor_placement
from moe_runtime.config.engine_config import HOST_EXPERT_QUANTIZATIONS, EngineConfig, EngineConfigError
from moe_runtime.moe.device_resident_experts import DeviceResidentExperts, hottest_slots
from moe_runtime.moe.host_experts import HOST, HostExpertKernel
from moe_runtime.moe.expert_kernel import expert_kernel_for
from moe_runtime.moe.comm_timeline import CommTimeline
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.moe.modular_moe import Alongside, MoECore, ModularMoE
from moe_runtime.moe.pair_moe import PairMoE
from moe_runtime.moe.routing_record import StepRouting
from moe_runtime.moe.stages import Staged
from moe_runtime.moe.token_share import TokenShare
from moe_runtime.config.parallel_context import ParallelContext

PHASES = (PHASE_PREFILL, PHASE_DECODE)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutedRows:
    """The rows of a step this rank dispatches (its attention-TP share, `TokenShare`) and where they go."""

    x: torch.Tensor         # [T', H]
    slots: torch.Tensor     # [T', K] physical slots (replicas chosen)
    weights: torch.Tensor   # [T', K]


class MoEExecutor:
    def __init__(self, kernels: KernelSet, parallel: ParallelContext, *, backend: str, num_redundant_experts: int,
                 hidden_size: int, dtype: torch.dtype, record_load: bool, record_window: int = 128,
                 decode_max_tokens: int | None = None, fp8_activations: bool = False,
                 two_batch_overlap: bool = False, deepep_module: str = DEFAULT_DEEPEP_MODULE,
                 cpu_experts: bool = False, device_resident_experts: int = 0):
        self.kernels = kernels
        self.parallel = parallel
        self.backend = backend
        self.num_redundant_experts = num_redundant_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.record_load = record_load
        self.record_window = record_window
        self.decode_max_tokens = decode_max_tokens  # a decode step's tokens per rank, drafts in (DeepEP low latency)
        self.fp8_activations = fp8_activations      # dispatch sends FP8 values + per-128-column scales
        self.deepep_module = deepep_module          # the module whose Buffer is DeepEP's
        # Each step runs as two micro-batches whose dispatch/combine overlap the other's compute (the same
        # on every rank of the job: their collectives must pair up). A plain setting, read every step.
        self.two_batch_overlap = two_batch_overlap
        # --cpu-experts: routed experts in host memory, run by the CPU kernels on a worker thread
        # (moe/host_experts.py); the `device_resident_experts` hottest slots of each layer keep a device copy
        self.cpu_experts = cpu_experts
        self.device_resident_experts = device_resident_experts
        self._resident: list[DeviceResidentExperts] = []   # by MoE layer, with device-resident experts
        self._host_kernel: HostExpertKernel | None = None
        self.num_experts: int | None = None         # logical experts per MoE layer (the same in every layer)
        self.placement: Placement | None = None     # in force; None until registration ends, or without MoE layers
        self.recorder: ExpertLoadRecorder | None = None
        self.phase = PHASE_PREFILL
        self._experts: list[ExpertWeights] = []     # by MoE layer (placement row)
        self._tables: list[ReplicaTable] = []       # this rank's, by MoE layer, on the step's device
        self._by_phase: dict[str, ModularMoE] = {}
        self._captured_core: MoECore | None = None  # a captured step's, where not the phase's (`_build_cores`)
        self._share = TokenShare(parallel.attn_tp_size, parallel.attn_tp_rank, parallel.attn_tp_group)
        self._registration_open = True
        self._phase_agreement: bool | None = None   # needs_phase_agreement's answer, once asked
        # routing replay: armed by the runner for one forward when a sequence of it records or forces routing
        self.routing: StepRouting | None = None

    @classmethod
    def for_engine(cls, config: EngineConfig, parallel: ParallelContext, kernels: KernelSet, hidden_size: int,
                   dtype: torch.dtype) -> "MoEExecutor":
        """The executor an engine rank runs. One EP rank dispatches locally whatever backend was asked; the
        load is recorded where ranks report it to a front (a multi-rank job), not on a single-rank engine."""
        return cls(kernels, parallel, backend=config.a2a_backend if parallel.ep_size > 1 else BACKEND_LOCAL,
                   num_redundant_experts=config.num_redundant_experts, hidden_size=hidden_size, dtype=dtype,
                   record_load=parallel.world_size > 1 or config.device_resident_experts > 0,
                   record_window=config.eplb_window,
                   decode_max_tokens=config.decode_max_tokens,
                   fp8_activations=config.dispatch_fp8 and parallel.ep_size > 1,
                   two_batch_overlap=config.enable_two_batch_overlap, deepep_module=config.deepep_module,
                   cpu_experts=config.cpu_experts, device_resident_experts=config.device_resident_experts)

    # ---- registration (model construction) ------------------------------------------------------------
    def _geometry(self, num_experts: int) -> SlotGeometry:
        return SlotGeometry(num_experts + self.num_redundant_experts, self.parallel.ep_size)

    def local_expert_ids(self, num_experts: int) -> list[int]:
        """The logical experts this rank's slots hold before any rebalance (the static placement)."""
        geometry = self._geometry(num_experts)
        template = static_placement(1, num_experts, geometry.num_slots, geometry.num_ranks).phy2log[0]  # [P]
        return template[list(geometry.rank_slots(self.parallel.ep_rank))].tolist()

    def routed_expert_device(self, device: torch.device | str | None) -> torch.device | str | None:
        """Where a layer's routed experts are held: host memory with --cpu-experts, else the layer's device."""
        return HOST if self.cpu_experts else device

    def register_layer(self, experts: ExpertWeights, num_experts: int) -> int:
        """Add one MoE layer, whose routed experts on this rank are `experts`; returns its MoE layer index
        (its row in the placement and in the load tables). Layers register in model order."""
        if not self._registration_open:
            raise RuntimeError("MoE layers register while the model is built, before finish_registration()")
        if self.num_experts not in (None, num_experts):
            raise ValueError(f"MoE layers disagree on the expert count ({self.num_experts} vs {num_experts})")
        self.num_experts = num_experts
        self._experts.append(experts)
        return len(self._experts) - 1

    def finish_registration(self) -> None:
        """After the model is built: the placement over every registered layer, the recorder, the dispatchers."""
        self._registration_open = False
        if not self._experts:  # a dense model, or a pipeline stage without MoE layers
            return
        p = self.parallel
        geometry = self._geometry(self.num_experts)
        placement = static_placement(len(self._experts), self.num_experts, geometry.num_slots, geometry.num_ranks)
        if self.record_load:
            self.recorder = ExpertLoadRecorder(placement.num_layers, self.num_experts, geometry.num_slots,
                                               geometry.num_ranks, window=self.record_window, device=p.device,
                                               placement=placement)
        self.set_placement(placement)
        dispatchers = make_phase_dispatchers(self._dispatch_config(geometry))
        if self.cpu_experts:
            self._start_host_experts(dispatchers)
        self._build_cores(dispatchers)
        if self.two_batch_overlap:
            cannot = sorted({moe.dispatcher.__class__.__name__ for moe in self._by_phase.values()
                             if not moe.dispatcher.supports_async()})
            if cannot:
                logger.info("two-batch overlap: %s cannot overlap its transfers; the micro-batches run the same "
                            "schedule synchronously", ", ".join(cannot))

    def _build_cores(self, dispatchers: dict[str, Dispatcher]) -> None:
        """One `ModularMoE` per step phase (a new one keeps the old one's timeline), and the captured step's core.
        One rank: the pair kernel (`PairMoE`; the local dispatcher's grouping has data-dependent sizes). Several:
        none of its own, the phase's `ModularMoE`, whose dispatcher a capture needs to be DeepEP's low-latency one
        (fixed shapes, counts on the device, its calls traced as operators: moe_runtime/dispatch/deepep_ops.py)."""
        timeline = next((moe.timeline for moe in self._by_phase.values()), None)
        for phase, dispatcher in dispatchers.items():
            kernel = self._host_kernel or expert_kernel_for(dispatcher.layout(), self.kernels)
            self._by_phase[phase] = ModularMoE(dispatcher, kernel)
            self._by_phase[phase].timeline = timeline
        self._captured_core = PairMoE(self.kernels.pair_expert_mlp) if self.parallel.ep_size == 1 else None

    def _start_host_experts(self, dispatchers: dict) -> None:
        """--cpu-experts: one host expert kernel for every phase; the device copies of the hot slots."""
        masked = sorted({d.__class__.__name__ for d in dispatchers.values() if d.layout() != LAYOUT_CONTIGUOUS})
        if masked:
            raise EngineConfigError(f"--cpu-experts: {', '.join(masked)} hands the experts a masked layout, which "
                                    "the host expert kernel does not take; use --a2a-backend all_to_all or allgather")
        quant = self._experts[0].quant   # the checkpoint's own format (an MXFP4 one) as well as --quantization's
        if quant is not None and quant.name not in HOST_EXPERT_QUANTIZATIONS:
            raise EngineConfigError(f"--cpu-experts with {quant.name} experts: the host expert kernels run float32, "
                                    "bfloat16, int8 and FP8 experts")
        self._host_kernel = HostExpertKernel(cpu_kernels(), expert_kernel_for(LAYOUT_CONTIGUOUS, self.kernels))
        if self.device_resident_experts > self._experts[0].num_local_experts:
            raise EngineConfigError(f"--device-resident-experts {self.device_resident_experts}: this rank holds "
                                    f"{self._experts[0].num_local_experts} routed experts per MoE layer; choose at "
                                    "most that many (or 0 for none)")
        if self.device_resident_experts:
            for experts in self._experts:
                copies = DeviceResidentExperts(experts, self.device_resident_experts, self.parallel.device)
                self._resident.append(copies)
                self._host_kernel.keep_on_device(copies)

    def _dispatch_config(self, geometry: SlotGeometry, phase: str | None = None) -> DispatchConfig:
        """This rank's dispatch settings; `max_tokens_per_rank` bounds decode steps (DeepEP low-latency)."""
        p = self.parallel
        return DispatchConfig(backend=self.backend, slots=geometry, rank=p.ep_rank, group=p.ep_group,
                              hidden_size=self.hidden_size, dtype=self.dtype, device=p.device, phase=phase,
                              max_tokens_per_rank=self.decode_max_tokens, fp8_activations=self.fp8_activations,
                              deepep_module=self.deepep_module)

    @property
    def num_moe_layers(self) -> int:
        return len(self._experts)

    # ---- the placement in force (load_balancer.live_rebalancer.BalancedExperts) -------------------------
    def set_placement(self, placement: Placement) -> None:
        """Switch to `placement`, whose expert weights are already in place on every rank: this rank's replica
        tables are built here, once per placement, on the step's device."""
        if tuple(placement.phy2log.shape) != (self.num_moe_layers, self._geometry(self.num_experts).num_slots):
            raise ValueError(f"placement.phy2log {tuple(placement.phy2log.shape)} does not match this executor's "
                             f"{self.num_moe_layers} MoE layers of {self._geometry(self.num_experts).num_slots} slots")
        mine = list(placement.geometry.rank_slots(self.parallel.ep_rank))
        for moe_layer, experts in enumerate(self._experts):
            if placement.phy2log[moe_layer, mine].tolist() != experts.expert_ids:
                raise RuntimeError(f"MoE layer {moe_layer}: this rank's slots hold experts {experts.expert_ids}, the "
                                   f"placement says {placement.phy2log[moe_layer, mine].tolist()}")
        self.placement = placement
        self._tables = replica_tables(placement, self.parallel.ep_rank, self.parallel.device)
        if self.recorder is not None:
            self.recorder.set_placement(placement)
        for copies in self._resident:   # migrations wrote new experts into host slots: retake the device copies
            copies.stale = True

    @property
    def host_kernel(self) -> HostExpertKernel | None:
        """The expert kernel of --cpu-experts (None without it)."""
        return self._host_kernel

    # ---- a lost rank (moe_runtime/processes/reform.py) ---------------------------------------------------------
    def reform(self, parallel: ParallelContext, backend: str, num_nodes: int = 1) -> list[SlotReload]:
        """Go on over the surviving ranks' new groups (every survivor calls this at once): the survivors' slots
        keep their experts, each expert no survivor holds is loaded from the checkpoint into a reclaimed slot
        (moe_runtime/load_balancer/survivor_placement.py), and the dispatchers, replica tables and load recorder are made anew
        for the smaller job. Raises `ExpertsLost` when the survivors cannot hold every expert. Returns the reloads
        of every rank (this rank loaded its own)."""
        self.parallel = parallel
        self.backend = backend if parallel.ep_size > 1 else BACKEND_LOCAL
        self.fp8_activations = self.fp8_activations and parallel.ep_size > 1
        self._share = TokenShare(parallel.attn_tp_size, parallel.attn_tp_rank, parallel.attn_tp_group)
        self._phase_agreement = None
        for experts in self._experts:
            experts.discard()   # a migration the loss interrupted
        if not self._experts:
            return []
        mine = torch.tensor([experts.expert_ids for experts in self._experts], dtype=torch.long)   # [L, S]
        gathered = [torch.empty_like(mine) for _ in range(parallel.ep_size)]
        torch.distributed.all_gather(gathered, mine, group=parallel.ep_control_group)
        # the same load on every member (summed over them: a replacement has none yet, and the members' slot
        # counts differ in shape), so that each plans the same placement
        load = (self.recorder.snapshot().counts.float() if self.recorder is not None
                else torch.zeros(len(self._experts), self.num_experts))                                # [L, E]
        torch.distributed.all_reduce(load, group=parallel.ep_control_group)
        survivors = survivor_placement(torch.cat(gathered, dim=1), self.num_experts, parallel.ep_size, num_nodes,
                                       load)
        placement = survivors.placement
        geometry = placement.geometry
        for reload in survivors.reloads:
            if geometry.rank_of_slot(reload.slot) == parallel.ep_rank:
                self._experts[reload.layer].reload_slot(geometry.local_index(reload.slot), reload.expert)
        self.num_redundant_experts = placement.num_slots - self.num_experts
        if self.record_load:
            self.recorder = ExpertLoadRecorder(placement.num_layers, self.num_experts, placement.num_slots,
                                               placement.num_ranks, window=self.record_window, device=parallel.device,
                                               placement=placement)
        self.set_placement(placement)
        self._build_cores(make_phase_dispatchers(self._dispatch_config(geometry)))
        return survivors.reloads

    def expert_store(self, moe_layer: int) -> ExpertWeights:
        return self._experts[moe_layer]

    def weights_changed(self) -> None:
        """The experts' weights were replaced in place (a weight update, a reload after sleep): device-resident
        copies (`--device-resident-experts`) are taken again before the next step."""
        for copies in self._resident:
            copies.stale = True

    # ---- steps ------------------------------------------------------------------------------------------
    def begin_step(self, phase: str) -> None:
        """Every rank must use the same backend in a step: the engine passes the agreed phase."""
        self.phase = phase
        for copies in self._resident:
            copies.sync()
        if phase in self._by_phase:
            self._by_phase[phase].dispatcher.begin_step()

    def end_step(self) -> None:
        if self.recorder is not None:
            self.recorder.end_step()
            if self._resident and self.recorder.steps % self.record_window == 0:
                self._choose_resident()

    def _choose_resident(self) -> None:
        """Each layer's device copies follow its hottest local slots over the recorder's window (this rank's
        routing counts: no collective); the copies are retaken at the next step's start."""
        window_load = self.recorder.window_steps().sum(0)                          # [L, E] logical experts
        for moe_layer, copies in enumerate(self._resident):
            slot_load = window_load[moe_layer, copies.host.expert_ids]             # [E_local]
            copies.choose(hottest_slots(slot_load, len(copies.slots)))

    @property
    def device_copies(self) -> list[DeviceResidentExperts]:
        """Per MoE layer, its device-resident copies (--device-resident-experts; [] without)."""
        return list(self._resident)

    def device_resident(self) -> list[list[int]]:
        """Per MoE layer, the logical experts whose copies run on the device (--device-resident-experts); []
        per layer when every routed expert runs where it is held."""
        if not self._resident:
            return [[] for _ in self._experts]
        return [copies.resident_experts() for copies in self._resident]

    def needs_phase_agreement(self) -> bool:
        """True when prefill and decode steps use different backends (DeepEP normal vs low-latency). Asked every
        step, answered once: the backends follow from settings that do not change."""
        if self._phase_agreement is None:
            # the same on every rank (a pipeline stage without MoE layers too: the vote is one collective)
            config = self._dispatch_config(SlotGeometry(self.parallel.ep_size, self.parallel.ep_size))
            self._phase_agreement = len({backend_for(config, phase).backend for phase in PHASES}) > 1
        return self._phase_agreement

    def overlaps_micro_batches(self) -> bool:
        """Whether the model should split this step into two overlapped micro-batches: two-batch overlap is on
        and this rank (so its whole pipeline stage, whose ranks hold the same layers) has MoE layers."""
        return self.two_batch_overlap and bool(self._experts)

    def run(self, moe_layer: int, x: torch.Tensor, topk: TopK,
            alongside: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """The layer's routed experts: the one forward of eager and captured steps. `alongside` is the block's work
        that does not wait for them (its shared experts): it runs while they compute on the host (--cpu-experts),
        else after them, and its output [T, H] is added to theirs."""
        captured = torch.compiler.is_compiling()
        routed = self._routed_rows(moe_layer, x, topk)
        core = self._captured_core if captured and self._captured_core is not None else self._by_phase[self.phase]
        beside = Alongside(alongside)
        y_share = core(routed.x, routed.slots, routed.weights, self._experts[moe_layer], beside,
                       timed=not captured)                                                   # [T', H]
        return beside.added_to(self._share.gather(y_share, x.shape[0]))

    def stages(self, moe_layer: int, x: torch.Tensor, topk: TopK,
               alongside: Callable[[], torch.Tensor | None] | None = None) -> Staged[torch.Tensor]:  # [T, H]
        """`run` for two-batch overlap only: it yields while this layer's dispatch and combine are in flight."""
        routed = self._routed_rows(moe_layer, x, topk)
        beside = Alongside(alongside)
        y_share = yield from self._by_phase[self.phase].stages(routed.x, routed.slots, routed.weights,
                                                               self._experts[moe_layer], beside)   # [T', H]
        return beside.added_to(self._share.gather(y_share, x.shape[0]))

    def _routed_rows(self, moe_layer: int, x: torch.Tensor, topk: TopK) -> "RoutedRows":
        """This rank's share of the rows and their physical slots; the routing record (when armed) and the load
        recorder see them here."""
        if self.routing is not None:   # the logical ids, before replicas: every rank of an attention-TP group alike
            self.routing.record(moe_layer, topk.ids)
        rows = self._share.rows(x.shape[0])
        ids, weights = topk.ids[rows], topk.weights[rows]                        # [T', K]
        slots = choose_replicas(ids, self._tables[moe_layer])                    # [T', K]
        if self.recorder is not None:
            self.recorder.record(moe_layer, ids, slots)
        return RoutedRows(x[rows], slots, weights)

    def trace_comm(self, timeline: CommTimeline | None) -> None:
        """Record every dispatch's and combine's per-phase timestamps into `timeline` (None: stop)."""
        for moe in self._by_phase.values():
            moe.timeline = timeline

    # ---- what the engine reports ---------------------------------------------------------------------------
    @property
    def comm_seconds(self) -> float:
        """Cumulative wall time in dispatch + combine."""
        return sum(moe.comm_seconds for moe in self._by_phase.values())

    def resident_expert_bytes(self) -> tuple[int, int]:
        """(bytes of routed-expert weights on this rank, bytes of all routed experts of these layers)."""
        local = sum(experts.resident_bytes() for experts in self._experts)
        total = sum(experts.resident_bytes() // max(experts.num_local_experts, 1) * self.num_experts
                    for experts in self._experts)
        return local, total
