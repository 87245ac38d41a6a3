"""ASGI middleware: a request body over a limit is refused with 413 before it is read whole."""
from __future__ import annotations

import json

from .api_errors import anthropic_error_body, is_anthropic, openai_error_body


class BodyLimit:
    """A body over `limit` bytes is a 413 (by Content-Length, or while a chunked body streams in)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await _send_413(send, self.limit, path)
        # read the body here (it is bounded), then replay it to the app
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return      # the client left before sending its body
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _send_413(send, self.limit, path)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_413(send, limit: int, path: str):
    message = f"request body larger than {limit} bytes"
    err = (anthropic_error_body(413, message) if is_anthropic(path)
           else openai_error_body(message, code="request_too_large"))
    body = json.dumps(err).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
