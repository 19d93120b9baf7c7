"""The architecture sweep: every causal LM transformers ships with experts (and six dense families), as a tiny random
checkpoint, through our engine, against transformers' greedy tokens.

EXPECTED is the table of what each model type does today: RUNS (greedy tokens equal transformers' on one rank with
chunked prefill, and the second prompt's shared prefix comes from the prefix cache; `path` says whether our own port
or transformers' modeling code behind our attention and MoE served it), REFUSED (the engine refuses it up front, an
UnsupportedArchitectureError or EngineConfigError whose message holds `reason`), or BROKEN (it fails otherwise, the
failure holding `reason`: a known gap, listed so the sweep notices when it changes). A model type that leaves its row
(stops running, is refused for another reason, starts running while listed otherwise) fails its test: update the row
with the change. FORCED_GENERIC is the same for `--model-impl transformers` where a native port exists, and the last
test runs --ep 2 --dp-attn 2 for every MoE model type the generic path serves. The checkpoints and prompts are
arch_sweep_configs.py's and arch_sweep_cases.py's; bench/arch_sweep.py writes the same sweep to
bench/results/arch_sweep.json.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from arch_sweep_cases import (ERROR, GENERIC, MISMATCH, NATIVE, REFUSED, RUNS, RankCase, build_sweep_checkpoint,
                              oracle_tokens, run_engine, run_on_rank)
from arch_sweep_configs import DENSE_TYPES, sweep_model_types
from multirank import ranks  # noqa: F401  (pytest fixture)
from shared_builds import build_once, shared_root

BROKEN = "broken"
MIN_DISTINCT_TOKENS = 5   # of the 16 tokens transformers continues the two prompts with


@dataclass(frozen=True)
class Expected:
    status: str          # RUNS, REFUSED or BROKEN
    path: str = ""       # RUNS: NATIVE or GENERIC
    reason: str = ""     # REFUSED / BROKEN: a substring of the refusal or failure ("" for BROKEN: any failure)


def native() -> Expected:
    return Expected(RUNS, NATIVE)


def generic() -> Expected:
    return Expected(RUNS, GENERIC)


def refused(reason: str) -> Expected:
    return Expected(REFUSED, reason=reason)


def broken(reason: str) -> Expected:
    return Expected(BROKEN, reason=reason)


INDEXED = "has layers of type 'indexed_attention'"
STATE_SHAPE = "whose shape the transformers backend does not know"

EXPECTED: dict[str, Expected] = {
    # our own ports
    "deepseek_v2": native(), "deepseek_v3": native(), "deepseek_v32": native(), "deepseek_v4": native(),
    "glm4_moe": native(), "glm_moe_dsa": native(), "gpt_oss": native(), "llama4_text": native(),
    "minimax_m2": native(), "mixtral": native(), "olmoe": native(), "qwen2_moe": native(),
    "qwen3_5_moe_text": native(), "qwen3_moe": native(), "qwen3_next": native(),
    "llama": native(), "qwen2": native(), "mistral": native(),
    # transformers' modeling code behind our paged attention and MoE executor
    "afmoe": generic(), "aria_text": generic(), "axk1": generic(), "beam": generic(), "cohere2_moe": generic(),
    "dots1": generic(), "ergo": generic(), "ernie4_5_moe": generic(), "exaone_moe": generic(),
    "flex_olmo": generic(), "flint": generic(), "glm4_moe_lite": generic(), "granitemoe": generic(),
    "granitemoe_swa": generic(), "granitemoeshared": generic(), "hunyuan_v1_moe": generic(), "hy_v3": generic(),
    "kolibri1": generic(), "laguna": generic(), "longcat_flash": generic(), "mellum": generic(),
    "minicpm5_moe": generic(), "minimax_m3_vl_text": generic(), "phimoe": generic(), "solar_open": generic(),
    "qwen3": generic(), "gemma3_text": generic(), "phi3": generic(),
    # a native port's architecture name on another model type's config and weights
    "sarvam_mla": generic(), "param2moe": generic(), "sarvam_moe": generic(),
    # recurrent layers (Mamba, Mamba2, linear attention, short conv) in our state slots
    "bailing_hybrid": generic(), "granitemoehybrid": generic(), "jamba": generic(), "kimi_linear": generic(),
    "lara_mini": generic(), "lfm2_moe": generic(), "nemotron_h": generic(),
    "zaya": generic(),   # attention layers that also keep a state (CCA)
    "minimax": generic(),   # lightning attention (decay buffers as the model derives them: arch_sweep_cases.py)
    # attention on transformers' own cache and mask, per sequence (sparse-attention indexers, a position bias)
    "axk2": generic(), "hy_v4": generic(), "dots3_note_text": generic(), "inkling_text": generic(),
    "doge": generic(),   # its dynamic mask over the causal mask
    # once the backend's KV probe read their layers' shapes
    "dbrx": generic(), "jetmoe": generic(), "mimo_v2_flash": generic(), "gemma4_text": generic(),
    # refused by name
    "kolibri1_1": refused(INDEXED), "qwen4_exp_text": refused(INDEXED),   # layers share state along the row
    "inkling2_text": refused(STATE_SHAPE), "inkling2_loop_text": refused(STATE_SHAPE),
}
# --model-impl transformers where a native port exists: the generic path on the models we know best
FORCED_GENERIC: dict[str, Expected] = {
    **{t: generic() for t in ("deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2", "mixtral", "olmoe",
                              "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "llama", "qwen2", "mistral")},
    "deepseek_v32": generic(), "glm_moe_dsa": generic(),
    "deepseek_v4": refused("has layers of type 'compressed_sparse_attention'"),
    "llama4_text": refused("counts positions along its row"),   # NoPE layers' attention temperature
}
# --ep 2 --dp-attn 2: model types the generic path runs on one rank but not split (a substring of the failure)
EP_BROKEN: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread while the module runs: for these tiny models a second thread only adds hand-offs, which
    cost 10x on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sweep_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """`checkpoint(model_type) -> Path`, each built once per run (shared by xdist workers)."""
    root = shared_root(tmp_path_factory)

    def checkpoint(model_type: str):
        return build_once(root, f"arch sweep {model_type}",
                          lambda path: build_sweep_checkpoint(model_type, path, tiny_tokenizer_dir))
    return checkpoint


@pytest.fixture(scope="module")
def summary(request):
    """Each test's outcomes, counted on the terminal when the module ends."""
    seen: dict[str, object] = {}
    yield seen
    counts: dict[tuple[str, str], int] = {}
    for outcome in seen.values():
        key = (outcome.status, outcome.path or "-")
        counts[key] = counts.get(key, 0) + 1
    line = ", ".join(f"{status}/{path}: {n}" for (status, path), n in sorted(counts.items()))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and seen:
        reporter.write_line(f"\narch sweep, one rank: {len(seen)} model types: {line}")


def check(expected: Expected, outcome) -> None:
    if expected.status == RUNS:
        assert outcome.status == RUNS, f"{outcome.model_type} no longer runs: {outcome.status}: {outcome.detail}"
        assert outcome.path == expected.path, f"{outcome.model_type} ran {outcome.path}, the table says {expected.path}"
        assert outcome.cached_prompt_tokens > 0, f"{outcome.model_type}: the shared prefix missed the prefix cache"
    elif expected.status == REFUSED:
        assert outcome.status == REFUSED, f"{outcome.model_type}: {outcome.status} ({outcome.detail}), listed refused"
        assert expected.reason in outcome.detail, f"{outcome.model_type}'s refusal changed: {outcome.detail}"
    else:
        assert outcome.status in (ERROR, MISMATCH), (
            f"{outcome.model_type} is listed broken, now {outcome.status} {outcome.path} {outcome.detail}: "
            "update its row")
        assert expected.reason in outcome.detail, f"{outcome.model_type}'s failure changed: {outcome.detail}"


def test_the_table_lists_every_model_type():
    assert sorted(EXPECTED) == sorted(sweep_model_types())


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_one_rank(model_type, sweep_checkpoint, summary):
    path = sweep_checkpoint(model_type)
    expected = oracle_tokens(path)
    outcome = run_engine(model_type, path, expected)
    summary[model_type] = outcome
    check(EXPECTED[model_type], outcome)
    if outcome.status == RUNS:   # a continuation of one or two repeated tokens would let a wrong model pass
        assert len({t for tokens in expected for t in tokens}) >= MIN_DISTINCT_TOKENS, f"weak oracle: {expected}"


def test_the_forced_table_lists_every_native_row():
    assert sorted(FORCED_GENERIC) == sorted(t for t, e in EXPECTED.items() if e == native())


@pytest.mark.parametrize("model_type", list(FORCED_GENERIC))
def test_one_rank_forced_transformers(model_type, sweep_checkpoint):
    path = sweep_checkpoint(model_type)
    check(FORCED_GENERIC[model_type], run_engine(model_type, path, oracle_tokens(path), model_impl="transformers"))


EP_MODEL_TYPES = [t for t, e in EXPECTED.items() if e == generic() and t not in DENSE_TYPES]


def test_expert_parallel_with_dp_attention(ranks, sweep_checkpoint, request):
    """--ep 2 --dp-attn 2 for every MoE model type the transformers backend serves: both ranks (each its own DP
    worker, experts split between them) give transformers' tokens. One pooled process group runs them all."""
    cases = [RankCase(t, str(sweep_checkpoint(t)), oracle_tokens(sweep_checkpoint(t))) for t in EP_MODEL_TYPES]
    per_rank = ranks(2).run(run_on_rank, cases, ep=2, dp_attn=2, timeout_s=600)
    failures = []
    for rank, outcomes in enumerate(per_rank):
        for o in outcomes:
            if o.model_type in EP_BROKEN:
                if o.status == RUNS or EP_BROKEN[o.model_type] not in o.detail:
                    failures.append(f"rank {rank} {o.model_type}: listed broken with --ep 2, now {o.status} {o.detail}")
            elif o.status != RUNS or o.path != GENERIC:
                failures.append(f"rank {rank} {o.model_type}: {o.status} {o.path} {o.detail}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\narch sweep, --ep 2 --dp-attn 2: {len(EP_MODEL_TYPES)} model types, "
                            f"{len(failures)} rank failures")
    assert not failures, "\n".join(failures)
    assert [o.model_type for o in per_rank[0]] == EP_MODEL_TYPES
