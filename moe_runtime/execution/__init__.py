"""Model execution: batch preparation, attention metadata, the model runner, context parallelism,
micro-batches, pipeline stages and the captured decode step."""
