"""One streamed request as the agents send it, timed: the time to the first generated output, the prompt and
cached tokens from the API's usage, and the reply as the agent would send it back (blocks / output items).

Usage fields read: Anthropic Messages `usage.input_tokens` (the uncached part) + `cache_read_input_tokens`
(message_delta), OpenAI Responses `usage.input_tokens` and `input_tokens_details.cached_tokens` (the final
response event), as mlx_dflash/server/apis/anthropic_api.py and responses_output.py report them. The first
output is the first content block (Messages) or output item / delta (Responses): `message_start` and
`response.created` come before the prefill, so they do not count.
"""

from __future__ import annotations

import json
import time

import httpx
from serve_load.clients import sse_lines

HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "sk-local", "authorization": "Bearer sk-local"}
FINAL_RESPONSES = ("response.completed", "response.incomplete", "response.failed")


def _anthropic_event(data: dict, out: dict, blocks: dict[int, dict], partial: dict[int, str]) -> bool:
    """Take one Messages event into `out`; True when it is generated output."""
    kind = data.get("type")
    if kind == "content_block_start":
        blocks[data["index"]] = dict(data["content_block"])
        return True
    if kind == "content_block_delta":
        block, delta = blocks.setdefault(data["index"], {"type": "text", "text": ""}), data["delta"]
        dtype = delta.get("type")
        if dtype == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif dtype == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif dtype == "signature_delta":
            block["signature"] = block.get("signature", "") + delta["signature"]
        elif dtype == "input_json_delta":
            partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        return True
    if kind == "content_block_stop" and data["index"] in partial:
        blocks[data["index"]]["input"] = json.loads(partial.pop(data["index"]) or "{}")
    elif kind == "message_delta":
        usage = data.get("usage") or {}
        out["cached"] = usage.get("cache_read_input_tokens")
        out["prompt_tokens"] = (usage.get("input_tokens") or 0) + (out["cached"] or 0)
        out["output_tokens"] = usage.get("output_tokens")
        out["stop"] = (data.get("delta") or {}).get("stop_reason")
        out["prefill_s"] = (data.get("dflash") or {}).get("prefill_seconds")
    elif kind == "message_stop":
        out["done"] = True
    elif kind == "error":
        out["error"] = json.dumps(data.get("error") or data)[:300]
    return False


def _responses_event(data: dict, out: dict, items: list[dict]) -> bool:
    """Take one Responses event into `out`; True when it is generated output."""
    kind = data.get("type", "")
    if kind == "response.output_item.done":
        items.append(data["item"])
    elif kind in FINAL_RESPONSES:
        response = data.get("response") or {}
        usage = response.get("usage") or {}
        out["prompt_tokens"] = usage.get("input_tokens")
        out["cached"] = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        out["output_tokens"] = usage.get("output_tokens")
        out["stop"] = response.get("status")
        out["prefill_s"] = (response.get("dflash") or {}).get("prefill_seconds")
        out["done"] = kind != "response.failed"
        if kind == "response.failed":
            out["error"] = json.dumps(response.get("error"))[:300]
    elif kind == "error":
        out["error"] = json.dumps(data)[:300]
    return kind == "response.output_item.added" or kind.endswith(".delta")


def stream_request(client: httpx.Client, url: str, api: str, path: str, body: dict, headers: dict,
                   timeout: float, read_timeout: float) -> dict:
    """Send `body` to `url + path` streamed; what came back: ttft and seconds (from sending), prompt_tokens,
    cached, output_tokens, stop, prefill_s (the server's own), the reply (`blocks` or `items`), `error` when it
    failed."""
    out: dict = {"ttft": None, "seconds": None, "prompt_tokens": None, "cached": None, "output_tokens": None,
                 "stop": None, "prefill_s": None, "error": None, "done": False, "blocks": [], "items": []}
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    start = time.perf_counter()
    deadline = start + timeout
    try:
        with client.stream("POST", url + path, json=body, headers={**HEADERS, **headers},
                           timeout=httpx.Timeout(read_timeout, connect=10.0)) as response:
            if response.status_code != 200:
                response.read()
                out["error"] = f"HTTP {response.status_code}: {response.text[:300]}"
                return out
            for line in sse_lines(response):
                if time.perf_counter() > deadline:
                    out["error"] = f"no end within {timeout:.0f} s"
                    return out
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                fresh = (_anthropic_event(data, out, blocks, partial) if api == "anthropic"
                         else _responses_event(data, out, out["items"]))
                if fresh and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
            if not out["done"] and out["error"] is None:
                out["error"] = "the stream ended without its last event"
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    except ValueError as e:
        out["error"] = f"an event that is not JSON: {e}"
    finally:
        out["seconds"] = time.perf_counter() - start
        out["blocks"] = [blocks[i] for i in sorted(blocks)]
    return out
