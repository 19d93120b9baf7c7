"""Data-parallel attention: the control plane, lock-step agreement and cache-aware routing between DP workers."""
