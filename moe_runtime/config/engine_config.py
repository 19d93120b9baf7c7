"""Engine settings: one dataclass the API, the CLI and the workers share, composed of its parts.

Each part is a dataclass of its own file that defines its fields and checks them (`ModelSettings`,
`CacheSettings`, `ParallelSettings`, `SchedulerSettings`, `SpeculativeSettings`, `ServingSettings`, as vLLM's
`VllmConfig` holds `ModelConfig`, `CacheConfig`, ...). `EngineConfig` inherits them, so its fields are the parts'
fields, flat and in part order: `config.block_size`, `EngineConfig(model=..., ep=2)`, `LLM(path, block_size=32)`,
one `moe-serve` flag per field and the msgpack form the ranks receive (one map of field names) are what they were
before the split. `config.cache_settings` (and the other `*_settings`) is a part as its own dataclass (a copy of
its values), and `EngineConfig.from_parts(...)` builds one from parts; the checks that span parts are here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

from moe_runtime.config.cache_settings import CacheSettings
from moe_runtime.config.config_error import EngineConfigError
from moe_runtime.config.model_settings import (DTYPES, HOST_EXPERT_QUANTIZATIONS, MODEL_IMPLS, QUANTIZATIONS,
                                               ModelSettings)
from moe_runtime.config.parallel_settings import ParallelSettings
from moe_runtime.config.scheduler_settings import SchedulerSettings
from moe_runtime.config.serving_settings import DISAGGREGATION_MODES, ServingSettings
from moe_runtime.config.speculative import SpeculativeConfig
from moe_runtime.config.speculative_settings import SpeculativeSettings
from moe_runtime.security.control_key import ControlKey
from moe_runtime.security.transfer_key import TransferKey

# Names other modules import from here (they were defined in this file before the parts were).
__all__ = ["DISAGGREGATION_MODES", "DTYPES", "HOST_EXPERT_QUANTIZATIONS", "MODEL_IMPLS", "QUANTIZATIONS",
           "EngineConfig", "EngineConfigError", "SETTINGS_PARTS"]

# The parts in field order (EngineConfig's bases are listed in reverse: a dataclass collects its bases' fields
# from the last base to the first).
SETTINGS_PARTS = (ModelSettings, CacheSettings, ParallelSettings, SchedulerSettings, SpeculativeSettings,
                  ServingSettings)
Part = TypeVar("Part")


@dataclass
class EngineConfig(ServingSettings, SpeculativeSettings, SchedulerSettings, ParallelSettings, CacheSettings,
                   ModelSettings):
    """Every engine setting, flat; the fields are the parts' (see the module docstring)."""

    @classmethod
    def from_parts(cls, model_settings: ModelSettings, *, cache_settings: CacheSettings | None = None,
                   parallel_settings: ParallelSettings | None = None,
                   scheduler_settings: SchedulerSettings | None = None,
                   speculative_settings: SpeculativeSettings | None = None,
                   serving_settings: ServingSettings | None = None) -> EngineConfig:
        """The config of these parts; a part left out has its defaults. Each keyword takes its part's type."""
        given = (model_settings, cache_settings, parallel_settings, scheduler_settings, speculative_settings,
                 serving_settings)
        values = {}
        for part_class, part in zip(SETTINGS_PARTS, given):
            if part is None:
                continue
            if type(part) is not part_class:
                raise EngineConfigError(f"EngineConfig.from_parts: {_keyword(part_class)} takes a "
                                        f"{part_class.__name__}, not {type(part).__name__}")
            values.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part_class)})
        return cls(**values)

    def part(self, part_class: type[Part]) -> Part:
        """This config's values of one part, as that part's dataclass (a copy: setting it changes nothing here)."""
        if part_class not in SETTINGS_PARTS:
            raise EngineConfigError(f"{part_class.__name__} is not a part of EngineConfig")
        return part_class(**{f.name: getattr(self, f.name) for f in dataclasses.fields(part_class)})

    @property
    def model_settings(self) -> ModelSettings:
        return self.part(ModelSettings)

    @property
    def cache_settings(self) -> CacheSettings:
        return self.part(CacheSettings)

    @property
    def parallel_settings(self) -> ParallelSettings:
        return self.part(ParallelSettings)

    @property
    def scheduler_settings(self) -> SchedulerSettings:
        return self.part(SchedulerSettings)

    @property
    def speculative_settings(self) -> SpeculativeSettings:
        return self.part(SpeculativeSettings)

    @property
    def serving_settings(self) -> ServingSettings:
        return self.part(ServingSettings)

    def validate(self) -> None:
        """Refuse a configuration that cannot run before anything is loaded or started.

        Messages name the `moe-serve` flag (`--dp-attn`); the `LLM` keyword is the same name with
        underscores. Checks that need the checkpoint (layouts the model admits) come later, in
        `ParallelLayout.validate`.
        """
        self.validate_options()
        ParallelSettings.validate_layout(self)
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError("--device cuda: no CUDA device is visible to this process "
                                    "(use --device cpu, or auto)")
        if self.ranks_start_elsewhere:
            ControlKey.shared(self.control_key_file)  # refuse now, without a shared key, rather than after loading
        if self.disaggregation_mode != "none":
            TransferKey.shared(self.kv_transfer_key_file)  # the same: no instance of a P/D set runs without it

    def validate_options(self) -> None:
        """Each part's own checks, then those across parts; `LLM` runs these too. The parallel layout's (which
        `ParallelLayout.validate` names with the `LLM` keywords and the values that would work) are left out."""
        for part_class in SETTINGS_PARTS:
            part_class.validate(self)
        if self.enable_torch_compile:
            self.validate_torch_compile()
        self.validate_cpu_experts()
        if self.deterministic:
            from moe_runtime.config.deterministic import validate_deterministic   # imports torch: only when asked

            validate_deterministic(self)

    def validate_cpu_experts(self) -> None:
        """Host-held routed experts run eagerly through the contiguous-layout kernels, in float, int8 or FP8 weights
        (the part's own checks, `ParallelSettings.validate`, hold the rest)."""
        if not self.cpu_experts:
            return
        if self.enable_torch_compile:
            raise EngineConfigError("--cpu-experts with --enable-torch-compile: the host experts run on their own "
                                    "thread from host counts, which a captured step cannot hold; use one of them")
        if self.quantization not in HOST_EXPERT_QUANTIZATIONS:
            raise EngineConfigError(f"--cpu-experts with --quantization {self.quantization}: the host expert "
                                    "kernels run float32, bfloat16, int8 and FP8 experts; use --quantization fp8, "
                                    "int8 or none")

    def validate_torch_compile(self) -> None:
        """A captured decode step is one rank's whole forward with unquantized weights; the one exchange it may
        hold is DeepEP's low-latency dispatch and combine (fixed shapes, traced as operators), on ranks that are
        each their own DP attention worker."""
        if self.ep > 1 and (self.a2a_backend != "deepep" or self.dp_attn != self.ep):
            raise EngineConfigError(f"--enable-torch-compile with --ep {self.ep}: the captured decode step exchanges "
                                    "tokens through DeepEP's low-latency kernels only, on ranks that are each a DP "
                                    "attention worker: add --a2a-backend deepep --dp-attn "
                                    f"{self.ep} (or run without --enable-torch-compile)")
        spread = {"--tp": self.tp, "--pp": self.pp, "--cp": self.cp}
        blocking = [f"{flag} {value}" for flag, value in spread.items() if value > 1]
        if blocking:
            raise EngineConfigError(f"--enable-torch-compile with {', '.join(blocking)}: the captured decode step is "
                                    "one rank's forward; steps that exchange tokens or K/V between ranks are not "
                                    "captured yet (run without --enable-torch-compile)")
        if self.quantization not in (None, "none"):
            raise EngineConfigError(f"--enable-torch-compile with --quantization {self.quantization}: quantized "
                                    "weights run through their own grouped kernels, which the capture cannot fuse "
                                    "(as opaque calls inside the graph int8 decoded slower than without it, "
                                    "docs/design.md); use one of them")
        if self.enable_two_batch_overlap:
            raise EngineConfigError("--enable-torch-compile with --enable-two-batch-overlap: overlap needs several "
                                    "ranks, the capture one; use one of them")

    @property
    def decode_max_tokens(self) -> int:
        """The most tokens one DP worker's decode-phase step computes: what DeepEP's low-latency buffers are sized
        for and what bounds the captured step's largest bucket. One per sequence (`max_num_seqs`); with speculative
        decoding each sequence verifies up to `num_speculative_tokens` drafts beside its last token, and the
        scheduler gives drafts only what is left of the step's token budget (`max_num_batched_tokens`), so a
        step of drafts never passes the larger of that budget and `max_num_seqs`."""
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is None:
            return self.max_num_seqs
        return min(self.max_num_seqs * (1 + speculative.num_speculative_tokens),
                   max(self.max_num_batched_tokens, self.max_num_seqs))


def _keyword(part_class: type) -> str:
    """`CacheSettings` -> `cache_settings`, the keyword (and property) of that part."""
    return part_class.__name__.removesuffix("Settings").lower() + "_settings"
