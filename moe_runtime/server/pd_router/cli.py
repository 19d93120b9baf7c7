"""`moe-serve router`: the P/D router in front of prefill and decode instances.

    moe-serve --disaggregation-mode prefill --port 8100 --ep 2 --dp-attn 1 ...
    moe-serve --disaggregation-mode decode  --port 8200 --ep 2 --dp-attn 2 ...
    moe-serve router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Every instance of a set shares the KV transfer secret ($MOE_RUNTIME_KV_KEY or --kv-transfer-key-file);
the router needs none: it only passes handles on. `moe-serve --pd 1:1` starts a whole set on this machine.
"""
from __future__ import annotations

import argparse
import logging
from typing import Awaitable, Callable

import uvicorn

from moe_runtime.server.flag_help import DefaultsHelpFormatter
from moe_runtime.server.flag_types import parse_size, positive_int, tcp_port
from moe_runtime.server.listen_socket import bind_socket, socket_url
from moe_runtime.server.serve_loop import serve_until_stopped, until_started
from moe_runtime.server.pd_router.app import build_router_app
from moe_runtime.server.pd_router.backends import BackendPool
from moe_runtime.server.server_config import DEFAULT_MAX_REQUEST_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-serve router", formatter_class=DefaultsHelpFormatter,
                                description="Route OpenAI requests over prefill and decode instances "
                                            "(moe-serve --disaggregation-mode prefill|decode): each prompt runs "
                                            "on a prefill instance, the tokens stream from a decode instance.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=tcp_port, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' from clients")
    p.add_argument("--backend-api-key", default=None,
                   help="the key the instances require (their --api-key); default: --api-key")
    p.add_argument("--max-request-bytes", type=parse_size, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted")
    p.add_argument("--request-timeout", type=positive_int, default=600, help="seconds an instance may take")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def serve_router(pool: BackendPool, host: str, port: int, api_key: str | None, backend_api_key: str | None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, request_timeout_s: float = 600.0,
                 log_level: str = "info", stop_when: Callable[[], Awaitable[str]] | None = None) -> int:
    """Listen and route until a signal (exit code 0); prints `moe-serve: serving ...` once listening.
    `stop_when()`: a coroutine that returns why the router must stop (`moe-serve --pd`: an instance of its set
    died); the router then stops (its clients' requests get a short grace) and the exit code is 1."""
    sock = bind_socket(host, port)
    url = socket_url(sock)
    app = build_router_app(pool, api_key, backend_api_key, max_request_bytes, request_timeout_s=request_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                                           timeout_graceful_shutdown=5))
    stopped_because: list[str] = []

    async def announce_and_watch() -> None:
        if not await until_started(server):
            return
        print(f"moe-serve: serving the P/D router ({len(pool.of_role('prefill'))} prefill, "
              f"{len(pool.of_role('decode'))} decode instances) on {url} (Ctrl-C to stop)\n", end="", flush=True)
        if stop_when is not None:
            stopped_because.append(await stop_when())
            print(f"moe-serve: {stopped_because[0]}; stopping\n", end="", flush=True)
            server.should_exit = True

    try:
        serve_until_stopped(server, sock, announce_and_watch)
    finally:
        sock.close()
    return 1 if stopped_because else 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pool = BackendPool.of(args.prefill, args.decode)
    return serve_router(pool, args.host, args.port, args.api_key, args.backend_api_key or args.api_key,
                        args.max_request_bytes, args.request_timeout, args.log_level)
