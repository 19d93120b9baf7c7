"""Ranks started outside the front join through its control port: a second "node" started with
`moe-serve --node-rank 1`, and ranks started by torchrun. Both on loopback, as two nodes would be,
and both authenticated by the operator's shared control key."""
import os
import secrets
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from transformers import AutoTokenizer

from moe_runtime.security.control_key import CONTROL_KEY_ENV
from engine_helpers import PROMPTS, greedy
from server_harness import ServerProcess
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM
from moe_runtime.processes.distributed import free_ports

NEW_TOKENS = 12

pytestmark = pytest.mark.slow


SHARED_KEY = secrets.token_hex(32)   # 32 random bytes, as every shared key must be


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", **{CONTROL_KEY_ENV: SHARED_KEY})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def test_second_node_started_with_node_rank(tiny_checkpoint_factory, monkeypatch):
    monkeypatch.setenv(CONTROL_KEY_ENV, SHARED_KEY)
    path = tiny_checkpoint_factory("deepseek_v3")
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    master_port, control_port = free_ports(2)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "moe_runtime.server.cli", "--model", str(path), "--device", "cpu", "--ep", "4",
         "--dp-attn", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(master_port), "--control-port", str(control_port), "--log-level", "warning"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with LLM(str(path), device="cpu", dtype="float32", ep=4, dp_attn=2, nnodes=2, node_rank=0,
                 master_port=master_port, control_port=control_port) as llm:
            assert sorted(llm.engine.client.processes) == [0, 1], "node 0 starts ranks 0 and 1 only"
            hosts = llm.engine.client.control.hellos
            assert sorted(hosts) == [0, 1, 2, 3]
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        assert node1.wait(30) == 0, node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_moe_serve_with_ranks_started_by_torchrun(tiny_checkpoint_factory):
    """The documented torchrun path end to end: `moe-serve --external-workers` serves completions and
    the expert load (whose report once carried tensors that only the front's own children could open)."""
    path = tiny_checkpoint_factory("mixtral")
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    master_port, control_port = free_ports(2)
    ranks = subprocess.Popen(
        ["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(master_port), "-m", "moe_runtime.processes.worker", "--control-addr", "127.0.0.1",
         "--control-port", str(control_port)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ServerProcess(["--model", str(path), "--device", "cpu", "--dtype", "float32", "--ep", "2",
                            "--dp-attn", "2", "--external-workers", "--master-port", str(master_port),
                            "--control-port", str(control_port), "--log-level", "warning"],
                           env={CONTROL_KEY_ENV: SHARED_KEY}) as server:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            for prompt, tokens in zip(PROMPTS, expected):
                reply = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                    "model": path.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == tokenizer.decode(tokens)
            # the served snapshot is refreshed at most once a second (scrapes never pause the ranks): the
            # traffic above shows in it within a few refreshes
            deadline = time.monotonic() + 10
            while True:
                load = httpx.get(server.base_url + "/v1/expert_load", timeout=60)
                assert load.status_code == 200, load.text
                if sum(map(sum, load.json()["totals"])) > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert sum(map(sum, load.json()["totals"])) > 0
        assert ranks.wait(60) == 0, ranks.stdout.read()
    finally:
        if ranks.poll() is None:
            ranks.kill()
