"""What a request must pass before its body is read: a size limit and, for the versioned API, a valid token.

Without this, FastAPI reads and parses the whole body before the route's authentication dependency runs:
an unauthenticated caller could make the controller parse tens of MiB, and malformed JSON got 422 instead
of 401. Here (a plain ASGI middleware, no body buffering):

- a body over ``max_body_bytes`` gets 413, from ``Content-Length`` before a byte is read, or as soon as a
  streamed body passes the limit;
- a request under ``/v1/`` without a token that authenticates gets 401 before its body is read. Which role a
  route needs stays with the route (:func:`service.api.auth.require`): a read token on an admin route gets
  its 403 there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import authenticate, bearer_token
from service.core.config import TokenEntry

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Admission"]

# etcd refuses requests over 1.5 MiB; a spec is written once per node assignment, so 1 MiB is already generous
DEFAULT_MAX_BODY_BYTES = 1 << 20


class Admission:
    def __init__(self, app: ASGIApp, tokens: Sequence[TokenEntry] | None, max_body_bytes: int) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope["path"].startswith("/v1/"):
            presented = bearer_token(headers.get("authorization"))
            if authenticate(self.tokens, presented) is None:
                detail = "missing or invalid bearer token" if presented else "missing bearer token"
                await _reply(send, 401, detail, [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _reply(send, 413, self._too_large())
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a streamed body (no Content-Length) past the limit
                    raise HTTPException(413, self._too_large())  # FastAPI passes HTTPExceptions through
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes"


async def _reply(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
