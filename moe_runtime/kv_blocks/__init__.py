"""A DP worker's KV blocks: the block pool and manager, prefix caching and its hash, KV cache groups (full,
windowed), recurrent-state snapshots."""
