"""Earlier tool calls, as chat templates expect them in a conversation.

Requests carry tools and earlier calls in each API's shape; the chat template renders them.
A reply's own calls are read back by `parser.ReplyParser`, in the model's format.
"""

from __future__ import annotations

import json
from typing import Any


def template_tool_call(name: str, arguments: Any) -> dict:
    """An earlier call as chat templates expect it (arguments as a mapping where possible)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
