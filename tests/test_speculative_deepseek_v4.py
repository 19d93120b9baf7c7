"""MTP speculative decoding for DeepSeek-V4: its `mtp.0.*` layer (moe_runtime/models/deepseek_v4_mtp.py) drafting,
its window and compressor state in a state slot of its own.

The tiny V4 checkpoint (tests/tiny_archs.py: CSA entries of 4 tokens, HCA of 16, an 8-token window) gets an MTP
layer with random weights (moe_runtime/weights/mtp_checkpoint_writer.py), its block drawn from the target's CSA
layer (window, compressor and indexer state, hash routing) or its sliding-only one. After every step, each
sequence's k = 2 drafts must equal what transformers' own V4 modules compute from the layer's definition over the
whole sequence (`DeepseekV4MtpReference`): a state written at the wrong slot, not overwritten where a chain row
wrote it, or not restored with a cached prefix changes them. Prompts (23 to 45 tokens) outrun the window and the
HCA block; prefills run in chunks of 8; a prompt sharing two cached blocks resumes from their state snapshot (and
the token after them: the MTP row at a block's last position p reads the token at p + 1, so where a prompt differs
there the resumed MTP state at p is the first prompt's, and its drafts, not its tokens, may differ).
Greedy tokens equal transformers' without speculation, on one rank and (slow) with EP + DP attention.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_helpers import greedy
from mtp_checkpoints import DeepseekV4MtpReference, run_checking_drafts
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.deepseek_v4_support import refuse_unsupported
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint
from test_deepseek_v4 import ARCH, PROMPTS

pytestmark = pytest.mark.timeout(600)

K = 2
MTP = dict(method="mtp", num_speculative_tokens=K)
NEW_TOKENS = 8
CHECKED = PROMPTS[:2]   # 45 and 23 tokens
# shares PROMPTS[0]'s first two blocks and the token after them: the MTP row at a block's last position reads the
# next token, so a cached prefix's MTP state is the sequence's own only where that token agrees (module doc)
SHARED_PREFIX = PROMPTS[0][:33] + [(3 * i + 11) % 450 + 8 for i in range(6)]
BLOCKS = {   # the target layer the MTP block is drawn from -> its attention and routing
    0: ("compressed_sparse_attention", "hash_moe"),
    2: ("sliding_attention", "moe"),
}


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """block layer -> the tiny V4 checkpoint with an `mtp.0.*` layer whose block is that layer's."""
    root = tmp_path_factory.mktemp("v4_mtp")
    return {layer: write_mtp_checkpoint(tiny_checkpoint_factory(ARCH), root / f"block{layer}", v4_block_layer=layer)
            for layer in BLOCKS}


def _run_checked(core: EngineCore, reference, prompts: list[list[int]], first_id: int) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        core.add_request(str(first_id + index), prompt, greedy(NEW_TOKENS))
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, reference, K) >= 2 * len(prompts)
    return [seq.output_token_ids for seq in seqs]


@pytest.mark.parametrize("block_layer", sorted(BLOCKS))
def test_the_drafts_are_the_mtp_layers_and_greedy_tokens_are_unchanged(block_layer, mtp_checkpoint, greedy_oracle,
                                                                      tmp_path):
    path = mtp_checkpoint[block_layer]
    reference = DeepseekV4MtpReference(path, tmp_path / "one_layer", *BLOCKS[block_layer])
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   enable_prefix_caching=True))
    try:
        outputs = _run_checked(core, reference, CHECKED, 0)
        hits = core.stats().prefix_cache_hits
        shared = _run_checked(core, reference, [SHARED_PREFIX], len(CHECKED))   # resumes the MTP state too
        assert core.stats().prefix_cache_hits > hits, "the shared prefix did not reuse its cached blocks"
        worker = core.stats().workers[0]
    finally:
        core.shutdown()
    assert outputs + shared == greedy_oracle(ARCH, CHECKED + [SHARED_PREFIX], NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0


@pytest.mark.slow
def test_mtp_with_expert_parallel_and_dp_attention(mtp_checkpoint, greedy_oracle):
    """Each DP worker drafts for its own sequences in lock-step (the MTP block's experts spread over both ranks);
    then one prompt alone: the other worker runs the MTP pass with no rows."""
    with LLM(str(mtp_checkpoint[0]), device="cpu", dtype="float32", speculative_config=MTP, ep=2,
             dp_attn=2) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
        workers = llm.engine.stats().workers
    assert outputs == greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    assert single.token_ids == outputs[1]
    assert all(w.spec_draft_tokens > 0 and w.spec_verify_steps > 0 for w in workers), workers


def test_a_checkpoint_without_the_mtp_layer_is_refused_by_name(tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=r"DeepseekV4ForCausalLM .* has no multi-token-prediction layer .* "
                                                  r"tensors mtp\.0\.\*"):
        LLM(str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", speculative_config=MTP)


def test_pipeline_stages_are_refused_by_name(hf_oracles):
    engine = SimpleNamespace(enable_torch_compile=False, speculative_config=MTP, block_size=16)
    context = SimpleNamespace(quant=None, engine=engine, parallel=SimpleNamespace(pp_size=2))
    with pytest.raises(InvalidRequestError, match=r"method 'mtp' with DeepSeek-V4 and --pp > 1: not implemented"):
        refuse_unsupported(hf_oracles(ARCH).model.config, context)
    refuse_unsupported(hf_oracles(ARCH).model.config, SimpleNamespace(quant=None, engine=engine,
                                                                      parallel=SimpleNamespace(pp_size=1)))
