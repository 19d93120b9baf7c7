"""The worked GRPO example (examples/grpo_tiny_moe.py, docs/rl_rollouts.md) runs end to end and holds what it says.

- Before the first update of every batch the trainer's logprobs, its MoE routers replaying the rollout's expert
  ids, equal the engine's processed logprobs (fp32, to a few ulps) and the policy ratio is 1: in iteration 0
  on the saved weights, later on the weights the trainer pushed (`update_weights_from_tensors`) - which are no
  longer the initial ones (the initial model's logprobs differ from the engine's).
- Replay matters: after an optimizer step the trainer's own routers send some positions to other experts than
  the rollout's, and its logprobs without replay differ from the replayed ones.
- The reward is learned: the trained model's probability of the target token rises at every iteration (seeded
  rollouts and weights: the run is the same each time), by more than half over three.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny_moe.py"


def load_example():
    """The example as a module (registered first: its dataclasses resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location("grpo_tiny_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    example = load_example()
    return example.run_grpo(example.GrpoConfig(iterations=3), tmp_path_factory.mktemp("grpo"))


def test_the_trainer_replays_the_engines_logprobs_before_each_update(reports):
    for report in reports:
        assert report.replayed_gap < 1e-5, report
        assert report.first_ratio_gap < 1e-5, report
    assert reports[0].initial_weights_gap < 1e-5
    assert all(report.initial_weights_gap > 1e-2 for report in reports[1:]), "the engine kept the initial weights"


def test_without_replay_the_trainer_routes_elsewhere(reports):
    assert any(report.routing_flips > 0 and report.unreplayed_gap > 1e-3 for report in reports), reports


def test_the_target_token_becomes_likelier(reports):
    probabilities = [report.target_probability for report in reports] + [reports[-1].target_probability_after]
    assert probabilities == sorted(probabilities) and probabilities[-1] > 1.5 * probabilities[0], probabilities
