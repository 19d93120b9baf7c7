"""The front: the LLM API, the async front, the engine fronts and output processing."""
