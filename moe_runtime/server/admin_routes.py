"""Routes that act on the whole server, not on the caller's requests: who may call them.

`POST /reset_prefix_cache` drops every tenant's cached blocks and `POST /dashboard/rebalance` moves every tenant's
experts, and the weight updates, sleep and wake act on every tenant's model (later: profiling). With one API key
the server has one tenant, whose key opens them as before. With several tenants' keys, one tenant's key must not
act on the others (red team round 3: any tenant flushed every tenant's prefix cache), so an admin route then needs
`--admin-key`, and without one it is refused to everyone. Given `--admin-key`, the admin routes take that key and
no other; the admin key also opens every other route, as the operator's own (it belongs to no tenant).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from moe_runtime.server.errors import APIError

ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/dashboard/rebalance",
                         # weight updates, the trainer's group, sleep, wake (server/weight_update_routes.py)
                         "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                         "/sleep", "/wake_up"})


def admin_only() -> APIError:
    return APIError(403, "this route acts on every tenant: it needs the server's --admin-key", "permission_error",
                    None, "admin_key_required")


def no_admin_key() -> APIError:
    return APIError(403, "this route acts on every tenant, and this server serves several tenants' keys without "
                         "an --admin-key: start it with --admin-key to use it", "permission_error", None,
                    "admin_key_required")


@dataclass(frozen=True)
class AdminKey:
    """The operator's key (`--admin-key`), or None: then the tenant keys' rule above applies."""

    key: str | None

    def matches(self, presented: str | None) -> bool:
        """Whether the key a request presented (`server.auth.request_key`) is this one (constant time)."""
        return (self.key is not None and presented is not None
                and secrets.compare_digest(presented.encode(), self.key.encode()))

    def refusal(self, several_tenants: bool, presented: str | None) -> APIError | None:
        """None when an admin route may run for a request that passed the API-key gate."""
        if self.key is not None:
            return None if self.matches(presented) else admin_only()
        return no_admin_key() if several_tenants else None
