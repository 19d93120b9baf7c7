"""Routing replay (issue 54): `return_routed_experts` gives each position's logical expert ids, equal to transformers'
router top-k and the same under every layout; `forced_routed_experts` routes the positions it covers."""
import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_helpers import greedy
from lazy_engines import tiny_engine_pool
from server_harness import serve_in_process
from tiny_checkpoints import hf_greedy
from moe_runtime import LLM, SamplingParams
from moe_runtime.config.parallel_context import ParallelContext
from moe_runtime.engine.request_limits import RequestLimits
from moe_runtime.engine.routing_replay import RankRouting
from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.routed_experts import RoutedExpertsArray
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

PROMPTS = [[5, 17, 42, 99, 3, 8, 21], [77, 6]]
NEW_TOKENS = 6
REPEATING = [5, 17, 42, 99, 3, 8] * 3   # n-gram drafts are proposed, some accepted, some rejected
LAYOUT_TOKENS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
LAYOUTS = {
    "one": {},
    # pipeline stages of expert-parallel ranks with DP attention, replicas, live rebalances while requests decode,
    # two-batch overlap (each DP worker's sequences in two micro-batches)
    "ep_pp": dict(pp=2, ep=2, dp_attn=2, num_redundant_experts=2, eplb_interval=3, eplb_layers_per_step=1,
                  eplb_window=4, enable_two_batch_overlap=True),
    # attention TP (ep=2, dp_attn=1: one DP worker over both ranks, experts split by EP) verifying n-gram drafts
    "ngram_tp_attn": dict(ep=2, dp_attn=1, speculative_config=NGRAM),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory):
    with tiny_engine_pool(tiny_checkpoint_factory, LAYOUTS) as get:
        yield get


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoint_factory):
    """arch -> its transformers model (fp32), loaded once; the session's oracles keep their answer cache (their
    `model` would turn it off for every other module)."""
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_factory(arch)), dtype=torch.float32,
                                                                local_files_only=True).eval()
        return loaded[arch]
    return get


def routed(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    return greedy(max_tokens, return_routed_experts=True, **kwargs)


def hf_router_ids(model, token_ids: list[int]) -> np.ndarray:
    """transformers' router top-k ([T, moe_layers, K], each token's ids sorted) over one forward of `token_ids`."""
    chosen = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
             for name, module in model.named_modules() if name.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return np.sort(torch.stack(chosen, dim=1).numpy(), axis=-1)                     # [T, L, K]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_returned_routing_is_transformers_router_top_k(arch, engines, hf_models):
    outputs = engines(arch, "one").generate(PROMPTS, routed())
    model = hf_models(arch)
    for prompt, output in zip(PROMPTS, outputs):
        array = output.routed_experts
        layers = sum(1 for name, _ in model.named_modules() if name.endswith("mlp.gate"))
        assert array.dtype == np.uint8
        assert array.shape == (len(prompt) + NEW_TOKENS - 1, layers, model.config.num_experts_per_tok)
        expected = hf_router_ids(model, prompt + output.token_ids[:-1])
        np.testing.assert_array_equal(np.sort(array, axis=-1), expected)


def hf_forced_greedy(model, prompt: list[int], forced: np.ndarray, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens with its routers patched: positions [0, len(forced)) take the forced ids, weighed
    by the family's own gating at them (softmax or sigmoid scores, normalized, scaled), the others its own top-k."""
    config = model.config
    scaling = getattr(config, "routed_scaling_factor", 1.0)
    layer_of = {module: layer for layer, module in enumerate(m for name, m in model.named_modules()
                                                             if name.endswith("mlp.gate"))}

    def patched(module, _inputs, out):
        logits, weights, ids = out                                                   # [T, E], [T, K], [T, K]
        rows = min(len(forced), ids.shape[0])
        ids = ids.clone()
        ids[:rows] = torch.from_numpy(forced[:rows, layer_of[module]].astype(np.int64))
        scores = logits.float().sigmoid() if config.model_type == "deepseek_v3" else logits.float().softmax(-1)
        chosen = scores.gather(1, ids)
        if config.norm_topk_prob:
            chosen = chosen / (chosen.sum(-1, keepdim=True) + (1e-20 if config.model_type == "deepseek_v3" else 0))
        weights = weights.clone()
        weights[:rows] = (chosen * scaling)[:rows].to(weights.dtype)
        return logits, weights, ids

    hooks = [module.register_forward_hook(patched) for module in layer_of]
    tokens = list(prompt)
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):   # no KV cache: every position is routed again in each forward
                tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    finally:
        for hook in hooks:
            hook.remove()
    return tokens[len(prompt):]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_forced_routing_replays_and_reroutes(arch, engines, hf_models):
    """Forcing the returned routing gives the same tokens and array; forcing another (every id shifted by one, over
    the prompt and the first generated positions) gives transformers' tokens with its routers so patched."""
    llm = engines(arch, "one")
    prompt = PROMPTS[0]
    first = llm.generate([prompt], routed())[0]
    again = llm.generate([prompt], routed(forced_routed_experts=first.routed_experts))[0]
    assert again.token_ids == first.token_ids
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)

    num_experts = llm.engine.limits.routing.num_experts
    other = ((first.routed_experts[: len(prompt) + 2].astype(np.int64) + 1) % num_experts).astype(np.uint8)
    rerouted = llm.generate([prompt], routed(forced_routed_experts=other))[0]
    np.testing.assert_array_equal(rerouted.routed_experts[: len(other)], other)
    assert rerouted.token_ids != first.token_ids, "the forced routing changed nothing: the test proves nothing"
    assert rerouted.token_ids == hf_forced_greedy(hf_models(arch), prompt, other, NEW_TOKENS)


def with_hash_table(source: Path, directory: Path) -> Path:
    """A copy of the tiny DeepSeek-V4 checkpoint whose hash layer's `tid2eid` names two different experts per token
    (the tiny model's, as transformers initializes it, is all zeros: expert 0 twice for every token)."""
    directory.mkdir()
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    tensors = {name: tensor for file in source.glob("*.safetensors") for name, tensor in load_file(str(file)).items()}
    [name] = [name for name in tensors if name.endswith("tid2eid")]
    experts = json.loads((source / "config.json").read_text())["n_routed_experts"]
    assert tensors[name].shape[1] == 2, "the table below is a top-2 one"
    token = torch.arange(tensors[name].shape[0])                          # [V]
    step = 1 + token // experts % (experts - 1)                           # 1 .. experts - 1: never the same expert
    tensors[name] = torch.stack([token % experts, (token + step) % experts], dim=1)   # [V, 2]
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_deepseek_v4_hash_layers_record_and_take_forced_routing(tiny_checkpoint_factory, tmp_path):
    """DeepSeek-V4's hash layer (layer 0 of the tiny model: experts from a token-id table) records its table's ids, and
    forcing replaces them as on any layer: its own array back gives the same tokens and bitwise logprobs (forced ids
    weighed as the table's are), and ids the table would not pick come back as forced and change the tokens."""
    checkpoint = with_hash_table(Path(tiny_checkpoint_factory("deepseek_v4")), tmp_path / "hashed")
    table = next(tensor for name, tensor in load_file(str(checkpoint / "model.safetensors")).items()
                 if name.endswith("tid2eid")).numpy()
    prompt = [(7 * i + 3) % 500 + 5 for i in range(20)]
    with LLM(str(checkpoint), device="cpu", dtype="float32") as llm:
        first = llm.generate([prompt], routed(logprobs=1))[0]
        again = llm.generate([prompt], routed(logprobs=1, forced_routed_experts=first.routed_experts))[0]
        other = first.routed_experts[: len(prompt) + 2].copy()
        other[:, 0] = (other[:, 0] + 1) % llm.engine.limits.routing.num_experts   # the hash layer only
        rerouted = llm.generate([prompt], routed(forced_routed_experts=other))[0]
    tokens = prompt + first.token_ids[:-1]
    np.testing.assert_array_equal(np.sort(first.routed_experts[:, 0], axis=-1), np.sort(table[tokens], axis=-1))
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)
    np.testing.assert_array_equal(rerouted.routed_experts[: len(other), 0], other[:, 0])
    assert rerouted.token_ids != first.token_ids, "the forced hash routing changed nothing: the test proves nothing"


def test_invalid_forced_routing_is_refused_naming_the_field(engines):
    llm = engines("qwen3_moe", "one")
    shape = llm.engine.limits.routing
    good = np.zeros((3, shape.num_moe_layers, shape.top_k), dtype=np.uint8)
    good[..., :] = np.arange(shape.top_k, dtype=np.uint8)
    duplicate = good.copy()
    duplicate[1, 0, 1] = duplicate[1, 0, 0]
    out_of_range = good.copy()
    out_of_range[2, 1, 0] = shape.num_experts
    cases = {
        "tokens, ": np.zeros((3, shape.num_moe_layers + 1, shape.top_k), dtype=np.uint8),
        "names an expert twice": duplicate,
        "expert ids must be in": out_of_range,
        "it covers 1 to": np.tile(good[:1], (len(PROMPTS[0]) + NEW_TOKENS + 1, 1, 1)),
        "dtype 'float32'": good.astype(np.float32),
        "bytes of data": RoutedExpertsArray((3, shape.num_moe_layers, shape.top_k), "uint8", b"\0"),
    }
    for words, forced in cases.items():
        with pytest.raises(InvalidRequestError, match="forced_routed_experts") as refused:
            llm.generate([PROMPTS[0]], routed(forced_routed_experts=forced))
        assert words in str(refused.value), (words, str(refused.value))
    with pytest.raises(ValueError, match=f"needs {2**64}$"):   # the exact size, where int64 wraps around to 0
        RoutedExpertsArray((2**62, 2, 2), "uint8", b"\0").to_numpy()


def decoded(field: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field["data"]), dtype=field["dtype"]).reshape(field["shape"])


def test_http_routed_experts_round_trip(tiny_checkpoint_factory):
    """Completions return each choice's array as base64 with its shape and dtype; the same object forced back
    reproduces it; a streamed chat call carries the array in its final chunk; bad input is a 400 naming the field."""
    llm = LLM(str(tiny_checkpoint_factory("qwen3_moe")), device="cpu", dtype="float32")
    prompt = PROMPTS[0]
    expected = llm.generate([prompt], routed())[0]
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_routed_experts": True}

    async def scenario(client, _):
        first = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        forced = await client.post("/v1/completions", json={**body, "forced_routed_experts": first["routed_experts"]})
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True,
            "return_routed_experts": True})
        not_base64 = await client.post("/v1/completions", json={
            **body, "forced_routed_experts": {**first["routed_experts"], "data": "%%%"}})
        twice = decoded(first["routed_experts"]).copy()
        twice[0, 0, 1] = twice[0, 0, 0]
        duplicate = await client.post("/v1/completions", json={
            **body, "forced_routed_experts": {**first["routed_experts"], "data": base64.b64encode(twice).decode()}})
        return first, forced.json()["choices"][0], chat.text, not_base64, duplicate

    first, forced, chat, not_base64, duplicate = serve_in_process(llm.engine, scenario)
    assert first["routed_experts"]["dtype"] == "uint8"
    np.testing.assert_array_equal(decoded(first["routed_experts"]), expected.routed_experts)
    assert forced["text"] == first["text"] and forced["routed_experts"] == first["routed_experts"]
    chunks = [json.loads(line[len("data: "):]) for line in chat.splitlines() if line.startswith("data: {")]
    carrying = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0].get("routed_experts")]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] == "length"
    assert decoded(carrying[0]["routed_experts"]).shape[1:] == expected.routed_experts.shape[1:]
    for refused in (not_base64, duplicate):
        assert refused.status_code == 400, refused.text
        assert "forced_routed_experts" in refused.json()["error"]["message"]


@pytest.mark.parametrize("layout", ["ep_pp", "ngram_tp_attn"])
def test_routing_is_the_same_under_every_layout(layout, engines):
    """Expert parallelism with DP attention, replicas and rebalances mid-generation, two-batch overlap; pipeline
    stages (each holds some MoE layers: gathered); n-gram speculation (only accepted tokens' rows) under attention
    TP (each rank routes all its worker's rows, then dispatches its share of them): the one-rank array."""
    prompts = [PROMPTS[1], REPEATING, PROMPTS[0], [9, 4]]
    expected = engines("qwen3_moe", "one").generate(prompts, routed(LAYOUT_TOKENS))
    llm = engines("qwen3_moe", layout)
    outputs = llm.generate(prompts, routed(LAYOUT_TOKENS))
    for want, got in zip(expected, outputs):
        assert got.token_ids == want.token_ids
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    if layout == "ep_pp":
        assert any(event.ok and event.experts_moved for event in llm.engine.rebalance_events()), \
            "no rebalance moved an expert: the test proves nothing"
    if layout == "ngram_tp_attn":
        workers = llm.engine.stats().workers
        accepted, drafted = sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)
        assert 0 < accepted < drafted, (accepted, drafted)


def test_chunked_prefill_preemption_prefix_cache_and_stop_strings(engines):
    """Prompts prefilled in chunks of 6 tokens, requests preempted and recomputed, a prompt whose blocks the
    prefix cache holds (not taken: every position is routed here), a request a stop string ends at the front:
    the one-rank arrays, cut at the last token."""
    one = engines("qwen3_moe", "one")
    prompts = [REPEATING, PROMPTS[0], PROMPTS[1] * 4]
    expected = one.generate(prompts, routed(LAYOUT_TOKENS))
    core = one.core
    bytes_per_token = core.runner.cache_bytes() // core.kv_capacity_tokens
    with LLM(str(core.checkpoint_dir), device="cpu", dtype="float32", block_size=4, enable_chunked_prefill=True,
             max_num_batched_tokens=6, kv_cache_memory=bytes_per_token * 32, enable_prefix_caching=True) as tight:
        outputs = tight.generate(prompts, routed(LAYOUT_TOKENS))
        assert tight.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        tight.generate(prompts[:1], greedy(1))
        assert tight.generate(prompts[:1], greedy(1))[0].cached_prompt_tokens > 0, "no prefix hit to refuse"
        cached = tight.generate(prompts[:1], routed(LAYOUT_TOKENS))[0]
        stop = tight.tokenizer.decode(expected[1].token_ids[3:5])
        stopped = tight.generate(prompts[1:2], routed(LAYOUT_TOKENS, stop=[stop]))[0]
    for want, got in zip(expected, outputs):
        assert got.token_ids == want.token_ids
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    np.testing.assert_array_equal(cached.routed_experts, expected[0].routed_experts)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < LAYOUT_TOKENS
    rows = len(prompts[1]) + len(stopped.token_ids) - 1
    np.testing.assert_array_equal(stopped.routed_experts, expected[1].routed_experts[:rows])


def test_a_forced_routing_never_feeds_the_prefix_cache(engines, tiny_checkpoint_factory):
    """A request forcing its routing computes its KV under that routing from the second MoE layer on: its blocks are
    not registered, so a plain request with the same prompt after it reuses none and gets the model's tokens."""
    llm = engines("qwen3_moe", "one")
    prompt = [(13 * i + 5) % 500 + 3 for i in range(34)]   # two full blocks, computed by no other test
    shape = llm.engine.limits.routing
    rng = np.random.default_rng(0)
    forced = np.stack([[rng.choice(shape.num_experts, shape.top_k, replace=False) for _ in range(shape.num_moe_layers)]
                       for _ in prompt]).astype(np.uint8)                                        # [T, L, K]
    forced_tokens = llm.generate([prompt], greedy(NEW_TOKENS, forced_routed_experts=forced))[0].token_ids
    plain = llm.generate([prompt], greedy(NEW_TOKENS))[0]
    expected = hf_greedy(tiny_checkpoint_factory("qwen3_moe"), [prompt], NEW_TOKENS)[0]
    assert forced_tokens != expected, "the forced routing changed nothing: the test proves nothing"
    assert plain.cached_prompt_tokens == 0 and plain.token_ids == expected


def test_layouts_without_routing_replay_refuse_it_at_admission():
    """Context parallelism and P/D instances (each rank or instance computes part of a request), and a dense model."""
    cp = RankRouting.for_engine(2, 2, 8, ParallelContext(cp_size=2))
    pd = RankRouting.for_engine(2, 2, 8, ParallelContext.single(), disaggregated=True)
    dense = RankRouting.for_engine(0, 0, 0, ParallelContext.single())
    for routing, words in ((cp, "context parallelism"), (pd, "disaggregation-mode"), (dense, "no MoE layers")):
        limits = RequestLimits(vocab_size=512, max_model_len=64, kv_capacity_tokens=64, routing=routing.shape)
        with pytest.raises(InvalidRequestError, match="return_routed_experts") as refused:
            limits.check([1, 2], routed())
        assert words in str(refused.value)
    RequestLimits(512, 64, 64, routing=RankRouting.for_engine(2, 2, 8, ParallelContext.single()).shape).check(
        [1, 2], routed())


def test_mtp_speculation_returns_the_target_models_routing(engines, tiny_checkpoint_factory, tmp_path):
    """A DeepSeek-V3 with an MTP layer drafting (its MoE layer not a column) and verifying: the one-rank array. The
    tiny random MTP layer's drafts are all rejected (n-gram's test has accepted ones): every verify step writes rows
    of rejected drafts that must not come out."""
    base = tiny_checkpoint_factory("deepseek_v3")
    prompts = [REPEATING, PROMPTS[0]]
    expected = engines("deepseek_v3", "one").generate(prompts, routed(LAYOUT_TOKENS))
    with LLM(str(write_mtp_checkpoint(base, tmp_path / "mtp")), device="cpu", dtype="float32",
             speculative_config={"method": "mtp", "num_speculative_tokens": 3}) as llm:
        outputs = llm.generate(prompts, routed(LAYOUT_TOKENS))
        workers = llm.engine.stats().workers
    accepted, drafted = sum(w.spec_accepted_tokens for w in workers), sum(w.spec_draft_tokens for w in workers)
    assert drafted > accepted, (accepted, drafted)
    for want, got in zip(expected, outputs):
        assert got.token_ids == want.token_ids
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
