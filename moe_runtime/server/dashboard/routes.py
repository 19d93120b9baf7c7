"""HTTP routes of the expert-load dashboard (plug into `build_app(extra_routers=[dashboard_router()])`).

    GET  /dashboard                  the page (plotly.js charts, polls /dashboard/state)
    GET  /dashboard/static/<asset>   its script, style and plotly.min.js, all served locally
    GET  /dashboard/state            everything the page shows, as JSON
    GET  /dashboard/trace            the recorded expert-load trace (load_balancer.trace JSON), as a download
    GET  /dashboard/plan             `moe-serve plan` for the served model on this server's hardware (plan_view.py;
                                     ?gpu=h100&gpus_per_node=8&nodes=1&prompt_len=&output_len=&concurrency=|qps=)
    POST /dashboard/rebalance        rebalance the expert placement now (needs the API key when one is set)

With `--api-key`, every route here takes the key like /v1 (the app's `ApiKeyGate`): the expert load is
not public. A browser opening /dashboard gets a Basic-auth prompt; the key is the password (any user
name), and the browser sends it with the page's own requests from then on. Rebalancing also checks
the key itself, so the router stays guarded in an app built without `ApiKeyGate`.
"""
from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Sequence

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from moe_runtime.server.auth import api_key_dependency
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.errors import MoERuntimeError
from moe_runtime.server.dashboard.monitor import DashboardConfig, DashboardMonitor
from moe_runtime.server.dashboard.plan_view import PlanQuery, served_plan
from moe_runtime.server.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
PLAN_TIMEOUT_S = 20.0   # the plan view answers within this or says it could not (the page renders without it)


def plotly_js_path() -> Path:
    """plotly.min.js as shipped inside the `plotly` Python package (no CDN)."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError as exc:
        raise RuntimeError("the dashboard needs the `plotly` Python package (pip install plotly)") from exc
    if not path.is_file():
        raise RuntimeError(f"the dashboard needs {path} (part of the plotly package); reinstall plotly")
    return path


def dashboard_router(api_key: str | Sequence[str] | None = None, config: DashboardConfig = DashboardConfig(),
                     plan_cpu_loader=None, served_engine_config: EngineConfig | None = None,
                     admin_key: str | None = None) -> APIRouter:
    """`api_key`/`admin_key`: as `build_app`'s (the rebalance button is an admin route: `server.admin_routes`);
    `plan_cpu_loader`: the plan view's `--gpu cpu` hardware (default: this machine's cached calibration);
    `served_engine_config`: the served engine's settings, which the plan view plans for (None: no plan view,
    its route answers 404)."""
    assets = {"dashboard.js": STATIC_DIR / "dashboard.js", "dashboard.css": STATIC_DIR / "dashboard.css",
              "plan.js": STATIC_DIR / "plan.js", "plotly.min.js": plotly_js_path()}
    for name, path in assets.items():
        if not path.is_file():
            raise RuntimeError(f"dashboard asset {name} is missing: {path}")
    page = (STATIC_DIR / "index.html").read_text()
    router = APIRouter(prefix="/dashboard", tags=["dashboard"])

    def monitor(request: Request) -> DashboardMonitor:
        """One monitor per app, made on first use (the router does not know its app in advance)."""
        state = request.app.state
        if getattr(state, "dashboard_monitor", None) is None:
            state.dashboard_monitor = DashboardMonitor(state.async_engine, config)
        return state.dashboard_monitor

    @router.get("", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> FileResponse:
        path = assets.get(name)
        if path is None:
            raise APIError(404, f"no dashboard asset named {name!r}", "not_found_error", "name", "no_such_asset")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "max-age=3600"})

    @router.get("/state")
    async def dashboard_state(request: Request) -> JSONResponse:
        return JSONResponse(monitor(request).state(), headers={"Cache-Control": "no-store"})

    @router.get("/trace")
    async def dashboard_trace(request: Request) -> JSONResponse:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return JSONResponse(monitor(request).trace_json(), headers={
            "Content-Disposition": f'attachment; filename="expert-load-trace-{stamp}.json"',
            "Cache-Control": "no-store"})

    @router.get("/plan")
    async def dashboard_plan(request: Request, gpu: str | None = None, gpus_per_node: int | None = None,
                             nodes: int = 1, prompt_len: int | None = None, output_len: int | None = None,
                             qps: float | None = None, concurrency: int | None = None,
                             ttft_ms: float | None = None, itl_ms: float | None = None) -> JSONResponse:
        engine = request.app.state.async_engine
        if served_engine_config is None:
            raise APIError(404, "plan: this server was not given its engine's settings to plan for",
                           "not_found_error", None, "no_plan")
        query = PlanQuery(gpu, gpus_per_node, nodes, prompt_len, output_len, qps, concurrency, ttft_ms, itl_ms)
        try:   # a thread with a bound: planning reads configs (no measuring), but the loop must never wait on it
            answer = await asyncio.wait_for(asyncio.to_thread(served_plan, served_engine_config, query,
                                                              engine.max_model_len, plan_cpu_loader),
                                            PLAN_TIMEOUT_S)
        except asyncio.TimeoutError as exc:
            raise APIError(503, f"plan: no answer within {PLAN_TIMEOUT_S:g} s", "server_error", None,
                           "plan_timeout") from exc
        except (MoERuntimeError, OSError, KeyError, ValueError) as exc:
            raise APIError(400, f"plan: {exc}", "invalid_request_error", None, "invalid_plan_query") from exc
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})

    @router.post("/rebalance", dependencies=[Depends(api_key_dependency(api_key, admin_key, admin=True))])
    async def dashboard_rebalance(request: Request) -> JSONResponse:
        return JSONResponse({"event": await monitor(request).rebalance_now()})

    return router
