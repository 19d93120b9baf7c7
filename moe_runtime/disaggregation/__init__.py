"""Prefill/decode disaggregation: both halves and KV transfer."""
