"""Running the app with uvicorn; Ctrl-C ends the requests in flight first, so their streams close cleanly."""

from __future__ import annotations

import logging
import sys
from typing import Any

import uvicorn
from uvicorn.config import LOG_LEVELS
from uvicorn.logging import DefaultFormatter

from .app import create_app
from .http.state import ServerState
from .worker.engine import Engine


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which on Ctrl-C also tells the engine to end its requests at once.

    Without this, uvicorn waits for streaming responses until its graceful-shutdown timeout
    and then cancels them mid-stream; with it each stream gets its last chunk and ends.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.cancel_all()
        super().handle_exit(sig, frame)


def make_server(state: ServerState, host: str, port: int, log_level: str = "warning") -> GracefulServer:
    """The server of `state`'s app on `host`:`port`; `host` becomes `state.bind_host`, which decides
    which `Host` names the app answers (loopback ones only on a loopback address)."""
    state.bind_host = host
    _show_package_log(log_level)
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    return GracefulServer(config, state.engine)


_HANDLER = logging.StreamHandler()
_HANDLER.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))  # as uvicorn writes its own lines


def _show_package_log(level: str) -> None:
    """The package's own log lines (logger "mlx_dflash": a long prefill's progress, why a request
    decodes alone, the disk tier) on stderr beside uvicorn's. They are few, so at the default
    level (warning) they show from info up; `--log-level error` keeps only errors."""
    number = LOG_LEVELS.get(level.lower(), logging.WARNING)
    if number <= logging.WARNING:
        number = min(number, logging.INFO)
    _HANDLER.setLevel(number)
    _HANDLER.setStream(sys.stderr)  # today's: a test's capture, or the process's
    logger = logging.getLogger("mlx_dflash")
    if _HANDLER not in logger.handlers:
        logger.addHandler(_HANDLER)
    if logger.getEffectiveLevel() > number:  # never quieter than a level set elsewhere (a test's)
        logger.setLevel(number)
