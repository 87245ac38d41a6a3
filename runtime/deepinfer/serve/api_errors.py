"""The error a handler raises (APIError) and the two JSON shapes it is answered in: OpenAI's
{"error": {"message", "type", "param", "code"}} everywhere, Anthropic's {"type": "error", "error":
{"type", "message"}} under /v1/messages, whose clients read only that one."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic names an error by its kind, not by a code: the kind for each status we answer
_ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers


def openai_error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None, path: str = "") -> JSONResponse:
    """The error in the shape the route's clients read (Anthropic's under /v1/messages)."""
    if is_anthropic(path):
        if status == 503:
            status = 529        # Anthropic's "overloaded": its clients back off and retry on it
        body = anthropic_error_body(status, message)
    else:
        body = openai_error_body(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)
