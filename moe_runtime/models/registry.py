"""Architecture name (config.json `architectures[0]`) -> model builder."""
from __future__ import annotations

from moe_runtime.errors import UnsupportedArchitectureError
from moe_runtime.kernels.batch_invariant import BATCH_INVARIANT
from moe_runtime.layers.linear import Linear
from moe_runtime.models.decoder import BuildContext, CausalLM
from moe_runtime.config.model_config import architecture_of
from moe_runtime.models.transformers_backend import TransformersCausalLM, build_transformers_model
from moe_runtime.models.transformers_backend.support import check_config, check_engine
from moe_runtime.moe.router import Router


def _builders():
    from moe_runtime.models import deepseek, glm4_moe, gpt_oss, llama, minimax_m2, mixtral, qwen_moe
    from moe_runtime.models import llama4
    from moe_runtime.models import qwen3_next
    from moe_runtime.models import deepseek_v32
    from moe_runtime.models import deepseek_v4

    return {
        "LlamaForCausalLM": llama.build_llama,
        "Qwen2ForCausalLM": llama.build_qwen2,
        "MistralForCausalLM": llama.build_mistral,
        "MixtralForCausalLM": mixtral.build_mixtral,
        "Qwen2MoeForCausalLM": qwen_moe.build_qwen2_moe,
        "Qwen3MoeForCausalLM": qwen_moe.build_qwen3_moe,
        "OlmoeForCausalLM": qwen_moe.build_olmoe,
        "DeepseekV2ForCausalLM": deepseek.build_deepseek_v2,
        "DeepseekV3ForCausalLM": deepseek.build_deepseek_v3,
        "DeepseekV32ForCausalLM": deepseek_v32.build_deepseek_v32,
        "DeepseekV4ForCausalLM": deepseek_v4.build_deepseek_v4,
        "Glm4MoeForCausalLM": glm4_moe.build_glm4_moe,
        "GlmMoeDsaForCausalLM": deepseek_v32.build_glm_moe_dsa,
        "MiniMaxM2ForCausalLM": minimax_m2.build_minimax_m2,
        "Llama4ForCausalLM": llama4.build_llama4,
        "GptOssForCausalLM": gpt_oss.build_gpt_oss,
        "Qwen3NextForCausalLM": qwen3_next.build_qwen3_next,
        "Qwen3_5MoeForCausalLM": qwen3_next.build_qwen3_5_moe,
    }


def supported_architectures() -> list[str]:
    return sorted(_builders())


def borrows_modeling_code(architecture: str, hf_config) -> bool:
    """A model type that runs another's modeling code under its own checkpoint names: transformers serves
    sarvam_moe with Glm4MoeForCausalLM and renames its tensors (query_key_value, dense, word_embeddings) by the
    model type's own conversion rules, which the native port of the class does not read. `auto` sends these
    through the transformers backend."""
    import transformers
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    model_type = getattr(hf_config, "model_type", None)
    own = getattr(getattr(getattr(transformers, architecture, None), "config_class", None), "model_type", None)
    return own is not None and model_type != own and get_checkpoint_conversion_mapping(model_type) is not None


def uses_transformers_backend(architecture: str, hf_config, model_impl: str) -> bool:
    """Whether `--model-impl model_impl` serves `architecture` through the transformers backend."""
    if model_impl == "transformers":
        return True
    if model_impl == "native":
        return False
    return architecture not in _builders() or borrows_modeling_code(architecture, hf_config)


def refuse_before_launch(config, hf_config) -> None:
    """The transformers backend's refusals of flags and layer types, asked at the front before any rank starts
    (each rank asks again as it builds the model)."""
    architecture = architecture_of(hf_config)
    if not uses_transformers_backend(architecture, hf_config, config.model_impl):
        return
    layout = config.layout()
    check_config(architecture, hf_config)
    check_engine(architecture, layout.pp, layout.attn_tp, layout.cp, config.quantization, config)


def build_model(architecture: str, hf_config, ctx: BuildContext) -> CausalLM | TransformersCausalLM:
    """The native port of `architecture`, or transformers' modeling code with our attention and MoE seam
    (`--model-impl transformers`, or `auto` where there is no native port)."""
    builders = _builders()
    impl = ctx.engine.model_impl if ctx.engine is not None else "auto"
    if uses_transformers_backend(architecture, hf_config, impl):
        try:
            return build_transformers_model(architecture, hf_config, ctx)
        except UnsupportedArchitectureError as exc:
            if architecture in builders:
                raise
            raise UnsupportedArchitectureError(f"architecture {architecture!r} (config.json 'architectures') has no "
                                               f"native port; and {exc}") from exc
    if architecture not in builders:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (config.json 'architectures') has no native port (--model-impl "
            f"native); ported: {', '.join(sorted(builders))}")
    model = builders[architecture](hf_config, ctx)
    for module in model.modules():   # every unquantized projection multiplies with the kernel family's few-row matmul
        if isinstance(module, Linear) or (isinstance(module, Router) and ctx.kernels.name == BATCH_INVARIANT):
            module.matmul = ctx.kernels.linear_rows   # routers too under --deterministic (else torch's, as always)
    return model
