"""Model execution: batch preparation and the KV cache tensors (the model runner), step inputs, pipeline
stages and the captured decode step."""
