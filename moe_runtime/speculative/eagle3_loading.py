"""Building the EAGLE-3 drafter: the head from its own checkpoint directory (`speculative_config["model"]`,
safetensors as the loader reads them), the target told which layers' inputs to keep, and the same drafting loop as
MTP (`MtpDrafter`: a pass over each step's true rows, then the chain). Every step keeps those inputs (eager, captured
by `enable_torch_compile`, or split in two micro-batches by two-batch overlap: `CausalLM.drafter_hidden`). Refusals
name what is not built."""
from __future__ import annotations

from moe_runtime.config.model_config import load_hf_config
from moe_runtime.errors import InvalidRequestError
from moe_runtime.models.eagle3 import Eagle3Head, eagle3_aux_layers
from moe_runtime.speculative.draft_source import DraftSource
from moe_runtime.speculative.mtp import MtpDrafter
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import SkippedTensor, SkippedTensors, load_model_weights

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def build_eagle3_drafter(source: DraftSource, directory: str, k: int) -> MtpDrafter:
    head_cfg = keep_eagle3_aux_layers(source, directory)
    reader = CheckpointReader.open(directory)
    head = Eagle3Head(head_cfg, source.ctx, source.target, own_embedding="embed_tokens.weight" in set(reader.names()))
    load_model_weights(head, reader, SkippedTensors((SkippedTensor(r"^t2d$", "the target-to-draft vocabulary "
                                                                   "map: drafting needs only d2t"),)))
    head.eval()
    return MtpDrafter(head, None, source.num_blocks, source.runner.block_size, source.ctx.dtype, source.ctx.device, k)


def keep_eagle3_aux_layers(source: DraftSource, directory: str):
    """The head's config, checked against the target, which is told to keep its aux layers' inputs (on every
    pipeline stage: those of earlier stages travel to the last with the activations)."""
    head_cfg = load_hf_config(directory)
    architectures = tuple(getattr(head_cfg, "architectures", None) or ())
    if not set(architectures) & set(EAGLE3_ARCHITECTURES):
        raise InvalidRequestError(f"speculative_config method 'eagle3': {directory} holds {list(architectures)}, not "
                                  f"an EAGLE-3 head ({', '.join(EAGLE3_ARCHITECTURES)})")
    target = source.target
    if (getattr(head_cfg, "target_hidden_size", None) or head_cfg.hidden_size) != target.hf_config.hidden_size:
        raise InvalidRequestError(f"speculative_config method 'eagle3': the head at {directory} reads hidden states "
                                  f"of width {getattr(head_cfg, 'target_hidden_size', None) or head_cfg.hidden_size}, "
                                  f"the target's are {target.hf_config.hidden_size}")
    layers = eagle3_aux_layers(head_cfg, target.hf_config.num_hidden_layers)
    if len(layers) != 3 or not all(0 <= layer < target.hf_config.num_hidden_layers for layer in layers):
        raise InvalidRequestError(f"speculative_config method 'eagle3': aux layers {list(layers)} must be three "
                                  f"layers of the target's {target.hf_config.num_hidden_layers}")
    if source.config.cp > 1:   # each rank would keep only its own share of the step's rows
        raise InvalidRequestError("speculative_config method 'eagle3' with --cp is not built: that step does not "
                                  "keep the target layers' inputs the head reads")
    target.aux_layers = layers
    source.runner.keep_hidden = True
    return head_cfg
