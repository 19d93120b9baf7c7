"""SIGTERM's graceful drain (`moe-serve --shutdown-timeout`): what Kubernetes expects of a pod it stops.

On SIGTERM the server keeps listening but takes no new request (503 with Retry-After, /health 503
"draining": the load balancer sends the traffic elsewhere), lets the requests already running finish
for up to `--shutdown-timeout` seconds, then stops as on an immediate stop: the requests still running
end with an error, the engine and its ranks shut down, and the process exits 0.

Without an engine yet (still starting), with a timeout of 0, or on a second signal, the stop is immediate.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from moe_runtime.front.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass
class GracefulDrain:
    timeout_s: float
    stop: Callable[[], None]   # called on the loop when the drain ends: the immediate stop
    engine: AsyncEngine | None = None
    loop: asyncio.AbstractEventLoop | None = None
    begun: bool = False
    task: asyncio.Task | None = None

    def serving(self, engine: AsyncEngine) -> None:
        """The engine serves, on the running loop: from now on SIGTERM drains."""
        self.engine, self.loop = engine, asyncio.get_running_loop()

    def begin(self) -> bool:
        """Signal-safe: start draining; False where the stop must be immediate (nothing to drain, a timeout
        of 0, or the drain already began: a second signal)."""
        if self.begun or self.timeout_s <= 0 or self.engine is None or self.loop is None or self.loop.is_closed():
            return False
        self.begun = True
        self.engine.begin_drain()   # a plain store: from this instant no request is admitted
        self.loop.call_soon_threadsafe(self._start)
        return True

    def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        engine = self.engine
        running = engine.num_in_flight
        if running:
            logger.info("SIGTERM: taking no new requests (503); waiting up to %ss for the %d running to finish "
                        "(--shutdown-timeout; a second SIGTERM or Ctrl-C stops at once)", self.timeout_s, running)
        try:
            await asyncio.wait_for(engine.wait_until_idle(), self.timeout_s)
            if running:
                logger.info("every request finished; stopping")
        except asyncio.TimeoutError:
            logger.warning("%d requests still running after --shutdown-timeout %ss: they end with an error",
                           engine.num_in_flight, self.timeout_s)
        self.stop()
