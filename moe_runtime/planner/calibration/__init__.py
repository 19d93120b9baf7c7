"""Calibrating the CPU planner by running the engine: decode steps timed by part and multi-rank jobs through
`LLM`, fitted into the planner's CPU overheads and cached. It sits above the front (it starts engines); the
planning itself (moe_runtime/planner/) reads only configs and the cache."""
