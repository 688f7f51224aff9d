"""service.agent.health: the health rule and the /healthz server, apart from the agent (whose use of them is
test_agent's and test_node_unit's)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from service.agent.health import HealthServer, HealthStatus, judge_health

pytestmark = pytest.mark.timeout(30)


def test_an_agent_is_healthy_while_registered_and_its_loop_runs_or_stops_a_torchrun() -> None:
    fresh = {"since_loop_s": 1.0, "lease_ttl_s": 15.0}
    assert judge_health("n1", registered=True, running=2, stopping=0, **fresh) == (
        True,
        {"status": "ok", "node": "n1", "jobs": 2, "stopping": 0},
    )
    assert not judge_health("n1", registered=False, running=0, stopping=0, **fresh)[0]
    assert not judge_health("n1", registered=True, running=0, stopping=0, since_loop_s=16.0, lease_ttl_s=15.0)[0]
    assert not judge_health("n1", registered=True, running=0, stopping=0, since_loop_s=11.0, lease_ttl_s=1.0)[0]
    assert judge_health("n1", registered=True, running=0, stopping=0, since_loop_s=9.0, lease_ttl_s=1.0)[0]
    busy = judge_health("n1", registered=True, running=0, stopping=1, since_loop_s=60.0, lease_ttl_s=15.0)
    assert busy == (True, {"status": "ok", "node": "n1", "jobs": 0, "stopping": 1})


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_server_answers_the_status_on_healthz_only_until_stopped() -> None:
    answer: list[HealthStatus] = [(True, {"status": "ok"})]
    server = HealthServer(lambda: answer[0], 0, "127.0.0.1").start()
    port = server.port
    try:
        assert server.serving and port != 0
        status, body = _get(port, "/healthz?x=1")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        answer[0] = (False, {"status": "unhealthy"})
        status, body = _get(port, "/healthz")
        assert status == 503 and json.loads(body) == {"status": "unhealthy"}
        assert _get(port, "/other")[0] == 404
    finally:
        server.stop()
    assert not server.serving
    server.stop()  # twice: nothing to do
    with pytest.raises(OSError):
        _get(port, "/healthz")
