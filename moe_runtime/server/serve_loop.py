"""Run a uvicorn server on an already bound socket until it stops or SIGTERM arrives (moe-serve, the P/D router).

uvicorn handles SIGTERM itself (a graceful shutdown) and then raises it again once it stopped; that
second one must end the process's event loop without a traceback, so the caller's clean-up runs.
"""
from __future__ import annotations

import asyncio
import signal
import socket
from typing import Awaitable, Callable

import uvicorn


class _Terminated(Exception):
    """SIGTERM arrived (after uvicorn's graceful shutdown)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


async def until_started(server: uvicorn.Server) -> bool:
    """Whether `server` started listening (False: it stopped first)."""
    while not server.started and not server.should_exit:
        await asyncio.sleep(0.02)
    return server.started


def serve_until_stopped(server: uvicorn.Server, sock: socket.socket,
                        alongside: Callable[[], Awaitable[None]]) -> None:
    """Serve on `sock`, with the coroutine `alongside()` running beside it (cancelled when serving ends)."""
    async def run() -> None:
        task = asyncio.create_task(alongside())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        asyncio.run(run())
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
