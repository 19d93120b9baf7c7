"""The MTP drafts transformers' modules give, for checkpoints with a multi-token-prediction layer
(moe_runtime/weights/mtp_checkpoint_writer.py appends one to a tiny DeepSeek-V3, GLM-4.5, DeepSeek-V3.2 or GLM-5
checkpoint).

`MtpReference` computes what the MTP layer drafts with transformers' own decoder layer and norms, from the
module's definition (vLLM's and SGLang's): x_p = eh_proj(cat(enorm(embed(t[p + 1])), hnorm(h_p))) with the
embedding zeroed at position 0, y = block(x) (causal over the sequence), draft = argmax head(norm(y_last)); the
next draft chains on y_last and the draft just made. A sparse-attention block (DeepSeek-V3.2, GLM-5) is loaded as
one more layer with an indexer of its own ("full" in GLM-5's `indexer_types`) and an MoE MLP, and is given the
causal mask its indexer reads.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors


class MtpReference:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
        cfg = self.model.config
        index = cfg.num_hidden_layers
        # the block loaded by transformers itself (its expert layout conversions): as one more decoder layer
        per_layer = {name: [*getattr(cfg, name), kind] for name, kind in
                     (("mlp_layer_types", "sparse"), ("indexer_types", "full"), ("layer_types", None))
                     if getattr(cfg, name, None)}
        if "layer_types" in per_layer:
            per_layer["layer_types"][-1] = per_layer["layer_types"][-2]
        extended = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa",
                                                        num_hidden_layers=index + 1, **per_layer).eval()
        self.block = extended.model.layers[index]                      # sdpa: causal without a mask ...
        self.masked = getattr(self.block.self_attn, "indexer", None) is not None   # ... but an indexer needs one
        tensors = {n[len(f"model.layers.{index}."):]: t for n, t in read_all_tensors(path).items()
                   if n.startswith(f"model.layers.{index}.")}
        self.norms = {}
        rms_norm = type(self.model.model.norm)                           # the architecture's own RMSNorm
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
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
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None] if self.masked else None
            y = self.block(x, position_embeddings=self.model.model.rotary_emb(x, positions),
                           position_ids=positions, attention_mask=mask)
            y = (y[0] if isinstance(y, tuple) else y)[0]                                        # [m, H]
            draft = int((self.norms["shared_head.norm"](y[-1]) @ self.head.T).argmax())
            drafts.append(draft)
            next_tokens.append(draft)                                                           # the chain
            previous.append(y[-1])
        return drafts


class Qwen3NextMtpReference:
    """Qwen3-Next's MTP module (`mtp.*`) from transformers' own modules: x = fc(cat(pre_fc_norm_embedding(
    embed(t[p + 1])), pre_fc_norm_hidden(h_p))), y = norm(block(x)), draft = argmax lm_head(y_last), chained on
    y_last; the block is transformers' full-attention decoder layer, loaded as one more layer of the model."""

    def __init__(self, path: Path, scratch: Path):
        from transformers import AutoModelForCausalLM

        from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, write_two_shards

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.model.config
        index = cfg.num_hidden_layers
        tensors = read_all_tensors(path)
        mtp = {n[len("mtp."):]: t for n, t in tensors.items() if n.startswith("mtp.")}
        # the block as layer N of an extended checkpoint, loaded by transformers itself (its expert conversions)
        extended = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
        extended.update({f"model.layers.{index}.{n[len('layers.0.'):]}": t for n, t in mtp.items()
                         if n.startswith("layers.0.")})
        copy_side_files(path, scratch)
        write_two_shards(extended, scratch)
        self.block = AutoModelForCausalLM.from_pretrained(
            str(scratch), dtype=torch.float32, num_hidden_layers=index + 1,
            layer_types=[*cfg.layer_types, "full_attention"]).eval().model.layers[index]
        rms_norm = type(self.model.model.norm)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data.copy_(mtp[f"{name}.weight"])
            self.norms[name] = norm
        self.fc = mtp["fc.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        hidden = self.model.model(ids[:, :-1]).last_hidden_state[0]                              # [n, H]
        embedding, head = self.model.model.embed_tokens.weight, self.model.lm_head.weight
        next_tokens, previous, drafts = list(tokens[1:]), [hidden[p] for p in range(len(tokens) - 1)], []
        for _ in range(k):
            embeds = embedding[torch.tensor(next_tokens)]                                        # [m, H]
            x = torch.cat([self.norms["pre_fc_norm_embedding"](embeds),
                           self.norms["pre_fc_norm_hidden"](torch.stack(previous))], dim=-1)
            x = (x @ self.fc.T)[None]                                                           # [1, m, H]
            positions = torch.arange(x.shape[1])[None]
            y = self.block(x, position_embeddings=self.model.model.rotary_emb(x, positions),
                           position_ids=positions, attention_mask=None)
            y = self.norms["norm"]((y[0] if isinstance(y, tuple) else y)[0])                    # [m, H]
            draft = int((y[-1] @ head.T).argmax())
            drafts.append(draft)
            next_tokens.append(draft)
            previous.append(y[-1])
        return drafts


def run_checking_drafts(core, reference, k: int) -> int:
    """Step `core` until its requests finish; after every step each sequence's drafts (a model drafter's, for
    where it stands now) must be the prefix of `reference.drafts(its tokens, k)`. The comparisons made."""
    seqs = list(core._sequences.values())
    compared = 0
    while core.has_unfinished():
        core.step()
        for seq in seqs:
            if seq.is_finished or seq.drafts.proposed_at != seq.num_tokens:
                continue                               # a prefill chunk that sampled nothing drafts nothing
            expected = reference.drafts(seq.all_token_ids, k)
            assert seq.drafts.proposed == expected[: len(seq.drafts.proposed)], f"after {seq.num_tokens} tokens"
            assert len(seq.drafts.proposed) >= 1
            compared += 1
    return compared


def drafting_core(path: Path, speculative: dict, prompts: list[list[int]], new_tokens: int, **options):
    """An engine core drafting by `speculative` (chunked prefill of 8 tokens, blocks of 4, prefix caching; `options`:
    more `EngineConfig` fields) with greedy requests for `prompts` added."""
    from engine_helpers import greedy
    from moe_runtime.config.engine_config import EngineConfig
    from moe_runtime.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=speculative,
                                   block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   enable_prefix_caching=True, **options))
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, greedy(new_tokens))
    return core


def drafted_greedy_run(path: Path, speculative: dict, reference, prompts: list[list[int]], new_tokens: int):
    """Greedy outputs of `prompts` on a `drafting_core`, the drafts checked against `reference` after every step
    (`run_checking_drafts`, at least twice per prompt); with the worker's stats."""
    core = drafting_core(path, speculative, prompts, new_tokens)
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, reference, speculative["num_speculative_tokens"]) >= 2 * len(prompts)
    worker = core.worker_stats()
    core.shutdown()
    return [seq.output_token_ids for seq in seqs], worker


class DeepseekV4MtpReference:
    """DeepSeek-V4's MTP layer (`mtp.0.*`, moe_runtime/models/deepseek_v4_mtp.py) from transformers' own modules, over
    the whole sequence at once (no cache): the target's streams s_p entering its hyper head (a hook), x[j] =
    e_proj(enorm(embed(t[p + 1]))) + h_proj(hnorm(s_p[j])), y = the block, draft = argmax head(norm(hc_head(y_last))),
    chained on y_last. The block, its hyper head, norm, embedding and head (the layer's own copies where stored) run as
    a one-layer transformers DeepseekV4ForCausalLM (`layer_type`: the block's attention; hash routing on the tokens it
    embeds) whose input streams a hook replaces."""

    def __init__(self, path: Path, scratch: Path, layer_type: str, mlp_layer_type: str):
        from transformers import AutoModelForCausalLM

        from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, write_two_shards

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.model.config
        tensors = read_all_tensors(path)
        mtp = {n[len("mtp.0."):]: t for n, t in tensors.items() if n.startswith("mtp.0.")}
        outside_block = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_", "head.", "embed.")
        one_layer = {f"model.layers.0.{n}": t for n, t in mtp.items() if not n.startswith(outside_block)}
        one_layer.update({"model.embed_tokens.weight": mtp.get("embed.weight", tensors["model.embed_tokens.weight"]),
                          "head.weight": mtp.get("head.weight", tensors["head.weight"]),
                          "model.norm.weight": mtp["norm.weight"],
                          **{f"model.hc_head.hc_{part}": mtp[f"hc_head_{part}"] for part in ("fn", "base", "scale")}})
        copy_side_files(path, scratch)
        write_two_shards(one_layer, scratch)
        self.block_model = AutoModelForCausalLM.from_pretrained(
            str(scratch), dtype=torch.float32, num_hidden_layers=1, layer_types=[layer_type],
            mlp_layer_types=[mlp_layer_type]).eval()
        rms_norm = type(self.model.model.norm)
        self.norms = {}
        for name in ("enorm", "hnorm"):
            norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data.copy_(mtp[f"{name}.weight"])
            self.norms[name] = norm
        self.e_proj, self.h_proj = mtp["e_proj.weight"], mtp["h_proj.weight"]
        self._captured: list[torch.Tensor] = []
        self._streams_in: torch.Tensor | None = None
        self.model.model.hc_head.register_forward_hook(lambda _m, args, _out: self._captured.append(args[0]))
        self.block_model.model.hc_head.register_forward_hook(lambda _m, args, _out: self._captured.append(args[0]))
        self.block_model.model.layers[0].register_forward_pre_hook(self._replace_streams, with_kwargs=True)

    def _replace_streams(self, _module, args, kwargs):
        return (self._streams_in, *args[1:]), kwargs

    def _streams(self, model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the streams entering `model`'s hyper head [m, n, H], its logits [m, V]) over `ids`."""
        self._captured.clear()
        logits = model(torch.tensor([ids]), use_cache=False).logits[0]
        return self._captured[-1][0], logits

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The MTP layer's k drafts after `tokens` (the target's streams over all but the last)."""
        previous, _ = self._streams(self.model, tokens[:-1])                                  # [m, n, H]
        next_tokens, drafts = list(tokens[1:]), []
        for _ in range(k):
            embeds = self.block_model.model.embed_tokens.weight[torch.tensor(next_tokens)]         # [m, H]
            e = self.norms["enorm"](embeds) @ self.e_proj.T                                       # [m, H]
            self._streams_in = (e[:, None, :] + self.norms["hnorm"](previous) @ self.h_proj.T)[None]  # [1, m, n, H]
            out, logits = self._streams(self.block_model, next_tokens)
            draft = int(logits[-1].argmax())
            drafts.append(draft)
            next_tokens.append(draft)                                                             # the chain
            previous = torch.cat([previous, out[-1:]])
        return drafts
