"""Every tensor the step path creates names its device.

On a GPU a tensor created without a device lands on the CPU and fails at its first meeting with a
CUDA tensor. Here the steps run with `torch.set_default_device("meta")`: a tensor created without
a device is then a meta tensor, and meeting the model's CPU tensors raises just the same. Host
staging names `device="cpu"`; everything else names the engine's device.
"""
import pytest
import torch
import torch.distributed as dist

from engine_helpers import PROMPTS, greedy
from multirank import ranks  # noqa: F401  (pytest fixture)
from test_engine_parity import ARCHS
from tiny_checkpoints import hf_greedy
from moe_runtime.processes.distributed import build_parallel_context
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.config.model_config import load_hf_config

NEW_TOKENS = 4


def _steps_on_meta_default(core: EngineCore) -> dict[str, list[int]]:
    """Run `core` to completion with the meta device as the default; each request's new tokens."""
    tokens: dict[str, list[int]] = {}
    torch.set_default_device("meta")
    try:
        while core.has_unfinished():
            for delta in core.step():
                assert delta.error is None, delta.error
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    finally:
        torch.set_default_device(None)
    return tokens


DENSE_ARCHS = {"llama", "qwen2", "mistral"}


def _two_ranks_on_meta_default(path: str, dense: bool) -> list[int]:
    """On each rank of the pool: ep=2 with dp_attn=2 (rank r serves PROMPTS[r]); a dense model, which
    expert parallelism cannot split, as tp=2 (both ranks serve PROMPTS[0])."""
    rank = dist.get_rank()
    layout = dict(tp=2) if dense else dict(ep=2, dp_attn=2)
    config = EngineConfig(model=path, device="cpu", dtype="float32", **layout)
    parallel = build_parallel_context(config.layout(), rank, torch.device("cpu"),
                                      load_hf_config(path).num_hidden_layers)
    core = EngineCore(config, parallel)
    prompt = PROMPTS[0] if dense else PROMPTS[rank]
    core.add_request(f"rank{rank}", prompt, greedy(NEW_TOKENS))
    return _steps_on_meta_default(core)[f"rank{rank}"]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint_factory):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_checkpoint_factory(arch), PROMPTS[:2], NEW_TOKENS)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_creates_no_tensor_without_a_device(arch, tiny_checkpoint_factory, expected):
    core = EngineCore(EngineConfig(model=str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32"))
    for i, prompt in enumerate(PROMPTS[:2]):
        core.add_request(f"r{i}", prompt, greedy(NEW_TOKENS))
    tokens = _steps_on_meta_default(core)
    assert [tokens["r0"], tokens["r1"]] == expected(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_create_no_tensor_without_a_device(arch, tiny_checkpoint_factory, expected, ranks):
    dense = arch in DENSE_ARCHS
    tokens = ranks(2).run(_two_ranks_on_meta_default, str(tiny_checkpoint_factory(arch)), dense)
    assert tokens == ([expected(arch)[0]] * 2 if dense else expected(arch))


def test_the_probe_catches_a_tensor_created_without_a_device():
    """The premise: under the meta default, an undeclared tensor cannot meet a CPU tensor unnoticed."""
    weights = torch.ones(3)
    torch.set_default_device("meta")
    try:
        with pytest.raises((RuntimeError, NotImplementedError)):
            (weights + torch.arange(3)).tolist()
    finally:
        torch.set_default_device(None)
