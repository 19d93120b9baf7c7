"""Every release row of issue 52 under `--ep 2 --dp-attn 2`, the rows whose own modules run on one rank only: each
tiny checkpoint in its release's format (written by the format's own library or the rows' writers) gives
transformers' greedy tokens on its exactly dequantized twin (a wrapper's or a renamed release's: on the text
checkpoint it holds), each rank holds half the routed experts, and where the engine keeps the experts quantized
(int4 releases by themselves, FP8 with `--quantization fp8`) each rank holds them at their quantized size.

The rows whose modules run them under EP already (Maverick FP8, DeepSeek-V4 with MXFP4 kept, GPTQ act order, int4
RTN, DeepSeek-V3 FP8 block, bf16 GLM / MiniMax) are not repeated here. One engine per row, started by its test and
shut down after it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from compressed_tensors_checkpoints import GROUP_SIZE as COMPRESSED_GROUP, write_compressed_checkpoint
from engine_helpers import greedy
from fp8_checkpoints import write_fp8_checkpoint
from int4_checkpoints import GROUP_SIZE as AWQ_GROUP, write_int4_checkpoint
from test_kimi_k25_wrapper import write_kimi_k25
from test_multimodal_wrappers import write_wrapper
from test_renamed_architectures import as_kimi
from tiny_checkpoints import TinyCheckpointFactory, hf_greedy
from moe_runtime import LLM
from moe_runtime.kernels.int4_layout import Int4Layout
from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(21)], [(11 * i + 1) % 380 + 9 for i in range(9)]]   # one a worker
NEW_TOKENS = 8
EP_DP = dict(ep=2, dp_attn=2)
# Kimi K2 Thinking's config: routed experts only in int4 (W4A16 symmetric, group 32); its ignore list as it ships
KIMI_THINKING_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")
KIMI_INT4 = Int4Layout(COMPRESSED_GROUP, zero_points=False)   # symmetric: no zero points
FP8_KEPT = "fp8"


@dataclass(frozen=True)
class Written:
    release: Path   # the checkpoint as the release ships it
    twin: Path      # what transformers runs: the exactly dequantized weights, or the text checkpoint a wrapper holds


@dataclass(frozen=True)
class Release:
    """One row: how its tiny checkpoint is written, the engine's options beside EP_DP, and the layout its routed
    experts stay in on each rank (None: the engine holds them in --dtype; FP8_KEPT: kept FP8)."""
    write: Callable[["Writers", Path], Written]
    options: dict = field(default_factory=dict)
    experts_kept: Int4Layout | str | None = None


class Writers:
    """The rows' tiny checkpoints, each written once per module (Kimi K2 Thinking's text model is K2.5's too)."""

    def __init__(self, factory: TinyCheckpointFactory, root: Path):
        self.factory, self.root = factory, root
        self._written: dict[str, Written] = {}

    def __call__(self, name: str) -> Written:
        if name not in self._written:
            self._written[name] = RELEASES[name].write(self, self.root / name)
        return self._written[name]

    def kimi_thinking_text(self) -> Written:
        """A tiny DeepSeek-V3 in K2 Thinking's compressed-tensors scheme (before Kimi's renaming)."""
        if "kimi_thinking_text" not in self._written:
            root = self.root / "kimi_thinking_text"
            release, twin = write_compressed_checkpoint(self.factory("deepseek_v3"), root / "release", root / "twin",
                                                        "W4A16", ignore=KIMI_THINKING_IGNORE)
            self._written["kimi_thinking_text"] = Written(release, twin)
        return self._written["kimi_thinking_text"]


def minimax_m2_fp8(writers: Writers, root: Path) -> Written:
    """DeepSeek-V3's FP8 block layout (128 x 128, the router unquantized) with MiniMax-M2's `fmt` spelling."""
    release, twin = write_fp8_checkpoint(writers.factory("minimax_m2"), root / "release", root / "twin", (128, 128),
                                         with_mtp=False)
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"]["fmt"] = "float8_e4m3fn"
    (release / "config.json").write_text(json.dumps(config, indent=2))
    return Written(release, twin)


def multimodal(arch: str) -> Callable[[Writers, Path], Written]:
    def write(writers: Writers, root: Path) -> Written:
        text = writers.factory(arch)
        return Written(write_wrapper(arch, text, root), text)
    return write


def kimi_k2(writers: Writers, root: Path) -> Written:
    text = writers.factory("deepseek_v3")
    return Written(as_kimi(text, root), text)


def kimi_k2_thinking(writers: Writers, root: Path) -> Written:
    text = writers.kimi_thinking_text()
    return Written(as_kimi(text.release, root), text.twin)


def kimi_k25(writers: Writers, root: Path) -> Written:
    text = writers.kimi_thinking_text()
    return Written(write_kimi_k25(text.release, root), text.twin)


def compressed(arch: str, preset: str) -> Callable[[Writers, Path], Written]:
    def write(writers: Writers, root: Path) -> Written:
        return Written(*write_compressed_checkpoint(writers.factory(arch), root / "release", root / "twin", preset))
    return write


def awq(writers: Writers, root: Path) -> Written:
    return Written(*write_int4_checkpoint(writers.factory("mixtral"), root / "release", root / "twin", "awq"))


RELEASES = {
    "minimax_m2_fp8_block": Release(minimax_m2_fp8),
    "qwen3_5_moe_wrapper": Release(multimodal("qwen3_5_moe")),
    "llama4_scout_wrapper": Release(multimodal("llama4")),
    "kimi_k2_renamed": Release(kimi_k2),
    "kimi_k2_thinking_int4_experts": Release(kimi_k2_thinking, experts_kept=KIMI_INT4),
    "kimi_k25_wrapper": Release(kimi_k25, experts_kept=KIMI_INT4),
    "glm_fp8_per_channel_kept": Release(compressed("glm4_moe", "FP8_DYNAMIC"), dict(quantization="fp8"), FP8_KEPT),
    "awq_mixtral": Release(awq, experts_kept=Int4Layout(AWQ_GROUP, zero_points=True)),
    "compressed_w8a16_mixtral": Release(compressed("mixtral", "W8A16")),
}


@pytest.fixture(scope="module")
def writers(tiny_checkpoint_factory, tmp_path_factory) -> Writers:
    return Writers(tiny_checkpoint_factory, tmp_path_factory.mktemp("releases"))


def routed_expert_weights(twin: Path) -> list[tuple[int, int]]:
    """The [N, K] of every routed expert's projection in the twin, one per expert of a stacked [E, ., .] tensor
    (Llama 4's, input-major); shared experts and dense MLPs are not routed."""
    shapes = []
    for name, tensor in read_all_tensors(twin).items():
        if ".experts." in name and tensor.dim() == 3:
            shapes += [tuple(tensor.shape[1:])] * tensor.shape[0]
        elif ".experts." in name and tensor.dim() == 2 and name.endswith(".weight"):
            shapes.append(tuple(tensor.shape))
    return shapes


def int4_bytes(layout: Int4Layout, rows: int, columns: int) -> int:
    """One weight kept in the int4 layout: its packed codes (a byte per two) and float32 scales (and zero points)."""
    return math.prod(layout.values_shape(rows, columns)) + 4 * math.prod(layout.scale_shape(rows, columns))


def assert_experts_kept(per_rank: dict[int, tuple[int, int]], kept: Int4Layout | str | None, twin: Path) -> None:
    shapes = routed_expert_weights(twin)
    dense = 4 * sum(n * k for n, k in shapes)   # float32
    for rank, (local, total) in per_rank.items():
        assert local * 2 == total, f"rank {rank} holds {local} of {total} routed-expert bytes"
        if isinstance(kept, Int4Layout):
            assert total == sum(int4_bytes(kept, n, k) for n, k in shapes), f"rank {rank}: experts not kept in int4"
        elif kept == FP8_KEPT:   # a byte a weight and its row's block scales: above a quarter of float32, not near it
            assert dense // 4 < total < 0.3 * dense, f"rank {rank}: {total} bytes, float32 {dense}"
        else:
            assert total == dense, f"rank {rank}: {total} routed-expert bytes, float32 {dense}"


def test_kimi_k2_thinking_and_minimax_m2_fp8_are_written_as_they_ship(writers):
    """K2 Thinking: routed experts packed int4, attention, shared experts and the dense MLP left full precision by
    its ignore list; MiniMax-M2: FP8 blocks spelled `float8_e4m3fn`, its router unquantized."""
    thinking = writers("kimi_k2_thinking_int4_experts").release
    assert json.loads((thinking / "config.json").read_text())["model_type"] == "kimi_k2"
    stored = read_all_tensors(thinking)
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight_packed"].dtype == torch.int32
    for full in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight"):
        assert stored[full].dtype == torch.float32, full
    minimax = writers("minimax_m2_fp8_block").release
    assert json.loads((minimax / "config.json").read_text())["quantization_config"]["fmt"] == "float8_e4m3fn"
    stored = read_all_tensors(minimax)
    assert stored["model.layers.1.block_sparse_moe.experts.0.w2.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RELEASES))
def test_a_release_under_expert_parallelism_with_dp_attention_gives_transformers_tokens(name, writers):
    row, written = RELEASES[name], writers(name)
    expected = hf_greedy(written.twin, PROMPTS, NEW_TOKENS)
    assert any(len(set(tokens)) > 2 for tokens in expected), "degenerate oracle tokens: the test would be weak"
    with LLM(str(written.release), device="cpu", dtype="float32", **EP_DP, **row.options) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == expected
        assert_experts_kept(llm.engine.client.resident_expert_bytes(), row.experts_kept, written.twin)
