"""Session fixtures shared by the test suite: the tiny tokenizer, tiny checkpoints, the demo model; and the
order in which the suite's modules go to the two pytest-xdist workers (`-n 2 --dist loadfile`)."""

import pytest
from shared_builds import build_once, shared_root
from tiny_checkpoints import GreedyOracle, HFOracle, TinyCheckpointFactory, tiny_tokenizer

from moe_runtime.demo.demo_model import ensure_demo_model
from moe_runtime.demo.tokenizer_training import save_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer (vocab 512) saved with `save_pretrained`, once per run."""
    return build_once(shared_root(tmp_path_factory), "tiny_tokenizer", lambda path: save_tokenizer(tiny_tokenizer(), path))


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory, tiny_tokenizer_dir):
    """`factory(arch, *, sharded=False, seed=0, **config_overrides) -> Path`, each built once per session."""
    return TinyCheckpointFactory(shared_root(tmp_path_factory), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def greedy_oracle(tiny_checkpoint_factory):
    """`oracle(arch, prompts, max_new_tokens)`: transformers' greedy tokens, each prompt computed once per session."""
    return GreedyOracle(tiny_checkpoint_factory)


@pytest.fixture(scope="session")
def hf_oracles(tiny_checkpoint_factory):
    """`get(arch) -> HFOracle` of the arch's default tiny checkpoint, loaded once per session."""
    loaded: dict[str, HFOracle] = {}

    def get(arch: str) -> HFOracle:
        if arch not in loaded:
            loaded[arch] = HFOracle(tiny_checkpoint_factory(arch))
        return loaded[arch]
    return get


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The embedded demo model (random weights, its own tokenizer and chat template), built once per session
    into a private cache: the servers that need a real chat template share it."""
    cache = build_once(shared_root(tmp_path_factory), "demo_cache", lambda path: None)
    return ensure_demo_model(cache)   # racing builders are safe (test_demo.py)


def pytest_collection_modifyitems(config, items):
    """Modules with multi-process tests (marked slow) first, each module's tests in their order: under
    `--dist loadfile` a module runs whole on one worker (its module-scoped engines once, its tests in order),
    and the longest modules starting first leave the shortest to even out the two workers' ends."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)   # stable: order kept within each
