"""Configuration: the engine's settings, the model's config, parallel layouts."""
