"""Recurrent layers of models run through transformers (Mamba, Mamba2, short convolutions, linear attention), their
states kept in our state cache (moe_runtime/models/transformers_backend/recurrent_*.py).

The bridge is checked against transformers itself: the prompt fed in chunks, every chunk's states loaded from and
stored back into our state rows (moved to another slot midway, as a prefix-cache snapshot restore does), gives
transformers' generate's greedy tokens and a one-piece forward's logits. Tiny configs are the arch sweep's.
"""
from __future__ import annotations

import pytest
import torch

from moe_runtime.layers.state_cache import LayerStateCache
from moe_runtime.models.transformers_backend.recurrent_bridge import RecurrentStateBridge
from moe_runtime.models.transformers_backend.recurrent_state import RecurrentLayout, UnsupportedRecurrentModel
from tests.arch_sweep_configs import tiny_config_kwargs

VOCAB = 128
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
HYBRID_TYPES = ("jamba", "nemotron_h", "granitemoehybrid", "bailing_hybrid", "kimi_linear", "lfm2_moe", "minimax",
                "qwen4_exp_text", "lara_mini", "zaya")
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


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_layout_is_what_transformers_keeps(models, model_type):
    """The per-model-type shapes (recurrent_state._SHAPES) agree with the states transformers builds: the store
    refuses any part whose shape differs."""
    cfg, model, prompt, _, _ = models(model_type)
    layout = RecurrentLayout.of(cfg)
    assert layout is not None and layout.layer_indices
    caches = {layer: LayerStateCache.allocate(layout.state_spec(), 2, torch.float32, "cpu")
              for layer in layout.layer_indices}
    hf_cache = _new_cache(model, layout)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=hf_cache, use_cache=True)
    RecurrentStateBridge(layout, torch.float32).store(hf_cache, caches, [0])
    assert all(cache.ssm[0].abs().sum() > 0 for cache in caches.values())


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
@pytest.mark.parametrize("chunks", [[4, 5, 2], [1, 1, 9]])
def test_chunked_prefill_through_our_state_rows_is_generate(models, model_type, chunks):
    cfg, model, prompt, expected, logits = models(model_type)
    tokens, last = run_in_chunks(model, RecurrentLayout.of(cfg), prompt, chunks, NEW_TOKENS)
    assert tokens == expected
    torch.testing.assert_close(last, logits, rtol=1e-4, atol=1e-4)


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
    """Inkling's attention layers also keep four short-convolution states: a layout this backend does not know."""
    with pytest.raises(UnsupportedRecurrentModel, match="inkling_text.*'hybrid_sliding'"):
        RecurrentLayout.of(tiny_config("inkling_text"))


def test_attention_only_model_has_no_layout():
    assert RecurrentLayout.of(tiny_config("qwen3_moe")) is None
