"""What a request must pass before a route reads it: its origin, its media type, its size, its nesting.

A browser lets any web page send a POST to 127.0.0.1; only the `Origin` header tells such a
request from a client's. So a request from another site's page is refused (403) unless the
server was told to allow that origin, and a body must be `application/json`, which no page
can send cross-site without a preflight this server answers for allowed origins only.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

import numpy as np
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

MAX_JSON_DEPTH = 64  # agents' bodies (tool schemas included) nest a dozen levels at most
DEFAULT_MAX_BODY_BYTES = 32 << 20  # agents send a few hundred KB
ALLOW_ALL = "*"
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENS = np.frombuffer(b"[{", dtype=np.uint8)


def anthropic_route(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_json(path: str, error: APIError) -> JSONResponse:
    """`error` in the shape (and, for overload, the status) of the API `path` belongs to."""
    if anthropic_route(path):
        return JSONResponse(error.anthropic_body(), status_code=error.anthropic_status, headers=error.headers)
    return JSONResponse(error.openai_body(), status_code=error.status, headers=error.headers)


# -- origins --------------------------------------------------------------------------------
def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _loopback(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OriginGuard:
    """ASGI middleware: refuses requests from origins other than the server's own, loopback
    pages' and the allowed ones (403), answers CORS preflights for allowed origins, and puts
    the CORS headers on their responses."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str] = ()):
        self.app = app
        self.allowed = {_normal_origin(o) for o in allowed}

    def allows(self, origin: str, scope: Scope, headers: Headers) -> bool:
        origin = _normal_origin(origin)
        if ALLOW_ALL in self.allowed or origin in self.allowed or _loopback(origin):
            return True
        host = headers.get("host")
        return host is not None and origin == f"{scope.get('scheme', 'http')}://{host}".lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None:  # not from a browser page (or a same-origin GET): nothing to check
            await self.app(scope, receive, send)
            return
        if not self.allows(origin, scope, headers):
            error = APIError(403, f"requests from origin '{origin[:200]}' are not allowed; start the server "
                             "with --allow-origin ORIGIN to allow a web page there to use it",
                             code="origin_not_allowed")
            await error_json(scope["path"], error)(scope, receive, send)
            return
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Expose-Headers": "Retry-After"}
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers")
            preflight = dict(cors, **{
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": asked or "authorization, content-type, x-api-key",
                "Access-Control-Max-Age": "600"})
            await Response(status_code=204, headers=preflight)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                for name, value in cors.items():
                    out[name] = value
            await send(message)

        await self.app(scope, receive, send_with_cors)


# -- bodies ---------------------------------------------------------------------------------
def _json_media_type(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def json_depth(raw: bytes) -> int:
    """How deeply `raw`'s arrays and objects nest, read without parsing (no recursion): brackets
    inside strings are dropped, the rest counted up and down."""
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    return int(np.cumsum(np.where(np.isin(brackets, _OPENS), 1, -1)).max())


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; anything else, too deep or not strict JSON, is a 400."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad encoding, NaN, a 5000-digit number
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The body of a POST: `application/json`, at most `max_bytes` (refused before it is all read)."""
    if not _json_media_type(request.headers.get("content-type")):
        raise APIError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                       code="unsupported_media_type")
    too_large = APIError(413, f"the request body is larger than this server takes ({max_bytes} bytes; "
                         "see --max-body-bytes)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))
