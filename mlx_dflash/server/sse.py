"""Server-sent events framing."""

from __future__ import annotations

import json


def sse_event(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def done_event() -> str:
    return "data: [DONE]\n\n"
