"""The router's view of its instances' health: each instance's /health, probed every `interval_s`.

/health on a moe-serve answers 200 when its engine runs and 503 while it starts or after it died;
an instance that does not answer at all is unreachable. The router's own /health is 200 while every
role has at least one healthy instance (its body names the instances only to callers with the key).
Each probe is logged at DEBUG, a change of state at INFO/WARNING (httpx's own line per request is
kept to DEBUG by `quiet_http_client_log`).
"""
from __future__ import annotations

import asyncio
import logging

import httpx

from moe_runtime.server.pd_router.backends import Backend, BackendPool

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0


async def probe(client: httpx.AsyncClient, backend: Backend) -> None:
    before = backend.status
    try:
        response = await client.get(backend.url + "/health", timeout=PROBE_TIMEOUT_S)
        backend.status = "ok" if response.status_code == 200 else "unhealthy"
        backend.detail = "" if response.status_code == 200 else f"/health answered {response.status_code}"
    except httpx.HTTPError as exc:
        backend.status, backend.detail = "unreachable", f"{type(exc).__name__}: {exc}"[:200]
    changed = backend.status != before
    log = logger.debug if not changed else logger.info if backend.status == "ok" else logger.warning
    log("%s instance %s: %s%s", backend.role, backend.url, backend.status,
        f" ({backend.detail})" if backend.detail else "")


async def probe_all(client: httpx.AsyncClient, pool: BackendPool) -> None:
    await asyncio.gather(*(probe(client, backend) for backend in pool.backends))


async def keep_probing(client: httpx.AsyncClient, pool: BackendPool, interval_s: float) -> None:
    while True:
        await probe_all(client, pool)
        await asyncio.sleep(interval_s)


def quiet_http_client_log() -> None:
    """httpx logs every request it makes at INFO: a probe per instance per second, and every forwarded
    request. Keep that to --log-level debug (the root logger's level, set before the app is built)."""
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    logging.getLogger("httpx").setLevel(logging.DEBUG if debug else logging.WARNING)
