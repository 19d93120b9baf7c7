"""A small Qwen3-MoE checkpoint whose router sends most tokens to a few experts (for load-balancing benches).

Random weights give near-uniform routing, which leaves a rebalancer nothing to do. Here the
router rows (`mlp.gate.weight[e]`) of a few "hot" experts per layer are multiplied by `hot_scale`:
their logits then have several times the spread of the others, so they win the top-k for most
tokens. The hot experts of every layer are chosen to sit on ONE rank under the static placement
at ep=4 (slot e -> expert e, 5 slots per rank with 4 redundant slots; see
`load_balancer.static_placement`), and away from the replicated experts 0..3, so the static
layout is as unbalanced as the routing: one rank computes most expert tokens.

    python bench/skewed_checkpoint.py   # builds (cached) and prints the routing share of the hot experts

The skew is measured in the benchmarks from the runtime's `expert_load()` (balancedness at ep=4);
`routing_share()` here checks it through transformers' router logits on random prompts.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"

logger = logging.getLogger("skewed_checkpoint")


@dataclass(frozen=True)
class SkewedShape:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1024
    intermediate_size: int = 512
    vocab_size: int = 4096
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class SkewSpec:
    hot_scale: float = 4.0          # router rows of hot experts are multiplied by this
    experts_per_rank: int = 5       # static placement at ep=4 with 4 redundant slots: 20 slots / 4 ranks
    hot_ranks: tuple[int, ...] = (1, 2)  # layer l's hot experts are rank hot_ranks[l % len]'s static slots

    def hot_experts(self, layer: int) -> list[int]:
        """Layer `layer`'s hot experts: the experts of one rank's static slots (never replicated ones)."""
        rank = self.hot_ranks[layer % len(self.hot_ranks)]
        first = rank * self.experts_per_rank
        return list(range(first, first + self.experts_per_rank))


def checkpoint_path(shape: SkewedShape = SkewedShape(), skew: SkewSpec = SkewSpec()) -> Path:
    return CACHE / (f"qwen3moe-skewed-h{shape.hidden_size}-l{shape.num_hidden_layers}-e{shape.num_experts}"
                    f"-i{shape.moe_intermediate_size}-s{skew.hot_scale:g}")


def build_skewed_checkpoint(shape: SkewedShape = SkewedShape(), skew: SkewSpec = SkewSpec()) -> Path:
    """Build (once; cached under bench/.cache) and return the checkpoint directory. fp32, no tokenizer."""
    path = checkpoint_path(shape, skew)
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moe_runtime.weights.random_weights import RandomWeightScales, randomize_weights

    for layer in range(shape.num_hidden_layers):
        bad = [e for e in skew.hot_experts(layer) if not 0 <= e < shape.num_experts]
        if bad:
            raise ValueError(f"SkewSpec names hot experts {bad} outside [0, {shape.num_experts}) for layer {layer}")
    logger.info("building skewed checkpoint in %s", path)
    config = Qwen3MoeConfig(**asdict(shape), initializer_range=0.05)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed=0, scales=RandomWeightScales(matrix_std=0.05))
    with torch.no_grad():
        for layer_index, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate.weight  # [E, H]
            hot = torch.tensor(skew.hot_experts(layer_index))
            gate[hot] *= skew.hot_scale
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def routing_share(path: Path, num_prompts: int = 8, prompt_len: int = 32, skew: SkewSpec = SkewSpec()) -> list[float]:
    """Per layer: the share of top-k choices that go to that layer's hot experts (transformers' router)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_prompts, prompt_len), generator=generator)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    shares = []
    for layer, logits in enumerate(out.router_logits):  # [B*S, E] each
        chosen = logits.topk(model.config.num_experts_per_tok, dim=-1).indices  # [B*S, K]
        hot = torch.isin(chosen, torch.tensor(skew.hot_experts(layer)))
        shares.append(float(hot.float().mean()))
    return shares


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shape, skew = SkewedShape(), SkewSpec()
    path = build_skewed_checkpoint(shape, skew)
    uniform = skew.experts_per_rank / shape.num_experts
    print(f"{path}")
    for layer, share in enumerate(routing_share(path, skew=skew)):
        print(f"layer {layer}: hot experts {skew.hot_experts(layer)} take {share:.0%} of top-{shape.num_experts_per_tok} "
              f"choices (uniform routing: {uniform:.0%})")


if __name__ == "__main__":
    main()
