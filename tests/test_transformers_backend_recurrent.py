"""Recurrent layers of models run through transformers (Mamba, Mamba2, short convolutions, linear attention), their
states kept in our state cache (moe_runtime/models/transformers_backend/recurrent_*.py).

The bridge is checked against transformers itself: the prompt fed in chunks, every chunk's states loaded from and
stored back into our state rows (moved to another slot midway, as a prefix-cache snapshot restore does), gives
transformers' generate's greedy tokens and a one-piece forward's logits. Then the engine (`--model-impl
transformers`) on saved tiny checkpoints of one model type per mixer family: chunked steps of 16 tokens, decodes of
several sequences batched, and a repeated prompt resuming from prefix-cache state snapshots, give transformers'
greedy tokens. Tiny configs are the arch sweep's.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from engine_helpers import greedy
from lazy_engines import engine_pool
from shared_builds import build_once, shared_root
from tiny_checkpoints import HFOracle, tiny_tokenizer
from moe_runtime import LLM
from moe_runtime.execution.model_runner import state_rows
from moe_runtime.layers.state_cache import LayerStateCache
from moe_runtime.models.transformers_backend.recurrent_bridge import RecurrentStateBridge
from moe_runtime.models.transformers_backend.recurrent_state import RecurrentLayout, UnsupportedRecurrentModel
from arch_sweep_configs import tiny_config_kwargs

VOCAB = 128
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# the bridge alone, for model types the engine tests below leave out (or refuse for their attention: Qwen4's QSA,
# Inkling's relative position bias; Inkling's attention layers keep four convolution states; Bailing's KDA)
BRIDGE_TYPES = ("jamba", "granitemoehybrid", "qwen4_exp_text", "inkling_text", "bailing_hybrid")
PROMPT_LEN = 11
NEW_TOKENS = 4


def tiny_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    return AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, default, VOCAB, SPECIAL))


class Models:
    """Each model type's tiny transformers model, its prompt and generate's greedy tokens, built once."""

    def __init__(self):
        self._built = {}

    def __call__(self, model_type: str):
        if model_type not in self._built:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            cfg = tiny_config(model_type)
            model = AutoModelForCausalLM.from_config(cfg).eval()
            prompt = torch.randint(3, VOCAB, (1, PROMPT_LEN))
            with torch.no_grad():
                tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
                logits = model(prompt).logits[0, -1]
            self._built[model_type] = (cfg, model, prompt[0].tolist(), tokens[0, PROMPT_LEN:].tolist(), logits)
        return self._built[model_type]


@pytest.fixture(scope="module")
def models():
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield Models()
    transformers.logging.set_verbosity(verbosity)


def _new_cache(model, layout: RecurrentLayout):
    from transformers import DynamicCache

    if layout.linear_cache:
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    return DynamicCache(config=model.config)


def run_in_chunks(model, layout: RecurrentLayout, prompt: list[int], chunks: list[int], new_tokens: int):
    """Greedy tokens and the prompt's last logits, the prompt fed in `chunks`, one token a call after it; the
    recurrent states live only in our state rows between calls (slot 1, then slot 3 from the second chunk on,
    restored from a snapshot row as the prefix cache does). transformers keeps the attention K/V itself."""
    caches = {layer: LayerStateCache.allocate(layout.state_spec(), 6, torch.float32, "cpu")
              for layer in layout.layer_indices}
    bridge = RecurrentStateBridge(layout, torch.float32)
    hf_cache = _new_cache(model, layout)
    tokens, done, slot, out, last = list(prompt), 0, 1, [], None
    pieces = list(chunks)
    with torch.no_grad():
        while len(out) < new_tokens:
            n = pieces.pop(0) if pieces else 1
            bridge.load(hf_cache, caches, [slot], fresh=done == 0, num_tokens=n, past_tokens=done)
            logits = model(torch.tensor([tokens[done:done + n]]), cache=hf_cache, use_cache=True,
                           position_ids=torch.arange(done, done + n)[None]).logits[0, -1]
            bridge.store(hf_cache, caches, [slot])
            done += n
            if done == chunks[0]:   # snapshot row 5 after the first chunk; the sequence resumes from it in slot 3
                for cache in caches.values():
                    cache.restore(torch.tensor([5]), torch.tensor([slot]))
                    cache.clear(torch.tensor([slot]))
                    cache.restore(torch.tensor([3]), torch.tensor([5]))
                slot = 3
            if done == len(prompt):
                last = logits
            if done >= len(tokens):
                tokens.append(int(logits.argmax()))
                out.append(tokens[-1])
    return out, last


@pytest.mark.parametrize("model_type", BRIDGE_TYPES)
def test_chunked_prefill_through_our_state_rows_is_generate(models, model_type):
    """Chunks of 1 (transformers' prefill path on one token), 4 and 6 (continued from a state); every store also
    checks each part's shape against the layout's (recurrent_state._SHAPES)."""
    cfg, model, prompt, expected, logits = models(model_type)
    tokens, last = run_in_chunks(model, RecurrentLayout.of(cfg), prompt, [1, 4, 6], NEW_TOKENS)
    assert tokens == expected
    torch.testing.assert_close(last, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["jamba", "granitemoehybrid", "qwen4_exp_text"])
def test_layout_dtypes_are_what_transformers_keeps_in_bf16(models, model_type):
    """The dtype a part is read back as before transformers left one in this process (a P/D transfer's state):
    the fp32 SSM / delta-rule states of a bf16 model, its convolutions in bf16."""
    from transformers import AutoModelForCausalLM

    cfg = models(model_type)[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    layout = RecurrentLayout.of(cfg)
    hf_cache = _new_cache(model, layout)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 7)), cache=hf_cache, use_cache=True)
    caches = {layer: LayerStateCache.allocate(layout.state_spec(), 2, torch.float32, "cpu")
              for layer in layout.layer_indices}
    bridge = RecurrentStateBridge(layout, torch.bfloat16)
    bridge.store(hf_cache, caches, [0])
    for state in layout.layers:
        for part in state.parts:
            seen = bridge.seen_dtypes[(state.layer, part.kind, part.index)]
            assert seen == (part.dtype or torch.bfloat16), (state, part)


def test_jamba_continues_its_scan_token_by_token(models):
    """Jamba's multi-token scan starts from zeros whatever the cache holds: without the per-token path for a
    continued chunk (`scan_ignores_state`) the chunks' logits leave the one-piece forward's."""
    cfg, model, prompt, _, logits = models("jamba")
    layout = RecurrentLayout.of(cfg)
    assert layout.scan_ignores_state
    wrong = RecurrentLayout(layout.model_type, layout.num_layers, layout.layers)
    _, last = run_in_chunks(model, wrong, prompt, [4, 7], 1)
    assert (last - logits).abs().max() > 1e-3


def test_unknown_recurrent_layers_are_refused_by_name():
    """Inkling 2's attention layers keep dynamic short-convolution states: a layout this backend does not know."""
    with pytest.raises(UnsupportedRecurrentModel, match="inkling2_text.*'hybrid_sliding'"):
        RecurrentLayout.of(tiny_config("inkling2_text"))


def test_attention_only_model_has_no_layout():
    assert RecurrentLayout.of(tiny_config("qwen3_moe")) is None


# one model type per mixer family: Mamba (token-by-token continuation), Mamba2 beside mixer-less MoE blocks, short
# convolution, lightning attention (transformers' own cache class), and ZAYA's attention layers whose q/k
# convolution keeps a state (a paged KV cache and a state slot in one layer)
ENGINE_TYPES = ("jamba", "nemotron_h", "lfm2_moe", "minimax", "zaya")
ENGINE_NEW_TOKENS = 5
PROMPTS = [  # longer than a KV block (16): chunked steps, and blocks whose end states are snapshotted
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(9)],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """`checkpoint(model_type) -> Path`: the arch sweep's tiny config of it with the tiny tokenizer, saved once."""
    def build(model_type: str, path):
        from transformers import AutoConfig, AutoModelForCausalLM

        tok = tiny_tokenizer()
        special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                   "pad_token_id": tok.pad_token_id}
        default = AutoConfig.for_model(model_type).to_dict()
        cfg = AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, default, len(tok), special))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path), safe_serialization=True)
        for file in sorted(tiny_tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, path / file.name)

    return lambda model_type: build_once(shared_root(tmp_path_factory), f"transformers backend recurrent {model_type}",
                                         lambda path: build(model_type, path))


@pytest.fixture(scope="module")
def engines(checkpoint):
    with engine_pool(lambda model_type: LLM(str(checkpoint(model_type)), device="cpu", dtype="float32",
                                            model_impl="transformers", max_num_batched_tokens=16,
                                            enable_chunked_prefill=True, enable_prefix_caching=True)) as get:
        yield get


@pytest.mark.parametrize("model_type", ENGINE_TYPES)
def test_engine_greedy_tokens_match_transformers_with_chunks_and_prefix_cache(engines, checkpoint, model_type):
    llm = engines(model_type)
    expected = HFOracle(checkpoint(model_type)).greedy(PROMPTS, ENGINE_NEW_TOKENS)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(ENGINE_NEW_TOKENS))] == expected
    hits = llm.core.block_manager.counters.hits
    [again] = llm.generate([PROMPTS[0]], greedy(ENGINE_NEW_TOKENS))   # resumes from its prefix's state snapshot
    assert again.token_ids == expected[0]
    assert llm.core.block_manager.counters.hits > hits



def test_engine_preemption_rebuilds_the_states_by_recompute(engines, checkpoint):
    """A KV budget that holds the longest request alone, not all three: preempted sequences give their state slots
    back and start again from zero states, as for Qwen3-Next."""
    full = engines("lfm2_moe").core
    state_bytes = sum(c.nbytes() for c in full.runner.caches if isinstance(c, LayerStateCache))
    row_bytes = state_bytes // state_rows(full.runner.state_slots)
    block_bytes = (full.runner.cache_bytes() - state_bytes) // full.block_manager.num_blocks   # of the full block size
    block_bytes = block_bytes * 8 // full.runner.block_size
    # 7 blocks of 8 tokens beside 3 slots' state rows: the longest request (40 + 12 tokens) fits alone
    with LLM(str(checkpoint("lfm2_moe")), device="cpu", dtype="float32", model_impl="transformers", block_size=8,
             max_num_seqs=3, kv_cache_memory=row_bytes * state_rows(3) + 7 * block_bytes) as llm:
        outputs = llm.generate(PROMPTS, greedy(12))
        assert llm.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert llm.core.block_manager.states.num_free == 3
    expected = HFOracle(checkpoint("lfm2_moe")).greedy(PROMPTS, ENGINE_NEW_TOKENS)
    assert [o.token_ids[:ENGINE_NEW_TOKENS] for o in outputs] == expected


def test_engine_blocks_without_a_token_mixer_keep_no_kv(engines):
    """Nemotron-H's MoE / MLP blocks keep nothing per token: their KV cache tensors are empty, so the budget pays
    only for the attention layers' blocks and the Mamba layers' slots."""
    core = engines("nemotron_h").core
    layout = RecurrentLayout.of(core.hf_config)
    assert layout.mixerless_layers
    for layer in layout.mixerless_layers:
        assert core.runner.caches[layer].keys.numel() == 0
