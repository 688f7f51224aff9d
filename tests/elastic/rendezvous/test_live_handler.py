"""The live-recovery handler (``--rdzv-conf recovery=live``): a node-local world at once, never a restart for
another node, the run's closed key, and what the plugin exports to the workers. Real etcd."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastic.contract.env import (
    ETCD_CA_CERT,
    ETCD_CERT,
    ETCD_ENDPOINTS,
    ETCD_KEY,
    ETCD_PASSWORD_FILE,
    ETCD_USER,
    LIVE_NODES,
    LIVE_PREFIX,
)
from elastic.etcd import EtcdClient, create_client
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.live_handler import LiveRendezvousHandler
from elastic.rendezvous.plugin import DEFAULT_KEY_PREFIX, create_handler, live_worker_environ
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules
from elastic.testing.counting_etcd import CountingEtcdClient
from elastic.testing.etcd_server import LocalEtcdCluster

EXPORTED = (LIVE_PREFIX, LIVE_NODES, ETCD_ENDPOINTS, ETCD_CA_CERT, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD_FILE)


@pytest.fixture
def client(etcd_server: LocalEtcdCluster) -> Iterator[CountingEtcdClient]:
    inner = create_client(etcd_server.config(op_timeout=5))
    yield CountingEtcdClient(inner)  # type: ignore[abstract]  # its methods are generated
    inner.close()


@pytest.fixture
def made() -> Iterator[list[LiveRendezvousHandler | EtcdV3RendezvousHandler]]:
    handlers: list[LiveRendezvousHandler | EtcdV3RendezvousHandler] = []
    yield handlers
    for h in handlers:
        h.release()


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The variables the plugin exports start unset, and are removed again after the test."""
    # setenv first: monkeypatch restores only what it changed, and delenv of an unset name records nothing
    for name in EXPORTED:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return monkeypatch


def _run() -> str:
    return f"live-{uuid.uuid4().hex[:8]}"


def _settings() -> HandlerSettings:
    return HandlerSettings(rules=RoundRules(1, 3, timedelta(seconds=1)), node_ttl=timedelta(seconds=2))


def _live(
    made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler], client: EtcdClient, run: str, addr: str
) -> LiveRendezvousHandler:
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    handler = LiveRendezvousHandler(client, run, keys, _settings(), local_addr=addr)
    made.append(handler)
    return handler


def _present(client: EtcdClient, keys: RendezvousKeys, handler: LiveRendezvousHandler) -> bool:
    return client.get(keys.alive_key(handler.node_id))[0] is not None


@pytest.mark.solo  # each answer within 0.5 s: runs alone in a parallel scripts/test.sh
@pytest.mark.timeout(60)
def test_each_of_three_nodes_gets_rank_0_of_a_world_of_1_at_once_without_waiting_for_the_others(
    client: CountingEtcdClient, made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler]
) -> None:
    run = _run()
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    for i in (1, 2, 3):
        handler = _live(made, client, run, f"127.0.0.{i}")
        start = time.monotonic()
        info = handler.next_rendezvous()
        took = time.monotonic() - start
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info is not None
        assert info.bootstrap_store_info.master_addr == f"127.0.0.{i}"
        assert info.bootstrap_store_info.master_port > 0
        assert took < 0.5, f"node {i}: next_rendezvous took {took:.2f}s"
        assert _present(client, keys, handler), "the agent's presence key is on its lease"
    assert (handler.get_backend(), handler.get_run_id(), handler.use_agent_store) == ("etcd-v3", run, False)


@pytest.mark.timeout(60)
def test_nodes_joining_and_leaving_never_make_num_nodes_waiting_nonzero_nor_ask_etcd(
    client: CountingEtcdClient, made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler]
) -> None:
    run = _run()
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    a = _live(made, client, run, "127.0.0.1")
    a.next_rendezvous()
    client.reset()
    assert a.num_nodes_waiting() == 0
    joiners = [_live(made, client, run, f"127.0.0.{i}") for i in (2, 3)]
    for j in joiners:
        j.next_rendezvous()
        assert a.num_nodes_waiting() == 0
    joiners[0].release()  # a clean exit: its presence key goes at once
    assert not _present(client, keys, joiners[0])
    assert a.num_nodes_waiting() == 0
    with client.record() as tally:
        for _ in range(100):
            assert a.num_nodes_waiting() == 0
    assert tally.requests == 0, f"num_nodes_waiting made etcd requests: {tally.by_op}"


@pytest.mark.timeout(60)
def test_the_store_works_and_each_rendezvous_gets_a_fresh_prefix(
    client: CountingEtcdClient, made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler]
) -> None:
    run = _run()
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    handler = _live(made, client, run, "127.0.0.1")
    first = handler.next_rendezvous().store
    first.set("greeting", "hello")
    assert first.get("greeting") == b"hello"
    assert first.add("counter", 2) == 2
    second = handler.next_rendezvous().store  # torchrun's restart after a worker crash
    assert not second.check(["greeting"]), "the second start saw the first start's keys"
    second.set("greeting", "again")
    assert first.get("greeting") == b"hello"
    stored = {kv.key for kv in client.get_prefix(keys.store)[0]}
    live_prefix = f"{keys.store}/torch.rendezvous.{run}.live.{handler.node_id}"
    assert f"{live_prefix}.0/greeting" in stored
    assert f"{live_prefix}.1/greeting" in stored


@pytest.mark.timeout(60)
def test_set_closed_makes_next_rendezvous_raise_closed_for_every_node(
    client: CountingEtcdClient, made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler]
) -> None:
    run = _run()
    a = _live(made, client, run, "127.0.0.1")
    a.next_rendezvous()
    assert not a.is_closed()
    a.set_closed()
    assert a.is_closed()
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()
    late = _live(made, client, run, "127.0.0.2")
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()


@pytest.mark.timeout(60)
def test_shutdown_closes_the_run_and_removes_the_presence_key_at_once(
    client: CountingEtcdClient, made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler]
) -> None:
    run = _run()
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, run)
    a = _live(made, client, run, "127.0.0.1")
    a.next_rendezvous()
    assert _present(client, keys, a)
    assert a.shutdown()
    assert not _present(client, keys, a)
    assert client.get(keys.closed)[0] is not None


def _params(endpoints: str, run: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoints, run, 1, 3, local_addr="127.0.0.1", node_ttl="2", **conf)


@pytest.mark.timeout(60)
def test_recovery_live_builds_the_live_handler_and_exports_the_live_group_and_etcd_to_the_workers(
    etcd_server: LocalEtcdCluster,
    made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler],
    clean_environ: pytest.MonkeyPatch,
) -> None:
    run = _run()
    handler = create_handler(_params(etcd_server.endpoints, run, recovery="live", key_prefix="/live-test"))
    assert isinstance(handler, LiveRendezvousHandler)
    made.append(handler)
    assert os.environ[LIVE_PREFIX] == f"/live-test/{run}/live/"
    assert os.environ[LIVE_NODES] == "1:3"
    assert os.environ[ETCD_ENDPOINTS] == etcd_server.endpoints
    assert ETCD_USER not in os.environ and ETCD_CA_CERT not in os.environ
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)


@pytest.mark.timeout(60)
def test_recovery_live_keeps_an_etcd_connection_the_job_service_already_set(
    etcd_server: LocalEtcdCluster,
    made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler],
    clean_environ: pytest.MonkeyPatch,
) -> None:
    clean_environ.setenv(ETCD_ENDPOINTS, "jobs-etcd:2379")
    clean_environ.setenv(ETCD_USER, "job-user")
    handler = create_handler(_params(etcd_server.endpoints, _run(), recovery="live"))
    assert isinstance(handler, LiveRendezvousHandler)
    made.append(handler)
    assert os.environ[ETCD_ENDPOINTS] == "jobs-etcd:2379"
    assert os.environ[ETCD_USER] == "job-user"
    assert os.environ[LIVE_NODES] == "1:3"


@pytest.mark.timeout(60)
def test_default_recovery_restart_builds_the_round_handler_and_exports_nothing(
    etcd_server: LocalEtcdCluster,
    made: list[LiveRendezvousHandler | EtcdV3RendezvousHandler],
    clean_environ: pytest.MonkeyPatch,
) -> None:
    handler = create_handler(_params(etcd_server.endpoints, _run()))
    assert isinstance(handler, EtcdV3RendezvousHandler)
    made.append(handler)
    assert not any(name in os.environ for name in EXPORTED)


@pytest.mark.timeout(30)
def test_an_unknown_recovery_mode_fails_naming_the_option_and_the_allowed_values(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    # the endpoint is never contacted: the option is checked first
    with pytest.raises(ValueError, match=r"recovery='bogus'.*restart, live"):
        create_handler(_params("127.0.0.1:1", _run(), recovery="bogus"))


@pytest.mark.timeout(30)
def test_live_mode_refuses_an_inline_password_since_workers_need_a_password_file(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    conf = {"recovery": "live", "user": "train", "password": "s3cret", "ca_cert": "/ca.pem"}
    with pytest.raises(ValueError, match="password_file"):
        create_handler(_params("127.0.0.1:1", _run(), **conf))
    assert LIVE_PREFIX not in os.environ


@pytest.mark.timeout(30)
def test_worker_etcd_variables_carry_absolute_files_and_no_password(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    conf = {"user": "train", "password_file": str(secret), "ca_cert": "ca.pem", "cert": "c.pem", "cert_key": "k.pem"}
    keys = RendezvousKeys.of(DEFAULT_KEY_PREFIX, "r")
    out = live_worker_environ(_params("h1:2379,h2:2379", "r", **conf), keys, env={})
    assert out == {
        LIVE_PREFIX: f"{DEFAULT_KEY_PREFIX}/r/live/",
        LIVE_NODES: "1:3",
        ETCD_ENDPOINTS: "h1:2379,h2:2379",
        ETCD_CA_CERT: str(Path("ca.pem").resolve()),
        ETCD_CERT: str(Path("c.pem").resolve()),
        ETCD_KEY: str(Path("k.pem").resolve()),
        ETCD_USER: "train",
        ETCD_PASSWORD_FILE: str(secret.resolve()),
    }
    assert "s3cret" not in "".join(out.values())
