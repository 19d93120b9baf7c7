"""`make_engine`: the one place that picks the engine for a configuration (`LLM` and `moe-serve` both use it)."""
from __future__ import annotations

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_protocol import Engine
from moe_runtime.front.local_engine import LocalEngine
from moe_runtime.front.multiprocess_engine import MultiprocessEngine


def make_engine(config: EngineConfig) -> Engine:
    """One rank in this process, or worker processes (one per rank) behind a front in this process.

    Options are checked here, so `LLM(...)` refuses an unknown quantization as `moe-serve` does; the
    layout is checked against the checkpoint when the engine starts.
    """
    config.validate_options()
    if config.world_size > 1 or config.nnodes > 1 or not config.launch_workers:
        return MultiprocessEngine(config)
    return LocalEngine(config)
