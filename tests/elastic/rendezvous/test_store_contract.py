"""torch.distributed.Store contract, run against the etcd v3 store and torch's HashStore (the reference)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError, HashStore, PrefixStore, Store

from elastic.etcd import EtcdClient, GrpcEtcdClient, create_client
from elastic.rendezvous.etcd_v3_store import EtcdV3Store
from elastic.testing.etcd_server import LocalEtcdCluster

pytestmark = pytest.mark.timeout(60)

StoreFactory = Callable[[], Store]


@pytest.fixture(params=["etcd-v3", "hashstore-reference"])
def make_store(request: pytest.FixtureRequest, etcd_client: EtcdClient, key_prefix: str) -> StoreFactory:
    """Each call returns another handle on the same logical store (as another process would have)."""
    if request.param == "etcd-v3":
        return lambda: EtcdV3Store(etcd_client, key_prefix + "/store", timeout=timedelta(seconds=10))
    shared = HashStore()
    shared.set_timeout(timedelta(seconds=10))
    return lambda: shared


def test_set_then_get_returns_bytes(make_store: StoreFactory) -> None:
    s = make_store()
    s.set("k", "v")
    s.set("b", b"\x00\xffbin")
    assert s.get("k") == b"v"
    assert s.get("b") == b"\x00\xffbin"


def test_get_blocks_until_another_handle_sets_the_key(make_store: StoreFactory) -> None:
    reader, writer = make_store(), make_store()
    threading.Timer(0.5, lambda: writer.set("late", b"here")).start()
    start = time.monotonic()
    assert reader.get("late") == b"here"
    elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 5


# torch's own store suite (test/distributed/test_store.py, _test_simple_wait) matches timeouts with this
TIMEOUT_MESSAGE = "[t -i]imeout"


def test_get_of_missing_key_times_out_with_torchs_error_and_message(make_store: StoreFactory) -> None:
    s = make_store()
    s.set_timeout(timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=TIMEOUT_MESSAGE):
        s.get("never")
    assert 0.9 < time.monotonic() - start < 5


def test_add_is_atomic_across_handles(make_store: StoreFactory) -> None:
    handles = [make_store() for _ in range(4)]
    results: list[int] = []
    lock = threading.Lock()

    def bump(h: Store) -> None:
        for _ in range(10):
            v = h.add("counter", 1)
            with lock:
                results.append(v)

    threads = [threading.Thread(target=bump, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 41))
    assert make_store().add("counter", 0) == 40
    assert make_store().add("counter", -5) == 35


def test_wait_returns_when_all_keys_exist_and_times_out_otherwise(make_store: StoreFactory) -> None:
    s, w = make_store(), make_store()
    threading.Timer(0.3, lambda: (w.set("a", "1"), w.set("b", "2"))).start()
    s.wait(["a", "b"])
    assert s.check(["a", "b"])
    with pytest.raises(DistStoreError, match=TIMEOUT_MESSAGE):
        s.wait(["a", "missing"], timedelta(seconds=1))


def test_check_does_not_block(make_store: StoreFactory) -> None:
    s = make_store()
    start = time.monotonic()
    assert s.check(["nope"]) is False
    assert time.monotonic() - start < 2
    s.set("yes", "1")
    assert s.check(["yes"]) is True


def test_compare_set_follows_torch_semantics(make_store: StoreFactory) -> None:
    s = make_store()
    # Missing key, non-empty expectation: nothing written, expected value returned.
    assert s.compare_set("cs", "x", "y") == b"x"
    assert s.check(["cs"]) is False
    # Missing key, empty expectation: desired value written.
    assert s.compare_set("cs", "", "first") == b"first"
    # Wrong expectation: current value returned, not replaced.
    assert s.compare_set("cs", "wrong", "second") == b"first"
    # Right expectation: replaced.
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.get("cs") == b"second"


def test_delete_key_and_num_keys(make_store: StoreFactory) -> None:
    s = make_store()
    base = s.num_keys()
    s.set("d1", "1")
    s.set("d2", "2")
    assert s.num_keys() == base + 2
    assert s.delete_key("d1") is True
    assert s.delete_key("d1") is False
    assert s.num_keys() == base + 1


def test_append_and_multi_ops(make_store: StoreFactory) -> None:
    s = make_store()
    s.append("log", "a")
    s.append("log", "bc")
    assert s.get("log") == b"abc"
    s.multi_set(["m1", "m2"], ["x", "y"])
    assert s.multi_get(["m1", "m2"]) == [b"x", b"y"]


def test_works_under_torch_prefix_store(make_store: StoreFactory) -> None:
    inner = make_store()  # a Python-implemented store must outlive the C++ PrefixStore that wraps it
    s = PrefixStore("torch.rendezvous.run.0", inner)
    s.set("MASTER_ADDR", "127.0.0.1")
    assert s.get("MASTER_ADDR") == b"127.0.0.1"
    assert s.add("n", 3) == 3


def test_etcd_store_get_uses_a_watch_not_polling(etcd_client: EtcdClient, key_prefix: str) -> None:
    """A reader blocked in get() for 2 s makes O(1) etcd requests, not one per poll interval."""
    calls = {"get": 0}

    class Counting(GrpcEtcdClient):
        def get(self, key: str):  # type: ignore[no-untyped-def]
            calls["get"] += 1
            return super().get(key)

    counting = Counting(etcd_client.config)
    store = EtcdV3Store(counting, key_prefix + "/w", timeout=timedelta(seconds=10))
    threading.Timer(2.0, lambda: etcd_client.put(key_prefix + "/w/k", b"v")).start()
    assert store.get("k") == b"v"
    assert calls["get"] <= 3
    counting.close()


@pytest.mark.timeout(90)
def test_store_get_survives_loss_of_one_member_of_three(etcd_cluster3: LocalEtcdCluster) -> None:
    client = create_client(etcd_cluster3.config(op_timeout=20, request_timeout=2))
    store = EtcdV3Store(client, "/ha/store", timeout=timedelta(seconds=30))
    store.set("before", "1")
    etcd_cluster3.stop_member(0)
    writer = create_client(etcd_cluster3.config(op_timeout=20))
    threading.Timer(1.0, lambda: writer.put("/ha/store/after", b"2")).start()
    assert store.get("after") == b"2"
    assert store.get("before") == b"1"
    assert store.add("n", 2) == 2
    client.close()
    writer.close()
