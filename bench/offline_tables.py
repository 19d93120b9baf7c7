"""The tables bench_offline.py prints: the dtype rows (with llama.cpp and step-breakdown columns
when measured), the captured decode step beside eager, the FP8 rows, the int8 rows and llama.cpp's
Q8_0 reference rows. Each printer takes the rows bench_offline builds (dicts, as written to the
JSON files) and prints nothing when a table has no rows.
"""
from __future__ import annotations


def print_table_head(title: str, header: str) -> None:
    """A table's title line, its column header and a rule as wide as the header."""
    print(title)
    print(header)
    print("-" * len(header))


def print_rows(rows: list[dict], prompt_len: int, new_tokens: int, threads: int) -> None:
    """The dtype rows; llama.cpp and breakdown columns only when the rows have them."""
    with_llama = any("llama_cpp_tok_s" in r for r in rows)
    with_breakdown = any("kernel_share" in r for r in rows)
    header = f"{'model dtype':15} {'batch':>5} {'runtime tok/s':>14} {'HF tok/s':>10} {'ratio':>7} {'RSS ours MiB':>13} " \
             f"{'RSS HF MiB':>11} {'same tokens':>12} {'weights GB/s ours/HF':>21} {'memcpy GB/s':>12} " \
             f"{'MB/step':>8} {'bound tok/s':>12}"
    header += f" {'llama.cpp tok/s':>16} {'vs llama.cpp':>13} {'l.cpp pp/tg tok/s':>18}" if with_llama else ""
    header += f" {'step ms':>8} {'kernel/other':>13}" if with_breakdown else ""
    print_table_head(f"\nOffline generation, Qwen3-MoE shape (dense: Llama ~90M), {prompt_len} prompt + {new_tokens} new tokens, "
                     f"{threads} threads", header)
    for r in rows:
        line = f"{row_label(r):15} {r['batch']:>5} {r['runtime_tok_s']:>14.1f} {r['transformers_tok_s']:>10.1f} " \
               f"{r['speedup']:>6.2f}x {r['runtime_peak_rss_mib']:>13.0f} {r['transformers_peak_rss_mib']:>11.0f} " \
               f"{r['identical_sequences']:>12} {r['runtime_weight_gbs']:>10.1f}/{r['transformers_weight_gbs']:<10.1f} " \
               f"{r['copy_bandwidth_gbs']:>12.1f} {r['weight_bytes_per_step'] / 1e6:>8.1f} " \
               f"{r['bandwidth_bound_tok_s']:>12.1f}"
        if with_llama:
            line += f" {r['llama_cpp_tok_s']:>16.1f} {r['vs_llama_cpp']:>12.2f}x " \
                    f"{r['llama_cpp_prefill_tok_s']:>9.0f}/{r['llama_cpp_decode_tok_s']:<8.1f}"
        if with_breakdown:
            line += f" {r['decode_step_ms']:>8.1f} {r['kernel_share']:>6.0%}/{r['other_share']:<6.0%}"
        print(line)
    print("weights GB/s: expert and dense weights a decode step reads (experts the batch touches), times steps/s;"
          "\nnear the memcpy figure a system is bound by memory bandwidth, not by its overheads. MB/step: those"
          "\nweights' bytes; bound tok/s: batch x memcpy bandwidth / MB per step (decode steps only, no overheads).")
    if with_llama:
        print("llama.cpp: llama-batched-bench on the same weights in GGUF (F32/BF16), batch x (64 prompt + 64 new) "
              "tokens,\ngenerated tokens over prefill + decode time; vs llama.cpp: runtime tok/s over llama.cpp's.")
    if with_breakdown:
        print("step ms: an unprofiled decode step of this runtime; kernel/other: operators' self CPU time vs the rest "
              "of the step\n(Python, scheduling, sampling, metadata) under torch.profiler.")


def print_compiled_rows(rows: list[dict]) -> None:
    if not any("compiled_tok_s" in r for r in rows):
        return
    header = f"{'model dtype':15} {'batch':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'vs eager':>9} {'vs HF':>7} " \
             f"{'vs llama.cpp':>13} {'same tokens':>12} {'weights GB/s':>13} {'compile s':>10}"
    print_table_head("\n--enable-torch-compile (captured decode step) beside the eager runtime, same checkpoint "
                     "and prompts", header)
    for r in rows:
        vs_llama = f"{r['compiled_vs_llama_cpp']:>12.2f}x" if "compiled_vs_llama_cpp" in r else f"{'-':>13}"
        print(f"{row_label(r):15} {r['batch']:>5} {r['runtime_tok_s']:>12.1f} {r['compiled_tok_s']:>15.1f} "
              f"{r['compiled_vs_eager']:>8.2f}x {r['compiled_vs_transformers']:>6.2f}x {vs_llama} "
              f"{r['compiled_identical_to_eager']:>12} {r['compiled_weight_gbs']:>13.1f} "
              f"{r['compiled_warmup_seconds']:>10.0f}")
    print("compile s: the warm-up generate, which compiles the batch's bucket (the inductor cache in /tmp makes a "
          "second run\nfaster); same tokens: greedy sequences identical to the eager runtime's.")


def row_label(row: dict) -> str:
    """`float32` for the MoE bench model's rows, `dense float32` for the dense model's."""
    return row["dtype"] if row.get("model", "moe") == "moe" else f"{row['model']} {row['dtype']}"


def print_cpu_experts_rows(rows: list[dict]) -> None:
    if not any("cpu_experts_tok_s" in r for r in rows):
        return
    header = f"{'model dtype':15} {'batch':>5} {'eager tok/s':>12} {'--cpu-experts tok/s':>20} {'vs eager':>9} " \
             f"{'same tokens':>12}"
    print_table_head("\n--cpu-experts (routed experts on their own thread, both sides on this CPU) beside eager", header)
    for r in (r for r in rows if "cpu_experts_tok_s" in r):
        print(f"{row_label(r):15} {r['batch']:>5} {r['runtime_tok_s']:>12.1f} {r['cpu_experts_tok_s']:>20.1f} "
              f"{r['cpu_experts_vs_eager']:>8.2f}x {r['cpu_experts_identical']:>12}")


def print_llama_cpp_reference_rows(rows: list[dict]) -> None:
    if not rows:
        return
    header = f"{'batch':>5} {'llama.cpp tok/s':>16} {'prefill tok/s':>14} {'decode tok/s':>13}"
    print_table_head("\nllama.cpp only, float32 checkpoint quantized to Q8_0 (a reference for the int8 rows)", header)
    for r in rows:
        print(f"{r['batch']:>5} {r['llama_cpp_tok_s']:>16.1f} {r['llama_cpp_prefill_tok_s']:>14.0f} "
              f"{r['llama_cpp_decode_tok_s']:>13.1f}")


def print_fp8_rows(rows: list[dict]) -> None:
    if not rows:
        return
    header = f"{'batch':>5} {'kept FP8':>9} {'dequantized':>12} {'HF deq.':>8} {'vs deq.':>8} {'vs HF':>7} " \
             f"{'MB/step FP8/deq.':>17} {'weights MiB FP8/deq.':>21} {'same tokens deq./HF':>20}"
    print_table_head(f"\nFP8 checkpoint (128x128 blocks), compute {rows[0]['compute_dtype']}: decode tok/s", header)
    for r in rows:
        print(f"{r['batch']:>5} {r['kept_fp8_tok_s']:>9.1f} {r['dequantized_tok_s']:>12.1f} "
              f"{r['transformers_tok_s']:>8.1f} {r['kept_vs_dequantized']:>7.2f}x {r['kept_vs_transformers']:>6.2f}x "
              f"{r['kept_weight_bytes_per_step'] / 1e6:>8.1f}/{r['dequantized_weight_bytes_per_step'] / 1e6:<8.1f} "
              f"{r['kept_weight_mib']:>10.0f}/{r['dequantized_weight_mib']:<10.0f} "
              f"{r['identical_to_dequantized']:>9}/{r['identical_to_transformers']:<10}")


def print_int8_rows(rows: list[dict]) -> None:
    if not rows:
        return
    header = f"{'batch':>5} {'int8':>8} {'fp32':>8} {'HF fp32':>8} {'vs fp32':>8} {'vs HF':>7} " \
             f"{'MB/step int8/fp32':>18} {'weights MiB int8/fp32':>22} {'same tokens int8~fp32 int8~HF fp32~HF':>38}"
    print_table_head("\nint8 weight-only (--quantization int8) on the float32 checkpoint, fp32 activations: "
                     "decode tok/s", header)
    for r in rows:
        same = "  ".join(r[k] for k in ("identical_int8_to_fp32", "identical_int8_to_transformers",
                                        "identical_fp32_to_transformers"))
        print(f"{r['batch']:>5} {r['int8_tok_s']:>8.1f} {r['fp32_tok_s']:>8.1f} {r['transformers_fp32_tok_s']:>8.1f} "
              f"{r['int8_vs_fp32']:>7.2f}x {r['int8_vs_transformers']:>6.2f}x "
              f"{r['int8_weight_bytes_per_step'] / 1e6:>8.1f}/{r['fp32_weight_bytes_per_step'] / 1e6:<9.1f} "
              f"{r['int8_weight_mib']:>10.0f}/{r['fp32_weight_mib']:<11.0f} {same:>38}")
