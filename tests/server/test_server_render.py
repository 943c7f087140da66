"""Prompt rendering: a chat template that ignores tools is noticed once, with a warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from mlx_dflash.server.http.state import ServerState

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


class TemplateTokenizer:
    """apply_chat_template over characters; `with_tools` decides whether tools reach the prompt."""

    chat_template = "stub"

    def __init__(self, with_tools: bool):
        self.with_tools = with_tools
        self.calls = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **options):
        self.calls += 1
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if tools and self.with_tools:
            text = "tools:" + ",".join(t["function"]["name"] for t in tools) + text
        return [ord(c) for c in text]


def state_for(tokenizer) -> ServerState:
    return ServerState(SimpleNamespace(tokenizer=tokenizer), "tiny")


def test_a_template_that_drops_tools_is_warned_about_once(caplog):
    tokenizer = TemplateTokenizer(with_tools=False)
    state = state_for(tokenizer)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        for _ in range(3):
            state.render(MESSAGES, TOOLS)
    warnings = [r for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(warnings) == 1
    assert tokenizer.calls == 4  # one extra render, on the first request with tools only


def test_a_template_that_renders_tools_is_not_warned_about(caplog):
    tokenizer = TemplateTokenizer(with_tools=True)
    state = state_for(tokenizer)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        ids = state.render(MESSAGES, TOOLS)
        state.render(MESSAGES)
    assert "".join(map(chr, ids)).startswith("tools:get_weather")
    assert not [r for r in caplog.records if "does not render tools" in r.getMessage()]
    assert tokenizer.calls == 3


class ToolsOnlyTokenizer(TemplateTokenizer):
    """A template that fails without tools (it indexes them): the probe for dropped tools must not
    turn that into a failed request."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **options):
        if not tools:
            raise IndexError("list object has no element 0")
        return super().apply_chat_template(messages, tools, add_generation_prompt, **options)


def test_a_template_that_needs_its_tools_renders_them_without_a_warning(caplog):
    state = state_for(ToolsOnlyTokenizer(with_tools=True))
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        ids = state.render(MESSAGES, TOOLS)
    assert "".join(map(chr, ids)).startswith("tools:get_weather")
    assert state._renders_tools is True and not caplog.records
