"""Admin HTTP routes for RL rollouts: weight updates, the trainer's group, sleep and wake.

SGLang's names and bodies: `POST /update_weights_from_disk` {"model_path", "policy"}, `/init_weights_update_group`
{"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s"},
`/update_weights_from_distributed` {"names", "dtypes", "shapes", "policy"}, `/sleep` {"level"}, `/wake_up`
{"reload"}. Each is an admin route (`admin_routes.ADMIN_PATHS`: the operator's key). Bodies are validated field by
field (an unknown field is refused by name); tensors are never taken over HTTP (only from the trainer's process
group, or in process). Each answers every rank's resident memory after it.
"""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from moe_runtime.engine.weight_update_group import JOIN_TIMEOUT_S
from moe_runtime.errors import MoERuntimeError
from moe_runtime.front.weight_sync import AdminResult, WeightsBrokenError
from moe_runtime.server.errors import APIError, as_api_error
from moe_runtime.server.json_body import json_body

WEIGHT_UPDATE_PATHS = frozenset({"/update_weights_from_disk", "/init_weights_update_group",
                                 "/update_weights_from_distributed", "/sleep", "/wake_up"})

Policy = Literal["drain", "abort", "pause"]


class AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDiskBody(AdminBody):
    model_path: str = Field(min_length=1)
    policy: Policy = "drain"


class InitGroupBody(AdminBody):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update", min_length=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(JOIN_TIMEOUT_S, gt=0, le=3600)


class UpdateFromDistributedBody(AdminBody):
    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    policy: Policy = "drain"


class SleepBody(AdminBody):
    level: Literal[1, 2] = 1


class WakeUpBody(AdminBody):
    reload: bool = False


def answer(result: AdminResult) -> JSONResponse:
    ranks = [{**{name: getattr(memory, name) for name in ("rank", "kv_cache_bytes", "weight_bytes",
                                                          "host_weight_bytes", "rss_bytes", "sleep_level")},
              "tensors": result.tensors.get(rank, 0)} for rank, memory in sorted(result.memory.items())]
    return JSONResponse({"status": "ok", "ranks": ranks})


def refused(exc: MoERuntimeError) -> APIError:
    if isinstance(exc, WeightsBrokenError):   # the message says what to do: a full update or a restart
        return APIError(500, str(exc), "internal_server_error", None, "weights_broken")
    return as_api_error(exc)


def weight_update_router(async_engine) -> APIRouter:
    router = APIRouter()

    async def run(call) -> JSONResponse:
        try:
            return answer(await call)
        except MoERuntimeError as exc:
            raise refused(exc) from exc

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskBody = Depends(json_body(UpdateFromDiskBody))):
        return await run(async_engine.update_weights(body.model_path, body.policy))

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupBody = Depends(json_body(InitGroupBody))):
        return await run(async_engine.init_weights_update_group(body.master_address, body.master_port,
                                                                body.rank_offset, body.world_size,
                                                                body.group_name, body.backend, body.timeout_s))

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
            body: UpdateFromDistributedBody = Depends(json_body(UpdateFromDistributedBody))):
        return await run(async_engine.update_weights_from_distributed(body.names, body.dtypes, body.shapes,
                                                                      body.policy))

    @router.post("/sleep")
    async def sleep(body: SleepBody = Depends(json_body(SleepBody))):
        return await run(async_engine.sleep(body.level))

    @router.post("/wake_up")
    async def wake_up(body: WakeUpBody = Depends(json_body(WakeUpBody))):
        return await run(async_engine.wake_up(body.reload))

    return router
