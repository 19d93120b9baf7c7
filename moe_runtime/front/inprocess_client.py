"""The engine core of a one-rank engine, in this process, behind the front's core-client interface.

Commands are applied by `attention_dp.core_commands.CoreCommands`, exactly as a worker rank applies
them, and the core's reports are the ranks' messages, so the front has one way to take them in.

Driven by `receive` (a blocking caller), the caller's thread runs the core: a command is applied as it
is sent, and each `receive` runs one step. Attached to an asyncio loop, a core thread runs it instead
(compute cannot share the loop): commands reach it through a queue and are applied between steps, its
messages reach the loop with one `call_soon_threadsafe` per step, and it sleeps on the queue while idle
(a KV pull that ends wakes it: no polling).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from moe_runtime.attention_dp.core_commands import CoreCommands, RankRole
from moe_runtime.attention_dp.messages import Message, Shutdown
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import EngineDeadError
from moe_runtime.front.core_client import CoreShape
from moe_runtime.front.rank_reform import ReformFailed, ReformOutcome

logger = logging.getLogger(__name__)


class CoreWake:
    """Queued by the core's puller thread when a KV pull ended: not a command, a reason to look."""


class InProcessClient:
    reformable = False   # one rank: nothing is left to re-form when it is lost

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokenizer = core.tokenizer
        self.shape = CoreShape(block_size=core.block_manager.block_size, num_kv_blocks=core.block_manager.num_blocks,
                               max_model_len=core.max_model_len, vocab_size=core.vocab_size, pp_size=1,
                               worker_ranks={0: [0]}, kv_shards={0: core.transfers.shard()}, routing=core.routing.shape)
        self._outbox: list[Message] = []
        self._applier = CoreCommands(core, RankRole.single(), self._outbox.append)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # attached: commands (and wakes) for the core thread
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        core.wake = lambda: self._queue.put(CoreWake())

    # ---- commands ---------------------------------------------------------------------------------
    def send(self, command: Message, only_worker: int | None = None) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._thread is None:
            self._apply(command)       # the caller's thread drives the core: apply it now
        else:
            self._queue.put(command)   # the core thread applies it before its next step

    def _apply(self, command) -> bool:
        """Apply one queued item; False on Shutdown."""
        if isinstance(command, Shutdown):
            return False
        if not isinstance(command, CoreWake):
            self._applier.apply(command)
        return True

    # ---- the blocking driver ----------------------------------------------------------------------
    def receive(self, timeout: float) -> list[Message]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._outbox:
            if not self.core.has_unfinished():   # idle: wait for a KV pull to end, up to `timeout`
                try:
                    self._apply(self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait())
                except queue.Empty:
                    pass
            try:
                self._run_once()
            except Exception as exc:  # noqa: BLE001 - the core is in an unknown state: it is dead
                self._dead = f"the engine core failed: {type(exc).__name__}: {exc}"
                logger.exception("engine core failed")
                raise EngineDeadError(self._dead) from exc
        messages, self._outbox[:] = list(self._outbox), []
        return messages

    def pending(self) -> list[Message]:
        return self._take_outbox()

    def _run_once(self) -> None:
        """One step if there is work, then the KV pulls that ended."""
        if self.core.has_unfinished():
            batch = self.core.schedule()
            deltas = self.core.execute(batch)
            self._applier.report_step(deltas, always=batch is not None)
        self._applier.report_landed_imports()

    # ---- the loop driver --------------------------------------------------------------------------
    def attach(self, on_messages: Callable[[list[Message]], None], on_lost: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        if self._outbox:   # reports made before the loop took over (e.g. an abort's)
            loop.call_soon(on_messages, self._take_outbox())
        self._thread = threading.Thread(target=self._serve, args=(loop, on_messages, on_lost), name="engine-core",
                                        daemon=True)
        self._thread.start()

    def _take_outbox(self) -> list[Message]:
        messages, self._outbox[:] = list(self._outbox), []
        return messages

    def _serve(self, loop: asyncio.AbstractEventLoop, on_messages, on_lost) -> None:
        """The core thread: apply what was sent, step while there is work, hand each step's messages over."""
        try:
            while True:
                items = [] if self.core.has_unfinished() else [self._queue.get()]   # idle: sleep until sent to
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if not all(self._apply(item) for item in items):
                    return
                self._run_once()
                if self._outbox:
                    loop.call_soon_threadsafe(on_messages, self._take_outbox())
        except Exception as exc:  # noqa: BLE001 - the core is in an unknown state: it is dead
            logger.exception("engine core failed")
            self._dead = f"the engine core failed: {type(exc).__name__}: {exc}"
            try:
                loop.call_soon_threadsafe(on_lost, self._dead)
            except RuntimeError:   # the loop is closed: nobody is listening
                pass

    def detach(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(Shutdown())
            thread.join(timeout=30)
            if thread.is_alive():
                logger.error("the engine core thread did not stop within 30 s (a step is stuck)")

    def reform(self) -> ReformOutcome:
        raise ReformFailed("a one-rank engine has no other rank to go on with")

    def shutdown(self) -> None:
        self.detach()
        self.core.shutdown()
