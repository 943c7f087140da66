"""The replay against one target: `dflash-mlx serve` started on it, then for each agent session A's turns, a
new session B, a sub-agent, and (when serve has the disk tier) a restart on the same --prompt-cache-dir
followed by session A's next turn and a new session C. Every request is streamed and becomes one row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .client import stream_request
from .report import header, line, verdicts
from .server import ServeProcess
from .synth import PROMPTS, AgentShape, first_request, next_turn, scale_for

BILLING_PREFIX = "x-anthropic-billing-header:"


@dataclass
class Target:
    """A model to serve: its name in the report, the serve options choosing it, and what it is."""

    name: str
    options: list[str]
    description: str
    rows: list[dict] = field(default_factory=list)


def drop_billing_header(body: dict) -> dict:
    """`body` without Claude Code's billing-header system block (what a server that ignores it would see)."""
    system = body.get("system")
    if isinstance(system, list):
        body["system"] = [b for b in system if not str(b.get("text", "")).startswith(BILLING_PREFIX)]
    return body


def warm_up(server: ServeProcess, timeout: float) -> None:
    """One short request before any measured one (first allocations); its prompt shares nothing with theirs."""
    body = {"model": "warm-up", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]}
    try:
        httpx.post(server.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"},
                   timeout=timeout)
    except httpx.HTTPError as e:
        print(f"warm-up request failed: {type(e).__name__}: {e}", flush=True)


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


class Replay:
    """The phases for every agent against one server, and the restart."""

    def __init__(self, args: argparse.Namespace, shapes: dict[str, AgentShape], serve_options: set[str],
                 workdir: Path):
        self.args, self.shapes, self.workdir = args, shapes, workdir
        self.disk = "--prompt-cache-dir" in serve_options
        self.disk_bytes_option = "--prompt-cache-disk-bytes" in serve_options
        self.client = httpx.Client()

    def options(self, target: Target, cache_dir: Path) -> list[str]:
        args = self.args
        opts = [*target.options, "--max-tokens-default", str(args.max_tokens), "--log-level", "warning"]
        if args.prompt_cache_bytes is not None:
            opts += ["--prompt-cache-bytes", str(args.prompt_cache_bytes)]
        if self.disk:
            opts += ["--prompt-cache-dir", str(cache_dir)]
            if self.disk_bytes_option:
                opts += ["--prompt-cache-disk-bytes", str(args.prompt_cache_disk_bytes)]
        return opts + list(args.server_arg)

    def send(self, server: ServeProcess, target: Target, shape: AgentShape, body: dict, phase: str,
             kind: str, previous: dict | None = None) -> dict:
        """Stream one request; its row (printed at once) with the reply kept for the next turn. With the
        `previous` turn's row: `ideal`, the share a perfect cache would read (that turn's prompt and reply)."""
        args = self.args
        if args.no_billing_header:
            drop_billing_header(body)
        out = stream_request(self.client, server.url, shape.api, shape.path, body, shape.headers,
                             args.request_timeout, args.read_timeout)
        row = {"target": target.name, "phase": phase, "agent": shape.name, "kind": kind,
               **{k: out[k] for k in ("prompt_tokens", "cached", "output_tokens", "ttft", "prefill_s", "seconds",
                                      "stop", "error")}}
        if previous is not None and previous.get("prompt_tokens") and out["prompt_tokens"]:
            reusable = previous["prompt_tokens"] + (previous.get("output_tokens") or 0)
            row["ideal"] = min(1.0, reusable / out["prompt_tokens"])
        target.rows.append(row)
        print(line(row), flush=True)
        row["_reply"] = {"blocks": out["blocks"], "items": out["items"]}
        return row

    def scale(self, shape: AgentShape) -> float:
        return 1.0 if shape.captured else scale_for(shape.skeleton, shape.api, self.args.system_tokens)

    def first(self, shape: AgentShape, session: str, skeleton: dict | None = None) -> dict:
        return first_request(shape, skeleton or shape.skeleton, session, PROMPTS[session], self.scale(shape),
                             self.args.max_tokens)

    def after(self, shape: AgentShape, body: dict, row: dict, session: str, turn: int) -> dict:
        return next_turn(body, shape.api, row["_reply"], session, turn, self.args.tool_result_tokens)

    def run(self, target: Target) -> dict:
        """Every phase against `target`; the target's part of the report."""
        args = self.args
        cache_dir = Path(args.prompt_cache_dir) / target.name if args.prompt_cache_dir else \
            self.workdir / f"prompt-cache-{target.name}"
        if cache_dir.exists() and any(cache_dir.iterdir()):
            raise SystemExit(f"{cache_dir} is not empty: the cold turns would read from it (give an empty folder)")
        cache_dir.mkdir(parents=True, exist_ok=True)
        options = self.options(target, cache_dir)
        log = self.workdir / f"serve-{target.name}.log"
        result: dict = {"target": target.name, "description": target.description, "serve_options": options,
                        "log": str(log), "prompt_cache_dir": str(cache_dir) if self.disk else None}
        print(f"\n== {target.name}: {target.description}", flush=True)
        server = ServeProcess(options, log)
        sessions: dict[str, tuple[dict, dict, int]] = {}  # agent -> (A's last body, its row, its turn)
        try:
            result["load_seconds"] = server.start(args.load_timeout)
            warm_up(server, args.request_timeout)
            print(header(), flush=True)
            for shape in self.shapes.values():
                body = self.first(shape, "A")
                row = self.send(server, target, shape, body, "A turn 1 (cold)", "first_turn")
                for turn in range(2, args.turns + 1):
                    body = self.after(shape, body, row, "A", turn)
                    row = self.send(server, target, shape, body, f"A turn {turn}", "later_turn", row)
                sessions[shape.name] = (body, row, args.turns)
                self.send(server, target, shape, self.first(shape, "B"), "B turn 1 (new session)", "new_session")
                if shape.subagent is not None:
                    self.send(server, target, shape, self.first(shape, "sub", shape.subagent), "sub-agent turn 1",
                              "subagent")
                else:
                    print(f"{'':9}  sub-agent: none captured for {shape.name} (shapes.json has no sub-agent "
                          "request): skipped", flush=True)
            result["health_before_restart"] = server.health()
            if not self.disk and not args.restart_anyway:
                result["restart"] = ("serve has no --prompt-cache-dir (the prompt cache's disk tier) yet: "
                                     "restart phase skipped")
                print(f"\n{result['restart']}", flush=True)
                return result
            if not self.disk:
                result["restart"] = "serve has no --prompt-cache-dir: restarted anyway, with nothing kept (a baseline)"
            result["stop"] = server.stop(args.stop_timeout)
            result["disk_bytes_after_stop"] = disk_bytes(cache_dir)
            print(f"-- restart: {result['stop']}; {result['disk_bytes_after_stop']:,} bytes in {cache_dir}",
                  flush=True)
            server = ServeProcess(options, log)
            result["reload_seconds"] = server.start(args.load_timeout)
            warm_up(server, args.request_timeout)
            for shape in self.shapes.values():
                body, row, turn = sessions[shape.name]
                body = self.after(shape, body, row, "A", turn + 1)
                self.send(server, target, shape, body, f"restart: A turn {turn + 1}", "restart_turn", row)
                self.send(server, target, shape, self.first(shape, "C"), "restart: C turn 1 (new)", "restart_session")
            result["health_after"] = server.health()
            return result
        finally:
            result["final_stop"] = server.stop(args.stop_timeout)
            for row in target.rows:
                row.pop("_reply", None)
            result["rows"] = target.rows
            result["verdicts"] = verdicts(target.rows, result.get("restart"))
