"""`dflash-mlx serve`: OpenAI- and Anthropic-compatible HTTP APIs over one decode worker.

Layers, each importing only those after it:
- `app.py` (the routes, the API key) and `runner.py` (uvicorn, a clean Ctrl-C);
- `apis/`: chat/completions and completions, Messages, Responses: request to job, events to replies;
- `reply/`: the reply read as text, reasoning and tool calls; structured output;
- `http/`: the edge: request guards, typed fields, errors, SSE, what every route shares;
- `worker/`: the decode thread, its scheduler and the prompt cache, over `stream_session`.
"""

from .app import create_app
from .worker.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig", "create_app"]
