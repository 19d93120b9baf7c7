"""`speculative_config` (vLLM's names), parsed and checked once: what the engine drafts with and how far."""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import InvalidRequestError

BUILT_METHODS = ("ngram", "mtp", "eagle3")
MODEL_DRAFTERS = ("mtp", "eagle3")       # drafters with a KV cache layer of their own


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"                # "ngram": prompt lookup; "mtp": the checkpoint's multi-token-prediction layer
    num_speculative_tokens: int = 3      # k: drafts proposed per sequence and step
    prompt_lookup_min: int = 1           # shortest suffix n-gram that may match (n-gram lookup)
    prompt_lookup_max: int = 4           # longest one tried
    model: str | None = None             # "eagle3": the draft head's checkpoint directory

    @classmethod
    def parse(cls, raw: dict | None) -> "SpeculativeConfig | None":
        """`raw` as `LLM(speculative_config=...)` or `moe-serve --speculative-config JSON` gives it (None: off).
        vLLM's rule for the lookup bounds: one given stands for both."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        method = raw.get("method", "ngram")
        if method not in BUILT_METHODS:
            raise InvalidRequestError(f"speculative_config method {method!r}: choose one of {list(BUILT_METHODS)}")
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        low, high = (low if low is not None else (high if high is not None else cls.prompt_lookup_min),
                     high if high is not None else (low if low is not None else cls.prompt_lookup_max))
        config = cls(method, int(raw.get("num_speculative_tokens", cls.num_speculative_tokens)), int(low), int(high),
                     raw.get("model"))
        config.check()
        return config

    @classmethod
    def drafter_kv_layers(cls, raw: dict | None) -> int:
        """Layers of KV cache a drafter keeps beside the target's: 1 for the MTP layer or an EAGLE-3 head, else 0."""
        config = cls.parse(raw)
        return 1 if config is not None and config.method in MODEL_DRAFTERS else 0

    def check(self) -> None:
        if self.num_speculative_tokens < 1:
            raise InvalidRequestError(f"speculative_config num_speculative_tokens {self.num_speculative_tokens}: "
                                      "must be >= 1")
        if (self.method == "eagle3") != (self.model is not None):
            raise InvalidRequestError(f"speculative_config model {self.model!r} with method {self.method!r}: "
                                      "method 'eagle3' needs its draft head's directory, and only it takes one")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min {self.prompt_lookup_min} / "
                                      f"prompt_lookup_max {self.prompt_lookup_max}: need 1 <= min <= max")
