"""`serve`: listen at once (503 while starting), build the engine in a thread, serve, shut down cleanly.

Signals: SIGTERM first drains (`graceful_drain`: new requests get 503, the running ones finish for up to
`--shutdown-timeout` seconds); SIGINT, a second SIGTERM and the drain's end stop at once: uvicorn's
graceful HTTP shutdown, which then restores the previous handlers and raises the signal again.
`serve_loop.serve_until_stopped` turns that second delivery into an exception, so the engine (and,
multi-process, its workers) is always shut down instead of the process just dying.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

import uvicorn

from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.server.app import build_app
from moe_runtime.server.responses.store import ResponseStore
from moe_runtime.server.dashboard import dashboard_router
from moe_runtime.server.engine_launch import EngineLaunch
from moe_runtime.server.exposure import warn_if_exposed
from moe_runtime.server.graceful_drain import GracefulDrain
from moe_runtime.server.listen_socket import bind_socket, socket_url
from moe_runtime.server.open_files import AcceptFailureLog, raise_open_file_limit
from moe_runtime.server.serve_loop import serve_until_stopped, until_started
from moe_runtime.server.server_config import ServerConfig
from moe_runtime.server.startup_gate import StartupGate
from moe_runtime.server.tool_calls.selection import checkpoint_model_type

logger = logging.getLogger(__name__)

DEAD_ENGINE_GRACE_S = 2.0


def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serve until a signal or a dead engine; the exit code (1: the engine died).

    The start-up line `moe-serve: serving ...` is printed once the engine is ready; an engine that
    fails to start stops the server and its error is raised.
    """
    server_config.validate()
    engine_config.validate()
    warn_if_exposed(server_config)
    raise_open_file_limit()   # before the ranks start: they inherit it
    AcceptFailureLog.install(logging.getLogger("asyncio"))   # a flood: one line a minute, not a traceback each
    sock = bind_socket(server_config.host, server_config.port)  # fail on a taken port before loading anything
    url = socket_url(sock)
    gate = StartupGate()
    launch = EngineLaunch(server_config, engine_config)
    log_level = server_config.log_level
    server = _Server(uvicorn.Config(gate, log_level=log_level, access_log=log_level == "debug",
                                    timeout_graceful_shutdown=5, lifespan="off"),
                     on_exit=launch.begin_shutdown, shutdown_timeout_s=server_config.shutdown_timeout_s)
    exit_code = 0

    async def announce_listening() -> None:
        if await until_started(server):
            print(f"moe-serve: listening on {url}; starting the engine (/health answers 503 until it is ready)\n",
                  end="", flush=True)   # one write: log lines on stderr cannot land inside it

    async def start_then_serve() -> None:
        announcer = asyncio.create_task(announce_listening())
        await asyncio.to_thread(launch.run)
        await announcer
        if launch.error is not None:
            server.should_exit = True
            return
        api_key = server_config.api_keys or None
        admin_key = server_config.admin_key
        gate.open(build_app(launch.async_engine, launch.served_name, api_key=api_key, admin_key=admin_key,
                            extra_routers=[dashboard_router(api_key, served_engine_config=launch.engine,
                                                            admin_key=admin_key)],
                            max_request_bytes=server_config.max_request_bytes,
                            response_store=ResponseStore(server_config.response_store_bytes,
                                                         server_config.response_ttl_s),
                            tool_call_parser=server_config.tool_call_parser,
                            reasoning_parser=server_config.reasoning_parser,
                            model_type=checkpoint_model_type(launch.model_path)))
        if server.should_exit:
            return
        server.drain.serving(launch.async_engine)
        print(ready_lines(launch.served_name, url, is_demo=server_config.model is None), end="", flush=True)
        await stop_when_the_engine_dies()

    async def stop_when_the_engine_dies() -> None:
        """A dead rank makes the service useless: report it for a moment (/health 503, in-flight
        requests end with 5xx errors), then exit non-zero so a supervisor restarts the whole job."""
        nonlocal exit_code
        detail = await launch.async_engine.wait_until_dead()
        if server.should_exit or launch.async_engine.stopping:
            return  # the shutdown we asked for
        logger.error("engine died (%s); exiting with code 1 in %.0fs", detail, DEAD_ENGINE_GRACE_S)
        exit_code = 1   # even if a drain under way stops the server before the grace is over
        await asyncio.sleep(DEAD_ENGINE_GRACE_S)
        server.should_exit = True

    try:
        serve_until_stopped(server, sock, start_then_serve)
    finally:
        launch.shutdown()
        sock.close()
        logger.info("stopped")
    if launch.error is not None:
        raise launch.error
    return exit_code


def ready_lines(served_name: str, url: str, is_demo: bool) -> str:
    """What `moe-serve` prints once it serves, in one write (log lines on stderr cannot land inside it).

    The demo's note is there because its answers are gibberish by design, and a person trying it
    first would otherwise think the runtime is broken.
    """
    demo_note = " (the demo model: seeded random weights, for trying the machinery, not the text)" if is_demo else ""
    return (f"moe-serve: serving {served_name!r}{demo_note} on {url} (Ctrl-C to stop)\n"
            f"moe-serve: dashboard at {url}/dashboard\n")


class _Server(uvicorn.Server):
    """uvicorn's server that drains on SIGTERM first (`drain`), and tells the engine to stop when it stops
    (the requests still in flight end)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], shutdown_timeout_s: float):
        super().__init__(config)
        self._on_exit = on_exit
        self.drain = GracefulDrain(shutdown_timeout_s, stop=self._stop_after_drain)

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.should_exit and self.drain.begin():
            return   # draining: the drain's end stops the server (`_stop_after_drain`)
        self._on_exit()
        super().handle_exit(sig, frame)

    def _stop_after_drain(self) -> None:
        self.handle_exit(signal.SIGTERM, None)
