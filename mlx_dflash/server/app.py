"""The Starlette application: routes, API-key check, and errors in each API's own shape.

Starlette (with uvicorn) is small, async and well kept; streaming responses cancel
their generator when the client goes away, which is how a dropped stream stops
its generation at the end of the running cycle.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_api, openai_api
from .errors import APIError
from .prompt_cache import describe
from .state import ServerState

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _anthropic_style(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def error_response(request: Request, error: APIError) -> JSONResponse:
    body = error.anthropic_body() if _anthropic_style(request) else error.openai_body()
    return JSONResponse(body, status_code=error.status)


async def read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def create_app(state: ServerState) -> Starlette:
    engine = state.engine

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
                             "waiting": engine.waiting, "prompt_cache": describe(engine.prompt_cache)})

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mlx-dflash"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        state.check_model(request.path_params["name"])
        return JSONResponse(model_card())

    async def openai_generate(request: Request, parse) -> Response:
        body = await read_body(request)
        generation, options = parse(state, body)
        job = state.run(generation)
        if options.stream:
            return StreamingResponse(openai_api.stream(state, generation, options, job),
                                     media_type="text/event-stream", headers=STREAM_HEADERS)
        steps, finished = await job.collect(request)
        return JSONResponse(openai_api.reply(state, generation, options, steps, finished))

    async def chat_completions(request: Request) -> Response:
        return await openai_generate(request, openai_api.chat_request)

    async def completions(request: Request) -> Response:
        return await openai_generate(request, openai_api.completion_request)

    async def messages(request: Request) -> Response:
        body = await read_body(request)
        generation, options = anthropic_api.messages_request(state, body)
        job = state.run(generation)
        if options.stream:
            return StreamingResponse(anthropic_api.stream(state, generation, options, job),
                                     media_type="text/event-stream", headers=STREAM_HEADERS)
        steps, finished = await job.collect(request)
        return JSONResponse(anthropic_api.reply(state, generation, options, steps, finished))

    async def count_tokens(request: Request) -> Response:
        body = await read_body(request)
        return JSONResponse({"input_tokens": len(anthropic_api.count_request(state, body))})

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
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint(model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/messages", endpoint(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(count_tokens), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
