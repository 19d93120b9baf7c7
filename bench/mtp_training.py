"""Train the MTP bench checkpoint's multi-token-prediction layer on the target's own greedy outputs, so that the
MTP row of bench/bench_speculative.py measures a drafter that predicts something (a random layer almost never
does: DeepSeek-V3's trained one is accepted 85-90% of the time).

The data: random prompts (not the bench's) continued greedily by the runtime itself; the target's final hidden
states over them from transformers. The layer is the module vLLM and the runtime run (models/deepseek_mtp.py):
x_p = eh_proj(cat(enorm(embed(t[p + 1])), hnorm(h_p))), the embedding zeroed at position 0, y = block(x) causal,
trained by cross-entropy of head(shared_head.norm(y_p)) against t[p + 2]. Trained: eh_proj, the three norms and
the block's parameters stored under the checkpoint's own names (attention, norms, router, shared expert); the
routed experts (which transformers keeps fused) stay as they are. The result is a copy of the MTP checkpoint with
those tensors replaced, built once under bench/.cache.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.deepseek_mtp_checkpoint import CACHE, build_mtp_checkpoint
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors, write_two_shards

logger = logging.getLogger("mtp_training")

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 48, 96, 96
STEPS, BATCH, LR = 200, 8, 2e-3


def greedy_sequences(path: Path, vocab: int) -> torch.Tensor:
    """[PROMPTS, PROMPT_TOKENS + NEW_TOKENS]: random prompts and the target's greedy continuations."""
    from moe_runtime import LLM, SamplingParams

    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(20, vocab, (PROMPT_TOKENS,), generator=generator).tolist() for _ in range(PROMPTS)]
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return torch.tensor([prompt + out.token_ids for prompt, out in zip(prompts, outputs)])


def training_sequences() -> torch.Tensor:
    """`greedy_sequences` of the MTP bench checkpoint's target, generated once (minutes on CPU) and kept."""
    cached = CACHE / "mtp-training-sequences.pt"
    if not cached.exists():
        source = build_mtp_checkpoint()
        vocab = json.loads((source / "config.json").read_text())["vocab_size"]
        torch.save(greedy_sequences(source, vocab), cached)
    return torch.load(cached)


class TrainableMtp(torch.nn.Module):
    """The MTP layer in transformers' modules, its parameters initialised from the checkpoint's tensors."""

    def __init__(self, path: Path):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.target.config
        self.index = cfg.num_hidden_layers
        extended = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                        num_hidden_layers=self.index + 1)
        self.block = extended.model.layers[self.index]
        tensors = read_all_tensors(path)
        prefix = f"model.layers.{self.index}."
        rms_norm = type(self.target.model.norm)
        self.norms = torch.nn.ModuleDict()
        for name in ("enorm", "hnorm", "shared_head_norm"):
            norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data.copy_(tensors[prefix + name.replace("shared_head_norm", "shared_head.norm") + ".weight"])
            self.norms[name] = norm
        self.eh_proj = torch.nn.Parameter(tensors[prefix + "eh_proj.weight"].clone())
        for param in self.target.parameters():
            param.requires_grad_(False)
        # the routed experts stay: transformers fuses them, the checkpoint keeps one tensor per expert
        self.trained_block = {name: param for name, param in self.block.named_parameters()
                              if prefix + name in tensors}
        for name, param in self.block.named_parameters():
            param.requires_grad_(name in self.trained_block)

    @torch.no_grad()
    def target_hidden(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, L] -> [N, L - 2, H], computed once
        return torch.cat([self.target.model(tokens[i : i + BATCH, :-2]).last_hidden_state
                          for i in range(0, tokens.shape[0], BATCH)])

    def loss(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # [B, L], [B, L - 2, H]
        embeds = self.target.model.embed_tokens(tokens[:, 1:-1]).clone()                      # t[p + 1]
        embeds[:, 0] = 0.0                                                                     # position 0
        x = torch.cat([self.norms["enorm"](embeds), self.norms["hnorm"](hidden)], dim=-1) @ self.eh_proj.T
        length = x.shape[1]
        positions = torch.arange(length)[None].expand(x.shape[0], -1)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]              # row p sees <= p
        y = self.block(x, position_embeddings=self.target.model.rotary_emb(x, positions), position_ids=positions,
                       attention_mask=causal)
        y = y[0] if isinstance(y, tuple) else y
        logits = self.target.lm_head(self.norms["shared_head_norm"](y))                        # [B, L - 2, V]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten())

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{self.index}."
        out = {prefix + name: param.detach().clone() for name, param in self.trained_block.items()}
        out[prefix + "eh_proj.weight"] = self.eh_proj.detach().clone()
        for name, norm in self.norms.items():
            stored = name.replace("shared_head_norm", "shared_head.norm")
            out[f"{prefix}{stored}.weight"] = norm.weight.detach().clone()
        return out


def build_trained_mtp_checkpoint() -> Path:
    path = CACHE / "deepseekv3-mtp-trained-float32"
    if (path / "config.json").exists():
        return path
    source = build_mtp_checkpoint()
    torch.manual_seed(0)
    model = TrainableMtp(source)
    data = training_sequences()                                                                # [N, L]
    hidden = model.target_hidden(data)                                                         # [N, L - 2, H]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=LR)
    for step in range(STEPS):
        rows = torch.randint(0, data.shape[0], (BATCH,))
        loss = model.loss(data[rows], hidden[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == STEPS - 1:
            logger.info("MTP training step %d: loss %.3f", step, loss.item())
    tensors = read_all_tensors(source)
    tensors.update(model.trained_tensors())
    copy_side_files(source, path)
    write_two_shards(tensors, path)
    return path
