"""Server-sent events framing, and keep-alives for streams that go quiet (a long prefill)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies and timeouts see traffic
KEEPALIVE_SECONDS = 10.0


def sse_event(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def done_event() -> str:
    return "data: [DONE]\n\n"


async def with_keepalive(events: AsyncIterator[str], interval: float = KEEPALIVE_SECONDS) -> AsyncIterator[str]:
    """`events`, with a keep-alive comment whenever nothing was sent for `interval` seconds.

    Closing this stream (the client went away) cancels the wait for the next event, which
    closes `events` at its await, so the request behind it is cancelled as before.
    """
    iterator = aiter(events)
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # it ends as it may: nobody reads it
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
