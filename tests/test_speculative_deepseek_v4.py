"""MTP speculative decoding for DeepSeek-V4: its `mtp.0.*` layer (moe_runtime/models/deepseek_v4_mtp.py) drafting,
its window and compressor state in a state slot of its own.

The tiny V4 checkpoint (tests/tiny_archs.py: CSA entries of 4 tokens, HCA of 16, an 8-token window) gets an MTP
layer with random weights (moe_runtime/weights/mtp_checkpoint_writer.py): its block drawn from the target's CSA
layer (window, compressor and indexer state, hash routing; its attention output scaled up so that the state weighs
in the drafts), or from its sliding-only layer with the layer made to draft the token it embeds (the "echo" layer,
whose drafts the target accepts where it repeats a token). After every step, each sequence's k = 2 drafts must
equal what transformers' own V4 modules compute from the layer's definition over the whole sequence
(`DeepseekV4MtpReference`): a state written at the wrong slot, left as a chain row wrote it, or not restored with a
cached prefix changes them. Prompts (20 to 45 tokens) outrun the window and the HCA block; prefills run in chunks
of 8; a prompt sharing two cached blocks resumes from their state snapshot (and the token after them: the MTP row
at a block's last position p reads the token at p + 1, so where a prompt differs there the resumed MTP state at p
is the first prompt's, and its drafts, not its tokens, may differ). Greedy tokens equal transformers' without
speculation, on one rank and (slow) under ep=2 with DP attention or attention TP.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine_helpers import greedy
from mtp_checkpoints import DeepseekV4MtpReference, run_checking_drafts
from multirank import ranks  # noqa: F401  (pytest fixture)
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig
from moe_runtime.engine.core import EngineCore
from moe_runtime.kv_blocks.kv_groups import KVCacheLayout, KVGroups
from moe_runtime.execution.model_runner import kv_blocks_for_budget, state_rows
from moe_runtime.layers.compressed_cache import CompressedAttentionSpec
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.deepseek_v4_support import refuse_unsupported
from moe_runtime.weights.mtp_checkpoint_writer import write_mtp_checkpoint
from moe_runtime.weights.quantization.fp8_checkpoint_writer import copy_side_files, read_all_tensors, write_two_shards
from speculative_pipeline_cases import drafted_on_rank
from test_deepseek_v4 import ARCH, PROMPTS

pytestmark = pytest.mark.timeout(600)

K = 2
MTP = dict(method="mtp", num_speculative_tokens=K)
NEW_TOKENS = 8
CHECKED = PROMPTS[:2]   # 45 and 23 tokens
# shares PROMPTS[0]'s first two blocks and the token after them: the MTP row at a block's last position reads the
# next token, so a cached prefix's MTP state is the sequence's own only where that token agrees (module doc)
SHARED_PREFIX = PROMPTS[0][:33] + [(3 * i + 11) % 450 + 8 for i in range(6)]
REPEATING = [7, 8, 9] * 6 + [1, 2]   # its continuation repeats one token five times: the echo layer's drafts hold


def _echo_layer(source: Path, target: Path) -> Path:
    """`source`'s checkpoint with its MTP layer made to draft the token it embeds (e_proj the identity, h_proj 0, its
    own LM head a copy of the embedding): drafts the target accepts where it repeats a token."""
    tensors = read_all_tensors(source)
    hidden = tensors["mtp.0.e_proj.weight"].shape[0]
    tensors.update({"mtp.0.e_proj.weight": torch.eye(hidden), "mtp.0.h_proj.weight": torch.zeros(hidden, hidden),
                    "mtp.0.head.weight": tensors["model.embed_tokens.weight"].clone()})
    copy_side_files(source, target)
    write_two_shards(tensors, target)
    return target


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """"csa": the tiny V4 checkpoint with an `mtp.0.*` layer whose block is its CSA layer's (hash-routed); "echo": one
    whose block is its sliding-only layer's, drafting the token it embeds (`_echo_layer`)."""
    root = tmp_path_factory.mktemp("v4_mtp")
    sliding = write_mtp_checkpoint(tiny_checkpoint_factory(ARCH), root / "sliding", v4_block_layer=2)
    return {"csa": write_mtp_checkpoint(tiny_checkpoint_factory(ARCH), root / "csa", v4_block_layer=0),
            "echo": _echo_layer(sliding, root / "echo")}


def _engine(path: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=MTP,
                                   block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   enable_prefix_caching=True))


def _run_checked(core: EngineCore, reference, prompts: list[list[int]], new_tokens: int,
                 name: str = "") -> list[list[int]]:
    """Greedy outputs of `prompts` (request ids `name`0, `name`1, ...), each sequence's drafts checked against
    `reference` after every step."""
    for index, prompt in enumerate(prompts):
        core.add_request(f"{name}{index}", prompt, greedy(new_tokens))
    seqs = list(core._sequences.values())
    assert run_checking_drafts(core, reference, K) >= 2 * len(prompts)
    return [seq.output_token_ids for seq in seqs]


def test_the_drafts_are_the_mtp_layers_and_greedy_tokens_are_unchanged(mtp_checkpoint, greedy_oracle, tmp_path):
    """A CSA block (window, compressor and indexer state; hash routing), its attention weighing in the drafts."""
    path = mtp_checkpoint["csa"]
    reference = DeepseekV4MtpReference(path, tmp_path / "one_layer", "compressed_sparse_attention", "hash_moe")
    core = _engine(path)
    try:
        outputs = _run_checked(core, reference, CHECKED, NEW_TOKENS)
        hits = core.worker_stats().prefix_cache_hits
        shared = _run_checked(core, reference, [SHARED_PREFIX], NEW_TOKENS, "shared")   # resumes the MTP state too
        assert core.worker_stats().prefix_cache_hits > hits, "the shared prefix did not reuse its cached blocks"
        worker = core.worker_stats()
    finally:
        core.shutdown()
    assert outputs + shared == greedy_oracle(ARCH, CHECKED + [SHARED_PREFIX], NEW_TOKENS)
    assert worker.spec_draft_tokens > 0 and worker.spec_verify_steps > 0


def test_accepted_drafts_leave_the_layers_state_as_its_true_rows_make_it(mtp_checkpoint, greedy_oracle, tmp_path):
    """A sliding-only block with its own LM head whose drafts the target accepts in a run of one token: the pass
    after such a verify step covers the accepted rows, over the positions the chain wrote."""
    path = mtp_checkpoint["echo"]
    reference = DeepseekV4MtpReference(path, tmp_path / "one_layer", "sliding_attention", "moe")
    core = _engine(path)
    try:
        [output] = _run_checked(core, reference, [REPEATING], 2 * NEW_TOKENS)
        worker = core.worker_stats()
    finally:
        core.shutdown()
    assert output == greedy_oracle(ARCH, [REPEATING], 2 * NEW_TOKENS)[0]
    assert 0 < worker.spec_accepted_tokens < worker.spec_draft_tokens, worker


@pytest.mark.slow
@pytest.mark.parametrize("dp_attn", [2, 1])
def test_mtp_with_expert_parallel(dp_attn, mtp_checkpoint, greedy_oracle):
    """ep=2 with DP attention (each worker drafts for its own sequences, in lock-step: the MTP block's experts are
    spread over both ranks; then one prompt alone, the other worker running the pass with no rows) and with
    attention TP (the MTP block's heads split like the target's)."""
    with LLM(str(mtp_checkpoint["csa"]), device="cpu", dtype="float32", speculative_config=MTP, ep=2,
             dp_attn=dp_attn) as llm:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))]
        if dp_attn > 1:
            [single] = llm.generate([PROMPTS[1]], greedy(NEW_TOKENS))
            assert single.token_ids == outputs[1]
        workers = llm.engine.stats().workers
    assert outputs == greedy_oracle(ARCH, PROMPTS, NEW_TOKENS)
    assert all(w.spec_draft_tokens > 0 and w.spec_verify_steps > 0 for w in workers), workers


def rank_reference(path: Path, root: Path) -> DeepseekV4MtpReference:
    """The CSA layer's reference on one rank of the pool (each writes its one-layer checkpoint apart)."""
    return DeepseekV4MtpReference(path, root / f"rank{dist.get_rank()}", "compressed_sparse_attention", "hash_moe")


@pytest.mark.slow
def test_mtp_under_pipeline_stages_drafts_the_layers_drafts(ranks, mtp_checkpoint, greedy_oracle, tmp_path):
    """--pp 2: the last stage keeps the hc_mult streams entering the hyper head and drafts; every stage's drafts
    (the first stage's by broadcast) equal the reference's after every step."""
    path = mtp_checkpoint["csa"]
    runs = ranks(2).run(drafted_on_rank, str(path), MTP, rank_reference, (path, tmp_path), PROMPTS, NEW_TOKENS,
                        pp=2, block_size=16)
    assert all(run.tokens == dict(enumerate(greedy_oracle(ARCH, PROMPTS, NEW_TOKENS))) for run in runs)
    assert all(run.compared >= len(PROMPTS) for run in runs)
    assert runs[-1].drafted > 0 and runs[-1].verify_steps > 0


def test_a_checkpoint_without_the_mtp_layer_is_refused_by_name(tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError, match=r"DeepseekV4ForCausalLM .* has no multi-token-prediction layer .* "
                                                  r"tensors mtp\.0\.\*"):
        LLM(str(tiny_checkpoint_factory(ARCH)), device="cpu", dtype="float32", speculative_config=MTP)


def test_an_eagle3_head_is_refused_by_name(hf_oracles):
    """Its aux rows would be one stream of the hc_mult: refused at start-up instead of failing in the first step."""
    engine = SimpleNamespace(enable_torch_compile=False, speculative_config={"method": "eagle3", "model": "head"},
                             block_size=16)
    context = SimpleNamespace(quant=None, engine=engine, parallel=SimpleNamespace(pp_size=1))
    with pytest.raises(InvalidRequestError, match=r"method 'eagle3' with DeepSeek-V4: not implemented"):
        refuse_unsupported(hf_oracles(ARCH).config, context)


def test_the_mtp_layers_cache_is_paid_from_the_kv_budget():
    """The MTP layer's state rows and paged entries come out of the same budget as the target's, at the largest
    layer's size (a CSA layer's: window, carried projections, entries and index keys)."""
    csa = CompressedAttentionSpec(32, 8, 4, True, 16, K + 1)
    model = SimpleNamespace(kv_cache_specs=lambda: [csa, CompressedAttentionSpec(32, 8, 16, draft_slack=K + 1),
                                                    CompressedAttentionSpec(32, 8, draft_slack=K + 1)])
    budget, slots = 2**22, 4

    def blocks(drafter_layers: int) -> int:
        layout = KVCacheLayout(KVGroups.single(), state_slots=slots, drafter_layers=drafter_layers)
        return kv_blocks_for_budget(model, budget, 16, torch.float32, layout)

    without, with_mtp = blocks(0), blocks(1)
    per_block = sum(spec.bytes_per_block(16, torch.float32) for spec in model.kv_cache_specs())
    per_slot = sum(spec.bytes_per_slot(torch.float32) for spec in model.kv_cache_specs())
    mtp_block, mtp_slot = csa.bytes_per_block(16, torch.float32), csa.bytes_per_slot(torch.float32)
    assert with_mtp < without
    assert with_mtp * (per_block + mtp_block) + (per_slot + mtp_slot) * state_rows(slots) <= budget
    assert (with_mtp + 1) * (per_block + mtp_block) + (per_slot + mtp_slot) * state_rows(slots) > budget
