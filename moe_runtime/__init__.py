"""moe-runtime: a Mixture-of-Experts expert-parallel inference runtime."""
from moe_runtime.llm import LLM
from moe_runtime.outputs import RequestOutput
from moe_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
