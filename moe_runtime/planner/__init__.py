"""`moe-serve plan`: which layout, how many GPUs, and why (docs/planning.md)."""
