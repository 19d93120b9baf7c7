"""The engine `moe-serve` builds in a background thread while its HTTP server already answers 503."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field

from moe_runtime.front.async_engine import AsyncEngine, AsyncEngineConfig
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.front.engine_factory import make_engine
from moe_runtime.server.server_config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineLaunch:
    server: ServerConfig
    engine: EngineConfig                  # its `model` is set here, once the checkpoint is resolved
    served_name: str = ""
    model_path: str = ""                  # the checkpoint directory, once resolved
    async_engine: AsyncEngine | None = None   # once started
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Resolve the model (building the demo on first use), start the engine; an error is kept in `error`."""
        try:
            if self.server.model is None:
                logger.info("no --model given: using the embedded demo model (built on first use)")
            model = self.server.resolve_model()
            self.served_name, self.model_path = model.served_name, model.path
            logger.info("loading %s from %s", model.served_name, model.path)
            engine_config = self.engine = dataclasses.replace(self.engine, model=model.path)
            if engine_config.world_size > 1 or engine_config.ranks_start_elsewhere:
                logger.info("starting %d worker ranks (ep %d, dp-attn %d, tp %d, pp %d, cp %d)",
                            engine_config.world_size, engine_config.ep, engine_config.dp_attn, engine_config.tp,
                            engine_config.pp, engine_config.cp)
            engine = make_engine(engine_config)
            self.async_engine = AsyncEngine(engine, AsyncEngineConfig(max_queue=self.server.max_queue)).start()
        except BaseException as exc:  # noqa: BLE001 - re-raised by serve() once the HTTP server has stopped
            self.error = exc
        finally:
            self.done.set()

    def begin_shutdown(self) -> None:
        if self.async_engine is not None:
            self.async_engine.begin_shutdown()

    def shutdown(self) -> None:
        """Stop the engine; one still being built is waited for first (its ranks must not outlive us)."""
        self.done.wait()
        if self.async_engine is not None:
            self.async_engine.shutdown()
