"""Bearer-token authentication for the API: ``read`` tokens may call GET endpoints, ``admin`` tokens all.

Without a tokens file, authentication is off (every caller is an anonymous admin) and the controller
logs a warning at start. A missing or unknown token gets 401 with ``WWW-Authenticate: Bearer``; a read
token on an admin endpoint gets 403. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.core.config import Role, TokenEntry

__all__ = ["Principal", "authenticate", "bearer_token", "require"]

_bearer = HTTPBearer(auto_error=False, description="a token from the controller's --tokens-file")


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


_ANONYMOUS = Principal("anonymous", Role.ADMIN)


def authenticate(tokens: Sequence[TokenEntry] | None, presented: str | None) -> Principal | None:
    """The principal a presented token belongs to; None if it matches none (pure)."""
    if tokens is None:
        return _ANONYMOUS
    if not presented:
        return None
    found: Principal | None = None
    for entry in tokens:  # compare with every entry: the time taken does not depend on which matched
        if hmac.compare_digest(entry.token.encode(), presented.encode()):
            found = Principal(entry.name, entry.role)
    return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme case-insensitive), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    """A FastAPI dependency admitting callers with ``role`` (admin satisfies read)."""

    async def dependency(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> Principal:
        tokens: Sequence[TokenEntry] | None = request.app.state.settings.tokens
        presented = bearer_token(request.headers.get("authorization"))  # (``credentials``: for the docs)
        principal = authenticate(tokens, presented)
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="missing or invalid bearer token" if presented else "missing bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if role == Role.ADMIN and principal.role != Role.ADMIN:
            raise HTTPException(status.HTTP_403_FORBIDDEN, detail=f"token {principal.name!r} is read-only")
        return principal

    return dependency


require_read = require(Role.READ)
require_admin = require(Role.ADMIN)
