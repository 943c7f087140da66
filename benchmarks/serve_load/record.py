"""What the clients of one run share: its settings and clock, and everything they saw (under one lock)."""

from __future__ import annotations

import threading
import time
from collections import Counter

MODEL_ID = "bench-load"


class Record:
    """Everything the clients saw; one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.served: Counter = Counter()  # completed 200 streams by API
        self.follow_ups: list[dict] = []  # follow-up turns whose previous turn completed
        self.cancelled = 0  # closed mid-stream on purpose
        self.hangups = 0  # raw socket closed right after the request
        self.cut_at_end = 0  # in flight when the run's drain ran out
        self.timeouts: Counter = Counter()  # normal requests past their time-out, by API
        self.five_xx: list[str] = []
        self.stream_errors: list[str] = []  # an error event inside a 200 stream
        self.unexpected: list[str] = []  # other statuses, transport errors, on normal requests
        self.hostile: dict[str, dict] = {}
        self.health: list[float] = []
        self.health_failures: list[tuple[float, str]] = []  # (when, what)
        self.health_samples: list[tuple[float, int, int]] = []  # (time, prompt cache bytes, waiting)

    def add(self, name: str, value) -> None:
        with self.lock:
            getattr(self, name).append(value)

    def count(self, name: str, key: str | None = None) -> None:
        with self.lock:
            if key is None:
                setattr(self, name, getattr(self, name) + 1)
            else:
                getattr(self, name)[key] += 1


class Run:
    def __init__(self, args, port: int, server: dict, prompts: dict):
        self.args, self.port, self.server, self.prompts = args, port, server, prompts
        self.url = f"http://127.0.0.1:{port}"
        self.record = Record()
        self.end = time.time() + args.seconds  # no request starts after this
        self.cut = self.end + args.drain  # requests still in flight are cut here
        self.clients_done = threading.Event()

    def deadline(self) -> float:
        return min(time.time() + self.args.request_timeout, self.cut)

    def over(self) -> bool:
        return time.time() >= self.end
