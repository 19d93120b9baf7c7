"""The speculative decoding part of the engine's settings (vLLM's speculative_config); its parsed form, with the
methods built, is `SpeculativeConfig` (config/speculative.py)."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config.speculative import SpeculativeConfig


@dataclass
class SpeculativeSettings:
    # Speculative decoding (vLLM's speculative_config): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}, {"method": "mtp", "num_speculative_tokens": k} (the
    # checkpoint's multi-token-prediction layer) or {"method": "eagle3", "model": DIR, "num_speculative_tokens": k}
    # (an EAGLE-3 draft head); None: off (moe_runtime/config/speculative.py)
    speculative_config: dict | None = None

    def validate(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)   # refuses unknown keys and methods not built, by name

