"""Speculative decoding's verify steps under expert parallelism run through the captured decode step.

With ep=2, dp_attn=2, DeepEP's low-latency kernels (the tests' emulation) and --enable-torch-compile, a step whose
sequences all decode, some verifying drafts (1 + d single-query rows each), is a decode-phase step: its rows fit
the decode bound that counts the drafts (`EngineConfig.decode_max_tokens`), and each rank runs it through its
graph with the low-latency dispatch and combine inside. Greedy tokens with n-gram and MTP drafts equal those
without speculation (also captured), every rank counts captured verify steps, and a worker verifies drafts
through its graph while the other DP worker is idle. (A worker verifying beside one that plain-decodes agrees on
the same phase: tests/test_capture_safe.py.)
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.stats import WorkerStats
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint

pytestmark = pytest.mark.timeout(900)

DEEPEP_HIDDEN = 2048          # one of the hidden sizes DeepEP's low-latency kernels take
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
# One per DP worker. The random model's output follows no pattern of its prompt; a prompt holding a third of the
# vocabulary makes the n-gram drafter find the latest token earlier in about a third of the steps. A verify step
# runs eagerly when the other worker prefills in it (the requests reach the ranks in separate agreements now and
# then), and in bfloat16 eager multi-token MLA (expanded) and the captured single-query rows (absorbed) differ in
# the last bits: these prompts' greedy tokens have no near-tie those bits flip (range(1, 512, 3) has one).
PROMPTS = [list(range(2, 512, 3)), list(range(3, 512, 3))]
NEW_TOKENS = 10


@dataclass
class CapturedRun:
    busy: list[list[int]]          # PROMPTS' tokens, one request on each DP worker
    one_idle: list[list[int]]      # PROMPTS[0]'s again, the other worker idle
    busy_workers: list[WorkerStats]
    idle_workers: list[WorkerStats]


def captured_run(path, speculative: dict | None) -> CapturedRun:
    with LLM(str(path), device="cpu", dtype="bfloat16", ep=2, dp_attn=2, a2a_backend="deepep",
             deepep_module="deepep_emulation", max_num_seqs=4, enable_torch_compile=True,
             torch_compile_backend="eager", speculative_config=speculative) as llm:
        busy = [out.token_ids for out in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        busy_workers = llm.engine.stats().workers
        one_idle = [out.token_ids for out in llm.generate(PROMPTS[:1], greedy(NEW_TOKENS))]
        return CapturedRun(busy, one_idle, busy_workers, llm.engine.stats().workers)


@pytest.fixture(scope="module")
def deepseek_2048(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("deepseek_v3", hidden_size=DEEPEP_HIDDEN)


@pytest.fixture(scope="module")
def without_speculation(deepseek_2048) -> CapturedRun:
    return captured_run(deepseek_2048, None)


def assert_verified_captured(run: CapturedRun, plain: CapturedRun) -> None:
    assert run.busy == plain.busy and run.one_idle == plain.one_idle
    assert all(w.spec_verify_steps > 0 for w in run.busy_workers), "each DP worker was meant to verify drafts"
    assert all(w.captured_verify_steps > 0 for w in run.busy_workers), [w.captured_verify_steps
                                                                        for w in run.busy_workers]
    # the second generate: one worker verifies through its graph, the other runs empty steps (eagerly) beside it
    verified = [after.captured_verify_steps - before.captured_verify_steps
                for before, after in zip(run.busy_workers, run.idle_workers)]
    captured = [after.captured_decode_steps - before.captured_decode_steps
                for before, after in zip(run.busy_workers, run.idle_workers)]
    assert sorted(verified) == [0, max(verified)] and max(verified) > 0, verified
    assert captured[verified.index(0)] == 0, captured


def test_ngram_verify_steps_under_ep_run_captured_and_give_the_plain_greedy_tokens(deepseek_2048,
                                                                                    without_speculation):
    assert_verified_captured(captured_run(deepseek_2048, NGRAM), without_speculation)


def test_mtp_verify_steps_under_ep_run_captured_and_give_the_plain_greedy_tokens(deepseek_2048, without_speculation,
                                                                                  tmp_path):
    mtp = write_mtp_checkpoint(deepseek_2048, tmp_path / "mtp")
    assert_verified_captured(captured_run(mtp, MTP), without_speculation)


def test_the_decode_bound_counts_the_drafts_within_the_token_budget():
    """DeepEP's low-latency buffers and the captured step's largest bucket are sized by it."""
    assert EngineConfig(model="unused", max_num_seqs=8).decode_max_tokens == 8
    assert EngineConfig(model="unused", max_num_seqs=8, speculative_config=NGRAM).decode_max_tokens == 32
    assert EngineConfig(model="unused", max_num_seqs=8, max_num_batched_tokens=20,
                        speculative_config=NGRAM).decode_max_tokens == 20
    assert EngineConfig(model="unused", max_num_seqs=8, max_num_batched_tokens=4,
                        speculative_config=NGRAM).decode_max_tokens == 8
