"""Structured output for every API: a request's response format as a grammar the decoder follows.

Each API names the format its own way (chat completions `response_format`, Responses
`text.format`, Anthropic `output_format` / `output_config.format`); `format_kind` reads any of
them as ("text" | "json_object" | "json_schema", schema). `constraint_for` compiles the grammar
when the request arrives, so a schema llguidance cannot honour is a 400 naming the problem
(never silently ignored), and returns the factory the engine calls for each generation's fresh
`TokenConstraint`. Constrained output is plain JSON text: `PlainReply` passes it through
without looking for reasoning or tool-call markup, and `without_thinking` turns a template's
thinking switch off for it.

A forced tool call (`tool_choice` "required" or a named function, Anthropic's "any" or "tool") is
the same machinery with another grammar: `tool_choice_constraint` writes the model's own call
markup (Hermes/Qwen `<tool_call>` JSON, Llama 3.x JSON) around each offered tool's parameters
schema, and `forced_call_parser` reads the calls back. A model whose call format has no grammar
here gets a 400 naming the format, never a reply served as "auto".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from ...decoding.constraint import (
    JSON_WHITESPACE,
    GrammarError,
    StructuredOutputUnavailable,
    TokenConstraint,
    grammar_tokenizer,
    json_schema_grammar,
    lark_grammar,
)
from ..http import fields
from ..http.errors import APIError
from ..http.state import ServerState
from .events import TextDelta, ToolCallItem
from .parser import ReplyFormat, ReplyParser, reply_parser
from .readers import PYTHON_TAG

KINDS = ("text", "json_object", "json_schema")
# The tool-call formats a forced call has a grammar for (ReplyFormat.tool_format), and the key of
# the call object that holds the arguments.
FORCED_CALL_KEYS = {"json_tools": "arguments", "llama3_json": "parameters"}


def format_kind(value: Any, param: str) -> tuple[str, dict | None]:
    """A response format as (kind, JSON schema): chat completions' {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}, Responses' and Anthropic's {"type": "json_schema", "schema"},
    {"type": "json_object"} or {"type": "text"}; None is "text"."""
    if value is None:
        return "text", None
    if not isinstance(value, dict):
        raise fields.bad(param, f"'{param}' must be an object such as {{'type': 'json_object'}}")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return kind, None
    if kind != "json_schema":
        raise fields.bad(f"{param}.type", f"'{param}.type' must be one of {', '.join(KINDS)}, got {kind!r}")
    where = param
    if "json_schema" in value:  # chat completions nests the schema with its name
        where, value = f"{param}.json_schema", value["json_schema"]
        if not isinstance(value, dict):
            raise fields.bad(where, f"'{where}' must be an object with a 'schema'")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise fields.bad(f"{where}.schema", f"'{where}.schema' must be a JSON schema (an object)")
    return "json_schema", schema


def constraint_for(state: ServerState, kind: str, schema: dict | None,
                   param: str) -> Callable[[], TokenConstraint] | None:
    """The constraint factory for a response format (None for "text"): each call gives a fresh
    `TokenConstraint` for one generation (put it in `GenerationRequest.constraint`).

    `kind` and `schema` as `format_kind` returns them; `param` names the field in errors. A schema
    that cannot be compiled is a 400; a server without llguidance (or a tokenizer it cannot read), a 501.
    """
    if kind == "text":
        return None
    if kind not in KINDS:
        raise ValueError(f"unknown response format kind {kind!r}")
    try:
        tokenizer = grammar_tokenizer(state.tokenizer)
        grammar = json_schema_grammar(schema if kind == "json_schema" else None, tokenizer)
    except StructuredOutputUnavailable as e:
        raise APIError(501, str(e), param=param, code="unsupported_value") from None
    except GrammarError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    engine = state.engine
    return partial(TokenConstraint, tokenizer, grammar, engine.target.vocab_size, engine.stop_ids)


def without_thinking(options: dict) -> dict:
    """Chat template variables for a constrained reply: thinking switched off (Qwen3's `enable_thinking`;
    mlx-lm passes it on under the template's own name, and templates without a switch ignore it) unless
    the request set it. The grammar allows the JSON alone: the model is better told not to think first."""
    if "enable_thinking" in options or "thinking" in options:
        return options
    return dict(options, enable_thinking=False)


class PlainReply:
    """A reply parser (the `parser.ReplyParser` interface) for constrained output: all of it is text."""

    def __init__(self) -> None:
        self.calls: list[ToolCallItem] = []

    def feed(self, text: str) -> list[TextDelta]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[TextDelta]:
        return []


# -- forced tool calls ----------------------------------------------------------------------
def _arguments_schema(tool: dict) -> dict:
    """A tool's parameters schema as the grammar of its arguments: an object (every reply parser
    takes arguments as one), spaced as structured output is unless the schema says otherwise."""
    schema = tool["function"].get("parameters")
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema.setdefault("type", "object")
    schema.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
    return schema


def _json_string(value: str) -> str:
    """A Lark literal (JSON escapes) for `value` written as a JSON string, quotes included."""
    return json.dumps(json.dumps(value, ensure_ascii=False))


def _call_object(name: str, key: str, schema: dict) -> str:
    """Lark for one call object, `{"name": NAME, KEY: ARGUMENTS}`, whitespace allowed between its parts.
    Each tool's schema is its own `%json` root, so its `$ref`s resolve against its own `$defs`."""
    parts = ['"{"', _json_string("name"), '":"', _json_string(name), '","', _json_string(key), '":"',
             f"%json {json.dumps(schema)}", '"}"']
    return " WS? ".join(parts)


def _single_token(state: ServerState, text: str) -> int | None:
    """The id of the vocabulary's token that is exactly `text` (an added or special token), if there is one."""
    tokenizer = state.tokenizer
    try:
        token = tokenizer.convert_tokens_to_ids(text)
    except Exception:  # a tokenizer without token lookup: the marker is text
        return None
    if not isinstance(token, int) or token == getattr(tokenizer, "unk_token_id", None):
        return None
    return token


def _marker(state: ServerState, grammar_tok: Any, text: str) -> str:
    """Lark for a call marker: the special token itself where the vocabulary holds the marker as one
    (text cannot spell a special token), else its text, which a plain added token spells too."""
    token = _single_token(state, text)
    if token is not None and token < grammar_tok.vocab_size and grammar_tok.is_special_token(token):
        return f"<[{token}]>"
    return json.dumps(text)


def _calls_lark(state: ServerState, grammar_tok: Any, fmt: ReplyFormat, tools: list[dict], parallel: bool) -> str:
    key = FORCED_CALL_KEYS[fmt.style if fmt.style == "llama3_json" else fmt.tool_format]
    objects = [_call_object(t["function"]["name"], key, _arguments_schema(t)) for t in tools]
    lines = [
        # Every token that keeps the text in the grammar is allowed, not only the tokenizer's own spelling
        # of text the grammar fixes (llguidance's default forcing): the target chooses among them.
        '%llguidance {"no_forcing": true}',
        "body: " + " | ".join(f"tool_{i}" for i in range(len(objects))),
        *(f"tool_{i}: {rule}" for i, rule in enumerate(objects)),
        f"WS: /{JSON_WHITESPACE}/",  # between a call object's parts, as inside its arguments
    ]
    if fmt.style == "llama3_json":
        # A bare object, or one after <|python_tag|>; several are separated by `;` or whitespace.
        tag = f"{_marker(state, grammar_tok, PYTHON_TAG)}?" if _single_token(state, PYTHON_TAG) is not None else ""
        lines.insert(1, f"start: {tag} body" + (" (SEP? body)*" if parallel else ""))
        lines.append(r"SEP: /;[\x20\x0A]{0,2}|[\x20\x0A]{1,2}/")
    else:
        start, end = _marker(state, grammar_tok, fmt.tool_start), _marker(state, grammar_tok, fmt.tool_end)
        lines.insert(1, "start: call" + (" (SEP? call)*" if parallel else ""))
        lines.insert(2, f"call: {start} NL? body NL? {end}")
        lines += [r"NL: /\x0A/", r"SEP: /\x0A{1,2}/"]
    return "\n".join(lines)


def tool_choice_constraint(state: ServerState, tools: list[dict] | None, name: str | None, param: str,
                           parallel: bool = True) -> Callable[[], TokenConstraint]:
    """The constraint factory for a forced tool call: the reply is a call (several with `parallel`) in the
    model's own markup, each naming one of `tools` (OpenAI-shape functions; only `name` when given) with
    arguments that follow that tool's parameters schema, then a stop token.

    A 400 naming `param` when there is no tool to call, when `name` is not offered, when a schema cannot be
    compiled, or when the model's call format is not one written as a grammar here (the format is named);
    a 501 without llguidance.
    """
    if not tools:
        raise fields.bad(param, f"'{param}' forces a tool call, but the request offers no tools to call")
    chosen = tools if name is None else [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise fields.bad(param, f"'{param}' names the tool {name!r}, which is not among the tools offered")
    fmt = ReplyFormat.of(state.tokenizer)
    hermes = fmt.style == "marked" and fmt.tool_format == "json_tools" and bool(fmt.tool_start and fmt.tool_end)
    if not (hermes or fmt.style == "llama3_json"):
        raise fields.bad(param, f"'{param}' that forces a tool call is not supported for this model's tool-call "
                         f"format ({fmt.tool_format or 'none found'}): calls can be forced only in Hermes/Qwen "
                         "<tool_call> JSON or Llama 3.x JSON; use 'auto' or 'none'")
    try:
        grammar_tok = grammar_tokenizer(state.tokenizer)
        grammar = lark_grammar(_calls_lark(state, grammar_tok, fmt, chosen, parallel), grammar_tok)
    except StructuredOutputUnavailable as e:
        raise APIError(501, str(e), param=param, code="unsupported_value") from None
    except GrammarError as e:
        raise APIError(400, _schema_problem(chosen, grammar_tok) or str(e), param=param,
                       code="invalid_value") from None
    engine = state.engine
    return partial(TokenConstraint, grammar_tok, grammar, engine.target.vocab_size, engine.stop_ids)


def _schema_problem(tools: list[dict], grammar_tok: Any) -> str | None:
    """Which tool's parameters schema broke the call grammar, and how (None if none did alone)."""
    for tool in tools:
        try:
            json_schema_grammar(_arguments_schema(tool), grammar_tok)
        except GrammarError as e:
            return f"tool {tool['function']['name']!r}: {e}"
    return None


def forced_call_parser(state: ServerState, tools: list[dict] | None, call_id_prefix: str) -> ReplyParser:
    """The reply parser for a forced call: the model's format, reading calls from the first token
    (the grammar leaves no room for a thinking span, even where the prompt opened one)."""
    return ReplyParser(ReplyFormat.of(state.tokenizer), tools=tools, call_id_prefix=call_id_prefix)


def output_parser(state: ServerState, prompt: list[int], tools: list[dict] | None, call_id_prefix: str, *,
                  forced: bool, constrained: bool) -> ReplyParser | PlainReply:
    """How a request's reply is read: a forced call as calls from its first token, other constrained
    output as the JSON text itself (no thinking span, no tool markup), anything else in the model's format."""
    if forced:
        return forced_call_parser(state, tools, call_id_prefix)
    if constrained:
        return PlainReply()
    return reply_parser(state, prompt, tools, call_id_prefix)
