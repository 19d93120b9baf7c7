"""A minimal GRPO loop on a tiny MoE model, on CPU: the engine rolls out, the trainer learns, the weights go back.

The trainer holds a transformers Qwen3-MoE (a tiny one built from its config class and saved, so the engine
serves the same weights) and a torch optimizer. Each iteration:

1. the engine (`moe_runtime.LLM`, `logprobs_mode="processed_logprobs"`) samples `group_size` completions of
   every prompt, each with its tokens' logprobs under the distribution it was drawn from and the experts each
   position was routed to (`return_routed_experts=True`);
2. each completion's reward is the fraction of its tokens equal to `target_token` (a verifiable reward the tiny
   model can learn), its advantage the reward normalized within its prompt's group (GRPO);
3. the trainer recomputes the completions' logprobs with the rollout's routing REPLAYED (every MoE router takes
   the engine's expert ids, its weights still the router's own softmax at them: `RoutingReplay`), forms the
   clipped policy-ratio loss against the engine's logprobs and steps the optimizer, `updates_per_batch` times;
4. the new weights go into the running engine (`LLM.update_weights_from_tensors`, under the checkpoint's names).

Before the first update of each batch the trainer's replayed logprobs equal the engine's (the policy ratio is 1):
both computed the same function of the same weights on the same routing. The later updates of a batch are where
replay matters: the router has moved, and without replay the trainer would route some tokens to other experts
than those that produced them (`IterationReport.routing_flips`), so the ratio would compare two different
computations, not two policies.

Run: `python examples/grpo_tiny_moe.py` (a few seconds); docs/rl_rollouts.md explains each step and the
multi-process form (`init_weights_update_group` + `update_weights_from_distributed`). It needs transformers 5 (the
pinned 5.25): the replay patches its Qwen3-MoE router module (`Qwen3MoeTopKRouter`), and its fused in-memory experts
go back to the checkpoint's names through its own `revert_weight_conversion`.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from moe_runtime import LLM, SamplingParams


@dataclass(frozen=True)
class GrpoConfig:
    prompts: tuple[tuple[int, ...], ...] = ((3, 5, 4, 6), (6, 4, 5, 3))   # token ids (no special ones), of one length
    group_size: int = 8                  # completions per prompt (GRPO's group)
    max_tokens: int = 6
    target_token: int = 7                # the reward: the fraction of completion tokens equal to it
    temperature: float = 1.0
    learning_rate: float = 5e-3
    clip_epsilon: float = 0.2
    updates_per_batch: int = 2           # optimizer steps on each batch of rollouts
    iterations: int = 3
    seed: int = 0
    vocab_size: int = 8                  # small: the target is sampled often enough to learn from in a few steps


@dataclass(frozen=True)
class Rollout:
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    engine_logprobs: torch.Tensor        # [M] float32: each completion token's processed logprob
    routed_experts: torch.Tensor         # [P + M - 1, moe_layers, top_k] int64 logical expert ids

    @property
    def input_ids(self) -> list[int]:
        """What the trainer feeds: every position whose next token is scored (the last token is never input)."""
        return list(self.prompt) + list(self.completion[:-1])


@dataclass(frozen=True)
class IterationReport:
    iteration: int
    mean_reward: float
    target_probability: float            # the trainer's mean probability of the target next to each prompt, before
    target_probability_after: float      # ... and after this iteration's updates
    replayed_gap: float                  # max |trainer's replayed logprob - engine's|, before the first update
    first_ratio_gap: float               # max |policy ratio - 1| at the first update
    unreplayed_gap: float                # max |trainer's own-routing logprob - replayed| at the last update
    routing_flips: int                   # (position, layer) choices the trainer's own routing changed, last update
    initial_weights_gap: float           # max |the initial model's replayed logprob - engine's|: 0 until a push


def tiny_moe_config(vocab_size: int):
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                          attention_dropout=0.0)


def save_tiny_moe(directory: Path, config: GrpoConfig):
    """The trainer's model, fp32, seeded; saved to `directory` as the engine's checkpoint."""
    torch.manual_seed(config.seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(config.vocab_size)).float()
    model.save_pretrained(directory)
    return model


def moe_routers(model) -> list[torch.nn.Module]:
    """Every MoE layer's router, in the model's layer order (the order of `routed_experts`' middle axis)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


class RoutingReplay:
    """While active, each MoE router of `model` routes row n to `expert_ids[n, layer]` (rows in the order the model
    flattens its [batch, positions] input) with the router's own softmax evaluated at those experts, renormalized
    as the model's top-k is (`norm_topk_prob`): gradients reach the router through its weights on the replayed
    experts, as in the forward that produced the rollout."""

    def __init__(self, model, expert_ids: torch.Tensor):   # [N, moe_layers, top_k] int64
        self.routers = moe_routers(model)
        if expert_ids.shape[1] != len(self.routers):
            raise ValueError(f"expert_ids has {expert_ids.shape[1]} MoE layers, the model {len(self.routers)}")
        self.expert_ids = expert_ids

    def __enter__(self) -> "RoutingReplay":
        for layer, router in enumerate(self.routers):
            router.forward = self._replayed(router, self.expert_ids[:, layer])
        return self

    def __exit__(self, *exc) -> None:
        for router in self.routers:
            del router.forward   # the class's own forward again

    @staticmethod
    def _replayed(router, indices: torch.Tensor):   # indices [N, K]
        def forward(hidden_states: torch.Tensor):
            hidden = hidden_states.reshape(-1, router.hidden_dim)                                # [N, H]
            if hidden.shape[0] != indices.shape[0]:
                raise ValueError(f"the forward routes {hidden.shape[0]} rows, the replay holds {indices.shape[0]}")
            logits = F.linear(hidden, router.weight)                                             # [N, E]
            scores = logits.float().softmax(dim=-1).gather(1, indices)                           # [N, K]
            if router.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), indices
        return forward


def completion_logprobs(model, rollouts: list[Rollout], temperature: float, replay: bool = True) -> torch.Tensor:
    """Each rollout's completion tokens' logprobs [B, M] under `model` at `temperature` (the distribution the engine
    sampled from: no top-k, top-p or penalties here), with the rollouts' routing replayed or the model's own."""
    input_ids = torch.tensor([r.input_ids for r in rollouts])                                   # [B, T]
    completions = torch.tensor([r.completion for r in rollouts])                                 # [B, M]
    prompt_len = len(rollouts[0].prompt)
    routing = torch.cat([r.routed_experts for r in rollouts])                                    # [B * T, L, K]
    if replay:
        with RoutingReplay(model, routing):
            logits = model(input_ids=input_ids, use_cache=False).logits                          # [B, T, V]
    else:
        logits = model(input_ids=input_ids, use_cache=False).logits
    scored = logits[:, prompt_len - 1:].float() / temperature                                    # [B, M, V]
    return scored.log_softmax(dim=-1).gather(2, completions.unsqueeze(2)).squeeze(2)


def generate_rollouts(llm: LLM, config: GrpoConfig, iteration: int) -> list[Rollout]:
    """`group_size` sampled completions of each prompt (grouped by prompt), each with its own seed."""
    prompts, params = [], []
    for p, prompt in enumerate(config.prompts):
        for g in range(config.group_size):
            prompts.append(list(prompt))
            seed = ((config.seed * 1000 + iteration) * 100 + p) * 100 + g
            params.append(SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed,
                                         ignore_eos=True, logprobs=0, return_routed_experts=True))
    outputs = llm.generate(prompts, params)
    return [Rollout(tuple(prompt), tuple(out.token_ids),
                    torch.tensor([step.logprob for step in out.logprobs], dtype=torch.float32),
                    torch.from_numpy(out.routed_experts.astype("int64")))
            for prompt, out in zip(prompts, outputs)]


def rewards(rollouts: list[Rollout], target_token: int) -> torch.Tensor:   # [B]
    return torch.tensor([sum(t == target_token for t in r.completion) / len(r.completion) for r in rollouts])


def group_advantages(reward: torch.Tensor, group_size: int) -> torch.Tensor:   # [B] -> [B]
    """GRPO's advantage: each reward against its prompt's group, in units of the group's spread."""
    groups = reward.view(-1, group_size)                                                         # [prompts, G]
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, unbiased=False, keepdim=True) + 1e-6)).flatten()


def clipped_policy_loss(new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, epsilon: float):
    """PPO's clipped surrogate over every completion token (new, old [B, M]; advantages [B]); also the ratio."""
    ratio = (new - old).exp()                                                                    # [B, M]
    advantage = advantages[:, None]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
    return -surrogate.mean(), ratio


def target_probability(model, config: GrpoConfig) -> float:
    """The model's mean probability of the target token right after each prompt (at the sampling temperature)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(config.prompts), use_cache=False).logits[:, -1]   # [P, V]
        return float((logits / config.temperature).softmax(dim=-1)[:, config.target_token].mean())


def push_weights(llm: LLM, model) -> None:
    """The trainer's weights into the engine, under the checkpoint's names (transformers' own reversal of its
    load-time conversions: the fused experts back to one tensor per expert and projection)."""
    with torch.no_grad():
        named = revert_weight_conversion(model, {name: t.detach().clone() for name, t in model.state_dict().items()})
    llm.update_weights_from_tensors(list(named.items()))


@dataclass(frozen=True)
class ReplayCheck:
    """How far the trainer's own routing would take it from the replayed forward."""

    logprob_gap: float                   # max |own-routing logprob - replayed logprob|
    routing_flips: int                   # (position, layer) expert choices that differ from the rollout's


def replay_check(model, rollouts: list[Rollout], config: GrpoConfig, replayed: torch.Tensor) -> ReplayCheck:
    """The forward without replay, the experts its routers chose recorded (`own`: [B * T, L, K])."""
    chosen = []
    hooks = [router.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
             for router in moe_routers(model)]
    try:
        with torch.no_grad():
            unreplayed = completion_logprobs(model, rollouts, config.temperature, replay=False)
    finally:
        for hook in hooks:
            hook.remove()
    own = torch.stack(chosen, dim=1)                                                             # [B * T, L, K]
    rollout = torch.cat([r.routed_experts for r in rollouts])
    flips = int((own.sort(dim=-1).values != rollout.sort(dim=-1).values).any(dim=-1).sum())
    return ReplayCheck(float((unreplayed - replayed.detach()).abs().max()), flips)


def run_grpo(config: GrpoConfig, workdir: Path) -> list[IterationReport]:
    if len({len(prompt) for prompt in config.prompts}) != 1:
        raise ValueError("GrpoConfig.prompts: one length for all (the trainer's batch has no padding)")
    if config.updates_per_batch < 1:
        raise ValueError("GrpoConfig.updates_per_batch: at least 1")
    model = save_tiny_moe(workdir / "tiny-moe", config)
    initial = copy.deepcopy(model).eval()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    reports = []
    with LLM(str(workdir / "tiny-moe"), device="cpu", dtype="float32", logprobs_mode="processed_logprobs") as llm:
        for iteration in range(config.iterations):
            rollouts = generate_rollouts(llm, config, iteration)
            reward = rewards(rollouts, config.target_token)
            advantages = group_advantages(reward, config.group_size)
            old = torch.stack([r.engine_logprobs for r in rollouts])                             # [B, M]
            probability = target_probability(model, config)
            with torch.no_grad():
                initial_gap = float((completion_logprobs(initial, rollouts, config.temperature) - old).abs().max())
            for update in range(config.updates_per_batch):
                new = completion_logprobs(model, rollouts, config.temperature)                  # [B, M]
                loss, ratio = clipped_policy_loss(new, old, advantages, config.clip_epsilon)
                if update == 0:
                    replayed_gap = float((new - old).detach().abs().max())
                    ratio_gap = float((ratio - 1).detach().abs().max())
                if update == config.updates_per_batch - 1:
                    check = replay_check(model, rollouts, config, new)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            push_weights(llm, model)
            reports.append(IterationReport(iteration, float(reward.mean()), probability,
                                           target_probability(model, config), replayed_gap, ratio_gap,
                                           check.logprob_gap, check.routing_flips, initial_gap))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=GrpoConfig.iterations)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        for report in run_grpo(GrpoConfig(iterations=args.iterations), Path(workdir)):
            print(report)


if __name__ == "__main__":
    main()
