"""A captured decode step: `torch.compile` over the whole forward + LM head of a pure decode batch.

Eager decode on CPU spends a third of a step outside kernels (about 5400 operator calls per step of
the 8-layer bench model, each a Python call and a dispatcher trip) and runs the routed experts through
grouped kernels whose sizes depend on the routing. The capture removes both (SGLang's
`--enable-torch-compile`, vLLM's compiled decode):

- **Static shapes.** A step whose sequences all decode one token (and sample it) is padded to the next
  batch bucket (1, 2, 4, ... `max_batch`): pad rows read nothing (context length 0) and write their K/V
  to a scratch block the block manager never hands out. The block-table width is the one dynamic
  dimension (marked so, at least 2 columns so 1 is never specialized): one graph per batch bucket.
- **No data-dependent sizes inside.** Attention sees `AttentionBatch.static_decode` and goes straight
  to the paged decode kernel, which attends to the table's full width instead of reading the longest
  context off the device (a sliding or chunked layer's rows start at their first key, computed in the
  graph from the context lengths: `AttentionBatch.decode_key_starts`); the MoE executor computes routed
  experts as per-(token, expert) GEMVs (moe_runtime/kernels/pair_experts.py), which inductor fuses into loops
  streaming each chosen expert's weights.
- **Whole step, no graph breaks** (`fullgraph=True`): the layers' plain `forward` (not the staged
  generators of two-batch overlap) from embedding to logits.
- **The next step's inputs too**: the tokens it drew, positions and context lengths one more, the next slots
  (`_next_inputs`), which a steady batch's next step takes instead of the host's preparation
  (moe_runtime/execution/decode_carry.py).

On the CPU the bucket's graph runs, by default, as an AOTInductor library (moe_runtime/execution/aot_step.py:
exported once, compiled once and cached on disk, no dynamo frame or Python wrapper in the step: 0.75-0.82x the
step time of inductor's C++ wrapper behind dynamo, docs/benchmarks.md); `torch_compile_wrapper` "cpp" keeps dynamo
with inductor's C++ wrapper, "python" its Python wrapper. The cpu kernel family's compiled kernels are operators
inside the graph either way (moe_runtime/kernels/cpu_native/custom_ops.py).

On CUDA the compiled graph is also replayed as a CUDA graph (inductor's `mode="reduce-overhead"`, its
CUDA-graph trees; what vLLM and SGLang capture at start-up): one launch per step instead of one per
kernel. A CUDA graph fixes every address and shape it was recorded with, so there the block table
always has the model's full width (`CaptureSettings.table_width`: the Triton decode kernel loops only
over each row's own context, so unused columns cost nothing) and the KV caches are marked static
addresses (written in place, never copied into the graph's input buffers). On CPU the width stays
dynamic: the torch decode kernel attends to the whole table under capture, so a narrow one is cheaper.

**Verify steps** (speculative decoding) are captured too: a sequence verifying d drafts computes 1 + d rows, all
of them logits rows, and each row is a single query at its own position, attending to the sequence's table up
to itself. The layers write every row's K/V before they attend, so the step runs as a decode step of
sum(1 + d) rows (each row its sequence's table and its own context length, pad rows as above) through the
same graphs, bucketed by rows. On one rank the captured MoE ignores the phase (per-(token, expert) GEMVs);
under expert parallelism a verify step is a decode-phase step (`ScheduledBatch.phase`): its rows go through
DeepEP's low-latency dispatch like any decode step's, within the decode bound that counts the drafts
(`EngineConfig.decode_max_tokens`, which also caps the largest bucket), so a DP worker verifying drafts, one
plain-decoding and an idle one run the same collectives in the same step.

Where capture cannot run it says so once and the engine decodes eagerly: no C++ compiler for
inductor's CPU backend, or a compile that fails. What cannot be captured at all (several ranks, kept
quantized weights) is refused when the engine is configured (`EngineConfig.validate_torch_compile`).
Mixed steps (prefill chunks beside decodes) always run eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moe_runtime.dispatch.backends import PHASE_DECODE
from moe_runtime.execution.aot_step import AotBucket, compile_bucket
from moe_runtime.execution.decode_carry import PaddedStep
from moe_runtime.layers.attention_batch import AttentionBatch
from moe_runtime.layers.kv_cache import LayerKVCache
from moe_runtime.sampling.graph_sampling import GraphSampling, GraphSamplingKind, sample_in_graph
from moe_runtime.sampling.prompt_logprobs import prompt_logprobs_due
from moe_runtime.sampling.sampling_row import SamplingRow
from moe_runtime.records.sequence import Sequence
from moe_runtime.execution.step_inputs import StepInputs

if TYPE_CHECKING:   # the runner owns the capture and hands it its prepared inputs
    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.models.decoder import CausalLM

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 2   # block-table columns a captured step always has (dynamo specializes a dimension of 1)
# Graphs dynamo keeps for the traced function. It counts per code object, i.e. over every engine in the process
# (each traces its own model): its default of 8 would stop the ninth engine's capture, or one engine's ninth bucket.
RECOMPILE_LIMIT = 64
WRAPPERS = ("aot", "cpp", "python")   # what runs inductor's graph on the CPU (CaptureSettings.for_device)


@dataclass(frozen=True)
class CaptureSettings:
    """`EngineConfig.enable_torch_compile` and its knobs, as the model runner gets them."""

    max_batch: int = 32             # --torch-compile-max-bs: the largest bucket; bigger decode steps run eagerly
    backend: str = "inductor"       # torch.compile backend ("eager" / "aot_eager" trace without generating code)
    table_width: int | None = None  # block-table columns of every captured step (None: dynamic, the step's own)
    cuda_graphs: bool = False       # replay the compiled graph as a CUDA graph (inductor's "reduce-overhead")
    cpp_wrapper: bool = False       # inductor's C++ wrapper: the graph's kernel and extern calls from C++, no Python
    aot: bool = False               # AOTInductor: one library per bucket, cached on disk (execution/aot_step.py)

    @classmethod
    def for_device(cls, device: torch.device, max_batch: int, backend: str, max_model_len: int,
                   block_size: int, wrapper: str = "aot") -> "CaptureSettings":
        """CUDA replays CUDA graphs, which need one table width for good: the widest a sequence can have. On the CPU
        inductor's graph runs through `wrapper`: "python" (dynamo and inductor's Python wrapper), "cpp" (its C++
        wrapper) or "aot" (AOTInductor's library, no Python in the step)."""
        if wrapper not in WRAPPERS:
            raise ValueError(f"torch_compile_wrapper {wrapper!r}: one of {', '.join(WRAPPERS)}")
        if device.type != "cuda":
            inductor = backend == "inductor"
            return cls(max_batch=max_batch, backend=backend, cpp_wrapper=inductor and wrapper in ("cpp", "aot"),
                       aot=inductor and wrapper == "aot")
        width = max(-(-max_model_len // block_size), MIN_TABLE_WIDTH)
        return cls(max_batch=max_batch, backend=backend, table_width=width, cuda_graphs=backend == "inductor")

    @classmethod
    def for_engine(cls, config: "EngineConfig", device: torch.device, max_model_len: int) -> "CaptureSettings | None":
        """The decode capture of `--enable-torch-compile` (None: off); the config refused layouts it cannot
        capture (`EngineConfig.validate_torch_compile`). Its largest bucket stays within the decode bound (a padded
        step's rows go through DeepEP's low-latency dispatch under expert parallelism)."""
        if not config.enable_torch_compile:
            return None
        largest = min(config.torch_compile_max_bs, config.decode_max_tokens)
        return cls.for_device(device, max_batch=largest, backend=config.torch_compile_backend,
                              max_model_len=max_model_len, block_size=config.block_size,
                              wrapper=config.torch_compile_wrapper)

    def compile_mode(self) -> str | None:
        """torch.compile's `mode` (only inductor takes one)."""
        return "reduce-overhead" if self.cuda_graphs else None

    def compile_options(self) -> dict | None:
        """inductor's config for the step's graphs (torch.compile's `options`; a `mode` excludes them)."""
        return {"cpp_wrapper": True} if self.cpp_wrapper else None

    def buckets(self) -> list[int]:
        """Batch sizes a decode step is padded to: powers of two up to `max_batch`, and `max_batch` itself."""
        sizes, size = [], 1
        while size < self.max_batch:
            sizes.append(size)
            size *= 2
        return sizes + [self.max_batch]


@dataclass
class CaptureStats:
    """What the capture did, for tests, benchmarks and the log."""

    captured_steps: int = 0                          # decode steps run through a compiled graph
    captured_verify_steps: int = 0                   # ... of which verified drafts (speculative decoding)
    eager_steps: int = 0                             # steps run eagerly (prefill, mixed, too large, fallback)
    buckets_compiled: list[int] = field(default_factory=list)  # batch buckets whose first step compiled
    graphs_compiled: list[tuple[int, str]] = field(default_factory=list)  # (bucket, GraphSamplingKind value) compiled
    graph_sampled_steps: int = 0                     # captured steps whose tokens the graph drew (graph_sampling.py)
    carried_steps: int = 0                           # ... whose inputs the previous step's graph computed
    buckets_loaded: list[int] = field(default_factory=list)    # ... of which AOT libraries found on disk, not built
    disabled_reason: str | None = None               # set when capture gave up; every step then runs eagerly

    @staticmethod
    def worker_fields(capture: "DecodeCapture | None") -> dict:
        """The `WorkerStats` fields (none without a capture: the defaults, 0)."""
        if capture is None:
            return {}
        return {"captured_decode_steps": capture.stats.captured_steps,
                "captured_verify_steps": capture.stats.captured_verify_steps,
                "carried_decode_steps": capture.stats.carried_steps}


def cpu_compiler_missing() -> str | None:
    """Why inductor's CPU backend cannot build kernels here (None: a C++ compiler was found)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:   # a torch without this helper: let the compile itself find out
        return None
    try:
        get_cpp_compiler()
    except Exception as missing:   # inductor raises its own InvalidCxxCompiler
        return f"no C++ compiler for torch.compile's CPU backend ({missing.__class__.__name__}: set CXX or install g++)"
    return None


@dataclass
class CapturedStep:
    logits: torch.Tensor           # [R, V] fp32
    hidden: torch.Tensor           # [R, H'] what a drafter reads (`CausalLM.drafter_hidden`): the final hidden
                                   # states [R, H], or the EAGLE-3 aux layers' inputs [R, 3H]
    sampled: torch.Tensor | None = None   # [2, R] int64 each row's token and DrawStatus, when the graph sampled
    carry: PaddedStep | None = None       # ... and the next step's inputs it computed, padded (decode_carry.py)

    def copied(self) -> "CapturedStep":
        carry = self.carry
        if carry is not None:
            carry = carry.advanced((carry.input_ids.clone(), carry.positions.clone(), carry.slot_mapping.clone(),
                                    carry.context_lens.clone()))
        return CapturedStep(self.logits.clone(), self.hidden.clone(),
                            None if self.sampled is None else self.sampled.clone(), carry)


class DecodeCapture:
    """Runs pure decode steps of one rank's model through one compiled graph per batch bucket."""

    def __init__(self, model: CausalLM, caches: list[LayerKVCache], block_size: int, scratch_block: int,
                 device: torch.device, settings: CaptureSettings):
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size   # where pad rows write their K/V
        self.settings = settings
        self.buckets = settings.buckets()
        self.stats = CaptureStats()
        if settings.backend == "inductor" and device.type == "cpu":
            self._disable(cpu_compiler_missing())
        if settings.cuda_graphs:   # written in place by every step: the graphs must see the caches themselves
            for cache in caches:
                for tensor in (cache.keys, cache.values):
                    if tensor is not None:
                        torch._dynamo.mark_static_address(tensor)
        self._aot: dict[tuple[int, GraphSamplingKind], AotBucket] = {}   # settings.aot: each bucket's libraries
        self._compiled = torch.compile(self._decode_step, backend=settings.backend, mode=settings.compile_mode(),
                                       options=settings.compile_options(), fullgraph=True, dynamic=False)
        if self.stats.disabled_reason is None:   # what the start-up log says is captured (/metrics counts it)
            logger.info("captured decode: pure decode steps of up to %d rows (buckets %s, backend %s%s) run as one "
                        "graph; prefill and mixed steps run eagerly", self.buckets[-1], self.buckets,
                        settings.backend, ", CUDA graphs" if settings.cuda_graphs else
                        ", C++ wrapper" if settings.cpp_wrapper else "")

    def covers(self, seqs: list[Sequence]) -> bool:
        """Whether this step is a decode step the capture runs: every sequence computes and samples its last
        token, and its drafts when it verifies some (every row a logits row; no prompt scored), all rows within
        the largest bucket (windowed layers need no limit: their rows' first keys are computed inside the
        graph)."""
        rows = sum(seq.num_scheduled_tokens for seq in seqs)
        if self.stats.disabled_reason is not None or not seqs or rows > self.settings.max_batch:
            return False
        executor = self.model.executor
        # several ranks agreed on prefill (some worker prefills): not the low-latency kernels
        if executor.phase != PHASE_DECODE and executor.parallel.ep_size > 1:
            return False
        for seq in seqs:
            if not seq.samples_this_step or seq.num_scheduled_tokens != seq.logit_rows or prompt_logprobs_due(seq):
                return False
            if self.settings.table_width is not None and seq.num_cached_tokens + seq.num_scheduled_tokens > \
                    self.settings.table_width * self.block_size:
                return False
        return True

    def run(self, seqs: list[Sequence], inputs: StepInputs,
            sampling: list[SamplingRow] | None = None) -> CapturedStep | None:
        """A covered step's (`covers`) drafter rows (`CapturedStep.hidden`) and next-token logits, one row per
        token (one per sequence without drafts), from the runner's prepared `inputs`; None for any other step, which
        the runner then runs eagerly (counted in `stats.eager_steps`). With `sampling` (the step's sequences, one
        row each, whose batch `GraphSampling.refusal` accepts) the graph also draws their tokens
        (`CapturedStep.sampled`)."""
        if not self.covers(seqs):
            self.stats.eager_steps += 1
            return None
        num_rows = inputs.input_ids.shape[0]
        verifying = num_rows > len(seqs)
        bucket = next(size for size in self.buckets if size >= num_rows)
        padded = self._pad(self._single_query_rows(inputs) if verifying else inputs, bucket)
        graph = GraphSampling.of(sampling if sampling is not None and not verifying else [], bucket,
                                 self.model.hf_config.vocab_size, inputs.input_ids.device)
        return self._run(PaddedStep(*padded, graph), num_rows, verifying, sampling is not None and not verifying)

    def run_carried(self, seqs: list[Sequence], step: PaddedStep) -> CapturedStep:
        """A covered step (`covers`) of one token per sequence, sampled in the graph, whose padded inputs the
        previous step's graph computed (`DecodeCarry.take`): no host preparation."""
        self.stats.carried_steps += 1
        return self._run(step, len(seqs), verifying=False, drew=True)

    def _run(self, padded: PaddedStep, num_rows: int, verifying: bool, drew: bool) -> CapturedStep:
        """Run the bucket's graph over `padded` (compiling it on its first step) for the step's `num_rows` rows;
        `drew`: the graph's tokens are the step's (and its next inputs are carried)."""
        bucket, graph = padded.bucket, padded.sampling
        first = (bucket, graph.kind.value) not in self.stats.graphs_compiled
        if first:
            logger.info("compiling the decode step for batch bucket %d, %s sampling (backend %s)", bucket,
                        graph.kind.value, self.settings.backend)
        try:
            if self.settings.cuda_graphs:   # the previous step's outputs are consumed: their memory may be reused
                torch.compiler.cudagraph_mark_step_begin()
            hidden, logits, sampled, *next_inputs = self._step(bucket, graph, padded.tensors(), first)
        except Exception as failure:
            # A compile (first call of a bucket, or a recompile later) that fails must not fail the step: this step
            # and every later one run eagerly. An error of the model itself raises again there.
            self._disable(f"the compiled decode step failed ({failure.__class__.__name__}: {failure})")
            self.stats.eager_steps += 1
            hidden, logits, *_ = self._decode_step(*padded.tensors()[:5])
            return CapturedStep(logits[:num_rows], hidden[:num_rows])
        if first:
            self.stats.graphs_compiled.append((bucket, graph.kind.value))
            if bucket not in self.stats.buckets_compiled:
                self.stats.buckets_compiled.append(bucket)
        self.stats.captured_steps += 1
        self.stats.captured_verify_steps += verifying
        self.stats.graph_sampled_steps += drew
        step = CapturedStep(logits[:num_rows], hidden[:num_rows], sampled[:, :num_rows] if drew else None,
                            padded.advanced(tuple(next_inputs)) if drew else None)
        # A CUDA graph's output lives in its pool and the next replay overwrites it: the caller gets its own copy.
        return step.copied() if self.settings.cuda_graphs else step

    def _step(self, bucket: int, graph: GraphSampling, inputs: tuple[torch.Tensor, ...],
              first: bool) -> tuple[torch.Tensor, ...]:
        """The bucket's compiled step for `graph`'s sampling kind: AOTInductor's library (compiled or loaded on the
        first step of the bucket and kind), or the graph dynamo runs (one per bucket and kind: their inputs differ)."""
        if not self.settings.aot:
            # A bucket's graph, once compiled, is only told apart from the others (other buckets, other engines'
            # graphs of this code) by the guards that differ between them: the full guard check (every weight's
            # shape, dtype and strides, about 1 ms of a 12 ms batch-1 step) runs only on a bucket's first call. A
            # tensor that changed shape behind it still trips the compiled code's own input asserts: that step
            # then reruns eagerly and the capture turns off.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=not first), \
                    torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return self._compiled(*inputs)
        key = (bucket, graph.kind)
        if key not in self._aot:
            self._aot[key] = compile_bucket(self.model, self.caches, self._decode_step, inputs)
            if self._aot[key].cache_hit and bucket not in self.stats.buckets_loaded:
                self.stats.buckets_loaded.append(bucket)
        return self._aot[key].run(*inputs)

    @staticmethod
    def _single_query_rows(inputs: StepInputs) -> StepInputs:
        """A verify step's inputs as one single-query row per token: each row its sequence's block table and its
        own context (its position + 1), so it attends to the sequence's earlier tokens and to the rows before it,
        whose K/V the layer writes first."""
        batch: AttentionBatch = inputs.batch
        per_seq = torch.tensor(batch.query_lens, dtype=torch.long, device=batch.block_tables.device)      # [B]
        rows = AttentionBatch(query_lens=[], context_lens=[], query_start=[0], slot_mapping=batch.slot_mapping,
                              block_tables=batch.block_tables.repeat_interleave(                          # [T, W]
                                  per_seq, dim=0, output_size=inputs.input_ids.shape[0]),
                              context_lens_tensor=(inputs.positions + 1).to(torch.int32),                 # [T]
                              block_size=batch.block_size)
        return StepInputs(inputs.input_ids, inputs.positions, rows, inputs.last_token_index)

    def _pad(self, inputs: StepInputs, bucket: int) -> tuple[torch.Tensor, ...]:
        """The step's tensors padded to `bucket` rows, and the table to `settings.table_width` columns (CUDA) or to at
        least MIN_TABLE_WIDTH (CPU, where the width stays dynamic)."""
        batch: AttentionBatch = inputs.batch
        rows = inputs.input_ids.shape[0]
        extra = bucket - rows
        input_ids = torch.nn.functional.pad(inputs.input_ids, (0, extra))                          # [B]
        positions = torch.nn.functional.pad(inputs.positions, (0, extra))                          # [B]
        slots = torch.nn.functional.pad(batch.slot_mapping, (0, extra), value=self.scratch_slot)  # [B]
        context_lens = torch.nn.functional.pad(batch.context_lens_tensor, (0, extra))             # [B]
        width = batch.block_tables.shape[1]
        width_extra = max(MIN_TABLE_WIDTH - width, 0) if self.settings.table_width is None \
            else self.settings.table_width - width
        tables = torch.nn.functional.pad(batch.block_tables, (0, width_extra, 0, extra), value=-1)  # [B, W]
        if self.settings.table_width is None:
            torch._dynamo.mark_dynamic(tables, 1)
        return input_ids, positions, slots, tables, context_lens

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     *sampling: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The traced step: one new token per row through every layer, then the LM head, then sampling: [B] -> the
        hidden rows a drafter reads (`CausalLM.drafter_hidden`: the final hidden states [B, H] for MTP, the aux
        layers' inputs [B, 3H] for an EAGLE-3 head), the logits [B, V] and each row's token and status [2, B]
        (`sample_in_graph`; `sampling`: the rows' parameters, `GraphSampling.tensors`), then the next step's
        input ids, positions, slots and context lengths [B] (`_next_inputs`)."""
        batch = AttentionBatch(query_lens=[], context_lens=[], query_start=[0], slot_mapping=slot_mapping,
                               block_tables=block_tables, context_lens_tensor=context_lens,
                               block_size=self.block_size, static_decode=True)
        hidden = self.model(input_ids, positions, batch, self.caches)                # [B, H]
        logits = self.model.logits(hidden)                                           # [B, V] fp32
        sampled = sample_in_graph(logits, positions, *sampling)                      # [2, B]
        return (self.model.drafter_hidden(hidden), logits, sampled,
                *self._next_inputs(sampled[0], positions, block_tables, context_lens))

    def _next_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Traced: the inputs of the same rows' next decode step, each computing the token it drew here
        (decode_carry.py): the token, position + 1, context + 1 and that position's slot in the row's table (the
        scratch slot where the table has no block there yet: the host writes the block it gains, and the slot).
        Pad rows (context 0) stay pad rows."""
        live = context_lens > 0                                                      # [B]
        next_positions = torch.where(live, positions + 1, positions)                 # [B]
        column = torch.div(next_positions, self.block_size, rounding_mode="floor")   # [B]
        inside = column < block_tables.shape[1]
        blocks = block_tables.gather(1, column.clamp(max=block_tables.shape[1] - 1).unsqueeze(1)).squeeze(1).long()
        slots = torch.where(live & inside & (blocks >= 0),
                            blocks * self.block_size + next_positions % self.block_size, self.scratch_slot)
        return (torch.where(live, tokens, 0), next_positions, slots,                 # [B] each
                torch.where(live, context_lens + 1, context_lens))

    def _disable(self, reason: str | None) -> None:
        if reason is None or self.stats.disabled_reason is not None:
            return
        self.stats.disabled_reason = reason
        logger.warning("decode capture off, decode steps run eagerly: %s", reason)
