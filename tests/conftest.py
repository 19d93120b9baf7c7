"""Session fixtures shared by the test suite: the tiny tokenizer, tiny checkpoints, the demo model (each built once
per run, whatever the number of pytest-xdist workers: shared_builds.py)."""

import os

import pytest
import torch
from shared_builds import build_once, shared_root
from tiny_checkpoints import GreedyOracle, HFOracle, TinyCheckpointFactory, tiny_tokenizer
from triton_interpreter_child import MARKER, SharedInterpreterRun, marked_case_files

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
    """`oracle(arch, prompts, max_new_tokens)`: transformers' greedy tokens, each prompt asked once per session
    (and computed once across runs: oracle_cache.py)."""
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


def pytest_configure(config):
    share_cores_between_workers()
    config.addinivalue_line("markers", f"{MARKER}(*case_files): the test holds these Triton case files to the run's "
                                       "one interpreter child (triton_interpreter_child.py)")


def pytest_collection_finish(session):
    """The Triton interpreter child starts as soon as the run's tests are known, in the background: by the time a
    test that reads it runs, it has mostly finished."""
    cases = marked_case_files(session.items)
    if cases and not torch.cuda.is_available():   # with CUDA the cases run compiled, in the suite's processes
        SharedInterpreterRun(shared_root(session.config._tmp_path_factory)).start(cases)



# The modules whose few tests take longest (server and rank start-ups, a venv's install, a two-node re-form), longest
# first. pytest-xdist's loadfile hands out modules in collection order once reordering by test count is off
# (`--no-loadscope-reorder`, pyproject.toml): by default these few-test modules went last and the run ended with one
# worker on them while the other sat idle.
LONGEST_MODULES = ("test_multi_node_elastic.py", "test_fresh_install.py", "test_server_expert_parallel.py",
                   "test_server_rank_death.py", "test_dashboard_browser.py", "test_server_drain.py",
                   "test_gpu_check_dry_run.py", "test_capture_safe.py", "test_captured_ep_verify.py",
                   "test_multi_node.py")


def pytest_collection_modifyitems(session, config, items):
    """The longest modules first, then the others by their number of tests (most first, as xdist's own reordering),
    each module's tests in their own order."""
    sizes: dict[str, int] = {}
    for item in items:
        sizes[item.path.name] = sizes.get(item.path.name, 0) + 1
    first = {name: rank for rank, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -sizes[item.path.name], str(item.path)))


def share_cores_between_workers() -> None:
    """Each pytest-xdist worker takes its share of the cores as torch's intra-op threads (it would take them all:
    two workers on two cores then run four OpenMP threads, which spin against each other; on this machine a small
    matmul took 8x longer and the speculative tests' CPU time was 2.7x). Engines a test starts in other processes
    (servers, ranks) set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
