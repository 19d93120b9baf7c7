"""The dashboard's time series: one sample of the engine's figures per dashboard refresh.

Samples are taken when the page asks for state (at most one per `min_interval_s`, shared by
every open page), so watching the dashboard costs nothing while nobody watches. The history
lives in the server, so a reloaded page gets it back.
"""
from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass


@dataclass
class TimelineSample:
    t: float                           # unix time
    balancedness_min: float | None     # over MoE layers, of the expert-load window (None: no MoE load)
    balancedness_mean: float | None
    generation_tokens_per_s: float     # since the previous sample
    prompt_tokens_per_s: float
    running: list[int]                 # per DP worker
    waiting: list[int]
    kv_usage: list[float]
    healthy: bool


@dataclass
class _Totals:
    t: float
    generation_tokens: int
    prompt_tokens: int


class Timeline:
    def __init__(self, max_samples: int = 600):
        if max_samples < 2:
            raise ValueError(f"Timeline max_samples={max_samples}: must be >= 2")
        self.samples: collections.deque[TimelineSample] = collections.deque(maxlen=max_samples)
        self._last: _Totals | None = None

    def add(self, t: float, stats, snapshot, healthy: bool) -> TimelineSample:
        """Record `stats` (EngineStats) and `snapshot` (ExpertLoadSnapshot or None) taken at time `t`."""
        generation_rate = prompt_rate = 0.0
        last = self._last
        if last is not None and t > last.t:
            # a restarted engine's totals start again from 0: never report a negative rate
            generation_rate = max(stats.generation_tokens - last.generation_tokens, 0) / (t - last.t)
            prompt_rate = max(stats.prompt_tokens - last.prompt_tokens, 0) / (t - last.t)
        self._last = _Totals(t, stats.generation_tokens, stats.prompt_tokens)
        low = mean = None
        if snapshot is not None:
            values = [v for v in snapshot.balancedness.double().tolist() if math.isfinite(v)]
            if values:
                low, mean = min(values), sum(values) / len(values)
        sample = TimelineSample(
            t=t,
            balancedness_min=low,
            balancedness_mean=mean,
            generation_tokens_per_s=generation_rate,
            prompt_tokens_per_s=prompt_rate,
            running=[w.running for w in stats.workers],
            waiting=[w.waiting for w in stats.workers],
            kv_usage=[w.kv_usage for w in stats.workers],
            healthy=healthy,
        )
        self.samples.append(sample)
        return sample

    def to_dict(self) -> dict:
        """Column-wise (one list per field), the shape plotly traces take."""
        columns = {name: [] for name in TimelineSample.__dataclass_fields__}
        for sample in self.samples:
            for name, value in asdict(sample).items():
                columns[name].append(value)
        return columns
