"""Tool calls: the `<tool_call>{json}</tool_call>` format of Qwen3 and Hermes chat templates.

Requests carry tools and earlier calls in the OpenAI shape; the chat template renders
them. A reply's markup is parsed back into calls; markup that does not parse stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def parse_tool_calls(markup: str, prefix: str = "call_") -> list[ToolCall] | None:
    """Calls in `markup` (the text from the first `<tool_call>` on, marker excluded); None if any is malformed."""
    calls = []
    for body in _CALL.findall(TOOL_CALL_OPEN + markup):
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(new_call_id(prefix), data["name"], arguments))
    return calls or None


def template_tool_call(name: str, arguments: Any) -> dict:
    """An earlier call as chat templates expect it (arguments as a mapping where possible)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
