"""The engine core of one rank: the step, the scheduler, KV blocks, the prefix cache, request state."""
