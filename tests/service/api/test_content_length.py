"""The admission middleware's ``Content-Length`` check, on the real app (a real etcd behind it): a length that is not a
plain number of ASCII digits (``'²'``, which ``str.isdigit`` accepts and ``int`` refuses; more digits than ``int``
parses) gets 413 like any length over the limit, never a 500. uvicorn's h11 refuses such a header itself, and the test
client re-encodes header values as UTF-8; another ASGI server may pass the raw bytes on, so the app is called here as
an ASGI server calls it, with the header's bytes as they came."""

from __future__ import annotations

import asyncio
import json

import pytest

from elastic.etcd import EtcdClient
from service.api.admission import DEFAULT_MAX_BODY_BYTES
from service.api.app import create_app
from service.core.config import Settings
from tests.service.conftest import ADMIN

pytestmark = pytest.mark.timeout(60)

# ASGI headers are bytes, which the middleware reads as latin-1: b"\xb2" is '²', b"\xb9" is '¹'
LENGTHS = {
    "superscript-two": b"\xb2",
    "superscript-digits": b"\xb9\xb2",
    "5000-digits": b"1" * 5000,
    "plus": b"+5",
    "space": b" 5",
    "empty": b"",
}


def _post(settings: Settings, etcd: EtcdClient, length: bytes) -> tuple[int, bytes]:
    """POST /v1/jobs with this Content-Length through the app: the answer's status and body (500 if it raised)."""
    app = create_app(settings, etcd)  # (its lifespan is not run: the reconcile loop stays off)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/jobs",
        "raw_path": b"/v1/jobs",
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"127.0.0.1:8080"),
            (b"authorization", f"Bearer {ADMIN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", length),
        ],
    }
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    try:
        asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    except Exception:  # what the server would answer 500 for
        return 500, b""
    status = next(int(m["status"]) for m in sent if m["type"] == "http.response.start")  # type: ignore[call-overload]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    return status, body


@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
def test_a_content_length_that_is_no_ascii_number_gets_413_not_500(
    settings: Settings, etcd_client: EtcdClient, length: bytes
) -> None:
    status, body = _post(settings, etcd_client, length)
    assert status == 413, body
    assert json.loads(body)["detail"] == f"request body larger than {DEFAULT_MAX_BODY_BYTES} bytes"


def test_a_plain_content_length_within_the_limit_is_admitted(settings: Settings, etcd_client: EtcdClient) -> None:
    status, body = _post(settings, etcd_client, b"2")
    assert status == 422, body  # past admission: the route refused the empty spec
