"""The engine core of one rank: the step, the scheduler, request limits, weight updates and sleep."""
