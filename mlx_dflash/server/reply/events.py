"""The events a reply parser yields: answer text, reasoning text and complete tool calls.

Every chat API renders these three kinds in its own shape, and the family readers
(readers.py) produce them for `ReplyParser` (parser.py), so they live apart from all of them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass
class TextDelta:
    """Visible answer text, streamed as it is released."""

    text: str


@dataclass
class ReasoningDelta:
    """Text inside the model's thinking span, markers excluded."""

    text: str


@dataclass
class ToolCallItem:
    """One complete, parsed tool call."""

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Event = TextDelta | ReasoningDelta | ToolCallItem


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]
