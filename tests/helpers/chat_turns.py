"""A chat turn driven through `ChatEngine.send` to its end: what the API tests of the chat share."""

from __future__ import annotations

from mlx_dflash.chat import ChatEngine


def run_turn(engine: ChatEngine, text: str, stop_after: int | None = None, **kwargs):
    """Drive one turn; with `stop_after`, request a stop after that many cycle events."""
    turn = engine.send(text, **kwargs)
    events = 0
    while True:
        try:
            next(turn)
        except StopIteration as done:
            return done.value
        events += 1
        if stop_after is not None and events == stop_after:
            engine.request_stop()
