"""A tiny Llama 4 Maverick-FP8 in fbgemm's row-wise FP8 layout, with its dequantized twin.

The release is a `Llama4ForConditionalGeneration` (text under `language_model.`, a vision tower beside it) whose
config says `quant_method: fbgemm_fp8`. Its layout is transformers' fbgemm integration's
(integrations/fbgemm_fp8.py): each converted linear stores `weight` float8_e4m3fn [N, K] and `weight_scale`
float32 [N, 1]; the routed experts (`FbgemmFp8Llama4TextExperts`) store the input-major stacks `gate_up_proj`
[E, H, 2I] with `gate_up_proj_scale` [E, 1, 2I] and `down_proj` [E, I, H] with `down_proj_scale` [E, H, 1], one
scale per output channel of each expert. Which modules stay bf16 is the config's `modules_to_not_convert`: here
the routers, the LM head, the vision tower and the projector; every other decoder linear is FP8. (The release's
own list was not available to check; the reader follows the stored dtypes, so any list loads.)

Scales are each output channel's largest magnitude over 448 (the largest float8_e4m3fn), as fbgemm's
`quantize_fp8_per_row` without an upper bound. The twin is the text checkpoint with every FP8 weight replaced by
values x scale in float32: transformers on the twin is the oracle for the runtime on the release.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from moe_runtime.weights.quantization.fp8_checkpoint_writer import read_all_tensors

FP8_MAX = 448.0
PREFIX = "language_model."            # the wrapper's prefix of the text model's tensors
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
              patch_size=14, projector_input_dim=32, vision_output_dim=32)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> FP8 values [..., N, K], float32 scales [..., N]: one per row (output channel)."""
    scales = (weight.float().abs().amax(-1) / FP8_MAX).clamp(min=1e-12)                 # [..., N]
    return (weight.float() / scales[..., None]).to(torch.float8_e4m3fn), scales


def quantize_stack(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An input-major expert stack [E, K, N] -> FP8 values [E, K, N], scales [E, N] (per output channel)."""
    values, scales = quantize_rows(stack.transpose(1, 2))                                 # [E, N, K], [E, N]
    return values.transpose(1, 2).contiguous(), scales


def is_converted(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linears and expert stacks fbgemm converts here: all but the routers (and norms, embeddings,
    the LM head, which are no decoder linears)."""
    if not name.startswith("model.layers.") or "norm" in name or ".router." in name:
        return False
    return name.endswith(".weight") and tensor.dim() == 2 or name.endswith(("experts.gate_up_proj",
                                                                            "experts.down_proj"))


def fbgemm_tensors(text: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the release's text tensors under the text model's names, the twin's) from the text checkpoint's."""
    release, twin = {}, {}
    for name, tensor in text.items():
        if not is_converted(name, tensor):
            release[name] = twin[name] = tensor
            continue
        if tensor.dim() == 3:   # gate_up_proj [E, H, 2I] -> scale [E, 1, 2I]; down_proj [E, I, H] -> [E, H, 1]
            values, scales = quantize_stack(tensor)
            stored = scales[:, None, :] if name.endswith("gate_up_proj") else scales[:, :, None]
            twin[name] = values.float() * scales[:, None, :]
        else:                   # a linear [N, K] -> weight_scale [N, 1]
            values, scales = quantize_rows(tensor)
            stored = scales[:, None]
            twin[name] = values.float() * stored
        release[name], release[name + "_scale"] = values, stored.contiguous()
    return release, twin


def modules_to_not_convert(config: transformers.Llama4Config) -> list[str]:
    moe_layers = set(config.text_config.moe_layers)
    routers = [f"{PREFIX}model.layers.{i}.feed_forward.router" for i in sorted(moe_layers)]
    return routers + [f"{PREFIX}lm_head", "vision_model", "multi_modal_projector"]


def write_maverick_fp8(text_checkpoint: Path, root: Path) -> tuple[Path, Path]:
    """(twin, release) under `root`, from a tiny Llama 4 text checkpoint."""
    twin_dir, release_dir, wrapper_dir = root / "twin", root / "release", root / "bf16_wrapper"
    text_model = transformers.AutoModelForCausalLM.from_pretrained(str(text_checkpoint), dtype=torch.float32)
    vision = dict(VISION, projector_output_dim=text_model.config.hidden_size)
    torch.manual_seed(0)
    wrapper = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text_model.config.to_dict(), vision_config=vision)).eval()
    wrapper.language_model.load_state_dict(text_model.state_dict())
    wrapper.save_pretrained(str(wrapper_dir))   # the release's names and config, in full precision
    stored = read_all_tensors(wrapper_dir)
    text = {name[len(PREFIX):]: tensor for name, tensor in stored.items() if name.startswith(PREFIX)}
    release, twin = fbgemm_tensors(text)
    release = {**{PREFIX + name: tensor for name, tensor in release.items()},
               **{name: tensor for name, tensor in stored.items() if not name.startswith(PREFIX)}}
    for directory, tensors in ((release_dir, release), (twin_dir, twin)):
        directory.mkdir(parents=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        for side in text_checkpoint.iterdir():   # tokenizer and generation files
            if side.is_file() and not side.name.endswith(".safetensors") and side.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy(side, directory / side.name)
    shutil.copy(text_checkpoint / "config.json", twin_dir / "config.json")
    config = json.loads((wrapper_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                     "modules_to_not_convert": modules_to_not_convert(wrapper.config)}
    (release_dir / "config.json").write_text(json.dumps(config, indent=2))
    return twin_dir, release_dir
