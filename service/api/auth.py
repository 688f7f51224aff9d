"""Bearer-token authentication for the API, and who may act on which job.

Roles (:class:`service.core.config.Role`): ``read`` tokens see status (GET endpoints, without env values, args,
log tails or logs); ``user`` tokens also submit jobs, and resize, cancel and read the logs of their own jobs (a
job's owner is the name of the token that submitted it); ``admin`` tokens do everything. Without a tokens file,
authentication is off (every caller is an anonymous admin) and the controller logs a warning at start. A missing
or unknown token gets 401 with ``WWW-Authenticate: Bearer``; a token below an endpoint's role, or a user's token
on another user's job, gets 403. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.core.config import Role, TokenEntry

__all__ = [
    "Principal",
    "authenticate",
    "bearer_token",
    "check_owner",
    "owns",
    "require",
    "require_admin",
    "require_read",
    "require_user",
]

_bearer = HTTPBearer(auto_error=False, description="a token from the controller's --tokens-file")


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


_ANONYMOUS = Principal("anonymous", Role.ADMIN)
_RANK = {Role.READ: 0, Role.USER: 1, Role.ADMIN: 2}


def owns(principal: Principal, owner: str | None) -> bool:
    """Whether ``principal`` may act on (and see everything of) a job submitted by ``owner`` (pure): an admin
    on any job, a user on its own."""
    return principal.role == Role.ADMIN or (principal.role == Role.USER and owner == principal.name)


def check_owner(principal: Principal, job_id: str, owner: str | None, action: str) -> None:
    """403 unless ``principal`` :func:`owns` the job."""
    if not owns(principal, owner):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail=f"token {principal.name!r} (role {principal.role.value}) may not {action} job {job_id}: it belongs "
            f"to {owner or 'no user'}, and only its owner or an admin token may",
        )


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
    """A FastAPI dependency admitting callers with ``role`` or above (read < user < admin)."""

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
        if _RANK[principal.role] < _RANK[role]:
            what = "is read-only" if principal.role == Role.READ else f"has role {principal.role.value}"
            article = "an" if role == Role.ADMIN else "a"
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                detail=f"token {principal.name!r} {what}: this needs {article} {role.value} token",
            )
        return principal

    return dependency


require_read = require(Role.READ)
require_user = require(Role.USER)
require_admin = require(Role.ADMIN)
