"""The MTP drafts transformers' modules give, for checkpoints with a multi-token-prediction layer
(moe_runtime/weights/mtp_checkpoint_writer.py appends one to a tiny DeepSeek-V3 checkpoint).

`MtpReference` computes what the MTP layer drafts with transformers' own decoder layer and norms, from the
module's definition (vLLM's and SGLang's): x_p = eh_proj(cat(enorm(embed(t[p + 1])), hnorm(h_p))) with the
embedding zeroed at position 0, y = block(x) (causal over the sequence), draft = argmax head(norm(y_last)); the
next draft chains on y_last and the draft just made.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors


class MtpReference:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        cfg = self.model.config
        index = cfg.num_hidden_layers
        # the block loaded by transformers itself (its expert layout conversions): as one more decoder layer
        extended = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa",
                                                        num_hidden_layers=index + 1).eval()
        self.block = extended.model.layers[index]                      # sdpa: causal without a mask
        tensors = {n[len(f"model.layers.{index}."):]: t for n, t in read_all_tensors(path).items()
                   if n.startswith(f"model.layers.{index}.")}
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norm = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data.copy_(tensors[f"{name}.weight"])
            self.norms[name] = norm
        self.eh_proj = tensors["eh_proj.weight"]
        self.embedding = tensors.get("embed_tokens.weight", self.model.model.embed_tokens.weight)
        self.head = tensors.get("shared_head.head.weight", self.model.lm_head.weight)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The MTP layer's k drafts after `tokens` (the target's hidden states over all but the last)."""
        ids = torch.tensor([tokens])
        hidden = self.model.model(ids[:, :-1]).last_hidden_state[0]                              # [n, H]
        next_tokens = list(tokens[1:])
        previous = [hidden[p] for p in range(len(tokens) - 1)]
        drafts = []
        for _ in range(k):
            embeds = self.embedding[torch.tensor(next_tokens)].clone()                          # [m, H]
            embeds[0] = 0.0                                                                     # position 0
            x = torch.cat([self.norms["enorm"](embeds), self.norms["hnorm"](torch.stack(previous))], dim=-1)
            x = (x @ self.eh_proj.T)[None]                                                      # [1, m, H]
            positions = torch.arange(x.shape[1])[None]
            y = self.block(x, position_embeddings=self.model.model.rotary_emb(x, positions),
                           position_ids=positions, attention_mask=None)
            y = (y[0] if isinstance(y, tuple) else y)[0]                                        # [m, H]
            draft = int((self.norms["shared_head.norm"](y[-1]) @ self.head.T).argmax())
            drafts.append(draft)
            next_tokens.append(draft)                                                           # the chain
            previous.append(y[-1])
        return drafts
