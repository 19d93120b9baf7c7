"""A tiny EAGLE-3 draft head in the published layout (`LlamaForCausalLMEagle3`: fc, midlayer.*, norm, lm_head over a
draft vocabulary, d2t / t2d) for a tiny target, and the drafts it makes computed naively from its tensors and
transformers' hidden states of the target (`Eagle3Reference`): the module's definition in moe_runtime/models/eagle3.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

DRAFT_VOCAB = 192


def write_eagle3_head(target: Path, directory: Path, aux_layers: list[int], seed: int = 0) -> Path:
    """A random head for the target at `target`, reading the inputs of `aux_layers`; its draft vocabulary is a
    random subset of the target's (d2t its offsets)."""
    cfg = json.loads((target / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    kept = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values                   # [Vd] target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden, std=0.05),
        "midlayer.input_layernorm.weight": 1.0 + rand(hidden),
        "midlayer.hidden_norm.weight": 1.0 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1.0 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1.0 + rand(hidden),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden),
        "d2t": kept - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    head_cfg = {key: cfg[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size", "rms_norm_eps", "vocab_size",
                                          "max_position_embeddings", "hidden_act") if key in cfg}
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                    head_dim=head_dim, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False,
                    rope_parameters=cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0},
                    eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers})
    (directory / "config.json").write_text(json.dumps(head_cfg, indent=2))
    return directory


class Eagle3Reference:
    def __init__(self, target: Path, head: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.t = load_file(str(head / "model.safetensors"))
        raw = json.loads((head / "config.json").read_text())
        self.cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")})
        self.aux = sorted(raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.rotary = LlamaRotaryEmbedding(self.cfg)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.t[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:  # [m, 2H] -> [m, H], causal over the m rows
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        c, t, m = self.cfg, self.t, x.shape[0]
        d = c.head_dim
        q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(m, c.num_attention_heads, d).transpose(0, 1)
        k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(m, c.num_key_value_heads, d).transpose(0, 1)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(m, c.num_key_value_heads, d).transpose(0, 1)
        cos, sin = self.rotary(x[None], torch.arange(m)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k[0].repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q[0] @ k.transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(m, -1)
        return out @ t["midlayer.self_attn.o_proj.weight"].T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        t = self.t
        states = self.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states   # layer inputs
        previous = list(torch.cat([states[a][0] for a in self.aux], dim=-1) @ t["fc.weight"].T)       # [n] of [H]
        next_tokens, drafts = list(tokens[1:]), []
        embedding = self.model.model.embed_tokens.weight
        for _ in range(k):
            h = torch.stack(previous)                                                             # [m, H]
            x = torch.cat([self._norm("midlayer.input_layernorm.weight", embedding[torch.tensor(next_tokens)]),
                           self._norm("midlayer.hidden_norm.weight", h)], dim=-1)
            r = h + self._attention(x)
            a = self._norm("midlayer.post_attention_layernorm.weight", r)
            mlp = (torch.nn.functional.silu(a @ t["midlayer.mlp.gate_proj.weight"].T)
                   * (a @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
            y = r + mlp
            draft = int((self._norm("norm.weight", y[-1]) @ t["lm_head.weight"].T).argmax())
            drafts.append(draft + int(t["d2t"][draft]))
            next_tokens.append(drafts[-1])
            previous.append(y[-1])
        return drafts
