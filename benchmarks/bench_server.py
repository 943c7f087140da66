"""Serving throughput: N concurrent streaming clients x M requests each, side by side in one run.

    python benchmarks/bench_server.py [--model M] [--draft D] [--clients 4] [--requests 2] [--max-tokens 64]

Three servers on the same target, started one after another on free local ports:
`dflash-mlx serve` (DFlash, `--block-size auto`), `dflash-mlx serve --no-draft`,
and `mlx_lm.server` (mlx-lm's own, which batches concurrent requests). Prompts are
MT-Bench first turns from ../shared/data; replies are greedy. Each client streams
its requests one after another; printed per server: requests/s, time to first
token, tokens/s per client, and all clients together. Without --model: the
embedded SmolLM2-135M-Instruct and the project's drafter for it.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
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
    first, chunks, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - start, "seconds": end - start, "tokens": tokens}


def run_clients(url: str, model: str, texts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
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
    per_client = [sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for rs in results.values()]
    return {
        "requests_per_s": len(done) / wall,
        "ttft_median": statistics.median(r["ttft"] for r in done),
        "ttft_max": max(r["ttft"] for r in done),
        "client_tps": statistics.mean(per_client),
        "total_tps": sum(r["tokens"] for r in done) / wall,
        "tokens": sum(r["tokens"] for r in done),
        "wall": wall,
    }


def serve(argv: list[str], port: int, model: str, args, texts: list[str]) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        run_clients(url, model, texts, 1, 1, 8)  # warm-up (compilation, first allocation)
        return run_clients(url, model, texts, args.clients, args.requests, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="DFlash drafter (default: the one `chat` picks for the model)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-mlx-lm", action="store_true", help="leave out mlx_lm.server")
    args = parser.parse_args()
    from mlx_dflash.resolve import choose_pair

    pair = choose_pair(args.model, args.draft)
    texts = prompts(args.clients * args.requests)
    ports = [free_port() for _ in range(3)]
    common = [*CLI, "serve", "--model", pair.target, "--max-tokens-default", str(args.max_tokens)]
    runs = [("dflash-mlx serve (DFlash)", [*common, "--port", str(ports[0])]
             + (["--draft", pair.draft] if pair.draft else [])),
            ("dflash-mlx serve --no-draft", [*common, "--no-draft", "--port", str(ports[1])])]
    if not args.skip_mlx_lm:
        runs.append(("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", pair.target,
                                       "--port", str(ports[2]), "--max-tokens", str(args.max_tokens)]))
    print(f"machine: {machine()}")
    print(f"target: {pair.target}\ndrafter: {pair.draft or 'none'}")
    print(f"{args.clients} concurrent streaming clients x {args.requests} requests, {args.max_tokens} tokens max, "
          "greedy, MT-Bench first turns")
    header = f"{'server':30} {'req/s':>7} {'TTFT med':>9} {'TTFT max':>9} {'tok/s/client':>13} {'tok/s all':>10}"
    rows = []
    for (name, argv), port in zip(runs, ports, strict=False):
        r = serve(argv, port, pair.target, args, texts)
        rows.append(f"{name:30} {r['requests_per_s']:7.2f} {r['ttft_median']:8.2f}s {r['ttft_max']:8.2f}s "
                    f"{r['client_tps']:13.1f} {r['total_tps']:10.1f}")
        print(f"  done: {name} ({r['tokens']} tokens in {r['wall']:.1f} s)", flush=True)
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
