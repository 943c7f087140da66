"""Coding agents' sessions replayed against `dflash-mlx serve`: what the prompt cache reuses, turn by turn.

    python benchmarks/bench_agent_replay.py [--targets attention,hybrid] [--agents claude-code,codex]
        [--system-tokens 1500] [--turns 4] [--max-tokens 32] [--tool-result-tokens 300] [--capture DIR]
        [--prompt-cache-dir DIR] [--prompt-cache-disk-bytes B] [--no-billing-header] [--json PATH]

Requests have the shapes of what the real CLIs send (benchmarks/agent_replay/shapes.json, recorded from
Claude Code and Codex with agent_replay/capture.py: system prompt and tool sizes, message structure) with
deterministic filler text; `--capture DIR` uses a capture folder's real bodies instead. The system prompt and
tools are scaled to about `--system-tokens` tokens of prose (the tools' JSON structure comes on top where the
chat template lists tools), so a CPU can run it. For each agent: session A turn 1 (system + tools + a user
message), turns 2..--turns (each adds the reply as returned, a tool call and a tool result of
--tool-result-tokens), a new session B (same system prompt and tools, another first message), a sub-agent
(another, shorter system prompt; Claude Code's, as captured), then a restart of the server on the same
--prompt-cache-dir (skipped, saying so, while serve has no disk tier), session A's next turn and a new session C.

Targets: `attention`, the embedded SmolLM2-135M-Instruct with its shipped drafter; `hybrid`, a tiny random
Qwen3.5 (GatedDeltaNet + attention every 4th layer) with SmolLM2's tokenizer, served alone; `model`, any
--model (and --draft) as serve takes them, for real prompt sizes (--capture) on a larger machine. The first
two get a ChatML template that lists the tools, as the models agents use have (SmolLM2's own leaves them out,
and with them most of an agent's prompt: `--native-template` serves it as shipped). Greedy, --max-tokens per
reply; the system prompts are scaled, not the turns' additions, so a turn's share cached is lower than at
full size (the `ideal%` column: what a perfect cache would read).

Printed per request: phase, agent, prompt tokens, cached tokens (Anthropic `cache_read_input_tokens`, Responses
`input_tokens_details.cached_tokens`), share cached, time to first token (streamed), the server's prefill
seconds; then per target the verdicts (see agent_replay/report.py). Exit status 1 when a request failed or a
server did not start; goals not met are reported, not failed on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from agent_replay.replay import Replay, Target
from agent_replay.report import show_verdicts
from agent_replay.server import serve_options
from agent_replay.synth import SHAPES, load_captured, load_shapes

GIB = 1 << 30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="attention,hybrid", help="comma-separated: attention, hybrid, model "
                   "(--model with --draft, e.g. a real agent model on a Mac with --capture)")
    p.add_argument("--model", help="the `model` target's --model")
    p.add_argument("--draft", help="the `model` target's --draft (default: none)")
    p.add_argument("--agents", default=None, help="comma-separated agents of the shape file (default: all)")
    p.add_argument("--shapes", type=Path, default=SHAPES, help="the shape file")
    p.add_argument("--capture", type=Path, help="a capture folder (agent_replay/capture.py record): real bodies")
    p.add_argument("--system-tokens", type=int, default=1500, help="the system prompt + tools' prose, in tokens "
                   "(scaled down proportionally; 0: as captured)")
    p.add_argument("--turns", type=int, default=4, help="session A's turns before the restart")
    p.add_argument("--max-tokens", type=int, default=32, help="each reply's max_tokens")
    p.add_argument("--tool-result-tokens", type=int, default=300, help="each tool result's size")
    p.add_argument("--no-billing-header", action="store_true", help="send no billing-header system block (Claude "
                   "Code's, with a per-session suffix; the server leaves it out of the prompt either way)")
    p.add_argument("--restart-anyway", action="store_true", help="run the restart phase even when serve has no "
                   "disk tier (nothing survives the restart then: the cold baseline)")
    p.add_argument("--prompt-cache-dir", type=Path, help="the server's --prompt-cache-dir (default: a temporary "
                   "folder; one sub-folder per target)")
    p.add_argument("--prompt-cache-disk-bytes", type=int, default=4 * GIB, help="the server's "
                   "--prompt-cache-disk-bytes")
    p.add_argument("--prompt-cache-bytes", type=int, default=None, help="the server's --prompt-cache-bytes "
                   "(default: its own)")
    p.add_argument("--block-size", default="4", help="the attention target's --block-size ('auto' calibrates "
                   "first; decoding only, the prefill is the same)")
    p.add_argument("--native-template", action="store_true", help="serve the attention target with SmolLM2's own "
                   "chat template, which leaves the tools out (default: a ChatML template listing them, as agents' "
                   "models have)")
    p.add_argument("--hybrid-layers", type=int, default=8)
    p.add_argument("--hybrid-hidden", type=int, default=256)
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for serve (repeatable)")
    p.add_argument("--load-timeout", type=float, default=300, help="the server must answer /health within this")
    p.add_argument("--request-timeout", type=float, default=900, help="longest a request may take")
    p.add_argument("--read-timeout", type=float, default=120, help="longest wait for a stream's next line")
    p.add_argument("--stop-timeout", type=float, default=60, help="the server must stop on SIGINT within this")
    p.add_argument("--keep", action="store_true", help="keep the working folder (server logs, hybrid model)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    args.system_tokens = args.system_tokens or None
    return args


def make_targets(args: argparse.Namespace, workdir: Path) -> list[Target]:
    from agent_replay.targets import build_hybrid, embedded_pair, with_tools_template

    template = "SmolLM2's own chat template (no tools)" if args.native_template else "a chat template listing tools"
    targets = []
    for name in args.targets.split(","):
        if name == "attention":
            what = f"the embedded SmolLM2-135M-Instruct and its shipped drafter, {template}"
            if args.native_template:
                targets.append(Target("attention", ["--block-size", args.block_size], what))
                continue
            source, drafter = embedded_pair()
            model = with_tools_template(source, workdir / "smollm2-tools")
            targets.append(Target("attention", ["--model", str(model), "--served-model-name", "SmolLM2-135M-Instruct",
                                                *(["--draft", drafter] if drafter else []),
                                                "--block-size", args.block_size], what))
        elif name == "hybrid":
            path = build_hybrid(workdir / "hybrid-qwen3_5", args.hybrid_layers, args.hybrid_hidden)
            targets.append(Target("hybrid", ["--model", str(path), "--no-draft"],
                                  f"a random Qwen3.5, {args.hybrid_layers} layers (full attention every 4th), "
                                  f"hidden {args.hybrid_hidden}, SmolLM2's tokenizer, a chat template listing tools, "
                                  "no drafter"))
        elif name == "model":
            if not args.model:
                raise SystemExit("--targets model needs --model")
            targets.append(Target("model", ["--model", args.model, *(["--draft", args.draft] if args.draft else
                                                                     ["--no-draft"])], f"{args.model} as given"))
        else:
            raise SystemExit(f"unknown target {name!r}: attention, hybrid or model")
    return targets


def machine() -> str:
    from mlx_dflash.platform.setup import machine as named

    return f"{named()}, {os.cpu_count()} CPU cores"


def main() -> None:
    args = parse_args()
    # SIGTERM ends this process through its `finally` blocks and atexit, which stop the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shapes = load_captured(args.capture) if args.capture else load_shapes(args.shapes)
    if args.agents:
        missing = set(args.agents.split(",")) - set(shapes)
        if missing:
            raise SystemExit(f"no shape for {sorted(missing)}; there are {sorted(shapes)}")
        shapes = {k: v for k, v in shapes.items() if k in args.agents.split(",")}
    workdir = Path(tempfile.mkdtemp(prefix="agent-replay-"))
    doc: dict = {"machine": machine(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
                 "args": {k: str(v) for k, v in vars(args).items()},
                 "agents": {k: {"cli": s.cli, "api": s.api, **s.summary} for k, s in shapes.items()}, "targets": []}
    print(f"machine: {doc['machine']}", flush=True)
    for name, s in shapes.items():
        print(f"agent {name}: {s.api} {s.path}, captured with {s.cli or 'unknown CLI'}; {s.summary}", flush=True)
    failed = False
    try:
        options = serve_options()
        if "--prompt-cache-dir" not in options:
            print("note: `dflash-mlx serve --help` has no --prompt-cache-dir (the disk tier) yet: the restart "
                  "phase will be skipped", flush=True)
        replay = Replay(args, shapes, options, workdir)
        for target in make_targets(args, workdir):
            try:
                result = replay.run(target)
            except SystemExit as e:  # a server that did not start: say so, go on with the next target
                result = {"target": target.name, "error": str(e), "rows": target.rows}
                print(f"{target.name}: {e}", file=sys.stderr, flush=True)
                failed = True
            doc["targets"].append(result)
            failed |= any(r.get("error") for r in result.get("rows", []))
        for result in doc["targets"]:
            if "verdicts" in result:
                show_verdicts(result["target"], result["verdicts"])
        print(f"\nmachine: {doc['machine']}")
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1, default=str))
            print(f"written to {args.json}")
    finally:
        if args.keep:
            print(f"working folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
