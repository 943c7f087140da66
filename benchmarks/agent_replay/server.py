"""`dflash-mlx serve` as a subprocess: its options read from `serve --help`, started on a free port and waited
for on /health, stopped cleanly (SIGINT, as Ctrl-C) and killed when it does not stop, and always killed when
this process ends, however it ends.

A subprocess (not the in-process server of serve_load/server.py) because the restart phase needs the real
command line: a server stopped and started again on the same `--prompt-cache-dir`.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_LIVE: set[subprocess.Popen] = set()


def _kill_all() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


atexit.register(_kill_all)


def serve_command() -> list[str]:
    """How to run `dflash-mlx serve` with this Python: the console script beside it, else `python -m cli`."""
    script = Path(sys.executable).with_name("dflash-mlx")
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "cli", "serve"]


def serve_options(timeout: float = 120) -> set[str]:
    """The long options `serve --help` lists (wide columns: rich shortens names in a narrow terminal)."""
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    done = subprocess.run(serve_command() + ["--help"], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"`dflash-mlx serve --help` failed ({done.returncode}): {done.stderr[-500:]}")
    return set(re.findall(r"--[a-z][a-z0-9-]+", done.stdout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `dflash-mlx serve` run: started with `options` on a free port, its output in `log`."""

    def __init__(self, options: list[str], log: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = serve_command() + ["--host", "127.0.0.1", "--port", str(self.port), *options]
        self.log = log
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, load_timeout: float) -> float:
        """Start it and wait until /health answers; the seconds that took."""
        start = time.monotonic()
        with open(self.log, "ab") as log:
            log.write(f"\n$ {' '.join(self.args)}\n".encode())
            # Its own session: a Ctrl-C here reaches only this process, which then stops the server itself.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        _LIVE.add(self.proc)
        while time.monotonic() - start < load_timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}) before answering /health:\n"
                                 + self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise SystemExit(f"the server did not answer /health within {load_timeout:.0f} s:\n" + self.log_tail())

    def health(self) -> dict:
        try:
            return httpx.get(self.url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def stop(self, timeout: float) -> str:
        """Stop it as Ctrl-C does (SIGINT), then SIGTERM, then SIGKILL; how it stopped."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return "not running"
        for sig, wait, how in ((signal.SIGINT, timeout, "stopped on SIGINT"),
                               (signal.SIGTERM, 10, "stopped on SIGTERM (SIGINT was not enough)")):
            proc.send_signal(sig)
            try:
                proc.wait(wait)
                _LIVE.discard(proc)
                return f"{how} (exit status {proc.returncode})"
            except subprocess.TimeoutExpired:
                continue
        self.kill()
        return "killed (SIGINT and SIGTERM did not stop it)"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        _LIVE.discard(self.proc)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
