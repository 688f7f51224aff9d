"""RendezvousBackend contract, run against the etcd-v3 backend and torch's c10d backend (the reference).

Running torch's own backend through the same suite shows the contract is torch's, not ours.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic.etcd import EtcdClient, EtcdConfig, MemoryEtcdServer, create_client
from elastic.rendezvous.etcd_v3_backend import EtcdV3RendezvousBackend
from elastic.testing.etcd_server import LocalEtcdCluster, free_port

pytestmark = pytest.mark.timeout(60)

BackendFactory = Callable[[str], RendezvousBackend]


@pytest.fixture(params=["etcd-v3", "etcd-v3-memory", "c10d-reference"])
def make_backend(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[BackendFactory]:
    if request.param.startswith("etcd-v3"):
        made: list[EtcdV3RendezvousBackend] = []
        # the real etcd, and the in-memory model of it (no etcd binary needed): one contract for both
        client: EtcdClient = (
            request.getfixturevalue("etcd_client") if request.param == "etcd-v3" else MemoryEtcdServer().client()
        )

        def etcd_factory(run_id: str) -> RendezvousBackend:
            b = EtcdV3RendezvousBackend(client, run_id, key_prefix=key_prefix)
            made.append(b)
            return b

        yield etcd_factory
        for b in made:
            b.close()
    else:
        store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)

        def c10d_factory(run_id: str) -> RendezvousBackend:
            return C10dRendezvousBackend(store, run_id)

        yield c10d_factory


def test_get_state_of_a_new_run_is_none(make_backend: BackendFactory) -> None:
    assert make_backend("run-a").get_state() is None


def test_set_state_without_token_creates_state(make_backend: BackendFactory) -> None:
    backend = make_backend("run-a")
    result = backend.set_state(b"state-1")
    assert result is not None
    state, token, ok = result
    assert (state, ok) == (b"state-1", True)
    got = backend.get_state()
    assert got == (b"state-1", token)


def test_set_state_with_current_token_replaces_state(make_backend: BackendFactory) -> None:
    backend = make_backend("run-a")
    first = backend.set_state(b"one")
    assert first is not None
    second = backend.set_state(b"two", first[1])
    assert second is not None
    assert second[0] == b"two" and second[2] is True
    assert second[1] != first[1]
    assert backend.get_state() == (b"two", second[1])


def test_stale_token_is_rejected_and_current_state_returned(make_backend: BackendFactory) -> None:
    a, b = make_backend("run-a"), make_backend("run-a")
    first = a.set_state(b"one")
    assert first is not None
    won = b.set_state(b"b-wins", first[1])
    assert won is not None and won[2] is True
    lost = a.set_state(b"a-loses", first[1])
    assert lost is not None
    assert lost[0] == b"b-wins" and lost[2] is False and lost[1] == won[1]


def test_none_token_on_existing_state_does_not_overwrite(make_backend: BackendFactory) -> None:
    backend = make_backend("run-a")
    backend.set_state(b"one")
    result = backend.set_state(b"two", None)
    assert result is not None
    assert result[0] == b"one" and result[2] is False


@pytest.mark.parametrize("token", ["not-a-number", -7, 0, 987654321])
def test_invalid_or_unknown_token_is_rejected(make_backend: BackendFactory, token: object) -> None:
    backend = make_backend("run-a")
    backend.set_state(b"one")
    result = backend.set_state(b"two", token)
    assert result is not None
    assert result[0] == b"one" and result[2] is False


def test_runs_are_isolated(make_backend: BackendFactory) -> None:
    make_backend("run-a").set_state(b"a")
    assert make_backend("run-b").get_state() is None


def test_corrupt_state_raises_state_error(etcd_client: EtcdClient, key_prefix: str) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, "run-x", key_prefix=key_prefix)
    backend.set_state(b"good")
    etcd_client.put(backend.state_key, b"garbage written by someone else")
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_bit_flip_in_state_is_detected(etcd_client: EtcdClient, key_prefix: str) -> None:
    backend = EtcdV3RendezvousBackend(etcd_client, "run-x", key_prefix=key_prefix)
    backend.set_state(b"good state")
    kv, _ = etcd_client.get(backend.state_key)
    assert kv is not None
    flipped = kv.value[:-1] + bytes([kv.value[-1] ^ 0x01])
    etcd_client.put(backend.state_key, flipped)
    with pytest.raises(RendezvousStateError, match="checksum"):
        backend.get_state()


def test_state_key_is_on_a_lease_so_abandoned_state_expires(etcd_client: EtcdClient, key_prefix: str) -> None:
    backend = EtcdV3RendezvousBackend(
        etcd_client, "run-ttl", key_prefix=key_prefix, state_ttl=timedelta(seconds=2)
    )
    backend.set_state(b"abandoned")
    kv, _ = etcd_client.get(backend.state_key)
    assert kv is not None and kv.lease != 0
    backend.close()  # stops refreshing: as if every agent died
    deadline_ok = False
    import time

    for _ in range(60):
        if etcd_client.get(backend.state_key)[0] is None:
            deadline_ok = True
            break
        time.sleep(0.1)
    assert deadline_ok, "state on an unrefreshed lease should expire after its TTL"


def test_empty_run_id_is_rejected(etcd_client: EtcdClient) -> None:
    with pytest.raises(ValueError):
        EtcdV3RendezvousBackend(etcd_client, "")


@pytest.mark.timeout(30)
def test_unreachable_etcd_raises_connection_error_naming_endpoint() -> None:
    port = free_port()
    client = create_client(EtcdConfig.from_options(f"127.0.0.1:{port}", {"op_timeout": "1"}))
    backend = EtcdV3RendezvousBackend(client, f"run-{uuid.uuid4().hex[:6]}")
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        backend.get_state()


@pytest.mark.timeout(60)
def test_state_survives_etcd_member_restart(etcd_member: LocalEtcdCluster) -> None:
    client = create_client(etcd_member.config(op_timeout=20))
    backend = EtcdV3RendezvousBackend(client, "run-restart")
    first = backend.set_state(b"before")
    assert first is not None
    etcd_member.stop_member(0)
    etcd_member.start_member(0)
    got = backend.get_state()
    assert got == (b"before", first[1])
    after = backend.set_state(b"after", first[1])
    assert after is not None and after[2] is True
    backend.close()
    client.close()
