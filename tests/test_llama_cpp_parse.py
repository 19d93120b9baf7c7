"""bench/llama_cpp.py reads llama.cpp's benchmark output (captured samples; no llama.cpp needed)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_cpp import BatchedRun, parse_batched_bench, parse_llama_bench_json  # noqa: E402

BATCHED_BENCH_MD = """\
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, \
n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     64 |    1 |    128 |    0.050 |  1280.00 |    0.400 |   160.00 |    0.450 |   284.44 |
|    64 |     64 |   16 |   2048 |    0.800 |  1280.00 |    1.600 |   640.00 |    2.400 |   853.33 |
"""

BATCHED_BENCH_JSONL = """\
llama_context: n_ctx = 2048
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 64, "pl": 16, "n_kv": 2048, "t_pp": 0.800000, \
"speed_pp": 1280.000000, "t_tg": 1.600000, "speed_tg": 640.000000, "t": 2.400000, "speed": 853.333333}
"""

LLAMA_BENCH_JSON = """\
[
  {"build_commit": "0c1e570", "n_prompt": 64, "n_gen": 0, "n_depth": 0, "avg_ns": 50000000,
   "stddev_ns": 100000, "avg_ts": 1280.0, "stddev_ts": 2.5, "samples_ts": [1280.0, 1280.0]},
  {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ns": 400000000,
   "stddev_ns": 100000, "avg_ts": 160.0, "stddev_ts": 0.5, "samples_ts": [160.0, 160.0]}
]
"""


def test_batched_bench_markdown_rows_become_runs_and_the_header_is_skipped():
    runs = parse_batched_bench(BATCHED_BENCH_MD)
    assert runs == [BatchedRun(1, 64, 64, 0.05, 0.4), BatchedRun(16, 64, 64, 0.8, 1.6)]
    batch16 = runs[1]
    assert batch16.prefill_tok_s == pytest.approx(1280.0)
    assert batch16.decode_tok_s == pytest.approx(640.0)
    # generated tokens over prefill + decode, not the tool's own S t/s (which counts prompt tokens too)
    assert batch16.generated_tok_s == pytest.approx(16 * 64 / 2.4)


def test_batched_bench_jsonl_gives_the_same_run_as_markdown():
    assert parse_batched_bench(BATCHED_BENCH_JSONL) == [parse_batched_bench(BATCHED_BENCH_MD)[1]]


def test_llama_bench_json_tests_split_into_prefill_and_decode():
    prefill, decode = parse_llama_bench_json("load log line\n" + LLAMA_BENCH_JSON)
    assert (prefill.n_prompt, prefill.n_gen, prefill.tok_s) == (64, 0, 1280.0)
    assert (decode.n_prompt, decode.n_gen, decode.tok_s, decode.stddev_tok_s) == (0, 64, 160.0, 0.5)
