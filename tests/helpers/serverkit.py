"""A live `dflash-mlx serve` app on 127.0.0.1 and a free port, in a thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import anthropic
import httpx
import mlx.core as mx
import openai

import mlx_dflash
from helpers.tiny import EOS_ID, save_target, tiny_drafter, tiny_target
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.http.state import ServerState
from mlx_dflash.server.runner import make_server

MODEL_ID = "tiny"


def tiny_pair(path):
    """(target, tokenizer, drafter): the tiny qwen3 target (seed 0) saved under `path` and loaded back as
    `dflash-mlx serve` loads a model, with a random DFlash drafter of block size 8."""
    target, tokenizer, _ = mlx_dflash.load(str(save_target(tiny_target("qwen3", seed=0), "qwen3", path)))
    return target, tokenizer, tiny_drafter(target, block_size=8)


def openai_client(live: LiveServer, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def anthropic_client(live: LiveServer, timeout: float = 60) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """Starts the app with uvicorn in a thread (bounded wait) and stops it on exit."""

    def __init__(self, target, tokenizer, drafter=None, *, api_key: str | None = None,
                 config: EngineConfig | None = None, max_tokens_default: int = 64, **state_fields):
        """`state_fields`: more `ServerState` fields (strict_model_name, max_body_bytes, allow_origins, ...)."""
        self.engine = Engine(target, tokenizer, drafter, config or EngineConfig())
        self.state = ServerState(self.engine, MODEL_ID, api_key=api_key, max_tokens_default=max_tokens_default,
                                 **state_fields)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.state, "127.0.0.1", self.port)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                return self
            time.sleep(0.025)
        raise RuntimeError("the test server did not start within 10 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def wait_idle(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.busy and self.engine.waiting == 0:
                return True
            time.sleep(0.02)
        return False


def endless_pair(tokenizer) -> tuple:
    """(target, tokenizer, drafter): the tiny target (seed 0) with its end-of-sequence row zeroed, so
    greedy replies never stop on their own."""
    model = tiny_target("qwen3", seed=0)
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = mx.where(mx.arange(weight.shape[0])[:, None] == EOS_ID, 0.0, weight)
    mx.eval(model.parameters())
    return model, tokenizer, tiny_drafter(model, block_size=8)


def cancelled_by_the_server(live: LiveServer, route: str, body: dict) -> httpx.Response:
    """The whole response to `body`, a request the server cancels once it is decoding (`Engine.cancel_all`,
    what Ctrl-C and shutdown call)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", httpx.post(live.url + route, json=body, timeout=60)))
    thread.start()
    deadline = time.monotonic() + 30
    while not live.engine.busy:
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.01)
    live.engine.cancel_all()
    thread.join(60)
    return box["r"]
