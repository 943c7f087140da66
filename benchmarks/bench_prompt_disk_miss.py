"""What the prompt cache's disk tier costs a request that misses: time to first token of fresh prompts, disk tier on
and off, side by side in one run.

The worst case for the tier is measured: the memory cache is made small (`--prompt-cache-bytes`), so every
request evicts the one before it and the tier writes that one to disk while the next prompt is prefilled, and
each request's prompt is looked up in the tier's index first. Rounds alternate (on, off, on, off, ...) so
that a machine's drift spreads over both. Each request is a new prompt (no prefix shared with any other), one
token long reply.

    python benchmarks/bench_prompt_disk_miss.py --rounds 4 --prompts 5 --words 300
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_replay.server import ServeProcess  # noqa: E402
from bench_cycle import machine  # noqa: E402

WORDS = ("cache", "prefill", "token", "draft", "verify", "block", "target", "layer", "window", "state", "agent",
         "restart", "disk", "memory", "prompt", "reply", "model", "tensor", "kernel", "metal")


def fresh_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ttft(client: httpx.Client, url: str, text: str) -> tuple[float, int, int]:
    """Seconds to the first streamed text of a one-token reply to `text` (the role comes first, at once);
    its prompt and cached tokens."""
    body = {"model": "m", "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": text}]}
    start = time.perf_counter()
    first, usage = None, {}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return first if first is not None else time.perf_counter() - start, usage.get("prompt_tokens", 0), \
        details.get("cached_tokens", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each setting (alternating)")
    parser.add_argument("--prompts", type=int, default=5, help="fresh prompts per round")
    parser.add_argument("--words", type=int, default=300, help="words per prompt")
    parser.add_argument("--cache-bytes", type=int, default=1 << 20,
                        help="--prompt-cache-bytes: small, so each request evicts (and the tier writes) the last")
    parser.add_argument("--json", type=Path, help="write the times here")
    args = parser.parse_args()
    rng = random.Random(0)
    times: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "prompt-cache"
        for round_ in range(2 * args.rounds):
            setting = "on" if round_ % 2 == 0 else "off"
            options = ["--prompt-cache-bytes", str(args.cache_bytes), "--max-batch", "1",
                       "--prompt-cache-dir", str(folder) if setting == "on" else "off"]
            server = ServeProcess(options, Path(tmp) / f"serve-{round_}.log")
            server.start(300)
            try:
                with httpx.Client() as client:
                    ttft(client, server.url, fresh_prompt(rng, 8))  # warm-up: first-use costs out of the timing
                    for _ in range(args.prompts):
                        seconds, prompt_tokens, cached = ttft(client, server.url, fresh_prompt(rng, args.words))
                        times[setting].append(seconds)
                        print(f"round {round_ + 1:2d} disk {setting:3s}  prompt {prompt_tokens:5d}  "
                              f"cached {cached:4d}  TTFT {seconds:6.2f} s", flush=True)
                disk = (server.health().get("prompt_cache") or {}).get("disk")
            finally:
                print(f"  {server.stop(120)}; disk tier: {disk if setting == 'on' else 'off'}", flush=True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"machine: {machine()}")
    print(f"median TTFT of a miss: disk tier on {on:.2f} s, off {off:.2f} s: {on / off:.3f}x "
          f"(goal <= 1.05x) over {len(times['on'])} + {len(times['off'])} requests")
    if args.json:
        args.json.write_text(json.dumps({"times": times, "median_on": on, "median_off": off}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
