"""The OpenAI-compatible HTTP service: `build_app(async_engine, served_model_name, ...)`."""
from server.app import Mount, build_app

__all__ = ["Mount", "build_app"]
