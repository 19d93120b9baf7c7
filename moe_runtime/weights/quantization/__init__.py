"""Quantized checkpoint formats: what a checkpoint's `quantization_config` means, and how to read it."""
