"""Weight sync without a restart (issue 54 item 2): from a checkpoint directory, from tensors in this process and
from a trainer's gloo group; the requests in flight drained, aborted or paused; the prefix cache flushed.

Two tiny Mixtral checkpoints of different seeds are the old and the new weights: after an update the engine's
greedy tokens are transformers' on the new checkpoint. Under --ep 2 --dp-attn 2 with replicas, each rank's expert
slots hold exactly the new weights of the experts its placement gives it.
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from multirank import ranks  # noqa: F401  (pytest fixture)
from safetensors.torch import load_file
from tiny_checkpoints import HFOracle, hf_greedy

from moe_runtime import LLM, SamplingParams
from moe_runtime.attention_dp.lockstep import LockstepLoop
from moe_runtime.attention_dp.messages import RebalanceNow, Shutdown, SleepEngine, UpdateWeights
from moe_runtime.engine import weight_updates
from moe_runtime.engine.weight_update_group import EngineRefusedUpdate, TrainerWeightSender
from moe_runtime.errors import InvalidRequestError
from moe_runtime.front.weight_sync import WeightsLostError

PROMPT = list(range(3, 3 + 19))   # more than a block: a stale prefix cache would serve old KV
TOKENS = 6
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory):
    """(old, new): the same tiny Mixtral shape, different seeds."""
    return tiny_checkpoint_factory("mixtral"), tiny_checkpoint_factory("mixtral", seed=1)


@pytest.fixture(scope="module")
def answers(checkpoints):
    """transformers' greedy tokens for PROMPT on each checkpoint (disk-cached)."""
    return [hf_greedy(path, [PROMPT], TOKENS)[0] for path in checkpoints]


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(str(checkpoints[0]), device="cpu", dtype="float32", block_size=8) as engine:
        yield engine


def tensors_of(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def half_written(checkpoint, directory):
    """A copy of `checkpoint` whose shard is 64 zero bytes (a save cut short): no safetensors file."""
    for file in checkpoint.iterdir():
        if file.is_file():
            (directory / file.name).write_bytes(b"\0" * 64 if file.suffix == ".safetensors" else file.read_bytes())
    return directory


def greedy(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].token_ids


def test_update_from_disk_and_tensors(llm, checkpoints, answers):
    old, new = checkpoints
    llm.update_weights(str(old))
    assert greedy(llm) == answers[0]
    assert greedy(llm) == answers[0]   # ... its prompt cached now
    result = llm.update_weights(str(new))
    assert result.tensors[0] > 0 and result.memory[0].weight_bytes > 0
    output = llm.generate([PROMPT], GREEDY)[0]
    assert output.token_ids == answers[1]
    assert output.cached_prompt_tokens == 0   # the prefix cache was flushed
    llm.update_weights_from_tensors(tensors_of(old))
    assert greedy(llm) == answers[0]


def test_refusals_change_nothing(llm, checkpoints, answers, tmp_path):
    old, new = checkpoints
    llm.update_weights(str(old))
    new_tensors = tensors_of(new)
    with pytest.raises(InvalidRequestError, match="'model.layers.0.self_attn.bogus.weight' are not the served"):
        llm.update_weights_from_tensors({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)})
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(InvalidRequestError, match=f"tensor '{name}' has shape"):
        llm.update_weights_from_tensors({name: new_tensors[name][:-1]})
    experts = {n: t for n, t in new_tensors.items() if n.startswith("model.layers.0.block_sparse_moe.experts.0.")}
    lacking = "loads its tensors together.*lacks 'model.layers.0.block_sparse_moe.experts.1"
    with pytest.raises(InvalidRequestError, match=lacking):
        llm.update_weights_from_tensors(experts)   # one expert of a layer whose experts load together
    with pytest.raises(InvalidRequestError, match="policy"):
        llm.update_weights(str(new), policy="later")
    with pytest.raises(InvalidRequestError, match="model.safetensors is not a readable safetensors file"):
        llm.update_weights(str(half_written(new, tmp_path)))
    assert greedy(llm) == answers[0]


def join_trainer(llm, world_size: int = 2) -> TrainerWeightSender:
    """The trainer's sender and the engine joined in a group at a free port."""
    port = free_port()
    trainer: dict = {}
    joining = threading.Thread(target=lambda: trainer.setdefault(
        "sender", TrainerWeightSender("127.0.0.1", port, world_size=world_size)))
    joining.start()
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=world_size)
    joining.join(timeout=60)
    return trainer["sender"]


def broadcast(llm, sender: TrainerWeightSender, named: list[tuple[str, torch.Tensor]],
              raised: list[BaseException]) -> None:
    """The trainer sends `named` while the engine receives them; what the trainer's send raises goes to `raised`."""
    def send():
        try:
            sender.send(named)
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            raised.append(exc)
    sending = threading.Thread(target=send)
    sending.start()
    specs = TrainerWeightSender.specs(named)
    try:
        llm.update_weights_from_distributed([s.name for s in specs], [s.dtype for s in specs],
                                            [list(s.shape) for s in specs])
    finally:
        sending.join(timeout=60)


def test_update_from_distributed_one_rank(llm, checkpoints, answers, monkeypatch):
    """Nobody at the address: the join is refused after its timeout. A second join leaves the first group. Specs
    the model lacks are refused before anything is received, and the trainer's send says so. The broadcast is
    received and loaded a module at a time (the batch bound set to one byte)."""
    old, new = checkpoints
    llm.update_weights(str(old))
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="rank 0"):
        llm.init_weights_update_group("127.0.0.1", free_port(), rank_offset=1, world_size=2, timeout_s=0.5)
    assert time.monotonic() - started < 20
    updater = llm.core.weight_updater
    join_trainer(llm)
    first = updater.group
    sender = join_trainer(llm)
    assert first._group is None and updater.group is not first   # the first group was left
    raised: list[BaseException] = []
    with pytest.raises(InvalidRequestError, match="'not.a.tensor.of.this.model' are not the served model's"):
        broadcast(llm, sender, [("not.a.tensor.of.this.model", torch.zeros(2, 3))], raised)
    assert len(raised) == 1 and isinstance(raised[0], EngineRefusedUpdate), raised   # told, nothing sent
    raised.clear()
    batches: list[set[str]] = []
    receive = updater.group.receive

    def recorded(*args):
        for batch in receive(*args):
            batches.append(set(batch))
            yield batch
    monkeypatch.setattr(updater.group, "receive", recorded)
    monkeypatch.setattr(weight_updates, "RECEIVE_BATCH_BYTES", 1)
    broadcast(llm, sender, sorted(tensors_of(new).items()), raised)
    assert raised == []
    assert greedy(llm) == answers[1]
    experts = [b for b in batches if any(".experts." in name for name in b)]
    assert len(batches) > 10 and all(len({n.split(".experts.")[0] for n in b}) == 1 for b in experts), batches


def paused_oracle(old, new, prompt: list[int], before: list[int], total: int) -> list[int]:
    """transformers' tokens of a request paused after `before` tokens: the KV of prompt + before[:-1] computed by
    the old model, the rest by the new one."""
    old_model, new_model = HFOracle(old, cache=False).model, HFOracle(new, cache=False).model
    with torch.no_grad():
        cache = old_model(torch.tensor([prompt + before[:-1]]), use_cache=True).cache
        tokens, last = list(before), before[-1]
        while len(tokens) < total:
            out = new_model(torch.tensor([[last]]), cache=cache, use_cache=True)
            cache, last = out.cache, int(out.logits[0, -1].argmax())
            tokens.append(last)
    return tokens


def run_with_update(llm, update) -> tuple[list[int], object]:
    """A request that has generated two tokens when `update()` runs; (tokens before it, its final output)."""
    llm.engine.add_request("in-flight", PROMPT, GREEDY)
    tokens: list[int] = []
    while len(tokens) < 2:
        for output in llm.engine.step():
            tokens = list(output.token_ids)
    update()
    final = None
    while final is None:
        final = next((o for o in llm.engine.step() if o.request_id == "in-flight" and o.finished), None)
    return tokens, final


def test_policies(llm, checkpoints, answers):
    old, new = checkpoints
    llm.update_weights(str(old))
    _, drained = run_with_update(llm, lambda: llm.update_weights(str(new), policy="drain"))
    assert drained.token_ids == answers[0]            # finished on the old weights
    assert greedy(llm) == answers[1]                  # then the new ones
    llm.update_weights(str(old))
    _, aborted = run_with_update(llm, lambda: llm.update_weights(str(new), policy="abort"))
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < TOKENS
    llm.update_weights(str(old))
    before, paused = run_with_update(llm, lambda: llm.update_weights(str(new), policy="pause"))
    assert before == answers[0][:len(before)]
    assert paused.finish_reason == "length"
    assert paused.token_ids == paused_oracle(old, new, PROMPT, before, TOKENS)


def expected_sums(tensors: dict[str, torch.Tensor], layer: int, expert: int) -> list[float]:
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    w13 = torch.cat([tensors[prefix + "w1.weight"], tensors[prefix + "w3.weight"]]).double()
    w2 = tensors[prefix + "w2.weight"].double()
    return [float(w13.sum()), float((w13 * w13).sum()), float(w2.sum()), float((w2 * w2).sum())]


def generate_killing_rank(llm, rank: int) -> object:
    """PROMPT's greedy output while `rank` is SIGKILLed once the request has two tokens (the job re-forms with a
    fresh process in its place, which loads the start-up checkpoint)."""
    pid = llm.engine.client.processes[rank].pid

    def kill_when_decoding():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(len(state.token_ids) >= 2 for state in list(llm.engine.outputs.requests.values())):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_when_decoding, daemon=True)
    killer.start()
    output = llm.generate([PROMPT], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    killer.join(5)
    return output


def check_recovery_after_updates(llm, new, answers) -> None:
    """After an update from memory no checkpoint describes the weights: a lost rank ends the request in flight
    (finish_reason "abort", saying why) instead of resuming it on mixed weights, new requests are refused and
    /health says so until an update carrying every tensor; after a full update_weights(path) the recovered ranks
    load that path again and the request resumes with the tokens it would have had."""
    lost = generate_killing_rank(llm, rank=1)
    assert lost.finish_reason == "abort" and "update from memory" in lost.error, lost
    assert llm.engine.stats().recovery.recoveries >= 1
    with pytest.raises(WeightsLostError, match="update carrying every tensor"):
        greedy(llm)
    health = llm.engine.health()
    assert not health.healthy and "update from memory" in health.detail
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(InvalidRequestError, match="only an update carrying every tensor"):
        llm.update_weights_from_tensors({name: tensors_of(new)[name]})
    llm.update_weights(str(new))   # restores service, and is reloadable
    assert llm.engine.health().healthy and greedy(llm) == answers[1]
    resumed = generate_killing_rank(llm, rank=1)
    assert resumed.finish_reason == "length" and resumed.token_ids[:TOKENS] == answers[1]
    assert llm.engine.stats().recovery.recoveries >= 2


def test_distributed_update_under_expert_parallelism(checkpoints, answers, tmp_path):
    """ep=2 dp_attn=2 with two redundant slots: the trainer (a gloo group member in this process) broadcasts every
    tensor; each rank keeps its experts, replicas included, and the tokens are the new checkpoint's. Then a rank is
    lost (`check_recovery_after_updates`)."""
    old, new = checkpoints
    new_tensors = tensors_of(new)
    with LLM(str(old), device="cpu", dtype="float32", block_size=8, ep=2, dp_attn=2, num_redundant_experts=2) as llm:
        port = free_port()
        trainer: dict = {}
        joining = threading.Thread(target=lambda: trainer.setdefault(
            "sender", TrainerWeightSender("127.0.0.1", port, world_size=3)))
        joining.start()
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=3)
        joining.join(timeout=60)
        named = sorted(new_tensors.items())
        sending = threading.Thread(target=trainer["sender"].send, args=(named,))
        sending.start()
        specs = TrainerWeightSender.specs(named)
        result = llm.update_weights_from_distributed([s.name for s in specs], [s.dtype for s in specs],
                                                     [list(s.shape) for s in specs], checksums=True)
        sending.join(timeout=60)
        assert sorted(result.checksums) == [0, 1]
        held = [slot.expert for slots in result.checksums.values() for slot in slots if slot.layer == 0]
        assert len(held) == 8 + 2 and len(set(held)) == 8   # every expert somewhere, two of them twice
        for slots in result.checksums.values():
            assert len(slots) == 2 * 5   # two MoE layers of five slots on each rank: its own, not the others'
            for slot in slots:
                assert slot.sums == pytest.approx(expected_sums(new_tensors, slot.layer, slot.expert), rel=1e-9)
        assert greedy(llm) == answers[1]
        with pytest.raises(InvalidRequestError, match="not a readable safetensors file"):   # refused on every rank
            llm.update_weights(str(half_written(new, tmp_path)))
        assert greedy(llm) == answers[1] and llm.engine.stats().recovery.recoveries == 0   # no rank was lost
        asleep = llm.sleep(level=1).memory   # every rank frees its KV pool, and wakes to the same tokens
        assert sorted(asleep) == [0, 1] and all(m.kv_cache_bytes == 0 and m.sleep_level == 1 for m in asleep.values())
        assert all(m.kv_cache_bytes > 0 for m in llm.wake_up().memory.values())
        assert greedy(llm) == answers[1]
        check_recovery_after_updates(llm, new, answers)


async def async_drain(async_engine, path) -> dict:
    """The async engine's "drain": a running request finishes on the weights it began with; one submitted while
    the update drains waits, then runs on the new weights."""
    async def run(request_id, params):
        return [output async for output in async_engine.generate(request_id, PROMPT, params)][-1]
    running = asyncio.create_task(run("running", SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)))
    while async_engine.num_in_flight == 0:
        await asyncio.sleep(0.001)
    update = asyncio.create_task(async_engine.update_weights(str(path)))
    while async_engine._admission_resumes is None and not update.done():
        await asyncio.sleep(0.001)
    held = async_engine._admission_resumes is not None and not running.done()
    waiting = asyncio.create_task(run("waiting", GREEDY))
    await update
    return {"held": held, "running": (await running).token_ids[:TOKENS], "waiting": (await waiting).token_ids}


def test_admin_http_routes(checkpoints, answers):
    """The routes need the admin key, refuse bad bodies naming the field, and update the weights and sleep."""
    from server_harness import serve_in_process

    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.front.engine_factory import make_engine

    old, new = checkpoints
    admin, tenant = {"Authorization": "Bearer operator"}, {"Authorization": "Bearer tenant"}

    async def scenario(client, async_engine):
        async def tokens():
            reply = await client.post("/v1/completions", headers=admin, json={
                "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
            return reply.json()["choices"][0]["text"]
        seen = {"before": await tokens()}
        seen["tenant"] = (await client.post("/update_weights_from_disk", headers=tenant,
                                            json={"model_path": str(new)})).status_code
        for body in ({"model_path": str(new), "policy": "soon"}, {"model_path": str(new), "force": True}, {}):
            reply = await client.post("/update_weights_from_disk", headers=admin, json=body)
            seen.setdefault("bad", []).append((reply.status_code, reply.json()["error"]["message"]))
        reply = await client.post("/update_weights_from_disk", headers=admin, json={"model_path": str(new)})
        seen["update"] = (reply.status_code, reply.json())
        seen["after"] = await tokens()
        seen["sleep"] = (await client.post("/sleep", headers=admin, json={"level": 3})).status_code
        reply = await client.post("/sleep", headers=admin, json={"level": 1})
        seen["asleep"] = reply.json()["ranks"][0]["kv_cache_bytes"]
        seen["refused"] = (await client.post("/v1/completions", headers=admin, json={"prompt": PROMPT})).status_code
        seen["woken"] = (await client.post("/wake_up", headers=admin, json={})).status_code
        seen["again"] = await tokens()
        seen.update(await async_drain(async_engine, old))
        return seen

    engine = make_engine(EngineConfig(model=str(old), device="cpu", dtype="float32", block_size=8))
    tokenizer = engine.tokenizer
    seen = serve_in_process(engine, scenario, api_key=["tenant", "other-tenant"], admin_key="operator")
    assert seen["before"] == tokenizer.decode(answers[0], skip_special_tokens=True)
    assert seen["tenant"] == 403
    assert [status for status, _ in seen["bad"]] == [400, 400, 400]
    assert "policy" in seen["bad"][0][1] and "force" in seen["bad"][1][1] and "model_path" in seen["bad"][2][1]
    assert seen["update"][0] == 200 and seen["update"][1]["ranks"][0]["tensors"] > 0
    assert seen["after"] == seen["again"] == tokenizer.decode(answers[1], skip_special_tokens=True)
    assert seen["sleep"] == 400 and seen["asleep"] == 0 and seen["refused"] == 400 and seen["woken"] == 200
    assert seen["held"] and seen["running"] == answers[1] and seen["waiting"] == answers[0]


@dataclass
class _OneRankWorker:
    """A rank that is its own DP worker, on a gloo group of the pool's ranks (what LockstepLoop reads of it)."""

    rank: int
    world_control_group: object
    dp_rank: int
    ep_rank: int = 0
    pp_rank: int = 0
    is_worker_leader: bool = True
    is_last_stage: bool = True
    ep_group: object = None


class _MigrationOfSteps:
    """A rebalancer whose migration, once started, takes `steps` lock steps (as --eplb-layers-per-step spreads one)."""

    def __init__(self, steps: int, log: list[str]):
        self.steps, self.left, self.log = steps, 0, log

    @property
    def in_progress(self) -> bool:
        return self.left > 0

    def start(self) -> None:
        self.left = self.steps

    def after_step(self, step: int) -> None:
        if self.left:
            self.left -= 1
            self.log.append("migrated a layer")


class _RecordingApplier:
    """Stands in for CoreCommands: records each command applied; RebalanceNow starts the migration."""

    def __init__(self, rebalancer: _MigrationOfSteps, log: list[str]):
        self.rebalancer, self.log = rebalancer, log

    def apply(self, command) -> None:
        self.log.append(type(command).__name__)
        if isinstance(command, RebalanceNow):
            self.rebalancer.start()

    def report_landed_imports(self) -> None:
        pass

    def report_step(self, deltas, always: bool) -> None:
        pass


class _IdleCore:
    wake = None
    waiting_for_grammars = False
    executor = SimpleNamespace(needs_phase_agreement=lambda: False)

    def has_unfinished(self) -> bool:
        return False

    def schedule(self):
        return None

    def execute(self, batch, phase: str) -> list:
        return []


class _Commands(queue.Queue):
    def wake(self) -> None:
        pass


def _commands_applied_around_a_migration(_) -> list[str]:
    """One rank's loop given a rebalance of 3 steps, an update and a sleep right behind it, then Shutdown."""
    rank, log = dist.get_rank(), []
    rebalancer = _MigrationOfSteps(3, log)
    commands = _Commands()
    for command in (RebalanceNow(), UpdateWeights(update_id=1, path="new"), SleepEngine(update_id=2, level=1),
                    Shutdown()):
        commands.put(command)
    loop = LockstepLoop(_IdleCore(), commands, queue.Queue(),
                        _OneRankWorker(rank, dist.new_group(backend="gloo"), dp_rank=rank), rebalancer)
    loop.applier = _RecordingApplier(rebalancer, log)
    loop.run()
    return log


def test_admin_commands_wait_for_a_migration_in_progress(ranks):
    """A live rebalance stages the old weights of the layers it moves and commits them at its end: an update (or
    sleep) applied meanwhile would be partly undone. Every rank applies them once it has committed."""
    migration = ["RebalanceNow"] + ["migrated a layer"] * 3 + ["UpdateWeights", "SleepEngine"]
    assert ranks(2).run(_commands_applied_around_a_migration, None) == [migration, migration]


def test_int8_kept_weights_quantized_again(checkpoints):
    """An engine keeping int8 experts and projections takes float tensors and quantizes them on the rank as it
    does at start-up: the slots and tokens after an update from tensors equal those after loading the checkpoint."""
    old, new = checkpoints
    with LLM(str(old), device="cpu", dtype="float32", quantization="int8") as llm:
        from_tensors = llm.update_weights_from_tensors(tensors_of(new), checksums=True).checksums[0]
        tokens = greedy(llm)
        from_disk = llm.update_weights(str(new), checksums=True).checksums[0]
        assert from_tensors == from_disk and greedy(llm) == tokens
        assert llm.core.executor.expert_store(0).w13.dtype == torch.int8
