"""The one error type request handling raises; each API renders it in its own shape."""

from __future__ import annotations

# Anthropic answers an overloaded service with 529 (both SDKs retry any status >= 500).
ANTHROPIC_OVERLOADED = 529


class APIError(Exception):
    """A request the server refuses: HTTP status, message and the offending field.

    `anthropic_message` replaces the message on Anthropic routes where that API words the
    same error its own way (clients such as Claude Code act on its exact text); `headers`
    go on the response (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 *, anthropic_message: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.anthropic_message = anthropic_message
        self.headers = headers or {}

    @property
    def openai_type(self) -> str:
        return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                503: "server_error", 500: "server_error"}.get(self.status, "invalid_request_error")

    @property
    def anthropic_type(self) -> str:
        return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 503: "overloaded_error", 500: "api_error"}.get(self.status,
                                                                                          "invalid_request_error")

    @property
    def anthropic_status(self) -> int:
        return ANTHROPIC_OVERLOADED if self.status == 503 else self.status

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.openai_type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": self.anthropic_type,
                                           "message": self.anthropic_message or self.message}}
