"""Users, roles and the auth switch of the real etcd client (:class:`~elastic.etcd.api.EtcdAuth` over gRPC).

A mixin of :class:`~elastic.etcd.client.GrpcEtcdClient`, apart so that the key/value client stays one concern;
like that module it uses ``python3-etcd3``'s stubs (``authstub``) and retries through the client's ``_call``.
A request retried after a lost answer meets its own effect ("already exists", "not found"): that is the answer
the first try would have had, so these calls are safe to retry.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from elastic.etcd.api import EtcdAuth, EtcdConnectionError, EtcdError, Permission, RolePermission, prefix_end

__all__ = ["GrpcAuthMixin"]

_PERM_TYPES: dict[Permission, int] = {"read": 0, "write": 1, "readwrite": 2}  # authpb.Permission.Type
_PERM_NAMES: dict[int, Permission] = {v: k for k, v in _PERM_TYPES.items()}


def _auth_refusal(exc: grpc.RpcError, phrase: str) -> bool:
    """etcd's answer to a user or role request is ``phrase`` ("already exists", "not found"): the state
    asked for holds already (etcd says so with FAILED_PRECONDITION and a message)."""
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and phrase in str(details)


class GrpcAuthMixin(EtcdAuth):
    """:class:`EtcdAuth` for a client that runs calls through ``_call`` (its retry loop)."""

    @abc.abstractmethod
    def _call(self, fn: Callable[[Any], Any], *, timeout: timedelta | None = None) -> Any:
        """Run ``fn(library_client)`` with retries until the operation's deadline."""

    def _auth_call(self, method: str, request: Any, unless: str | None = None) -> Any:
        """``AuthStub.<method>(request)``; None when etcd refuses it with ``unless`` in its message."""

        def op(c: Any) -> Any:
            try:
                return getattr(c.authstub, method)(
                    request, c.timeout, credentials=c.call_credentials, metadata=c.metadata
                )
            except grpc.RpcError as exc:
                if unless is not None and _auth_refusal(exc, unless):
                    return None
                raise

        return self._call(op)

    def user_add(self, name: str, password: str) -> bool:
        req = etcdrpc.AuthUserAddRequest(name=name, password=password)
        return self._auth_call("UserAdd", req, unless="already exists") is not None

    def user_change_password(self, name: str, password: str) -> None:
        self._auth_call("UserChangePassword", etcdrpc.AuthUserChangePasswordRequest(name=name, password=password))

    def user_delete(self, name: str) -> bool:
        return self._auth_call("UserDelete", etcdrpc.AuthUserDeleteRequest(name=name), unless="not found") is not None

    def user_list(self) -> list[str]:
        resp = self._auth_call("UserList", etcdrpc.AuthUserListRequest())
        return sorted(str(u) for u in resp.users)

    def user_grant_role(self, user: str, role: str) -> None:
        self._auth_call("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))

    def role_add(self, name: str) -> bool:
        return self._auth_call("RoleAdd", etcdrpc.AuthRoleAddRequest(name=name), unless="already exists") is not None

    def role_delete(self, name: str) -> bool:
        return self._auth_call("RoleDelete", etcdrpc.AuthRoleDeleteRequest(role=name), unless="not found") is not None

    def role_grant_permission(self, role: str, permission: RolePermission) -> None:
        if not permission.key:
            raise EtcdError("an empty key cannot be granted")
        perm = auth_pb2.Permission(permType=_PERM_TYPES[permission.perm], key=permission.key.encode())
        if permission.prefix:
            perm.range_end = prefix_end(permission.key)
        self._auth_call("RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm))

    def role_revoke_permission(self, role: str, key: str, prefix: bool = False) -> bool:
        request = etcdrpc.AuthRoleRevokePermissionRequest(
            role=role, key=key.encode(), range_end=prefix_end(key) if prefix else b""
        )
        try:
            self._auth_call("RoleRevokePermission", request)
        except EtcdConnectionError:
            raise
        except EtcdError as exc:
            if "permission is not granted" in str(exc):
                return False
            raise
        return True

    def role_permissions(self, role: str) -> list[RolePermission]:
        resp = self._auth_call("RoleGet", etcdrpc.AuthRoleGetRequest(role=role))
        out: list[RolePermission] = []
        for p in resp.perm:
            key = bytes(p.key).decode(errors="replace")
            end = bytes(p.range_end)
            if end and end != prefix_end(key):
                continue  # a range that is neither one key nor a prefix
            out.append(RolePermission(key=key, perm=_PERM_NAMES[int(p.permType)], prefix=bool(end)))
        return sorted(out, key=lambda r: (r.key, r.prefix))

    def auth_enable(self) -> None:
        """Turn etcd's authentication on (etcd needs a ``root`` user holding the ``root`` role first; it
        refuses otherwise). Enabling it again is not an error."""
        self._auth_call("AuthEnable", etcdrpc.AuthEnableRequest())
