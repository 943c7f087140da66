"""The Starlette application: routes, API-key check, and errors in each API's own shape.

What a request must pass first (its Host, origin, size, media type, the time its body takes,
its nesting) is `guard`'s; every streamed reply goes out with SSE keep-alives
(`http.sse.with_keepalive`).

Starlette (with uvicorn) is small, async and well kept; streaming responses cancel
their generator when the client goes away, which is how a dropped stream stops
its generation at the end of the running cycle. Parsing a body, rendering its prompt and
tokenizing it run in worker threads: a large prompt never holds up the other requests.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .apis import anthropic_api, openai_api, responses_api
from .http.errors import APIError
from .http.guard import OriginGuard, error_json, loopback_name, read_json_body
from .http.sse import with_keepalive
from .http.state import JobStream, ServerState
from .worker.prompt_cache import describe

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nobody reads it: the status access logs give a request whose client left


def error_response(request: Request, error: APIError) -> JSONResponse:
    return error_json(request.url.path, error)


class JobEventStream(StreamingResponse):
    """A streamed reply that cancels its job however the response ends. A client gone before the
    first event can end the response before its generator ever starts, and then the generator's
    own clean-up (which cancels the job) never runs."""

    def __init__(self, events: AsyncIterator[str], job: JobStream, **kwargs: Any):
        super().__init__(events, **kwargs)
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a job that finished already ignores it


def create_app(state: ServerState) -> Starlette:
    engine = state.engine

    async def read_body(request: Request) -> dict:
        """The request's JSON object, within the server's body limits (`guard`)."""
        return await read_json_body(request, state.max_body_bytes, state.body_timeout)

    def event_stream(events: AsyncIterator[str], job: JobStream) -> StreamingResponse:
        """Every streamed reply: SSE, with keep-alive comments while nothing comes (a long prefill)."""
        return JobEventStream(with_keepalive(events, state.keepalive_seconds), job, media_type="text/event-stream",
                              headers=STREAM_HEADERS)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")

    def endpoint(handler: Callable[[Request], Awaitable[Response]], auth: bool = True):
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    authorize(request)
                return await handler(request)
            except APIError as e:
                return error_response(request, e)

        return wrapped

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": state.model_id, "busy": engine.busy,
                             "waiting": engine.waiting, "prompt_cache": describe(engine.prompt_cache),
                             "batch": engine.batching, "prefill": engine.prefilling})

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mlx-dflash"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        state.check_model(request.path_params["name"])
        return JSONResponse(model_card())

    async def generate(request: Request, api, parse) -> Response:
        """A generation route: the body read by `parse`, the reply streamed or sent whole by `api` (the
        OpenAI, Anthropic or Responses module: `stream` and `reply`)."""
        body = await read_body(request)
        generation, options = await run_in_threadpool(parse, state, body)  # the template and the tokenizer
        if await request.is_disconnected():  # gone while its prompt was read or rendered: nothing to run
            return Response(status_code=CLIENT_CLOSED)
        job = state.run(generation)
        if options.stream:
            return event_stream(api.stream(state, generation, options, job), job)
        steps, finished = await job.collect(request)
        return JSONResponse(api.reply(state, generation, options, steps, finished))

    async def chat_completions(request: Request) -> Response:
        return await generate(request, openai_api, openai_api.chat_request)

    async def completions(request: Request) -> Response:
        return await generate(request, openai_api, openai_api.completion_request)

    async def messages(request: Request) -> Response:
        return await generate(request, anthropic_api, anthropic_api.messages_request)

    async def responses(request: Request) -> Response:
        return await generate(request, responses_api, responses_api.responses_request)

    async def count_tokens(request: Request) -> Response:
        body = await read_body(request)
        return JSONResponse({"input_tokens": len(await run_in_threadpool(anthropic_api.count_request, state, body))})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return error_response(request, APIError(exc.status_code, f"{message}: {request.method} {request.url.path}"))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    routes = [
        # Clients probe the base URL before their first request (Claude Code sends HEAD /).
        Route("/", endpoint(health, auth=False), methods=["GET", "HEAD"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint(model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/messages", endpoint(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(count_tokens), methods=["POST"]),
        Route("/v1/responses", endpoint(responses), methods=["POST"]),
    ]
    guard = Middleware(OriginGuard, allowed=state.allow_origins, hosts=state.allow_hosts,
                       loopback=state.bind_host is not None and loopback_name(state.bind_host.lower()))
    return Starlette(routes=routes, lifespan=lifespan, middleware=[guard],
                     exception_handlers={HTTPException: http_error, Exception: server_error})
