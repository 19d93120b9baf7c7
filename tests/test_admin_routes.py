"""Routes that act on every tenant (red team round 3: any tenant's key flushed every tenant's prefix cache).

With several tenants' keys an admin route needs `--admin-key` and takes no tenant key; without an admin key
it is refused to everyone; with one key (one tenant) that key opens it as before. The admin key opens the
other routes too. In process (fake engine); `prefix_cache_resets` counts what reached the engine.
"""
from __future__ import annotations

import pytest
from server_harness import FakeEngine, serve_in_process

from moe_runtime.server.cli import build_parser, server_config_from_args
from moe_runtime.server.dashboard import dashboard_router
from moe_runtime.server.server_config import ServerConfigError

pytestmark = pytest.mark.timeout(60)

TENANT_A, TENANT_B, ADMIN = "tenant-a-key", "tenant-b-key", "operator-key"
ADMIN_ROUTES = ("/reset_prefix_cache", "/dashboard/rebalance")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def statuses(api_key, admin_key, callers: dict[str, dict]) -> tuple[dict, int]:
    """{caller: {route: status}} for the admin routes and a completion, and the resets the engine saw."""
    engine = FakeEngine()

    async def scenario(client, _):
        seen = {}
        for caller, headers in callers.items():
            seen[caller] = {path: (await client.post(path, headers=headers)).status_code for path in ADMIN_ROUTES}
            completion = await client.post("/v1/completions", headers=headers,
                                           json={"prompt": [1, 2, 3], "max_tokens": 2})
            seen[caller]["/v1/completions"] = completion.status_code
        return seen

    router = dashboard_router(api_key=api_key, admin_key=admin_key)
    seen = serve_in_process(engine, scenario, api_key=api_key, admin_key=admin_key, extra_routers=[router])
    return seen, engine.prefix_cache_resets


def allowed(status: int) -> bool:
    return status not in (401, 403)


def test_several_tenants_without_an_admin_key_cannot_act_on_each_other():
    seen, resets = statuses([TENANT_A, TENANT_B], None, {"a": bearer(TENANT_A), "b": bearer(TENANT_B)})
    for caller in ("a", "b"):
        assert seen[caller]["/reset_prefix_cache"] == 403 and seen[caller]["/dashboard/rebalance"] == 403
        assert seen[caller]["/v1/completions"] == 200
    assert resets == 0


def test_the_admin_key_and_only_it_opens_the_admin_routes():
    seen, resets = statuses([TENANT_A, TENANT_B], ADMIN, {"a": bearer(TENANT_A), "admin": bearer(ADMIN),
                                                         "nobody": {}, "wrong": bearer("guess")})
    assert seen["a"]["/reset_prefix_cache"] == 403 and seen["a"]["/dashboard/rebalance"] == 403
    assert seen["admin"]["/reset_prefix_cache"] == 200 and allowed(seen["admin"]["/dashboard/rebalance"])
    assert seen["admin"]["/v1/completions"] == 200 and seen["a"]["/v1/completions"] == 200
    assert set(seen["nobody"].values()) == {401} and set(seen["wrong"].values()) == {401}
    assert resets == 1


def test_one_tenant_keeps_its_key_for_everything_unless_an_admin_key_is_set():
    seen, resets = statuses(TENANT_A, None, {"a": bearer(TENANT_A), "nobody": {}})
    assert seen["a"]["/reset_prefix_cache"] == 200 and allowed(seen["a"]["/dashboard/rebalance"])
    assert set(seen["nobody"].values()) == {401} and resets == 1
    seen, resets = statuses(None, ADMIN, {"anyone": {}, "admin": bearer(ADMIN)})   # no tenant keys at all
    assert seen["anyone"]["/reset_prefix_cache"] == 403 and seen["anyone"]["/v1/completions"] == 200
    assert seen["admin"]["/reset_prefix_cache"] == 200 and resets == 1


def test_the_admin_key_flag_is_checked():
    parse = build_parser().parse_args
    config = server_config_from_args(parse(["--api-key", TENANT_A, "--api-key", TENANT_B, "--admin-key", ADMIN]))
    assert config.admin_key == ADMIN and config.api_keys == (TENANT_A, TENANT_B)
    config.validate()
    for bad in (["--api-key", TENANT_A, "--admin-key", TENANT_A], ["--admin-key", ""]):
        with pytest.raises(ServerConfigError, match="--admin-key"):
            server_config_from_args(parse(bad)).validate()
