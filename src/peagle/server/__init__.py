"""The OpenAI-compatible HTTP server: `create_app(engine, served_model_name, ...)` and `peagle serve`.

`create_app` is imported on first use, so that the other commands run where the web stack is not installed."""

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_MAX_REQUEST_BYTES", "create_app"]

DEFAULT_MAX_QUEUE = 256  # requests accepted beyond --max-num-seqs before 503
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # larger bodies answer 413 unread


def __getattr__(name):
    if name == "create_app":
        from peagle.server.app import create_app

        return create_app
    raise AttributeError(f"module 'peagle.server' has no attribute {name!r}")
