"""The router's instances: where each is, what its /health last said, how many requests it is serving.

A request goes to the usable instance of its role with the fewest requests in flight. An instance
that failed a request, or whose /health did not answer 200, is left out until the next probe says
otherwise; an instance never probed yet is tried.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


class NoBackend(Exception):
    """No usable instance of a role (every one unhealthy, unreachable, or failed)."""


@dataclass
class Backend:
    url: str
    role: str
    status: str = "unknown"     # "ok" | "unhealthy" (its /health says 503) | "unreachable" | "unknown" (not probed)
    detail: str = ""
    in_flight: int = 0
    served: int = 0
    failed: int = 0

    @property
    def usable(self) -> bool:
        return self.status in ("ok", "unknown")

    def view(self) -> dict:
        return {"url": self.url, "status": self.status, "in_flight": self.in_flight, "served": self.served,
                "failed": self.failed, **({"detail": self.detail} if self.detail else {})}


@dataclass
class BackendPool:
    backends: list[Backend] = field(default_factory=list)

    @classmethod
    def of(cls, prefill_urls: list[str], decode_urls: list[str]) -> "BackendPool":
        return cls([Backend(url.rstrip("/"), "prefill") for url in prefill_urls]
                   + [Backend(url.rstrip("/"), "decode") for url in decode_urls])

    def of_role(self, role: str) -> list[Backend]:
        return [backend for backend in self.backends if backend.role == role]

    def choose(self, role: str) -> Backend:
        usable = [backend for backend in self.of_role(role) if backend.usable]
        if not usable:
            raise NoBackend(f"no {role} instance is available (" + ", ".join(
                f"{b.url}: {b.status}" for b in self.of_role(role)) + ")")
        return min(usable, key=lambda backend: backend.in_flight)

    def mark_failed(self, backend: Backend, detail: str) -> None:
        """The instance failed a request in a way that says it is gone (no connection, a broken stream)."""
        backend.status, backend.detail = "unreachable", detail
        backend.failed += 1

    def health(self) -> tuple[bool, dict]:
        """(every role has a healthy instance, the body /health answers)."""
        roles_ok = all(any(b.status == "ok" for b in self.of_role(role)) for role in ROLES)
        all_ok = all(b.status == "ok" for b in self.backends)
        status = "ok" if all_ok else ("degraded" if roles_ok else "unhealthy")
        return roles_ok, {"status": status, **{role: [b.view() for b in self.of_role(role)] for role in ROLES}}
