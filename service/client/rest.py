"""A small HTTP client of the controller's REST API (used by the CLI and the demo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

__all__ = ["ApiClient", "ApiError", "load_job_file"]


class ApiError(Exception):
    """The API answered with an error (``status`` is the HTTP status, 0 when unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def load_job_file(path: str | Path) -> dict[str, Any]:
    """A job spec from a YAML or JSON file (JSON is YAML); the server validates it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ApiError(0, f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ApiError(0, f"{path}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise ApiError(0, f"{path}: a job file must be a mapping of spec fields")
    return data


class ApiClient:
    def __init__(self, server: str, token: str | None = None, timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout)
        self.server = server

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        if method != "GET" and kwargs.get("json") is None:
            # (a controller without tokens on loopback refuses state-changing requests of any other type)
            kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Type": "application/json"}
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the controller at {self.server}: {exc}") from exc
        if resp.status_code >= 400:
            raise _error(resp)
        return resp.json()

    def ready(self) -> bool:
        """True when the controller answers /readyz with 200 (etcd reachable, leader known)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/jobs", json=spec)
        return result

    def jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every job (following the pages), oldest first."""
        out: list[dict[str, Any]] = []
        params: dict[str, str] = {"state": state} if state else {}
        while True:
            page = self._call("GET", "/v1/jobs", params=params)
            out += page["jobs"]
            if not page.get("next"):
                return out
            params["after"] = page["next"]

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}")
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/jobs/{job_id}/cancel")
        return result

    def events(self, job_id: str, after: str | None = None) -> list[dict[str, Any]]:
        params = {"after": after} if after else None
        result: list[dict[str, Any]] = self._call("GET", f"/v1/jobs/{job_id}/events", params=params)["events"]
        return result

    def metrics(self, job_id: str, since: float | None = None, max_points: int | None = None) -> dict[str, Any]:
        """The job's metric series from its start (``GET /v1/jobs/{id}/metrics``)."""
        params: dict[str, Any] = {}
        if since is not None:
            params["since"] = since
        if max_points is not None:
            params["max_points"] = max_points
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}/metrics", params=params or None)
        return result

    def trace(self, job_id: str) -> dict[str, Any]:
        """The job's history as Chrome trace JSON (``GET /v1/jobs/{id}/trace``)."""
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}/trace")
        return result

    def logs(
        self, job_id: str, *, node: str | None = None, generation: int | None = None, follow: bool = False
    ) -> Iterator[bytes]:
        """The job's logs (``GET /v1/jobs/{id}/logs``) as they arrive; with ``follow`` until the torchruns end
        (no read timeout then: a quiet job may print nothing for long)."""
        params: dict[str, Any] = {"follow": "true"} if follow else {}
        if node is not None:
            params["node"] = node
        if generation is not None:
            params["generation"] = generation
        timeout = httpx.Timeout(None if follow else self._http.timeout.read, connect=self._http.timeout.connect)
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error(resp)
                yield from resp.iter_raw()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ApiError(0, f"cannot reach the controller at {self.server}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise ApiError(0, f"the log stream from the controller at {self.server} broke: {exc}") from exc

    def nodes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/nodes")["nodes"]
        return result

    def node_op(self, name: str, action: str, reason: str | None = None) -> dict[str, Any]:
        """``POST /v1/nodes/{name}/{action}`` (cordon, drain, uncordon): the node after it, with a ``message``."""
        body = {"reason": reason} if reason else None
        result: dict[str, Any] = self._call("POST", f"/v1/nodes/{quote(name, safe='')}/{action}", json=body)
        return result

    def resize(self, job_id: str, min_nodes: int | None = None, max_nodes: int | None = None) -> dict[str, Any]:
        """``PATCH /v1/jobs/{id}``: the job with its new bounds."""
        body = {k: v for k, v in (("min_nodes", min_nodes), ("max_nodes", max_nodes)) if v is not None}
        result: dict[str, Any] = self._call("PATCH", f"/v1/jobs/{job_id}", json=body)
        return result


def _error(resp: httpx.Response) -> ApiError:
    """The API's error answer as an :class:`ApiError` (its ``message`` or ``detail``)."""
    try:
        body = resp.json()
        message = body.get("message") or body.get("detail") or resp.text
    except ValueError:
        message = resp.text
    return ApiError(resp.status_code, f"HTTP {resp.status_code}: {message}")
