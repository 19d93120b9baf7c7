"""Sampling: parameters, logits processors, the sampler, prompt logprobs, structured output."""
