"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): compressed sparse attention (CSA), heavily compressed attention (HCA) and a
sliding window, hyper-connected residual streams, hash-routed and sqrtsoftplus MoE layers.

The tiny model (tests/tiny_archs.py) compresses 4 tokens per CSA entry (its indexer keeping 4 per query) and 16 per
HCA entry (shrunk from 128), with an 8-token window. The prompts (23 to 45 tokens) hold several complete entries of
both and a partial one, and outrun the window and the top-k: `test_the_compressed_entries_really_matter` shows that
the indexer's choice and the compressed entries change the tokens.

Greedy tokens and prompt logprobs equal transformers' on one rank, with prefills cut into 5-token chunks, with a
cached prefix resumed from a state snapshot, with n-gram speculative decoding, in DeepSeek's published checkpoint
names, and (slow) with EP + DP attention, two-batch overlap, attention TP and two pipeline stages (P/D:
tests/test_pd_deepseek_v4.py; DeepSeek's FP8 / FP4 release format: tests/test_deepseek_v4_release.py). The paged cache per token is measured against a full MLA cache's; the layouts and
options not built are refused by name.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import greedy
from lazy_engines import tiny_engine_pool
from test_prompt_logprobs import assert_prompt_logprobs_match, expected_logprobs
from tiny_checkpoints import HFOracle
from moe_runtime import LLM
from moe_runtime.config.parallel_layout import ParallelLayout
from moe_runtime.errors import InvalidRequestError
from moe_runtime.layers.compressed_cache import CompressedAttentionSpec, LayerCompressedCache
from moe_runtime.planner.model_shape import model_shape_of

ARCH = "deepseek_v4"
NEW_TOKENS = 8
NUM_TOP = 3
PROMPTS = [   # HCA: 2 complete entries of 16 and a partial one in the first; CSA: 5 to 11 entries, top-4 kept
    [(7 * i + 3) % 500 + 5 for i in range(45)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(38)],
]
SHARED_PREFIX = PROMPTS[0][:32] + [(3 * i + 11) % 450 + 8 for i in range(7)]   # two cached blocks, its own tail
LAYOUTS = {
    "one_rank": {},
    "chunked_prefix": dict(max_num_batched_tokens=5, enable_chunked_prefill=True, enable_prefix_caching=True),
    "ep2_dp2": dict(ep=2, dp_attn=2),
    "ep2_dp2_overlap": dict(ep=2, dp_attn=2, enable_two_batch_overlap=True),
    "ep2_attention_tp2": dict(ep=2, dp_attn=1),   # 4 heads, 2 output groups: a group per rank
    "pp2": dict(pp=2, pp_layers=(1, 2)),          # the CSA layer, then the HCA and sliding layers
    "ngram_speculation": dict(speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                                      prompt_lookup_max=3)),
}
REPEATING = [[7, 8, 9] * 6 + [1, 2], [11, 23] * 12]   # continuations that repeat: some drafts hold, some do not
SPECULATED_TOKENS = 24


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
        yield lambda layout: get(ARCH, layout)


@pytest.fixture(scope="module")
def expected(greedy_oracle):
    def get(prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
        tokens = greedy_oracle(ARCH, prompts, NEW_TOKENS)
        assert max(len(set(continuation)) for continuation in tokens) > 2, "degenerate oracle tokens"
        return tokens
    return get


def test_the_compressed_entries_really_matter(tiny_checkpoint_factory):
    """transformers' own model with its indexer keeping every CSA entry, or with its HCA layer's compressor taken out,
    scores the prompt otherwise: the top-k choice and the compressed entries are what the parity tests hold."""
    oracle = HFOracle(tiny_checkpoint_factory(ARCH))   # its own: the model it hands out is changed (and its cache off)
    attentions = [layer.self_attn for layer in oracle.model.model.layers]
    indexer, hca = attentions[0].compressor.indexer, attentions[1].compressor
    reference = oracle.prefill_logits(PROMPTS[0])
    try:
        indexer.index_topk = 4096
        every_entry = oracle.prefill_logits(PROMPTS[0])
        indexer.index_topk, attentions[1].compressor = 4, None
        no_hca = oracle.prefill_logits(PROMPTS[0])
    finally:
        indexer.index_topk, attentions[1].compressor = 4, hca
    assert torch.equal(oracle.prefill_logits(PROMPTS[0]), reference)
    for changed in (every_entry, no_hca):
        assert (changed - reference)[12:].abs().max() > 1e-2    # from position 12 on, past the window and top-k
        torch.testing.assert_close(changed[:3], reference[:3], atol=1e-5, rtol=0)   # before any entry is complete


def test_one_rank_tokens_and_prompt_logprobs_equal_transformers(engines, expected, hf_oracles):
    outputs = engines("one_rank").generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected()
    for prompt, output in zip(PROMPTS, outputs):
        assert_prompt_logprobs_match(output.prompt_logprobs, expected_logprobs(hf_oracles(ARCH), prompt), prompt,
                                     NUM_TOP)


def test_chunked_prefill_and_a_cached_prefix_keep_the_tokens(engines, expected, hf_oracles):
    """Prefills in steps of 5 tokens (entries completed across chunks, from the carried partial windows); then a
    prompt sharing the first two blocks of one already served resumes from their entries and the state snapshot
    at their end."""
    llm = engines("chunked_prefix")
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected()
    assert_prompt_logprobs_match(outputs[0].prompt_logprobs, expected_logprobs(hf_oracles(ARCH), PROMPTS[0]),
                                 PROMPTS[0], NUM_TOP)
    hits = llm.engine.stats().prefix_cache_hits
    [shared] = llm.generate([SHARED_PREFIX], greedy(NEW_TOKENS))
    assert llm.engine.stats().prefix_cache_hits > hits, "the shared prefix did not reuse its cached blocks"
    assert shared.token_ids == expected([SHARED_PREFIX])[0]


def test_speculative_decoding_rolls_the_state_rings_back(engines, greedy_oracle):
    """Verify steps of 1 + 3 tokens: a rejected draft's window key and carried projections land on ring slots no later
    step reads (the rings keep 4 more positions; without them the tokens differ), and an entry a rejected draft
    completed is computed again when its window really completes."""
    llm = engines("ngram_speculation")
    outputs = llm.generate(REPEATING, greedy(SPECULATED_TOKENS))
    assert [o.token_ids for o in outputs] == greedy_oracle(ARCH, REPEATING, SPECULATED_TOKENS)
    workers = llm.engine.stats().workers
    accepted, drafted = sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)
    assert 0 < accepted < drafted, (accepted, drafted)   # drafts kept and drafts rolled back


def test_deepseeks_published_tensor_names_load(tiny_checkpoint_factory, tmp_path, expected):
    """The checkpoint as DeepSeek publishes it (`embed.weight`, `layers.N.attn.wq_a.weight`, `hc_head_fn`, ...,
    no `model.` prefix; an `mtp.0.*` layer, skipped) gives the same tokens."""
    source = Path(tiny_checkpoint_factory(ARCH))
    published = tmp_path / "published"
    published.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            (published / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for file in source.glob("*.safetensors"):
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
            tensors[name] = tensor
    tensors["mtp.0.hc_head_fn"] = tensors["hc_head_fn"].clone()
    assert "embed.weight" in tensors and "layers.0.attn.wq_a.weight" in tensors and "head.weight" in tensors
    save_file(tensors, str(published / "model.safetensors"))
    with LLM(str(published), device="cpu", dtype="float32") as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], greedy(NEW_TOKENS))] == expected()[:1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_dp2", "ep2_dp2_overlap"])
def test_expert_parallel_with_dp_attention_matches(layout, engines, expected):
    """Each DP worker's sequences keep their state on its rank; with two-batch overlap a step's two halves each
    compress and attend their own sequences."""
    llm = engines(layout)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected()
    [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))   # the other DP worker runs empty batches
    assert single.token_ids == expected()[1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_attention_tp2", "pp2"])
def test_attention_tp_and_pipeline_stages_match(layout, engines, expected, hf_oracles):
    """Attention TP: each rank its heads and output groups, the compressors and indexer whole on both; pp2: the
    hyper-connection streams travel between the stages flattened."""
    outputs = engines(layout).generate(PROMPTS, greedy(NEW_TOKENS, prompt_logprobs=NUM_TOP))
    assert [o.token_ids for o in outputs] == expected()
    assert_prompt_logprobs_match(outputs[0].prompt_logprobs, expected_logprobs(hf_oracles(ARCH), PROMPTS[0]),
                                 PROMPTS[0], NUM_TOP)


def test_the_paged_cache_per_token_is_a_full_mla_caches_over_the_compression_ratios(engines):
    """Measured on the allocated tensors: a compressing layer pages head_dim / rate elements per token (and its
    indexer index_head_dim / rate), where a full MLA-style cache pages a whole latent per token per layer; the
    window and the partial windows are per sequence, whatever its length."""
    llm = engines("one_rank")
    runner, cfg = llm.core.runner, llm.core.hf_config
    caches = [cache for cache in runner.caches if isinstance(cache, LayerCompressedCache)]
    assert len(caches) == cfg.num_hidden_layers
    tokens = caches[0].entries.shape[0] * runner.block_size
    full_mla_per_layer = cfg.head_dim * 4                   # one fp32 latent of head_dim per token per layer
    for cache, kind in zip(caches, cfg.layer_types):
        paged = sum(t.numel() * t.element_size() for t in cache.paged_tensors()) / tokens
        if kind == "sliding_attention":
            assert paged == 0
            continue
        rate = cfg.compress_rates[kind]
        index = cfg.index_head_dim * 4 / rate if kind == "compressed_sparse_attention" else 0
        assert paged == full_mla_per_layer / rate + index
    total = sum(sum(t.numel() * t.element_size() for t in c.paged_tensors()) for c in caches) / tokens
    assert total == 56 < full_mla_per_layer * cfg.num_hidden_layers / 6   # 56 bytes a token against 384


def test_deepseek_v4_flash_pages_under_a_tenth_of_deepseek_v3s_cache_per_token():
    """At the published shapes (bfloat16): V4-Flash's 43 layers page 2 * (43 entries' bytes) per token (CSA
    (512 + 128) / 4, HCA 512 / 128); DeepSeek-V3's 61 MLA layers page 576 each."""
    from transformers import DeepseekV3Config, DeepseekV4Config

    v4, v3 = DeepseekV4Config(), DeepseekV3Config()
    per_token = 0.0
    for kind in v4.layer_types:
        rate = v4.compress_rates.get(kind, 0)
        spec = CompressedAttentionSpec(v4.head_dim, v4.sliding_window, rate, kind == "compressed_sparse_attention",
                                       v4.index_head_dim if kind == "compressed_sparse_attention" else 0)
        per_token += spec.bytes_per_block(128 * 16, torch.bfloat16) / (128 * 16)
    mla_per_token = v3.num_hidden_layers * (v3.kv_lora_rank + v3.qk_rope_head_dim) * 2
    assert per_token < mla_per_token / 10, (per_token, mla_per_token)


def test_the_planner_reads_deepseek_v4_flash():
    """Its published shape: 284B parameters, 13B active; its commands ask for blocks of 128 (the HCA rate)."""
    from transformers import DeepseekV4Config

    config = {**DeepseekV4Config().to_dict(), "architectures": ["DeepseekV4ForCausalLM"], "torch_dtype": "bfloat16"}
    shape = model_shape_of(config)
    assert round(shape.total_params / 1e9) == 284 and round(shape.active_params / 1e9) == 13
    assert shape.block_size_for(16) == 128
    csa = shape.layers[config["layer_types"].index("compressed_sparse_attention")]
    assert csa.kv_dim == (512 + 128) // 4


@pytest.mark.parametrize("layout, match", [
    (dict(ep=4, dp_attn=1), r"attention TP = 4 with DeepSeek-V4's 2 output groups .* divides 2"),
    (dict(ep=2, dp_attn=1, cp=2), r"cp=2 with DeepSeek-V4: not implemented"),
])
def test_layouts_not_built_are_refused_by_name(layout, match, hf_oracles):
    with pytest.raises(InvalidRequestError, match=match):
        ParallelLayout(**layout).validate(hf_oracles(ARCH).config)
    for built in (dict(ep=2, dp_attn=2), dict(ep=2, dp_attn=1), dict(pp=2)):
        ParallelLayout(**built).validate(hf_oracles(ARCH).config)


@pytest.mark.parametrize("options, match", [
    (dict(block_size=8), r"--block-size 8 with DeepSeek-V4: .* multiple of every compression rate \[4, 16\]"),
    # refused before the model is built, by the option rules (front/model_options.py)
    (dict(quantization="int8"), r"--quantization int8 with DeepseekV4ForCausalLM: not implemented"),
    (dict(enable_torch_compile=True), r"--enable-torch-compile with DeepseekV4ForCausalLM: .*compressor state"),
])
def test_engine_options_not_built_are_refused_at_start_up(options, match, tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=match):
        LLM(str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", **options)
