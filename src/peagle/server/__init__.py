"""The OpenAI-compatible HTTP server: `create_app(engine, served_model_name, ...)` and `peagle serve`."""

from peagle.server.app import create_app

__all__ = ["create_app"]
