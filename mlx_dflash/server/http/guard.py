"""What a request must pass before a route reads it: the name it was sent to, its origin, its media
type, its size, the time its body takes, its nesting.

A browser lets any web page send a POST to 127.0.0.1; only the `Origin` header tells such a
request from a client's. So a request from another site's page is refused (403) unless the
server was told to allow that origin, and a body must be `application/json`, which no page
can send cross-site without a preflight this server answers for allowed origins only.
A page can also point its own name at 127.0.0.1 (DNS rebinding): the browser then deems the
page's requests same-origin, but they name that foreign host in `Host`. So a server bound to a
loopback address answers loopback names only, and those allowed with --allow-host.

Every check is linear in the request's size and the JSON parse runs off the event loop, so no
body stalls the other requests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

MAX_JSON_DEPTH = 64  # agents' bodies (tool schemas included) nest a dozen levels at most
DEFAULT_MAX_BODY_BYTES = 32 << 20  # agents send a few hundred KB
DEFAULT_BODY_TIMEOUT = 60.0  # seconds for a whole body: a few MB on a slow link, not a held connection
ALLOW_ALL = "*"
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEPS = np.zeros(256, dtype=np.int8)  # a byte's change to the nesting depth
_STEPS[list(b"[{")] = 1
_STEPS[list(b"]}")] = -1
_SCAN_BLOCK = 1 << 20  # bytes scanned at a time: the scan's memory is bounded by a block's, whatever the body
_NOT_IN_HOST = frozenset("@/\\?# \t")


def anthropic_route(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_json(path: str, error: APIError) -> JSONResponse:
    """`error` in the shape (and, for overload, the status) of the API `path` belongs to."""
    if anthropic_route(path):
        return JSONResponse(error.anthropic_body(), status_code=error.anthropic_status, headers=error.headers)
    return JSONResponse(error.openai_body(), status_code=error.status, headers=error.headers)


# -- hosts and origins ------------------------------------------------------------------------
def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def host_name(authority: str) -> str | None:
    """The host of a `Host` header (or an origin's authority): lowercased, without port, brackets or
    a final dot; None when it is not a plain `host[:port]`."""
    if not authority or not _NOT_IN_HOST.isdisjoint(authority):
        return None
    try:
        parts = urlsplit("//" + authority)
        name, _ = parts.hostname, parts.port  # `port` refuses a port that is not a number
    except ValueError:
        return None
    name = (name or "").rstrip(".")
    return name or None


def loopback_name(name: str) -> bool:
    """Whether `name` (a host name or address, as `host_name` gives it) can only mean this machine."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


class OriginGuard:
    """ASGI middleware, before any route: refuses a request for a host name this server does not
    answer (403, against DNS rebinding), and one from a web page of an origin not allowed (403);
    answers CORS preflights for allowed origins and puts the CORS headers on their responses.

    `loopback`: the server is bound to a loopback address, so only loopback names and `hosts` are
    answered; otherwise any name is, unless `hosts` names some. `hosts` may be '*' (any name).
    An origin is allowed when loopback, listed in `allowed` (or `allowed` has '*'), or on a host
    named in `hosts`: a page on a name the server answers to is its own site.
    """

    def __init__(self, app: ASGIApp, allowed: Iterable[str] = (), hosts: Iterable[str] = (), loopback: bool = False):
        self.app = app
        self.allowed = {_normal_origin(o) for o in allowed}
        hosts = [h.strip().lower() for h in hosts]
        self.hosts = {host_name(h) for h in hosts if h != ALLOW_ALL} - {None}  # a port given is not checked
        self.check_host = ALLOW_ALL not in hosts and (loopback or bool(self.hosts))

    def _served(self, name: str | None) -> bool:
        return name is not None and (loopback_name(name) or name in self.hosts)

    def allows_host(self, host: str | None) -> bool:
        """Whether a request with this `Host` header (None: none, as HTTP/1.0 may send) is served."""
        return not self.check_host or host is None or self._served(host_name(host.strip().lower()))

    def allows(self, origin: str) -> bool:
        origin = _normal_origin(origin)
        if ALLOW_ALL in self.allowed or origin in self.allowed:
            return True
        try:
            authority = urlsplit(origin).netloc
        except ValueError:
            return False
        return self._served(host_name(authority))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.allows_host(host):
            error = APIError(403, f"requests for host '{(host or '')[:200]}' are not allowed: a server bound to a "
                             "loopback address answers loopback names only; start it with --allow-host NAME to "
                             "answer that name too", code="host_not_allowed")
            await error_json(scope["path"], error)(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:  # not from a browser page (or a same-origin GET): nothing to check
            await self.app(scope, receive, send)
            return
        if not self.allows(origin):
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


def _as_utf8(raw: bytes) -> bytes:
    """`raw` in UTF-8, as `json.loads` reads it: UTF-16 and UTF-32 bodies hold quote and bracket bytes
    inside other characters, so they are scanned re-encoded (b"" when they cannot be decoded: then
    `json.loads` refuses them before parsing anything)."""
    encoding = json.detect_encoding(raw)
    if encoding in ("utf-8", "utf-8-sig"):  # UTF-8 multi-byte characters hold no ASCII bytes
        return raw
    try:
        return raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError:
        return b""


def _string_quotes(block: np.ndarray, odd_run: bool) -> tuple[np.ndarray, bool]:
    """Where `block`'s unescaped quotes are, and whether it ends in an odd run of backslashes. A quote
    is escaped by an odd run of backslashes before it; `odd_run`: the block follows one."""
    index = np.arange(block.size, dtype=np.int32)
    last_other = np.maximum.accumulate(np.where(block == _BACKSLASH, -1, index))  # the last non-backslash so far
    quotes = np.flatnonzero(block == _QUOTE)
    before = np.maximum(quotes - 1, 0)
    run = np.where(quotes > 0, before - last_other[before], 0)  # the backslashes right before each quote
    from_start = (quotes == 0) | (last_other[before] < 0)  # that run began in an earlier block
    escaped = (run % 2 == 1) ^ (from_start & odd_run)
    tail = block.size - 1 - int(last_other[-1])  # the backslashes ending the block
    return quotes[~escaped], (tail % 2 == 1) ^ (odd_run and tail == block.size)


def json_depth(raw: bytes) -> int:
    """How deeply `raw`'s arrays and objects nest, read without parsing (no recursion), in time linear
    in its size: brackets inside strings are dropped, the rest counted up and down.

    The unescaped quotes delimit the strings. On valid JSON this is the exact depth; on invalid JSON
    it can differ only after the first error, where the parser stops, so it never counts less than the
    parser would reach. Scanned a block at a time with numpy, carrying the string, the backslash run
    and the depth from one block to the next."""
    data = np.frombuffer(_as_utf8(raw), dtype=np.uint8)
    in_string, odd_run, depth, deepest = 0, False, 0, 0
    for lo in range(0, data.size, _SCAN_BLOCK):
        block = data[lo : lo + _SCAN_BLOCK]
        quotes, odd_run_after = _string_quotes(block, odd_run)
        toggles = np.zeros(block.size, dtype=np.uint8)
        toggles[quotes] = 1
        inside = np.bitwise_xor.accumulate(toggles) ^ in_string  # 1 from an opening quote to its closing one
        steps = _STEPS[block]
        steps = steps[(steps != 0) & (inside == 0)]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int64) + depth
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        in_string, odd_run = int(inside[-1]), odd_run_after
    return deepest


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


async def _read_all(request: Request, max_bytes: int) -> bytes:
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
    return b"".join(chunks)


async def read_json_body(request: Request, max_bytes: int, timeout: float = DEFAULT_BODY_TIMEOUT) -> dict:
    """The body of a POST: `application/json`, at most `max_bytes` (refused before it is all read), all
    of it within `timeout` seconds (else 408: a client sending slowly cannot hold a connection), parsed
    in a worker thread so the event loop keeps serving the other requests."""
    if not _json_media_type(request.headers.get("content-type")):
        raise APIError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                       code="unsupported_media_type")
    try:
        raw = await asyncio.wait_for(_read_all(request, max_bytes), timeout)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds (see --body-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return await run_in_threadpool(parse_json_object, raw)
