"""What the dashboard shows, gathered from the `AsyncEngine`'s thread-safe views.

`DashboardMonitor` lives on the event loop (every method is called from it): it never touches the
engine itself, only the `AsyncEngine`'s snapshots and its `rebalance_now`.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from moe_runtime.errors import EngineDeadError, InvalidRequestError
from moe_runtime.server.dashboard.interval_trace import IntervalTrace
from moe_runtime.server.dashboard.load_view import load_view
from moe_runtime.server.dashboard.tier_view import worker_tier_fields
from moe_runtime.server.dashboard.timeline import Timeline
from moe_runtime.server.errors import APIError, engine_unavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DashboardConfig:
    sample_interval_s: float = 0.5     # at most one timeline sample per interval, whatever the number of pages
    max_samples: int = 600             # timeline length (10 minutes at one sample a second)
    max_trace_rows: int = 3600         # sampling intervals kept for the trace download
    poll_interval_ms: int = 1000       # how often an open page asks for state
    rebalance_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.sample_interval_s <= 0:
            raise ValueError(f"DashboardConfig.sample_interval_s={self.sample_interval_s}: must be > 0")
        if not 50 <= self.poll_interval_ms <= 1000:
            raise ValueError(f"DashboardConfig.poll_interval_ms={self.poll_interval_ms}: must be in [50, 1000] "
                             "(the page refreshes at least once a second)")


class DashboardMonitor:
    def __init__(self, async_engine, config: DashboardConfig = DashboardConfig()):
        self.async_engine = async_engine
        self.config = config
        self.instance = uuid.uuid4().hex      # a page seeing a new one knows the server restarted
        self.timeline = Timeline(config.max_samples)
        self.trace = IntervalTrace(config.max_trace_rows)
        self._last_sample_t = float("-inf")
        self._own_events: dict[int, dict] = {}   # events returned by our rebalance calls, by index
        self._rebalance_unsupported: str | None = None

    # ---- state --------------------------------------------------------------------------------

    def sample(self, now: float):
        """Read the engine's views; add a timeline sample and a trace row when one is due."""
        engine = self.async_engine
        snapshot = engine.expert_load()       # also keeps the snapshot fresh while the dashboard asks
        stats = engine.front.stats()
        health = engine.front.health()
        if now - self._last_sample_t >= self.config.sample_interval_s:
            self._last_sample_t = now
            self.timeline.add(now, stats, snapshot, health.healthy)
            if snapshot is not None:
                self.trace.add(now, snapshot)
        return snapshot, stats, health

    def state(self) -> dict:
        now = time.time()
        snapshot, stats, health = self.sample(now)
        return {
            "instance": self.instance,
            "now": now,
            "poll_interval_ms": self.config.poll_interval_ms,
            "health": {"healthy": health.healthy, "detail": health.detail, "degraded": health.degraded},
            "expert_load": load_view(snapshot) if snapshot is not None else None,
            "workers": [dict(dp_rank=w.dp_rank, running=w.running, waiting=w.waiting, kv_usage=w.kv_usage,
                             kv_blocks_total=w.kv_blocks_total, kv_blocks_free=w.kv_blocks_free,
                             num_preemptions=w.num_preemptions, prefix_cache_queries=w.prefix_cache_queries,
                             prefix_cache_hits=w.prefix_cache_hits, **worker_tier_fields(w)) for w in stats.workers],
            "tokens": {"prompt": stats.prompt_tokens, "generation": stats.generation_tokens},
            "timeline": self.timeline.to_dict(),
            "rebalance": self.rebalance_state(snapshot is not None),
            "trace_rows": len(self.trace.rows),
        }

    def rebalance_state(self, has_expert_load: bool) -> dict:
        events = self.rebalance_events()
        reason = self.rebalance_unavailable_reason(has_expert_load)
        return {"available": reason is None, "reason": reason,
                "events": events if events is not None else [], "events_available": events is not None}

    def rebalance_events(self) -> list[dict] | None:
        """Every rebalance the engine reports, plus the ones we triggered (by index); None if it keeps none."""
        events = self.async_engine.rebalance_events()
        merged = dict(self._own_events)
        if events is not None:
            for event in events:
                merged[event.index] = event.to_dict()
        elif not merged:
            return None
        return [merged[i] for i in sorted(merged)]

    def rebalance_unavailable_reason(self, has_expert_load: bool) -> str | None:
        if self._rebalance_unsupported is not None:
            return self._rebalance_unsupported
        if not has_expert_load:
            return "this engine has no expert-parallel load to balance (one rank, or a dense model)"
        if getattr(self.async_engine.front, "rebalance_now", None) is None:
            return f"{type(self.async_engine.front).__name__} has no rebalance_now()"
        return None

    # ---- actions ------------------------------------------------------------------------------

    async def rebalance_now(self) -> dict:
        """Plan and migrate now, between engine steps; the `RebalanceEvent` as a dict, or an `APIError`."""
        reason = self.rebalance_unavailable_reason(self.async_engine.expert_load() is not None)
        if reason is not None:
            raise APIError(501, f"rebalancing is not available: {reason}", "not_implemented_error", None,
                           "rebalance_unavailable")
        try:
            event = await self.async_engine.rebalance_now(self.config.rebalance_timeout_s)
        except NotImplementedError as exc:
            self._rebalance_unsupported = f"the engine does not implement rebalance_now(): {exc}"
            raise APIError(501, self._rebalance_unsupported, "not_implemented_error", None,
                           "rebalance_unavailable") from exc
        except InvalidRequestError as exc:
            raise APIError(409, f"the engine refused to rebalance: {exc}", "invalid_request_error", None,
                           "rebalance_refused") from exc
        except EngineDeadError as exc:
            logger.warning("rebalance refused, the engine is unavailable: %s", exc)
            raise engine_unavailable() from exc
        except asyncio.TimeoutError as exc:
            raise APIError(504, f"the rebalance did not finish within {self.config.rebalance_timeout_s:.0f}s",
                           "timeout_error", None, "rebalance_timeout") from exc
        except Exception as exc:  # noqa: BLE001 - the engine survived (a dead one raises EngineDeadError)
            logger.exception("rebalance_now failed")
            raise APIError(500, "the rebalance failed (see the server log)", "internal_server_error", None,
                           "rebalance_failed") from exc
        record = event.to_dict()
        self._own_events[event.index] = record
        logger.info("manual rebalance %d: %d experts moved in %.3fs, balancedness %.3f -> %.3f", event.index,
                    event.experts_moved, event.duration_s, event.balancedness_before, event.balancedness_after)
        return record

    def trace_json(self) -> dict:
        self.sample(time.time())  # a last row, so the download includes the latest tokens
        return self.trace.to_json()
