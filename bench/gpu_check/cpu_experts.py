"""Part `cpu_experts`: `--cpu-experts` on the GPU, the routed experts in host memory beside the device's layers.

`LLM(device="cuda", cpu_experts=True)` on the tiny qwen2_moe (routed experts and a gated shared expert), fp32:

  placement   the routed experts' stacks are in host memory, the attention and shared expert on the device; with
              `device_resident_experts=2` each layer keeps two copies on the device
  tokens      greedy tokens equal the all-on-device engine's, offloaded and with the two hot experts resident
              (rows split between the device and the host in the same layer)
  speed       ms per generated token, offloaded vs on the device (figures, not gated: the tiny model is far
              too small for the split to pay; what it shows is the cost of the host round trip per layer)

The dry run (CPU) runs the same code with the "device" being the CPU too.
"""
from __future__ import annotations

import time
from pathlib import Path

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM

from .report import Outcome, RunMode, judged, passed
from .tiny_models import tiny_factory

ARCH = "qwen2_moe"
NEW_TOKENS = 8
SPEED_NEW_TOKENS = 24
RESIDENT = 2
CHECKS = ("placement", "tokens", "speed")
LAYOUTS = {"device": {}, "offloaded": dict(cpu_experts=True),
           "resident": dict(cpu_experts=True, device_resident_experts=RESIDENT, eplb_window=2)}


class CpuExpertsPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = mode.device
        self._path: Path | None = None
        self._engines: dict[str, LLM] = {}     # by layout, built on first use and shared by the checks

    def check_names(self) -> list[str]:
        return list(CHECKS)

    def close(self) -> None:
        for llm in self._engines.values():
            llm.shutdown()
        self._engines.clear()

    def run(self, name: str) -> Outcome:
        return {"placement": self.placement, "tokens": self.tokens, "speed": self.speed}[name]()

    def checkpoint(self) -> Path:
        if self._path is None:
            self._path = tiny_factory(self.mode.work_dir)(ARCH)
        return self._path

    def engine(self, layout: str) -> LLM:
        if layout not in self._engines:
            self._engines[layout] = LLM(str(self.checkpoint()), device=self.device, dtype="float32",
                                        **LAYOUTS[layout])
        return self._engines[layout]

    def placement(self) -> Outcome:
        core = self.engine("resident").core
        executor = core.executor
        routed = {str(executor.expert_store(layer).w13.device) for layer in range(executor.num_moe_layers)}
        copies = {str(c.copies.w13.device) for c in executor.device_copies}
        first_layer = next(m for name, m in core.model.named_modules() if name.endswith("shared_expert"))
        shared = str(first_layer.w13.device)
        resident = executor.device_resident()
        problems = []
        if routed != {"cpu"}:
            problems.append(f"routed experts held on {sorted(routed)}, expected the host")
        if self.device != "cpu" and (copies != {"cuda:0"} or shared.split(":")[0] != self.device):
            problems.append(f"device copies on {sorted(copies)}, shared expert on {shared}: expected {self.device}")
        if any(len(r) != RESIDENT for r in resident):
            problems.append(f"resident experts per layer {resident}, expected {RESIDENT} each")
        return judged(problems, routed_on=sorted(routed), copies_on=sorted(copies), shared_on=shared,
                      resident=resident)

    def tokens(self) -> Outcome:
        tokens = {}
        for layout in LAYOUTS:
            tokens[layout] = [out.token_ids for out in self.engine(layout).generate(PROMPTS, greedy(NEW_TOKENS))]
        problems = [f"{layout} tokens differ from the all-on-device engine's" for layout in LAYOUTS
                    if tokens[layout] != tokens["device"]]
        return judged(problems, layouts=list(LAYOUTS), equal={k: v == tokens["device"] for k, v in tokens.items()})

    def speed(self) -> Outcome:
        ms = {}
        for layout in ("device", "offloaded"):
            llm = self.engine(layout)                                         # warmed up by `tokens`
            started = time.perf_counter()
            llm.generate(PROMPTS[:1], greedy(SPEED_NEW_TOKENS))
            ms[layout] = 1000 * (time.perf_counter() - started) / SPEED_NEW_TOKENS
        return passed(device=self.device, new_tokens=SPEED_NEW_TOKENS, ms_per_token=ms,
                      offloaded_over_device=ms["offloaded"] / ms["device"])
