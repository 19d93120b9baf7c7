"""Prefill/decode disaggregation: moving a prefilled request's KV blocks from one instance to another.

A prefill instance parks a finished prefill's blocks and hands out a `KVHandle` (which ranks hold
which layers and heads, the first sampled token, the request's sampler state); a decode instance
given the handle allocates blocks, pulls each of its ranks' share straight from the prefill ranks
(re-sharding between different attention-TP head splits and pipeline stages), and tells the prefill
instance to free its copy. See docs/design.md, "Prefill/decode disaggregation".

The modules here import nothing of the engine but its KV cache tensors and the control key, so the
transport can be swapped (`transport.py`: NIXL or NCCL on GPU) without touching the engine.
"""
