"""The captured decode step (`enable_torch_compile`): the same greedy tokens as eager on every architecture,
eager where it cannot capture, and refusals where it never could.

Every architecture is traced with torch.compile's "eager" backend (dynamo captures the whole step with
`fullgraph=True`, so any graph break fails the capture, and the graph runs without generated code); one
MoE architecture goes through inductor's generated C++ as well. Eager decode equals transformers
(test_engine_parity.py), so the transformers oracle is the eager tokens here (shared, computed once).
"""
import logging

import pytest
import torch

from engine_helpers import PROMPTS, greedy
from oracle_cache import cache_dir as oracle_cache_dir
from moe_runtime import LLM, SamplingParams
from moe_runtime.execution import aot_step
from moe_runtime.execution.decode_capture import CaptureSettings
from moe_runtime.config.engine_config import EngineConfigError
from moe_runtime.engine.core_setup import CoreSetup
from moe_runtime.server.cli import build_parser, engine_config_from_args

ARCHS = ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
         "deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
NEW_TOKENS = 20   # the parity tests' length: the oracle's cached tokens are reused


def capture_stats(llm):
    return llm.core.runner.capture.stats


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_decode_gives_eager_tokens(arch, tiny_checkpoint_factory, greedy_oracle):
    expected = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        stats = capture_stats(llm)
    assert [o.token_ids for o in outputs] == expected
    assert stats.disabled_reason is None
    assert stats.buckets_compiled == [4]                  # 4 prompts: one bucket, no pad row needed
    assert stats.captured_steps == NEW_TOKENS - 1         # every decode step; the prefill step ran eagerly


def test_padded_buckets_and_mixed_steps(tiny_checkpoint_factory, greedy_oracle):
    """Three sequences decode in bucket 4 (a pad row writes to the scratch block, which nobody reads), a
    prefill arriving mid-decode makes a mixed step that runs eagerly, and sequences finishing at different
    lengths shrink the batch to smaller buckets; the tokens stay the eager ones throughout."""
    arch = "qwen2_moe"                                     # routed + shared experts, a shared-expert gate
    lengths = [NEW_TOKENS, 7, 12, 3]
    expected = [tokens[:n] for tokens, n in zip(greedy_oracle(arch, PROMPTS, NEW_TOKENS), lengths)]
    with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", enable_torch_compile=True,
             torch_compile_backend="eager", torch_compile_max_bs=4) as llm:
        engine = llm.engine
        for index in range(3):
            engine.add_request(f"r{index}", PROMPTS[index], greedy(lengths[index]))
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished() or steps == 0:
            if steps == 4:                                 # three decoding: the late prompt's step is mixed
                engine.add_request("r3", PROMPTS[3], greedy(lengths[3]))
            for out in engine.step():
                tokens[out.request_id] = list(out.token_ids)
            steps += 1
        stats = capture_stats(llm)
    assert [tokens[f"r{i}"] for i in range(4)] == expected
    assert stats.disabled_reason is None
    assert 4 in stats.buckets_compiled and {1, 2} & set(stats.buckets_compiled)
    assert stats.eager_steps >= 2                          # the first prefill and the mixed step


def test_inductor_generated_code_gives_eager_tokens(tiny_checkpoint_factory, greedy_oracle, tmp_path, monkeypatch):
    """The default backend, inductor's C++ (and its fused per-(token, expert) GEMV loops), compiled ahead of time
    (AOTInductor, the CPU's default): the step's library writes the KV caches in place and reads the model's own
    weights; a second engine loads the library the first one made instead of compiling it again.

    The libraries are kept with the tests' cached oracle answers (a cold compile is a minute or two per graph): the
    runtime's own cache key (the exported graph's code, shapes, dtypes, thread count, torch's version) makes any
    change of the step compile again, so the first engine compiles whenever the step changed (or the cache is off:
    oracle_cache.CACHE_ENV) and otherwise loads what an earlier run compiled from the same graph."""
    cached = oracle_cache_dir()
    libraries = tmp_path if cached is None else cached.parent / "aot_decode"
    monkeypatch.setattr(aot_step, "DEFAULT_CACHE", libraries)
    arch = "qwen3_moe"
    expected = greedy_oracle(arch, PROMPTS, NEW_TOKENS)
    # seeded sampling, drawn inside the library (the graph's sampled kind): the eager engine's tokens
    seeded = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.85, seed=seed)
              for seed in range(len(PROMPTS))]
    with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32") as llm:
        expected_seeded = [o.token_ids for o in llm.generate(PROMPTS, seeded)]
    for run in ("compiles or loads", "loads"):
        with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", enable_torch_compile=True) as llm:
            outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
            sampled = llm.generate(PROMPTS, seeded)
            stats = capture_stats(llm)
            assert llm.core.runner.capture.settings.aot
            hits = [bucket.cache_hit for bucket in llm.core.runner.capture._aot.values()]
        assert [o.token_ids for o in outputs] == expected
        assert [o.token_ids for o in sampled] == expected_seeded
        assert stats.disabled_reason is None and stats.captured_steps == NEW_TOKENS - 1 + 7
        assert stats.graph_sampled_steps == stats.captured_steps   # every step's tokens came out of the library
        # ... and every step after each batch's first took its inputs from the library's outputs (decode_carry.py),
        # every sequence crossing a KV block on the way (16-token blocks)
        assert stats.carried_steps == NEW_TOKENS - 2 + 8 - 2
        assert stats.graphs_compiled == [(4, "greedy"), (4, "sampled")]
        assert len(hits) == 2 and stats.buckets_loaded == ([4] if any(hits) else [])
        if run == "loads":
            assert hits == [True, True]                 # both libraries found on disk, none compiled again


def test_without_a_cpp_compiler_decode_runs_eagerly_after_one_log_line(tiny_checkpoint_factory, greedy_oracle,
                                                                        caplog):
    # inductor's own patch: monkeypatch's undo deletes a config entry (the next compile in this process then fails)
    expected = greedy_oracle("mixtral", PROMPTS, NEW_TOKENS)
    with caplog.at_level(logging.WARNING, logger="moe_runtime.execution.decode_capture"), \
            torch._inductor.config.patch({"cpp.cxx": ("no-such-compiler++",)}):
        with LLM(str(tiny_checkpoint_factory("mixtral")), device="cpu", dtype="float32",
                 enable_torch_compile=True) as llm:
            outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
            stats = capture_stats(llm)
    assert [o.token_ids for o in outputs] == expected
    assert "no C++ compiler" in stats.disabled_reason and stats.captured_steps == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_runtime.execution.decode_capture"]
    assert len(lines) == 1 and "decode steps run eagerly" in lines[0]


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_failing_compile_falls_back_to_eager_for_that_step_and_after(failing_call, tiny_checkpoint_factory,
                                                                       greedy_oracle, monkeypatch):
    """The first call of a bucket (its compile) or a later one (a recompile) raises: that step reruns eagerly,
    the capture turns off, and the tokens are the eager ones."""
    expected = greedy_oracle("llama", PROMPTS, NEW_TOKENS)
    with LLM(str(tiny_checkpoint_factory("llama")), device="cpu", dtype="float32", enable_torch_compile=True,
             torch_compile_backend="eager") as llm:
        capture = llm.core.runner.capture
        compiled, calls = capture._compiled, []

        def breaking(*args):
            calls.append(1)
            if len(calls) == failing_call:
                raise RuntimeError("inductor exploded")
            return compiled(*args)

        monkeypatch.setattr(capture, "_compiled", breaking)
        outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
        stats = capture.stats
    assert [o.token_ids for o in outputs] == expected
    assert "inductor exploded" in stats.disabled_reason
    assert stats.captured_steps == failing_call - 1 and len(calls) == failing_call


def test_cuda_shapes_fixed_table_width_give_eager_tokens(tiny_checkpoint_factory, greedy_oracle, monkeypatch):
    """What CUDA captures, traced on CPU: every step's block table at the model's full width (CUDA graphs fix
    shapes for good), pad rows and pad columns included, one graph per bucket; MLA reads V through K's view."""
    arch = "deepseek_v3"
    lengths = [NEW_TOKENS, NEW_TOKENS, 9]                  # the third finishing early: bucket 4, then bucket 2
    expected = [tokens[:n] for tokens, n in zip(greedy_oracle(arch, PROMPTS, NEW_TOKENS), lengths)]

    def cuda_settings(config, device, max_model_len):
        return CaptureSettings.for_device(torch.device("cuda"), max_batch=4, backend="eager",
                                          max_model_len=max_model_len, block_size=config.block_size)

    monkeypatch.setattr(CoreSetup, "capture_settings", staticmethod(cuda_settings))
    with LLM(str(tiny_checkpoint_factory(arch)), device="cpu", dtype="float32", enable_torch_compile=True) as llm:
        capture = llm.core.runner.capture
        compiled, widths = capture._compiled, []

        def recording(*inputs):
            widths.append(inputs[3].shape[1])              # block_tables [B, W]
            return compiled(*inputs)

        monkeypatch.setattr(capture, "_compiled", recording)
        outputs = llm.generate(PROMPTS[:3], [greedy(n) for n in lengths])
        full_width = -(-llm.core.max_model_len // capture.block_size)
    assert [o.token_ids for o in outputs] == expected
    assert capture.settings.table_width == full_width and not capture.settings.cuda_graphs
    assert set(widths) == {full_width} and len(widths) == NEW_TOKENS - 1
    assert capture.stats.buckets_compiled == [4, 2] and capture.stats.disabled_reason is None


def test_cuda_replays_graphs_and_cpu_keeps_a_dynamic_width():
    def settings(device: str, backend: str) -> CaptureSettings:
        return CaptureSettings.for_device(torch.device(device), max_batch=8, backend=backend, max_model_len=1000,
                                          block_size=16)

    cuda = settings("cuda", "inductor")
    assert (cuda.table_width, cuda.cuda_graphs, cuda.compile_mode()) == (63, True, "reduce-overhead")
    traced = settings("cuda", "eager")                     # a trace only: same shapes, no graphs to replay
    assert (traced.table_width, traced.cuda_graphs, traced.compile_mode()) == (63, False, None)
    cpu = settings("cpu", "inductor")
    assert (cpu.table_width, cpu.cuda_graphs, cpu.compile_mode()) == (None, False, None)
    assert cpu.aot and cpu.compile_options() == {"cpp_wrapper": True}     # AOTInductor by default
    wrapped = CaptureSettings.for_device(torch.device("cpu"), max_batch=8, backend="inductor", max_model_len=1000,
                                         block_size=16, wrapper="cpp")
    assert not wrapped.aot and wrapped.compile_options() == {"cpp_wrapper": True}
    with pytest.raises(ValueError, match="torch_compile_wrapper 'c'"):
        CaptureSettings.for_device(torch.device("cpu"), max_batch=8, backend="inductor", max_model_len=1000,
                                   block_size=16, wrapper="c")


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert CaptureSettings(max_batch=1).buckets() == [1]
    assert CaptureSettings(max_batch=16).buckets() == [1, 2, 4, 8, 16]
    assert CaptureSettings(max_batch=24).buckets() == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("flags,message", [
    (["--enable-torch-compile", "--ep", "2"], "--enable-torch-compile with --ep 2"),
    (["--enable-torch-compile", "--tp", "2", "--pp", "2"], "--enable-torch-compile with --tp 2, --pp 2"),
    (["--enable-torch-compile", "--quantization", "int8"], "--enable-torch-compile with --quantization int8"),
])
def test_layouts_the_capture_cannot_trace_are_refused_naming_the_flags(flags, message):
    config = engine_config_from_args(build_parser().parse_args(flags))
    with pytest.raises(EngineConfigError, match=message):
        config.validate()


def test_flags_reach_the_engine_config():
    config = engine_config_from_args(build_parser().parse_args(["--enable-torch-compile", "--torch-compile-max-bs",
                                                                "8"]))
    assert config.enable_torch_compile and config.torch_compile_max_bs == 8
