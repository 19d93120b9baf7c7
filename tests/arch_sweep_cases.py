"""The architecture sweep's cases: a tiny checkpoint of each model type (arch_sweep_configs.py), transformers' greedy
tokens for the sweep's two prompts, and one run of our engine on it, told as an `Outcome`.

The two prompts are longer than every window, chunk, sparse top-k and compression block of the tiny configs, the
engine's token budget (16) chunks their prefill, and the second shares the first's leading 32 tokens (4 full KV
blocks of 16), so it is served from the prefix cache the first one filled. Used by tests/test_arch_sweep.py and
bench/arch_sweep.py.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.errors import UnsupportedArchitectureError

NEW_TOKENS = 8
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(40)]   # ids 3..502: no special token of the tiny tokenizer
SHARED_PREFIX = 32
PREFIX_PROMPT = PROMPT[:SHARED_PREFIX] + [(i * 53 + 7) % 500 + 3 for i in range(8)]
PROMPTS = [PROMPT, PREFIX_PROMPT]
# one rank; chunked prefill and prefix caching on (they are the defaults: named so a changed default shows here)
ENGINE_OPTIONS = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=16, max_num_seqs=4,
                      enable_chunked_prefill=True, enable_prefix_caching=True, kv_cache_memory=8 * 2**20)
REFUSALS = (UnsupportedArchitectureError, EngineConfigError)

RUNS, REFUSED, MISMATCH, ERROR = "runs", "refused", "mismatch", "error"
NATIVE, GENERIC = "native", "generic"   # the model ran as our own port, or through transformers' modeling code


@dataclass(frozen=True)
class Outcome:
    """What the engine did with one architecture: `status` one of RUNS, REFUSED (it raised a refusal; `detail` is
    the message), MISMATCH (tokens differ from transformers'; `detail` shows both), ERROR (anything else raised)."""

    model_type: str
    status: str
    detail: str = ""
    path: str = ""                  # NATIVE or GENERIC: which built the model ("" where none was built)
    cached_prompt_tokens: int = 0   # the second prompt's tokens served from the prefix cache


def model_path(model) -> str:
    """NATIVE or GENERIC: whether `model` (an engine core's) is transformers' modeling code behind our seams."""
    from moe_runtime.models.transformers_backend import TransformersCausalLM

    return GENERIC if isinstance(model, TransformersCausalLM) else NATIVE


def _judged(model_type: str, got: list[list[int]], expected: list[list[int]], path: str, cached: int) -> Outcome:
    if got != expected:
        return Outcome(model_type, MISMATCH, f"got {got}, transformers {expected}", path, cached)
    return Outcome(model_type, RUNS, "", path, cached)


def build_sweep_checkpoint(model_type: str, path: Path, tokenizer_dir: Path) -> Path:
    """A tiny random `model_type` checkpoint (fp32 safetensors, the tiny tokenizer's files) in `path`."""
    import transformers
    from arch_sweep_configs import tiny_config
    from tiny_checkpoints import build_model
    from transformers import AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = build_model(tiny_config(model_type, AutoTokenizer.from_pretrained(str(tokenizer_dir))))
        _recompute_derived_buffers(model)
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    for file in sorted(Path(tokenizer_dir).iterdir()):
        if file.is_file():
            shutil.copyfile(file, path / file.name)
    return path


def _recompute_derived_buffers(model) -> None:
    """Put back the buffers a module derives from its config, which the random weights redrew with the rest:
    MiniMax's lightning-attention decays (slope rate, query/key/diagonal decay). Random ones make the oracle itself
    non-causal (the diagonal decay's upper triangle no longer zero), so transformers' one-pass prefill and its
    chunked continuation disagree, and no runtime can match it."""
    import torch

    for module in model.modules():
        if hasattr(module, "get_slope_rate") and hasattr(module, "decay_factors"):
            slope = module.get_slope_rate(device=module.slope_rate.device)
            with torch.no_grad():
                for name, value in zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"),
                                       (slope, *module.decay_factors(slope))):
                    getattr(module, name).copy_(value)


def oracle_tokens(path: Path) -> list[list[int]]:
    """transformers' greedy NEW_TOKENS for each of PROMPTS (kept on disk across runs: oracle_cache.py)."""
    import transformers
    from tiny_checkpoints import HFOracle

    class EosIgnoringOracle(HFOracle):
        """`generate` fills a None eos_token_id of the config it is given from the model's generation_config, and
        stops at that eos: the model's own is cleared first, so every answer has NEW_TOKENS tokens."""

        def _generate(self, ids, max_new_tokens):
            self._loaded().generation_config.eos_token_id = None
            return super()._generate(ids, max_new_tokens)

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return EosIgnoringOracle(path).greedy(PROMPTS, NEW_TOKENS)
    finally:
        transformers.logging.set_verbosity(verbosity)


def run_engine(model_type: str, path: Path, expected: list[list[int]], **options) -> Outcome:
    """Our engine on `path`, PROMPTS one after the other (the second meets the first's cached prefix), compared with
    `expected`; `options` add to or replace ENGINE_OPTIONS (ep, dp_attn, ...)."""
    from engine_helpers import greedy
    from moe_runtime import LLM

    built = ""
    try:
        with LLM(str(path), **{**ENGINE_OPTIONS, **options}) as llm:
            built = model_path(llm.engine.client.core.model)   # the in-process client's core
            outputs = [llm.generate([prompt], greedy(NEW_TOKENS))[0] for prompt in PROMPTS]
    except REFUSALS as refusal:
        return Outcome(model_type, REFUSED, f"{type(refusal).__name__}: {refusal}", built)
    except Exception as error:  # noqa: BLE001 - any other failure is this architecture's outcome, not the sweep's
        return Outcome(model_type, ERROR, f"{type(error).__name__}: {error}", built)
    return _judged(model_type, [o.token_ids for o in outputs], expected, built, outputs[1].cached_prompt_tokens)


@dataclass(frozen=True)
class RankCase:
    """One architecture for `run_on_rank`: its checkpoint and transformers' tokens."""

    model_type: str
    path: str
    expected: list[list[int]]


def run_on_rank(cases: list[RankCase], **options) -> list[Outcome]:
    """On every rank of a process group (tests/multirank.py): each case's engine core in layout `options` (e.g.
    ep=2, dp_attn=2: each rank its own DP worker, given both prompts), PROMPTS one after the other, judged against
    transformers. One call serves many architectures, so the group starts once."""
    import torch
    import torch.distributed as dist

    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.config.model_config import load_hf_config
    from moe_runtime.engine.core import EngineCore
    from moe_runtime.processes.distributed import build_parallel_context
    from engine_helpers import greedy

    outcomes = []
    for case in cases:
        core, built = None, ""
        try:
            config = EngineConfig(model=case.path, **{**ENGINE_OPTIONS, **options})
            parallel = build_parallel_context(config.layout(), dist.get_rank(), torch.device("cpu"),
                                              load_hf_config(case.path).num_hidden_layers)
            core = EngineCore(config, parallel)
            built = model_path(core.model)
            got, cached = [], 0
            for index, prompt in enumerate(PROMPTS):
                hits_before = core.block_manager.counters.hits
                core.add_request(str(index), list(prompt), greedy(NEW_TOKENS))
                tokens: list[int] = []
                while _anyone_busy(core.has_unfinished()):
                    for delta in core.step() if core.has_unfinished() else core.execute(None):
                        tokens.extend(delta.new_token_ids)
                got.append(tokens)
                cached = core.block_manager.counters.hits - hits_before
            outcomes.append(_judged(case.model_type, got, case.expected, built, cached))
        except REFUSALS as refusal:
            outcomes.append(Outcome(case.model_type, REFUSED, f"{type(refusal).__name__}: {refusal}", built))
        except Exception as error:  # noqa: BLE001 - a symmetric failure (both ranks) is this case's outcome
            outcomes.append(Outcome(case.model_type, ERROR, f"{type(error).__name__}: {error}", built))
        finally:
            if core is not None:
                core.shutdown()
    return outcomes


def _anyone_busy(busy: bool) -> bool:
    """Whether any rank has work (DP workers of one job step together, an idle one with an empty batch)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(busy)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
