"""What every generating route needs from its app: one `ServingContext` per app, made by `build_app`.

The OpenAI routes (`server.app`), the Responses API (`server.responses`) and the Messages API
(`server.messages`) take the same context, so a request of any API runs through the same conversion
threads, tenant salts, metrics, reasoning reading and engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.front.async_engine import AsyncEngine
from moe_runtime.server.conversion_threads import ConversionThreads
from moe_runtime.server.harmony_output import HarmonyFormat
from moe_runtime.server.logprobs import TokenNamer
from moe_runtime.server.metrics import ServerMetrics
from moe_runtime.server.reasoning.selection import ReasoningChoice
from moe_runtime.server.request_conversion import ModelInfo
from moe_runtime.server.tenant_salt import TenantSalts


@dataclass(frozen=True)
class ServingContext:
    async_engine: AsyncEngine
    model: ModelInfo
    metrics: ServerMetrics
    conversions: ConversionThreads
    salts: TenantSalts
    namer: TokenNamer
    reasoning: ReasoningChoice
    harmony: HarmonyFormat | None = None   # the model answers in harmony channels (gpt-oss)

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name
