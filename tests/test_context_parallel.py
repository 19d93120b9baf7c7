"""Context parallelism: the ranks of a DP attention worker split each step's tokens (zigzag pieces of long
sequences, whole short ones), exchange new K/V, and generate transformers' greedy tokens.

Every architecture runs a 2k-token prompt next to a short prompt and a one-token prompt at cp=2, so one
run covers the zigzag split of a long prefill, whole short sequences, and decode batches shared out by
sequence; chunked prefill, expert parallelism and DP attention are layered on top for some of them.
"""
from dataclasses import dataclass

import pytest
import torch
from context_parallel_cases import generate_on_rank
from tiny_checkpoints import HFOracle

from moe_runtime import LLM, SamplingParams
from moe_runtime.models.context_parallel import SequencePiece, assign_pieces
from multirank import ranks  # noqa: F401  (fixture)

ARCHS = ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
         "deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
LONG = 2048
NEW_TOKENS = 4


def long_prompt(length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


PROMPTS = [long_prompt(LONG), long_prompt(37, 1), [5]]


def causal_cost(pieces, context_before: int = 0) -> int:
    """Query x key pairs causal attention computes for a rank's pieces (of one sequence)."""
    return sum(sum(context_before + p.offset + i + 1 for i in range(p.length)) for p in pieces)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_long_sequences_cut_in_zigzag_pieces_with_equal_causal_cost(cp):
    pieces = assign_pieces([LONG], cp)
    rows = sorted((p.offset, p.offset + p.length) for own in pieces for p in own)
    assert rows[0][0] == 0 and rows[-1][1] == LONG and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert all(len(own) == 2 for own in pieces)
    costs = [causal_cost(own) for own in pieces]
    assert max(costs) / min(costs) < 1.01, costs   # a contiguous split would give rank cp-1 about 2cp-1 times rank 0
    contiguous = [causal_cost([SequencePiece(0, r * LONG // cp, LONG // cp)]) for r in range(cp)]
    assert max(contiguous) / min(contiguous) > 2 * cp - 1.5


def test_short_sequences_go_whole_to_the_least_loaded_rank():
    # six decode tokens and a 3-token chunk after a long prompt: shared out by tokens
    pieces = assign_pieces([1, 1, 1, 100, 1, 1, 3, 1], 2)
    owner = {p.seq: r for r, own in enumerate(pieces) for p in own if p.length < 100}
    assert [owner[s] for s in (0, 1, 2)] == [0, 1, 0]
    assert sum(p.length for p in pieces[0]) in (54, 55) and sum(p.length for p in pieces[1]) in (54, 55)
    assert all(p.length == 3 for own in pieces for p in own if p.seq == 6)
    assert assign_pieces([], 2) == [[], []]
    assert assign_pieces([1], 2) == [[SequencePiece(0, 0, 1)], []]   # the other rank runs an empty step


@pytest.fixture(scope="module")
def long_checkpoint(tiny_checkpoint_factory):
    """`path(arch)`: the arch's tiny checkpoint with room for the 2k-token prompt."""
    return lambda arch: tiny_checkpoint_factory(arch, max_position_embeddings=4096)


@dataclass
class Expected:
    tokens: list[list[int]]               # transformers' greedy tokens of PROMPTS
    first_prompt_logprobs: torch.Tensor   # [P-1] logprob of the long prompt's tokens 1..P-1


@pytest.fixture(scope="module")
def oracle(long_checkpoint):
    """`oracle(arch) -> Expected`, computed once per architecture."""
    found = {}

    def expected(arch):
        if arch not in found:
            model = HFOracle(long_checkpoint(arch))
            logprobs = model.prefill_logits(PROMPTS[0]).log_softmax(-1)[:-1]               # [P-1, V]
            targets = torch.tensor(PROMPTS[0][1:])[:, None]
            found[arch] = Expected(model.greedy(PROMPTS, NEW_TOKENS), logprobs.gather(1, targets)[:, 0])
        return found[arch]
    return expected


def assert_matches(runs, expected: Expected) -> None:
    """Every rank generated transformers' tokens and scored every position of the long prompt as it does (each
    position's logprob depends on exactly the keys before it: a piece attending one key too many or too few
    shows here even where the greedy tokens survive it)."""
    for run in runs:
        assert run.tokens == expected.tokens
        torch.testing.assert_close(torch.tensor(run.first_prompt_logprobs), expected.first_prompt_logprobs,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_matches_transformers_on_a_2k_prompt(arch, ranks, long_checkpoint, oracle):
    path = long_checkpoint(arch)
    runs = ranks(2).run(generate_on_rank, str(path), PROMPTS, NEW_TOKENS, cp=2)
    assert_matches(runs, oracle(arch))
    # one K/V exchange per attention layer per step: the prefill step then a decode step per new token
    assert runs[0].exchanges == runs[1].exchanges == _num_layers(path) * NEW_TOKENS
    assert runs[0].bytes_received > 0 and runs[1].bytes_received > 0


def _num_layers(path) -> int:
    from moe_runtime.config.model_config import load_hf_config

    return load_hf_config(path).num_hidden_layers


@pytest.mark.parametrize("arch, layout", [
    ("qwen3_moe", dict(ep=2, cp=2)),                                          # experts split too, dispatch unchanged
    ("deepseek_v3", dict(ep=2, cp=2, max_num_batched_tokens=512)),            # MLA, chunked prefill (4+ chunks)
    ("llama", dict(cp=2, max_num_batched_tokens=300, enable_prefix_caching=False)),  # GQA, chunked, uneven chunks
])
def test_with_expert_parallelism_and_chunked_prefill(arch, layout, ranks, long_checkpoint, oracle):
    runs = ranks(2).run(generate_on_rank, str(long_checkpoint(arch)), PROMPTS, NEW_TOKENS, **layout)
    assert_matches(runs, oracle(arch))


def test_a_prompt_sharing_a_cached_prefix(ranks, long_checkpoint):
    """A prompt whose first 1504 tokens an earlier prompt had: its blocks come from the prefix cache (written by
    both ranks' exchanges), and only its 5-token tail is cut among the ranks."""
    path = long_checkpoint("qwen2")
    prompts = [PROMPTS[0], PROMPTS[0][:1504] + [7, 8, 9, 10, 11]]
    expected = HFOracle(path).greedy(prompts, NEW_TOKENS)
    runs = ranks(2).run(generate_on_rank, str(path), prompts, NEW_TOKENS, cp=2, max_num_batched_tokens=LONG)
    assert runs[0].tokens == runs[1].tokens == expected
    assert runs[0].prefix_cache_hits == runs[1].prefix_cache_hits == 1504


@pytest.mark.parametrize("arch, layout", [
    ("llama", dict(tp=2, cp=2)),                     # heads split inside each cp slice (dense TP)
    ("llama", dict(cp=2, pp=2)),                     # two stages; each hands the next the whole step
    ("qwen3_moe", dict(ep=4, dp_attn=2, cp=2)),      # two DP workers of two cp ranks, experts over all four
])
def test_four_rank_layouts(arch, layout, ranks, long_checkpoint, oracle):
    """Every rank is given every prompt (with dp_attn=2 both DP workers run them all, independently)."""
    runs = ranks(4).run(generate_on_rank, str(long_checkpoint(arch)), PROMPTS, NEW_TOKENS, **layout)
    assert_matches(runs[2:] if layout.get("pp") else runs, oracle(arch))   # with pp, ranks 2 and 3 score prompts


def test_llm_routes_to_a_context_parallel_worker_and_hears_it_once(long_checkpoint, oracle):
    """The process layer: two worker processes (ep=2, cp=2) form one DP worker; the front gets each token once,
    from the worker's first rank."""
    path = long_checkpoint("qwen3_moe")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", ep=2, cp=2) as llm:
        outputs = llm.generate(PROMPTS + PROMPTS[1:], params)
    expected = oracle("qwen3_moe").tokens
    assert [o.token_ids for o in outputs] == expected + expected[1:]
