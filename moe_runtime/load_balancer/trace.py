"""Expert-load traces on disk (JSON), for replay in bench/bench_rebalance.py.

Format (JSON, one object):
  {"format": "moe-runtime/expert-load-trace", "version": 1,
   "num_layers": L, "num_experts": E, "num_slots": P, "num_ranks": W,
   "steps": [[[tokens of layer l, expert e] ...] ...]}   # [S, L, E], oldest step first
JSON rather than .pt: readable by any tool (the dashboard, jq) and loading it
never runs pickled code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from moe_runtime.load_balancer.recorder import ExpertLoadRecorder

TRACE_FORMAT = "moe-runtime/expert-load-trace"
TRACE_VERSION = 1


@dataclass
class ExpertLoadTrace:
    steps: torch.Tensor  # [S, L, E] long: tokens per logical expert per step
    num_slots: int
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.steps.shape[1]

    @property
    def num_experts(self) -> int:
        return self.steps.shape[2]

    @classmethod
    def from_recorder(cls, recorder: ExpertLoadRecorder) -> "ExpertLoadTrace":
        """The finished steps still in the recorder's window."""
        return cls(recorder.window_steps(), recorder.num_slots, recorder.num_ranks)


def save_trace(path: Union[str, Path], trace: Union[ExpertLoadTrace, ExpertLoadRecorder]) -> None:
    if isinstance(trace, ExpertLoadRecorder):
        trace = ExpertLoadTrace.from_recorder(trace)
    payload = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "num_slots": trace.num_slots,
        "num_ranks": trace.num_ranks,
        "steps": trace.steps.tolist(),
    }
    Path(path).write_text(json.dumps(payload))


def load_trace(path: Union[str, Path]) -> ExpertLoadTrace:
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"expert-load trace {path} is not valid JSON: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not an expert-load trace (missing format {TRACE_FORMAT!r})")
    if payload.get("version") != TRACE_VERSION:
        raise ValueError(f"expert-load trace {path} has version {payload.get('version')}, expected {TRACE_VERSION}")
    for key in ("num_layers", "num_experts", "num_slots", "num_ranks", "steps"):
        if key not in payload:
            raise ValueError(f"expert-load trace {path} lacks {key!r}")
    steps = torch.tensor(payload["steps"], dtype=torch.long)
    if steps.numel() == 0:
        steps = steps.reshape(0, payload["num_layers"], payload["num_experts"])
    expected = (payload["num_layers"], payload["num_experts"])
    if steps.dim() != 3 or tuple(steps.shape[1:]) != expected:
        raise ValueError(f"expert-load trace {path}: steps have shape {tuple(steps.shape)}, expected [S, *{expected}]")
    return ExpertLoadTrace(steps, int(payload["num_slots"]), int(payload["num_ranks"]))
