"""What one rank of a DP worker builds before it can step: the model and its weights, the tokenizer, the KV cache,
and the parts the step loop drives.

The engine core (engine/core.py) keeps the step loop; everything it steps with is built here, in order: the
kernel family and the MoE executor, the model from the checkpoint (weights kept as the config asks), routing
replay's per-rank record, the tokenizer and its EOS ids, the KV cache groups and how many blocks the memory
budget holds (agreed across the ranks), the block manager and the model runner over the cache tensors, the
speculative drafter, the sampler, the structured-output grammar compiler and the waits for its grammars, the
scheduler (with the stop checks), a P/D instance's KV transfer end, and the KV tiers below the device pool.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.config.model_config import architecture_of, load_hf_config
from moe_runtime.config.parallel_context import ParallelContext, agree_on_minimum
from moe_runtime.disaggregation.transfer_ends import TransferEnds
from moe_runtime.engine.routing_replay import RankRouting, model_top_k
from moe_runtime.engine.scheduler import Scheduler, SchedulerConfig
from moe_runtime.kv_blocks.state_slots import state_layers
from moe_runtime.engine.tier_steps import TierSteps
from moe_runtime.errors import InvalidRequestError
from moe_runtime.execution.decode_capture import CaptureSettings
from moe_runtime.execution.model_runner import ModelRunner, kv_blocks_for_budget
from moe_runtime.kernels import get_kernels
from moe_runtime.kernels.batch_invariant import batch_invariant_kernels
from moe_runtime.kernels.kernel_set_type import KernelSet
from moe_runtime.kv_blocks.block_manager import BlockManager
from moe_runtime.kv_blocks.kv_groups import KVCacheLayout
from moe_runtime.models.attention_spans import attention_spans
from moe_runtime.models.decoder import BuildContext
from moe_runtime.models.deterministic_layers import check_deterministic_model
from moe_runtime.models.registry import build_model
from moe_runtime.moe.executor import MoEExecutor
from moe_runtime.sampling.sampler import Sampler
from moe_runtime.sampling.structured_output.compiler import build_grammar_compiler
from moe_runtime.sampling.structured_output.grammar_waits import GrammarWaits
from moe_runtime.security.transfer_key import TransferKey
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.verification import Speculation, VerifyingSampler
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import SkippedTensors, load_model_weights
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat
from moe_runtime.weights.quantization.in_memory import engine_weights_in_memory
from moe_runtime.weights.tokenizer_files import eos_token_ids, load_tokenizer


@dataclass
class CoreSetup:
    checkpoint_dir: Path
    hf_config: Any                  # transformers' PretrainedConfig of the checkpoint
    architecture: str
    device: torch.device
    dtype: torch.dtype
    kernels: KernelSet
    executor: MoEExecutor
    model: torch.nn.Module
    routing: RankRouting            # routing replay: this rank's record / forced ids
    tokenizer: Any                  # None for a checkpoint without tokenizer files
    eos_ids: list[int]
    max_model_len: int
    block_manager: BlockManager
    runner: ModelRunner
    speculation: Speculation | None
    sampler: VerifyingSampler
    grammars: Any                   # the tokenizer's structured-output grammar compiler
    grammar_waits: GrammarWaits     # requests waiting off the stepping loop for their grammars
    scheduler: Scheduler
    transfers: TransferEnds         # a P/D prefill / decode instance's parked exports / imports (neither: none)
    tier_steps: TierSteps           # KV tiers below the device pool, if asked
    load_seconds: float

    @staticmethod
    def capture_settings(config: EngineConfig, device: torch.device, max_model_len: int) -> CaptureSettings | None:
        """Whether and how decode steps are captured (a seam tests replace to capture on the CPU)."""
        return CaptureSettings.for_engine(config, device, max_model_len)

    @classmethod
    def build(cls, config: EngineConfig, parallel: ParallelContext, transfer_key: TransferKey | None,
              wake: Callable[[], None]) -> "CoreSetup":
        """`wake` (called from another thread): a KV pull or a grammar compile ended, or a compile's deadline passed."""
        started = time.perf_counter()
        checkpoint_dir = Path(config.model)
        hf_config = load_hf_config(checkpoint_dir)
        architecture = architecture_of(hf_config)
        config.layout().validate(hf_config)
        device, dtype = config.resolved_device(), config.resolved_dtype(hf_config)
        kernels = get_kernels(device, config.kernels)   # --deterministic: fixed-order reductions in every row
        kernels = batch_invariant_kernels(kernels) if config.deterministic else kernels
        executor = MoEExecutor.for_engine(config, parallel, kernels, hf_config.hidden_size, dtype)
        checkpoint_fp8 = Fp8BlockFormat.from_hf_config(hf_config, str(checkpoint_dir))
        reader = CheckpointReader.open(checkpoint_dir, checkpoint_fp8, hf_config)
        quant = engine_weights_in_memory(config, hf_config, str(checkpoint_dir), reader, kernels)
        ctx = BuildContext(kernels, executor, parallel, dtype, device, quant, config)
        model = build_model(architecture, hf_config, ctx)
        if config.deterministic:
            check_deterministic_model(model, architecture)
        executor.finish_registration()  # every MoE layer registered itself while the model was built
        routing = RankRouting.for_engine(executor.num_moe_layers, model_top_k(model), executor.num_experts or 0,
                                         parallel, config.disaggregation_mode != "none")   # routing replay
        load_model_weights(model, reader, SkippedTensors.for_config(hf_config),
                           parallel.world_control_group if parallel.world_size > 1 else None)
        model.eval()
        tokenizer = load_tokenizer(checkpoint_dir)
        eos_ids = eos_token_ids(checkpoint_dir, hf_config, tokenizer)
        max_model_len = config.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
        kv_layout = KVCacheLayout.plan(attention_spans(hf_config), config,   # windowed groups, state slots
                                       state_layers(hf_config))
        num_blocks = kv_blocks_for_budget(model, config.kv_cache_memory, config.block_size, dtype, kv_layout)
        if parallel.world_size > 1:  # every rank schedules alike: pipeline stages hold different layers
            num_blocks = agree_on_minimum(num_blocks, parallel.world_control_group)
        if num_blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of {config.block_size} tokens")
        block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                     kv_layout.windows, kv_layout.state_slots)
        runner = ModelRunner(model, num_blocks, config.block_size, dtype, device,
                             capture=cls.capture_settings(config, device, max_model_len), kv_layout=kv_layout)
        speculation = Speculation.for_engine(config.speculative_config, config.pp, max_model_len,
                                             DraftSource(config, ctx, reader, model, runner, num_blocks))
        sampler = VerifyingSampler(Sampler(eos_ids, grammar_threads=torch.get_num_threads(),
                                           logprobs_mode=config.logprobs_mode), speculation)
        # structured output: the tokenizer's xgrammar view is built once here; grammars once per spec
        grammars = build_grammar_compiler(tokenizer, hf_config.vocab_size, eos_ids,
                                          max_threads=torch.get_num_threads(),
                                          any_whitespace=config.structured_output_any_whitespace)
        grammar_waits = GrammarWaits(grammars, config.grammar_compile_timeout_s, wake=wake)
        limits = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                 config.enable_chunked_prefill, tuple(eos_ids))
        scheduler = Scheduler(limits, block_manager, speculation)
        transfers = TransferEnds.open(config, transfer_key, parallel, model, runner.caches, speculation, block_manager,
                                      dtype, hf_config.num_hidden_layers, grammar_waits, wake)
        drafter = speculation.local_model_drafter() if speculation is not None else None
        state_caches = ([drafter.cache] if drafter else []) + runner.drafter_state_caches
        tier_steps = TierSteps.open(config, parallel, runner, state_caches, scheduler, block_manager, checkpoint_dir,
                                    dtype)
        if transfers.imports is not None:
            transfers.imports.before_pull = tier_steps.save_evicted   # an import's pull may evict to the tiers first
        return cls(checkpoint_dir, hf_config, architecture, device, dtype, kernels, executor, model, routing,
                   tokenizer, eos_ids, max_model_len, block_manager, runner, speculation, sampler, grammars,
                   grammar_waits, scheduler, transfers, tier_steps, time.perf_counter() - started)
