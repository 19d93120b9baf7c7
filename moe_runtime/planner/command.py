"""The exact `moe-serve` command line of a planned deployment (flags only where they differ from the defaults)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.planner.memory import Precision

MIB = 2**20
MASTER_PORT = 29500


@dataclass(frozen=True)
class Launch:
    model: str
    device: str
    precision: Precision
    layout: ParallelLayout
    kv_cache_memory: int
    max_num_seqs: int
    gpus_per_node: int
    block_size: int = 16
    kv_host_memory: int = 0

    def flags(self) -> list[str]:
        lo, p = self.layout, self.precision
        flags = ["--model", self.model, "--device", self.device, "--dtype", p.dtype]
        if p.quantization and not p.automatic:   # unset keeps an int4 release's experts int4 by itself
            flags += ["--quantization", p.quantization]
        for name, value in (("--ep", lo.ep), ("--dp-attn", lo.dp_attn), ("--tp", lo.tp), ("--pp", lo.pp),
                            ("--cp", lo.cp), ("--num-redundant-experts", lo.num_redundant_experts)):
            if value != (0 if name == "--num-redundant-experts" else 1):
                flags += [name, str(value)]
        if self.block_size != 16:
            flags += ["--block-size", str(self.block_size)]
        flags += ["--kv-cache-memory", size_flag(self.kv_cache_memory), "--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_host_memory:
            flags += ["--kv-host-memory", size_flag(self.kv_host_memory)]
        return flags

    @property
    def nodes(self) -> int:
        return -(-self.layout.world_size // self.gpus_per_node)

    def command(self, replicas: int = 1) -> str:
        line = "moe-serve " + shlex.join(self.flags())
        if self.nodes > 1:
            line += (f" --nnodes {self.nodes} --node-rank 0 --master-addr NODE0 --master-port {MASTER_PORT}"
                     f"  # and on nodes 1..{self.nodes - 1}: the same with --node-rank i")
        return line if replicas == 1 else f"{replicas} x [{line}]"


def disaggregated_command(launch: Launch, prefill: int, decode: int) -> str:
    """A P/D set: on one node `moe-serve --pd P:D`, else its instances and the router."""
    if launch.nodes == 1 and (prefill + decode) * launch.layout.world_size <= launch.gpus_per_node:
        base = [f for f in launch.flags()]
        return "moe-serve " + shlex.join([*base, "--pd", f"{prefill}:{decode}"])
    one = "moe-serve " + shlex.join(launch.flags())
    return (f"{prefill} x [{one} --disaggregation-mode prefill] ; {decode} x [{one} --disaggregation-mode decode] ; "
            f"moe-serve router --prefill URL... --decode URL...")


def size_flag(nbytes: int) -> str:
    """A --kv-cache-memory (or --kv-host-memory) value the flag parser reads back to the same bytes (whole MiB or
    GiB)."""
    if nbytes % 2**30 == 0:
        return f"{nbytes // 2**30}G"
    if nbytes % MIB == 0:
        return f"{nbytes // MIB}M"
    return str(nbytes)
