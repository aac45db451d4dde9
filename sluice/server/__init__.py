"""OpenAI-compatible HTTP front end: `create_app(engine, model_name, ...)`; `sluice serve` runs it with uvicorn."""

from .app import create_app

__all__ = ["create_app"]
