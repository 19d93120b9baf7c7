"""Expert parallelism with DP attention: every layout gives the one-rank greedy tokens.

Each engine below starts real worker processes (gloo); one engine serves several tests.
"""
import pytest

from engine_helpers import PROMPTS, greedy
from moe_runtime import LLM

NEW_TOKENS = 10   # PROMPTS[1] prefills across a 16-token KV block, PROMPTS[3] decodes across one
LAYOUTS = [  # (arch, ep, dp_attn): attention TP = ep / dp_attn; every valid pair of ep {2, 4}, dp_attn {1, 2, 4}
    (arch, ep, dp)
    for arch in ("mixtral", "qwen3_moe", "deepseek_v3")
    for ep, dp in ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4))
]


@pytest.fixture(scope="module")
def oracle(greedy_oracle):
    return lambda arch, prompts: greedy_oracle(arch, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch, ep, dp_attn", LAYOUTS, ids=[f"{a}-ep{e}-dp{d}" for a, e, d in LAYOUTS])
def test_layout_matches_one_rank(arch, ep, dp_attn, tiny_checkpoint_factory, oracle):
    path = tiny_checkpoint_factory(arch)
    with LLM(str(path), device="cpu", dtype="float32", ep=ep, dp_attn=dp_attn) as llm:
        # a full batch over every DP worker
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        assert [o.token_ids for o in outputs] == oracle(arch, PROMPTS)
        # one request: every other DP worker is idle and runs empty batches, prefill and decode
        [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
        assert single.token_ids == oracle(arch, [PROMPTS[1]])[0]
        # requests ending at different steps never hang the others
        lengths = [3, NEW_TOKENS, 1, 7]
        mixed = llm.generate(PROMPTS, [greedy(n) for n in lengths])
        assert [o.token_ids for o in mixed] == [tokens[:n] for tokens, n in zip(oracle(arch, PROMPTS), lengths)]
        # each rank holds ~1/ep of the routed-expert bytes
        resident = llm.engine.client.resident_expert_bytes()
        for rank, (local, total) in resident.items():
            assert local * ep == total, f"rank {rank} holds {local} of {total} expert bytes"


def test_router_spreads_requests_by_load(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("mixtral")
    with LLM(str(path), device="cpu", dtype="float32", ep=2, dp_attn=2) as llm:
        engine = llm.engine
        engine.add_request("long", list(range(5, 205)), greedy(4))
        assert engine.router.last_decision.dp_rank == 0
        engine.add_request("short-1", [5, 6, 7], greedy(4))
        assert engine.router.last_decision.dp_rank == 1, "the busy worker got the next request"
        engine.add_request("short-2", [8, 9, 10], greedy(4))
        decision = engine.router.last_decision
        assert decision.dp_rank == 1, "round-robin would have picked worker 0, which holds 200 tokens"
        assert [w.tokens for w in decision.loads] == [200, 3]
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert set(done) == {"long", "short-1", "short-2"}
        assert all(w.tokens == 0 and w.requests == 0 for w in engine.router.loads)
