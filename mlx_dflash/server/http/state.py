"""What every route shares: the engine, the served model's name and defaults, prompt rendering."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..worker.engine import Engine, QueueFull
from ..worker.jobs import Finished, GenerationRequest, Job, Step
from .errors import APIError
from .guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from .sse import KEEPALIVE_SECONDS

logger = logging.getLogger("mlx_dflash")
RETRY_AFTER_SECONDS = 5  # a full queue drains in requests' time: a retry sooner would find it full again


@dataclass
class ServerState:
    engine: Engine
    model_id: str
    api_key: str | None = None
    max_tokens_default: int = 512
    temperature_default: float = 0.0
    aliases: set[str] = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))
    strict_model_name: bool = False  # False: any model name is served (by this model); True: others 404
    max_tokens_cap: int | None = None  # replies longer than this are cut to it (None: the context window)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allow_origins: list[str] = field(default_factory=list)  # web page origins allowed besides loopback ("*": all)
    allow_hosts: list[str] = field(default_factory=list)  # Host names answered besides loopback ones ("*": all)
    # The address listened on (make_server sets it): a loopback one answers loopback Host names only;
    # None (an app not served on a socket, as in tests): Host names are checked only against allow_hosts.
    bind_host: str | None = None
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds a request's whole body may take to arrive (then 408)
    keepalive_seconds: float = KEEPALIVE_SECONDS  # a quiet stream gets an SSE comment this often
    _renders_tools: bool | None = field(default=None, init=False, repr=False)  # known after the first tools request

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, name: str) -> None:
        """Any name is this model's unless --strict-model-name (replies name the served id either way)."""
        if self.strict_model_name and name != self.model_id and name not in self.aliases:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def render(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> list[int]:
        """Prompt ids of a conversation; `options` go to the template (e.g. Qwen3's enable_thinking)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                     **(options or {}))
        except Exception as e:  # a template rejecting the conversation (roles, order) is the request's fault
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        if tools and self._renders_tools is None:
            try:
                without = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(options or {}))
            except Exception:  # noqa: BLE001 - a template that needs its tools: it renders them
                without = None
            self._renders_tools = ids != without
            if not self._renders_tools:  # agents send tools to any model: say once why it never calls them
                logger.warning("this model's chat template does not render tools: requests' tool definitions "
                               "are not shown to the model, so it cannot call them")
        return list(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def budget(self, prompt: list[int], max_tokens: int | None, param: str = "messages") -> int:
        """The tokens a reply may have: as asked (or the default), within the context window."""
        if not prompt:
            raise APIError(400, "the prompt is empty", param=param)
        limit = self.engine.max_context
        if limit is not None and len(prompt) >= limit:
            # Anthropic's wording is the one Claude Code reads (and compacts on); a reply needs a position,
            # so the longest prompt is one short of the context.
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                           f"{len(prompt)} tokens", param=param, code="context_length_exceeded",
                           anthropic_message=f"prompt is too long: {len(prompt)} tokens > {limit - 1} maximum")
        wanted = self._wanted(max_tokens)
        return wanted if limit is None else min(wanted, limit - len(prompt))

    def _wanted(self, max_tokens: int | None) -> int:
        wanted = max_tokens if max_tokens is not None else self.max_tokens_default
        if self.max_tokens_cap is not None:
            wanted = min(wanted, self.max_tokens_cap)  # agents ask for 32000 and mean "as long as it takes"
        return wanted

    def context_bound(self, prompt: list[int], max_tokens: int | None) -> bool:
        """Whether the context window, not max_tokens (or the cap), bounds this reply: a reply cut there
        ran out of context (Anthropic's `model_context_window_exceeded`), not out of its own budget."""
        limit = self.engine.max_context
        return limit is not None and limit - len(prompt) < self._wanted(max_tokens)

    def run(self, request: GenerationRequest) -> JobStream:
        try:
            return JobStream(self.engine, request)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS), "x-should-retry": "true"}) from None


class JobStream:
    """A submitted job's `Step`s and its `Finished`, as an async iterator; closing it cancels the job."""

    def __init__(self, engine: Engine, request: GenerationRequest):
        loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[Step | Finished] = asyncio.Queue()

        def emit(item: Step | Finished) -> None:
            try:
                loop.call_soon_threadsafe(self.items.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody listens
                self.job.cancelled.set()

        self.job: Job = engine.submit(request, emit)

    def cancel(self) -> None:
        self.job.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Step | Finished]:
        try:
            while True:
                item = await self.items.get()
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            self.job.cancelled.set()

    async def collect(self, request: Any) -> tuple[list[Step], Finished]:
        """Every item (non-streaming replies), cancelling the job if the client goes away."""

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)
            self.cancel()

        watcher = asyncio.create_task(watch())
        steps: list[Step] = []
        try:
            async for item in self:
                if isinstance(item, Finished):
                    return steps, item
                steps.append(item)
        finally:
            watcher.cancel()
        raise APIError(500, "generation ended without a result")


def usage_numbers(request: GenerationRequest, finished: Finished) -> tuple[int, int, int]:
    """Prompt tokens, generated tokens, and prompt tokens taken from the prompt cache."""
    return len(request.prompt), finished.stats.num_tokens, finished.cached_tokens


def dflash_extension(state: ServerState, finished: Finished) -> dict:
    """How DFlash decoded this reply; ordinary clients ignore the extra field."""
    stats = finished.stats
    return {
        "drafter": state.engine.drafter is not None,
        "prompt_lookup": state.engine.config.prompt_lookup,
        "block_size": state.engine.block_size,
        "tree_cycles": sum(1 for n in stats.tree_sizes if n),  # cycles verified as draft trees (`--tree-budget`)
        "tau": round(stats.tau, 4),
        "cycles": stats.cycles,
        "plain_cycles": stats.plain_cycles,
        "acceptance_histogram": stats.histogram,
        "accepted_by_source": stats.accepted_by_source,
        "proposed_by_source": stats.proposed_by_source,
        "cached_prompt_tokens": finished.cached_tokens,
        "prefill_seconds": round(stats.prefill_time, 4),
        "decode_seconds": round(stats.decode_time, 4),
    }
