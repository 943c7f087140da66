"""The one step after a decode stream ends, shared by the chat and the server: close, then store.

`stream_session` leaves its session consistent at every `yield`, so a consumer that stops
there (a `break`, a stop request, the consumer's own generator being closed) may keep the
session for the next turn or request. An exception raised inside a cycle (a hard Ctrl-C)
may leave uncommitted work in the caches: that session must not be reused as it is.
The chat wraps its stream in `guarded`; the server, whose worker pulls each request's
stream across loop iterations, calls `end_stream` when the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def end_stream(stream: Iterator[Any], store: Callable[[bool], None], consistent: bool) -> None:
    """Close `stream` (its session settles), then hand the session on: `store(consistent)`."""
    stream.close()
    store(consistent)


@contextmanager
def guarded(stream: Iterator[Any], store: Callable[[bool], None]) -> Iterator[Iterator[Any]]:
    """Yield `stream` to the body; however it ends, close the stream, then call `store(consistent)`.

    `consistent` is false only when the body raised (anything but `GeneratorExit`, which
    reaches a generator at a `yield`, where the session is consistent).
    """
    consistent = True
    try:
        yield stream
    except GeneratorExit:
        raise
    except BaseException:
        consistent = False
        raise
    finally:
        end_stream(stream, store, consistent)
