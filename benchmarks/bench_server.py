"""Serving throughput: 1, 2, 4, 6 and 8 concurrent streaming clients, three servers side by side in one run.

    python benchmarks/bench_server.py [--model M] [--draft D] [--clients 1,2,4,6,8] [--requests 2] [--max-tokens 64]

The servers, on the same target, started one after another on free local ports:
`dflash-mlx serve` (DFlash, `--block-size auto`, batching: `--max-batch 8`), the same with
`--max-batch 1` (one request at a time), and `mlx_lm.server` (mlx-lm's own, which batches
plain decoding). Prompts are MT-Bench first turns from ../shared/data; replies are greedy
and must not depend on the batching: the two dflash-mlx servers' replies are compared
prompt by prompt. Each client streams its requests one after another; printed per server and
client count: wall time, aggregate tokens/s and time to first token (median, 95th
percentile). Without --model: the embedded SmolLM2-135M-Instruct and the project's drafter
for it.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx_dflash  # noqa: F401
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
CLI = [sys.executable, "-c", "from mlx_dflash.cli.main import main; main()"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int) -> list[str]:
    questions = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines() if line.strip()]
    return [questions[i % len(questions)] for i in range(count)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no server at {url} after {timeout:.0f} s")


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, chunks, usage, text = None, 0, None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                chunks += 1
                text.append(data["choices"][0]["delta"]["content"])
                first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - start, "seconds": end - start, "tokens": tokens, "text": "".join(text)}


def percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[max(math.ceil(q * len(ranked)) - 1, 0)]


def run_clients(url: str, model: str, texts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads, each streaming `requests` requests one after another (prompt i*requests + j)."""
    results: dict[int, list[dict]] = {}

    def client(i: int) -> None:
        results[i] = [one_request(url, model, texts[i * requests + j], max_tokens) for j in range(requests)]

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [r for rs in results.values() for r in rs]
    ttfts = [r["ttft"] for r in done]
    return {
        "wall": wall,
        "tokens": sum(r["tokens"] for r in done),
        "total_tps": sum(r["tokens"] for r in done) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "texts": {i * requests + j: r["text"] for i, rs in results.items() for j, r in enumerate(rs)},
    }


def serve(argv: list[str], port: int, model: str, args, texts: list[str]) -> dict[int, dict]:
    """Start one server, warm it up, then run every client count against it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        run_clients(url, model, texts, 2, 1, 8)  # warm-up (compilation, first allocation)
        out = {}
        for clients in args.clients:
            out[clients] = run_clients(url, model, texts, clients, args.requests, args.max_tokens)
            print(f"  {clients} clients: {out[clients]['wall']:.1f} s", flush=True)
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="DFlash drafter (default: the one `chat` picks for the model)")
    parser.add_argument("--clients", default="1,2,4,6,8", help="client counts to run, comma-separated")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8, help="the batching server's --max-batch")
    parser.add_argument("--skip-mlx-lm", action="store_true", help="leave out mlx_lm.server")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    from mlx_dflash.loading.resolve import choose_pair

    pair = choose_pair(args.model, args.draft)
    texts = prompts(max(args.clients) * args.requests)
    ports = [free_port() for _ in range(3)]
    common = [*CLI, "serve", "--model", pair.target, "--max-tokens-default", str(args.max_tokens),
              *(["--draft", pair.draft] if pair.draft else [])]
    runs = [(f"serve --max-batch {args.max_batch}",
             [*common, "--max-batch", str(args.max_batch), "--port", str(ports[0])]),
            ("serve --max-batch 1", [*common, "--max-batch", "1", "--port", str(ports[1])])]
    if not args.skip_mlx_lm:
        # Its defaults batch up to 32 concurrent requests (--decode-concurrency).
        runs.append(("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", pair.target,
                                       "--port", str(ports[2]), "--max-tokens", str(args.max_tokens)]))
    print(f"machine: {machine()}")
    print(f"target: {pair.target}\ndrafter: {pair.draft or 'none'}")
    print(f"clients {args.clients}, each streaming {args.requests} requests one after another, {args.max_tokens} "
          "tokens max, greedy, MT-Bench first turns", flush=True)
    results = {}
    for (name, argv), port in zip(runs, ports, strict=False):
        print(f"{name}:", flush=True)
        results[name] = serve(argv, port, pair.target, args, texts)
    batched, alone = (results[name] for name, _ in runs[:2])
    for clients in args.clients:
        same = batched[clients]["texts"] == alone[clients]["texts"]
        print(f"{clients} clients: replies with batching {'identical to' if same else 'DIFFER from'} one at a time")
    print("\n| clients | server | wall s | tok/s (all) | TTFT p50 s | TTFT p95 s |\n|---|---|---|---|---|---|")
    for clients in args.clients:
        for name, _ in runs:
            r = results[name][clients]
            print(f"| {clients} | {name} | {r['wall']:.1f} | {r['total_tps']:.1f} | {r['ttft_p50']:.2f} | "
                  f"{r['ttft_p95']:.2f} |")


if __name__ == "__main__":
    main()
