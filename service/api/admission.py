"""What a request must pass before its body is read: a size limit and, for the versioned API, a valid token.

Without this, FastAPI reads and parses the whole body before the route's authentication dependency runs:
an unauthenticated caller could make the controller parse tens of MiB, and malformed JSON got 422 instead
of 401. Here (a plain ASGI middleware, no body buffering):

- a body over ``max_body_bytes`` gets 413, from ``Content-Length`` before a byte is read (one that is not 1 to 20
  ASCII digits counts as over), or as soon as a streamed body passes the limit;
- a request under ``/v1/`` without a token that authenticates gets 401 before its body is read. Which role a
  route needs stays with the route (:func:`service.api.auth.require`): a read token on an admin route gets
  its 403 there;
- with authentication off on a loopback address (``loopback_only``: every caller is admin, and the only
  protection is that nothing but the machine itself reaches the port), a web page in the user's browser must
  not act for it either: a request whose ``Host`` is not a loopback name (a DNS-rebinding page: its own name
  resolving to 127.0.0.1) gets 403, and a state-changing request (not GET, HEAD or OPTIONS) without
  ``Content-Type: application/json`` (a cross-site form post, or a body-less ``fetch``: a browser sends a JSON
  request to another site only after a CORS preflight, which this API never grants) gets 415.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import authenticate, bearer_token
from service.core.config import TokenEntry

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Admission", "is_loopback_host"]

# etcd refuses requests over 1.5 MiB; a spec is written once per node assignment, so 1 MiB is already generous
DEFAULT_MAX_BODY_BYTES = 1 << 20


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# a Content-Length the limit is checked on: ASCII digits only (str.isdigit also takes '²', which int() refuses), and
# few of them (int() refuses more than 4300 digits; h11 allows 20)
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a host name or address, with or without a port; ``[::1]`` bracketed) names loopback."""
    if host.startswith("["):
        name = host[1 : host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Admission:
    def __init__(
        self, app: ASGIApp, tokens: Sequence[TokenEntry] | None, max_body_bytes: int, loopback_only: bool = False
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.loopback_only:
            refusal = _browser_refusal(scope["method"], headers)
            if refusal is not None:
                await _reply(send, *refusal)
                return
        if scope["path"].startswith("/v1/"):
            presented = bearer_token(headers.get("authorization"))
            if authenticate(self.tokens, presented) is None:
                detail = "missing or invalid bearer token" if presented else "missing bearer token"
                await _reply(send, 401, detail, [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get("content-length")
        if length is not None and (not _CONTENT_LENGTH.fullmatch(length) or int(length) > self.max_body_bytes):
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


def _browser_refusal(method: str, headers: dict[str, str]) -> tuple[int, str] | None:
    """With authentication off on loopback: why a request may come from a web page rather than the user."""
    host = headers.get("host", "")
    if not is_loopback_host(host):
        return 403, (
            f"Host {host[:100]!r} refused: with authentication off the API answers only requests addressed "
            "to a loopback name (127.0.0.1, ::1, localhost)"
        )
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if method not in _SAFE_METHODS and media != "application/json":
        return 415, (
            f"{method} needs Content-Type: application/json with authentication off (a web page cannot "
            "send that to another site unasked; forms and bodiless requests it can)"
        )
    return None


async def _reply(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
