"""A small HTTP client of the controller's REST API (used by the CLI and the demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the controller at {self.server}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                body = resp.json()
                message = body.get("message") or body.get("detail") or resp.text
            except ValueError:
                message = resp.text
            raise ApiError(resp.status_code, f"HTTP {resp.status_code}: {message}")
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

    def trace(self, job_id: str) -> dict[str, Any]:
        """The job's history as Chrome trace JSON (``GET /v1/jobs/{id}/trace``)."""
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}/trace")
        return result

    def nodes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/nodes")["nodes"]
        return result
