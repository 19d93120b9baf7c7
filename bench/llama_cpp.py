"""Run llama.cpp's benchmark tools on a GGUF file and read their output as prefill and decode rates.

Two tools, both from a llama.cpp build (see docs/llama_cpp.md):

- `llama-batched-bench -npp P -ntg N -npl 1,16`: for each number of parallel sequences B, B prompts of
  P random tokens prefilled in one batch (timed: T_PP), then N decode steps of B tokens each (timed:
  T_TG). B*N / (T_PP + T_TG) is what bench_offline reports for this runtime and transformers
  (generated tokens over the whole prompt + generate time), so it is the comparable column. It runs
  each configuration once, so a best-of-`repeats` is taken over separate runs.
- `llama-bench -p P -n N -o json`: batch 1 only, prefill of P tokens and N decode steps from an empty
  context, each repeated `-r` times; a cross-check of the batch-1 rates from a second tool.

Neither tool samples (they feed random token ids and discard the logits), so llama.cpp's rates
carry no sampling cost; at vocab 8192 this runtime's greedy sampling is a small part of a step.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

BATCHED_BENCH = "llama-batched-bench"
LLAMA_BENCH = "llama-bench"


@dataclass(frozen=True)
class BatchedRun:
    """One line of llama-batched-bench: `parallel` sequences of `prompt_tokens` + `new_tokens`."""
    parallel: int
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tok_s(self) -> float:
        return self.parallel * self.prompt_tokens / self.prefill_seconds

    @property
    def decode_tok_s(self) -> float:
        return self.parallel * self.new_tokens / self.decode_seconds

    @property
    def generated_tok_s(self) -> float:
        """Generated tokens over prefill + decode time: the definition bench_offline uses for every system."""
        return self.parallel * self.new_tokens / (self.prefill_seconds + self.decode_seconds)


@dataclass(frozen=True)
class LlamaBenchTest:
    """One test of llama-bench: a prefill (`n_prompt` > 0) or a decode (`n_gen` > 0) rate, tokens/s."""
    n_prompt: int
    n_gen: int
    n_depth: int
    tok_s: float
    stddev_tok_s: float


def parse_batched_bench(output: str) -> list[BatchedRun]:
    """The result lines of llama-batched-bench, in either of its formats (`--output-format md` or `jsonl`)."""
    runs = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            runs.append(BatchedRun(record["pl"], record["pp"], record["tg"], record["t_pp"], record["t_tg"]))
        elif line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit():   # PP TG B N_KV T_PP S_PP T_TG S_TG T S
                pp, tg, pl = (int(c) for c in cells[:3])
                runs.append(BatchedRun(pl, pp, tg, float(cells[4]), float(cells[6])))
    return runs


def parse_llama_bench_json(output: str) -> list[LlamaBenchTest]:
    """llama-bench `-o json` output: a JSON array, one object per test."""
    start = output.index("[")
    tests = json.loads(output[start:output.rindex("]") + 1])
    return [LlamaBenchTest(t["n_prompt"], t["n_gen"], t.get("n_depth", 0), t["avg_ts"], t["stddev_ts"]) for t in tests]


@dataclass(frozen=True)
class LlamaCppRates:
    """What bench_offline keeps of llama.cpp for one GGUF file and one batch."""
    parallel: int
    generated_tok_s: float       # batched-bench, best of the runs: comparable to the other systems' tok/s
    prefill_tok_s: float
    decode_tok_s: float
    llama_bench_prefill_tok_s: float | None = None    # batch 1 only: llama-bench's cross-check
    llama_bench_decode_tok_s: float | None = None


@dataclass(frozen=True)
class LlamaCppTools:
    """The binaries of a llama.cpp build: `bin_dir` holds them (a build directory's `bin/` is also looked in)."""
    bin_dir: Path
    threads: int = 2

    def binary(self, name: str) -> Path:
        for candidate in (self.bin_dir / name, self.bin_dir / "bin" / name):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"no {name} in {self.bin_dir} (nor in its bin/): build it, see docs/llama_cpp.md")

    def _run(self, command: list[str]) -> str:
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
        return completed.stdout + "\n" + completed.stderr

    def version(self) -> str:
        """`llama-batched-bench --version`'s lines: the build number, commit and compiler."""
        output = self._run([str(self.binary(BATCHED_BENCH)), "--version"])
        return "; ".join(line.strip() for line in output.splitlines() if line.strip())

    def batched_bench(self, model: Path, prompt_tokens: int, new_tokens: int, parallel: list[int],
                      repeats: int) -> dict[int, BatchedRun]:
        """Per number of parallel sequences, the run with the least prefill + decode time of `repeats` runs."""
        context = max(parallel) * (prompt_tokens + new_tokens)
        command = [str(self.binary(BATCHED_BENCH)), "-m", str(model), "-t", str(self.threads), "-c", str(context),
                   "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", ",".join(map(str, parallel)),
                   "--output-format", "jsonl"]
        best: dict[int, BatchedRun] = {}
        for _ in range(repeats):
            for run in parse_batched_bench(self._run(command)):
                kept = best.get(run.parallel)
                if kept is None or run.prefill_seconds + run.decode_seconds < kept.prefill_seconds + kept.decode_seconds:
                    best[run.parallel] = run
        missing = set(parallel) - set(best)
        if missing:
            raise RuntimeError(f"{BATCHED_BENCH} reported no result for parallel={sorted(missing)} on {model}")
        return best

    def llama_bench(self, model: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> list[LlamaBenchTest]:
        command = [str(self.binary(LLAMA_BENCH)), "-m", str(model), "-t", str(self.threads), "-p", str(prompt_tokens),
                   "-n", str(new_tokens), "-r", str(max(repeats, 1)), "-o", "json"]
        return parse_llama_bench_json(self._run(command))

    def measure(self, model: Path, prompt_tokens: int, new_tokens: int, batches: list[int],
                repeats: int) -> dict[int, LlamaCppRates]:
        """Rates per batch: batched-bench for every batch, plus llama-bench's rates on batch 1."""
        runs = self.batched_bench(model, prompt_tokens, new_tokens, batches, repeats)
        cross_check = self.llama_bench(model, prompt_tokens, new_tokens, repeats) if 1 in batches else []
        prefill = next((t.tok_s for t in cross_check if t.n_prompt > 0 and t.n_gen == 0), None)
        decode = next((t.tok_s for t in cross_check if t.n_gen > 0 and t.n_prompt == 0), None)
        return {batch: LlamaCppRates(batch, run.generated_tok_s, run.prefill_tok_s, run.decode_tok_s,
                                     prefill if batch == 1 else None, decode if batch == 1 else None)
                for batch, run in runs.items()}
