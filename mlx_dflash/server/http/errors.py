"""The one error type request handling raises; each API renders it in its own shape."""

from __future__ import annotations

# Anthropic answers an overloaded service with 529 (both SDKs retry any status >= 500).
ANTHROPIC_OVERLOADED = 529
SERVER_CANCELLED = "server_shutting_down"  # the code of a reply the server cut short (`cancelled`)


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
        """OpenAI's error type: `server_error` for the server's own failures, else `invalid_request_error`.

        OpenAI tells client errors apart by status and `code` (invalid_api_key, model_not_found, ...), not by
        type; SDKs map the status to their exception classes.
        """
        return "server_error" if self.status >= 500 else "invalid_request_error"

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


def server_cancelled() -> APIError:
    """The error a request ends with when the server cancelled it (it is shutting down) before the reply was
    complete: a 503 (Anthropic's overloaded 529), which clients retry, so a cut reply never passes as whole.

    A client that hung up also leaves its request cancelled, but nobody reads that reply.
    """
    return APIError(503, "the server cancelled this request before its reply was complete (it is shutting "
                    "down); retry it", code=SERVER_CANCELLED)


def failure(finish_reason: str, error: str | None = None) -> APIError | None:
    """The error a reply ends with instead of its finish reason: a failed generation (500), or one the
    server cancelled (`server_cancelled`); None for a reply that ended as replies do."""
    if finish_reason == "error":
        return APIError(500, f"generation failed: {error}")
    if finish_reason == "cancelled":
        return server_cancelled()
    return None
