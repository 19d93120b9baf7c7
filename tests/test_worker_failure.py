"""A dead worker is detected within seconds, named, and the rest of the job is torn down."""
import json
import os
import signal
import time

import pytest
from safetensors.torch import load_file, save_file

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM
from moe_runtime.errors import EngineDeadError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killed_worker_raises_naming_the_rank_and_leaves_no_process(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral")
    llm = LLM(str(path), device="cpu", dtype="float32", ep=2, dp_attn=2, max_rank_restarts=0)   # no restart
    pids = [p.pid for p in llm.engine.client.processes.values()]
    assert llm.generate(PROMPTS[:2], greedy(4))  # the job works before the kill
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1"):
        llm.generate(PROMPTS, greedy(64))
    assert time.monotonic() - started < 10, "death was not noticed within a few seconds"
    assert not llm.engine.health().healthy
    llm.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "worker processes left behind"


def test_worker_exception_is_reported_with_its_cause(tiny_checkpoint_factory, tmp_path):
    """Rank 1 alone misses one of its experts' tensors: the start-up error names the rank and the tensor."""
    source = tiny_checkpoint_factory("mixtral")
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    num_experts = json.loads((tmp_path / "config.json").read_text())["num_local_experts"]
    victim = f"model.layers.0.block_sparse_moe.experts.{num_experts - 1}.w1.weight"  # held by the last rank only
    del tensors[victim]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineDeadError, match=rf"worker rank 1 failed: CheckpointError.*{victim.replace('.', '[.]')}"):
        LLM(str(tmp_path), device="cpu", dtype="float32", ep=2, dp_attn=2)
