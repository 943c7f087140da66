"""`dflash-mlx serve`: OpenAI- and Anthropic-compatible HTTP APIs over one decode worker.

Layers: `app` (routes, auth, errors) -> `openai_api` / `anthropic_api` (request
validation, response and stream shapes) -> `engine` (a FIFO queue and one decode
thread running `stream_session`) -> `prompt_cache` (sessions kept across requests).
"""

from .app import create_app
from .engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig", "create_app"]
