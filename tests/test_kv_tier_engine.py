"""KV tiers in the engine: a prefix evicted from the device pool comes back from host memory or disk with
transformers' greedy tokens, for every cache kind (full-attention K/V, MLA latents, sparse attention's index keys,
sliding and chunked windows, linear-attention states, DeepSeek-V4's compressed caches); the disk tier serves after
a restart, a corrupted file is a recompute, tenants' salts keep their entries apart, a request aborted while loading
frees its blocks safely, and the layouts with several ranks per DP worker (attention TP, PP) agree on each load.

The device pool is sized to 12 blocks: each prompt (9 blocks and a bit) evicts the one before it, so the second
round of the same prompts finds every prefix only below the device.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import greedy
from moe_runtime import LLM
from moe_runtime.config.engine_config import EngineConfig, EngineConfigError
from moe_runtime.engine.core import EngineCore
from moe_runtime.kv_tiers.block_contents import BlockContents
from moe_runtime.kv_tiers.tier_file import HEADER
from moe_runtime.kv_tiers.tier_key import FULL_GROUP, STATE_SNAPSHOT

NEW_TOKENS = 3
POOL_BLOCKS = 12
HOST = dict(kv_host_memory=64 << 20)


def block_size_of(arch: str) -> int:
    return 16 if arch == "deepseek_v4" else 8   # V4 pages whole compression blocks (rates 4 and 16)


def prompts_for(arch: str, count: int = 3, salt: int = 0) -> list[list[int]]:
    """`count` prompts of 9 blocks and 6 tokens sharing nothing (longer than every window, chunk and compression
    block of the tiny models)."""
    length = 9 * block_size_of(arch) + 6
    return [[(7 * i + 31 * j + salt) % 490 + 5 for i in range(length)] for j in range(count)]


def options_for(arch: str, path: Path, blocks: int = POOL_BLOCKS, **layout) -> dict:
    """CPU fp32 options whose device pool holds `blocks` full-group blocks (measured on a probe engine)."""
    common = dict(device="cpu", dtype="float32", block_size=block_size_of(arch), max_num_seqs=2,
                  max_num_batched_tokens=32, **layout)
    probe_budget = 8 << 20
    one_rank = {k: v for k, v in common.items() if k not in layout}
    with LLM(str(path), kv_cache_memory=probe_budget, **one_rank) as probe:
        core = probe.core
        per_block = BlockContents(core.runner.caches, [], 0).entry_bytes()[FULL_GROUP]
        probe_blocks = core.block_manager.num_blocks
    return dict(common, kv_cache_memory=probe_budget - (probe_blocks - blocks) * per_block)


def run_twice(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, then each again (each one evicting the one before from the device pool)."""
    return [llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids for prompt in prompts + prompts]


def tier_stats(llm: LLM):
    [worker] = llm.engine.stats().workers
    return worker


# arch -> (what it adds, the tier options, the entry kinds that must have come back from the tiers)
CACHE_KINDS = {
    "llama": ("full-attention K/V", "host", {FULL_GROUP}),
    "deepseek_v3": ("MLA latents", "disk", {FULL_GROUP}),
    "deepseek_v32": ("MLA latents and the indexer's keys", "host", {FULL_GROUP}),
    "gpt_oss": ("sliding windows beside full layers", "host", {FULL_GROUP, 1}),
    # a prefix ending on a chunk boundary (chunks of 8, blocks of 8) needs none of its chunked layers' blocks
    "llama4": ("chunked windows beside full layers", "disk", {FULL_GROUP}),
    "qwen3_next": ("linear-attention states", "host", {FULL_GROUP, STATE_SNAPSHOT}),
    "qwen3_5_moe": ("linear-attention states (Qwen3.5-MoE)", "disk", {FULL_GROUP, STATE_SNAPSHOT}),
    "deepseek_v4": ("compressed entries, rings and carried projections", "host", {FULL_GROUP, STATE_SNAPSHOT}),
}


@pytest.mark.parametrize("arch", list(CACHE_KINDS))
def test_an_evicted_prefix_comes_back_from_a_tier_with_the_same_tokens(arch, tiny_checkpoint_factory, greedy_oracle,
                                                                        tmp_path):
    _, tier, kinds = CACHE_KINDS[arch]
    path = tiny_checkpoint_factory(arch)
    prompts = prompts_for(arch)
    tiers = HOST if tier == "host" else dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size=64 << 20)
    with LLM(str(path), **options_for(arch, path), **tiers) as llm:
        assert llm.core.block_manager.num_blocks == POOL_BLOCKS
        tokens = run_twice(llm, prompts)
        worker = tier_stats(llm)
        loaded = llm.core.tiers.counters.loaded_by_kind
    assert tokens == greedy_oracle(arch, prompts, NEW_TOKENS) * 2
    assert worker.kv_tier_hit_tokens >= len(prompts) * 4 * block_size_of(arch), "the second round came from the tier"
    assert {t.name for t in worker.kv_tiers} == {tier} and worker.kv_tiers[0].hits > 0
    assert kinds <= {kind for kind, count in loaded.items() if count}, loaded


def test_without_tiers_the_same_workload_recomputes(tiny_checkpoint_factory):
    """The control: the pool alone keeps none of the evicted prefixes (so the test above cannot pass without them)."""
    path = tiny_checkpoint_factory("llama")
    with LLM(str(path), **options_for("llama", path)) as llm:
        run_twice(llm, prompts_for("llama"))
        worker = tier_stats(llm)
    assert worker.prefix_cache_hits == 0 and worker.kv_tier_hit_tokens == 0 and worker.kv_tiers == []


@pytest.fixture(scope="module")
def llama_options(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    return path, options_for("llama", path)


def test_the_disk_tier_serves_after_a_restart_and_a_corrupted_file_is_a_recompute(llama_options, greedy_oracle,
                                                                                  tmp_path):
    path, options = llama_options
    prompts = prompts_for("llama")
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size=64 << 20)
    want = greedy_oracle("llama", prompts, NEW_TOKENS)
    with LLM(str(path), **options, **disk) as llm:      # the later prompts evict the first (tail first) to the disk
        assert [llm.generate([p], greedy(NEW_TOKENS))[0].token_ids for p in prompts] == want
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    with LLM(str(path), **options, **disk) as llm:             # a restart: the files are the index again
        assert llm.generate([prompts[0]], greedy(NEW_TOKENS))[0].token_ids == want[0]
        worker = tier_stats(llm)
        assert worker.kv_tier_hit_tokens == 9 * 8 and worker.kv_tiers[0].hits >= 9
        # the last prompt was on the device at shutdown: written down then, it is found too
        assert llm.generate([prompts[-1]], greedy(NEW_TOKENS))[0].token_ids == want[-1]
        assert tier_stats(llm).kv_tier_hit_tokens == 2 * 9 * 8
    for f in sorted((tmp_path / "kv").rglob("g0-*.kv")):      # every full-group block damaged
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x5A
        f.write_bytes(bytes(data))
    with LLM(str(path), **options, **disk) as llm:
        assert llm.generate([prompts[0]], greedy(NEW_TOKENS))[0].token_ids == want[0]
        worker = tier_stats(llm)
        assert worker.kv_tiers[0].misses >= 1 and worker.kv_tier_failed_loads == 1


def test_another_disk_layout_or_model_reads_none_of_the_files(llama_options, tiny_checkpoint_factory, tmp_path):
    path, options = llama_options
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size=64 << 20)
    prompts = prompts_for("llama", 2)
    with LLM(str(path), **options, **disk) as llm:
        for prompt in prompts:
            llm.generate([prompt], greedy(NEW_TOKENS))
        assert tier_stats(llm).kv_tiers[0].entries > 0
    with LLM(str(path), **dict(options, block_size=16, kv_cache_memory=options["kv_cache_memory"]), **disk) as llm:
        llm.generate([prompts[0]], greedy(NEW_TOKENS))
        assert tier_stats(llm).kv_tiers[0].entries == 0, "another block size: another directory"


def test_tenants_salts_keep_their_entries_apart(llama_options):
    path, options = llama_options
    shared, *others = prompts_for("llama")
    with LLM(str(path), **options, **HOST) as llm:
        alice = greedy(NEW_TOKENS, cache_salt="alice")
        first = llm.generate([shared], alice)[0].token_ids
        for prompt in others:                                     # evicts alice's blocks into the host tier
            llm.generate([prompt], greedy(NEW_TOKENS))
        before = tier_stats(llm).kv_tier_hit_tokens
        assert llm.generate([shared], greedy(NEW_TOKENS, cache_salt="bob"))[0].token_ids == first
        assert tier_stats(llm).kv_tier_hit_tokens == before, "bob's salt finds none of alice's entries"
        for prompt in others:
            llm.generate([prompt], greedy(NEW_TOKENS))
        assert llm.generate([shared], alice)[0].token_ids == first
        assert tier_stats(llm).kv_tier_hit_tokens > before


def test_a_request_aborted_while_loading_frees_its_blocks_and_the_others_go_on(llama_options):
    path, options = llama_options
    core = EngineCore(EngineConfig(model=str(path), **options, **HOST))
    try:
        first, second = prompts_for("llama", 2)
        for index, prompt in enumerate([first, second]):
            core.add_request(f"warm{index}", prompt, greedy(1))
            while core.has_unfinished():
                core.step()
        core.add_request("again", first, greedy(NEW_TOKENS))     # its prefix is in the host tier now
        core.add_request("other", second[:12], greedy(NEW_TOKENS))   # fits beside it (2 blocks)
        core.step()
        assert [seq.request_id for seq in core.scheduler.loading] == ["again"]
        assert [seq.request_id for seq in core.scheduler.running] == ["other"], "the others step while it loads"
        assert core.drop_request("again")
        assert not core.scheduler.loading and core.tiers.wait_for("again") is False
        while core.has_unfinished():
            core.step()
        manager = core.block_manager
        assert manager.num_free_blocks == manager.num_blocks, "no block is left held"
    finally:
        core.shutdown()


def test_tier_settings_are_checked_and_name_the_flag(tiny_checkpoint_factory, tmp_path):
    path = str(tiny_checkpoint_factory("llama"))
    for bad, flag in ((dict(kv_disk_dir=str(tmp_path)), "--kv-disk-size"), (dict(kv_disk_size=1 << 20), "--kv-disk-dir"),
                      (dict(kv_host_memory=1 << 20, enable_prefix_caching=False), "--enable-prefix-caching"),
                      (dict(kv_host_memory=-1), "--kv-host-memory")):
        with pytest.raises(EngineConfigError, match=flag):
            EngineConfig(model=path, **bad).validate()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(ep=2, dp_attn=2), dict(pp=2), dict(ep=2, dp_attn=1, cp=2)],
                         ids=["ep2_dp2", "pp2", "ep2_cp2"])
def test_several_ranks_keep_their_own_tiers_with_the_same_tokens(layout, tiny_checkpoint_factory, greedy_oracle):
    arch = "qwen3_moe"
    path = tiny_checkpoint_factory(arch)
    prompts = prompts_for(arch)
    with LLM(str(path), **options_for(arch, path, **layout), **HOST) as llm:
        tokens = run_twice(llm, prompts)
        hit_tokens = sum(worker.kv_tier_hit_tokens for worker in llm.engine.stats().workers)
    assert tokens == greedy_oracle(arch, prompts, NEW_TOKENS) * 2
    assert hit_tokens >= len(prompts) * 4 * 8


@pytest.mark.slow
def test_the_ranks_of_a_worker_agree_when_one_ranks_file_is_damaged(tiny_checkpoint_factory, greedy_oracle, tmp_path):
    """One DP worker over two ranks (attention TP): after a restart, rank 1's files are damaged and rank 0's are not;
    both recompute (neither serves half a prefix from its tier), with transformers' tokens."""
    arch = "qwen3_moe"
    path = tiny_checkpoint_factory(arch)
    prompts = prompts_for(arch)
    options = options_for(arch, path, blocks=POOL_BLOCKS // 2, ep=2, dp_attn=1)   # each rank keeps half the heads
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size=64 << 20)
    want = greedy_oracle(arch, prompts, NEW_TOKENS)
    with LLM(str(path), **options, **disk) as llm:
        assert [llm.generate([p], greedy(NEW_TOKENS))[0].token_ids for p in prompts] == want
    rank_dirs = sorted(d for d in (tmp_path / "kv").glob("*/*") if d.is_dir())
    assert [d.name for d in rank_dirs] == ["dp0-pp0-tp0-cp0", "dp0-pp0-tp1-cp0"]
    for f in rank_dirs[1].glob("g0-*.kv"):
        data = bytearray(f.read_bytes())
        data[HEADER.size + 3] ^= 0x01
        f.write_bytes(bytes(data))
    with LLM(str(path), **options, **disk) as llm:
        assert [llm.generate([p], greedy(NEW_TOKENS))[0].token_ids for p in prompts[:1]] == want[:1]
        [worker] = llm.engine.stats().workers      # reported by rank 0, whose own files were intact
        assert worker.kv_tier_failed_loads >= 1, "rank 0 followed rank 1's failed load"



