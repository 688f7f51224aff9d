"""The parts of python3-etcd3 that GrpcEtcdClient relies on, private ones included, still exist.

``elastic/etcd/client.py`` calls the library's gRPC stubs directly (``kvstub``, ``channel``) with the
client's ``timeout``, ``call_credentials`` and ``metadata``, builds ``etcdrpc`` messages by field name
and reads response fields by name. An upgrade of ``etcd3`` that renames any of them fails here, without
an etcd server (the library connects lazily), rather than at run time.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import etcd3
import pytest
from etcd3 import etcdrpc
from etcd3 import exceptions as etcd_exc

from elastic.etcd import EtcdConfig, GrpcEtcdClient, create_client
from elastic.testing.etcd_server import free_port


@pytest.fixture
def raw_client() -> Iterator[Any]:
    """The library's client object exactly as GrpcEtcdClient makes it (to a port nobody serves)."""
    client = create_client(EtcdConfig.from_options(f"127.0.0.1:{free_port()}", {"request_timeout": "3"}))
    raw = client._raw()
    yield raw
    client.close()


def test_create_client_makes_the_grpc_client() -> None:
    client = create_client(EtcdConfig.from_options("127.0.0.1:2379"))
    assert isinstance(client, GrpcEtcdClient)


def test_the_library_client_has_the_private_attributes_the_gRPC_client_passes_to_stubs(raw_client: Any) -> None:
    assert isinstance(raw_client, etcd3.MultiEndpointEtcd3Client)
    assert raw_client.timeout == 3.0
    assert raw_client.call_credentials is None and raw_client.metadata is None  # no auth configured
    for method in ("Range", "Put", "DeleteRange", "Txn"):
        assert callable(getattr(raw_client.kvstub, method)), method
    assert callable(etcdrpc.WatchStub(raw_client.channel).Watch)


def test_the_library_client_has_the_public_calls_the_gRPC_client_uses(raw_client: Any) -> None:
    for name in ("get_response", "lease", "refresh_lease", "revoke_lease", "close"):
        assert callable(getattr(raw_client, name)), name
    assert callable(etcd3.MultiEndpointEtcd3Client.get_secure_creds)
    params = inspect.signature(etcd3.MultiEndpointEtcd3Client).parameters
    assert {"endpoints", "timeout", "user", "password", "failover"} <= set(params)
    endpoint_params = inspect.signature(etcd3.Endpoint).parameters
    assert {"host", "port", "secure", "creds", "time_retry", "opts"} <= set(endpoint_params)


def test_the_retryable_library_exceptions_exist() -> None:
    for name in ("ConnectionFailedError", "ConnectionTimeoutError", "InternalServerError", "NoServerAvailableError"):
        assert issubclass(getattr(etcd_exc, name), Exception), name


def _fields(message: Any) -> set[str]:
    return set(message.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        ("RangeRequest", {"key", "range_end", "count_only"}),
        ("RangeResponse", {"header", "kvs", "count"}),
        ("PutRequest", {"key", "value", "lease"}),
        ("PutResponse", {"header"}),
        ("DeleteRangeRequest", {"key", "range_end"}),
        ("DeleteRangeResponse", {"header", "deleted"}),
        ("Compare", {"key", "result", "target", "mod_revision", "create_revision"}),
        ("RequestOp", {"request_range", "request_put", "request_delete_range"}),
        ("ResponseOp", {"response_range"}),
        ("TxnRequest", {"compare", "success", "failure"}),
        ("TxnResponse", {"header", "succeeded", "responses"}),
        ("WatchCreateRequest", {"key", "range_end", "start_revision"}),
        ("WatchRequest", {"create_request"}),
        ("WatchResponse", {"compact_revision", "canceled", "cancel_reason", "events"}),
        ("LeaseKeepAliveResponse", {"TTL"}),
        ("ResponseHeader", {"revision"}),
    ],
)
def test_the_etcdrpc_messages_have_the_fields_the_gRPC_client_sets_and_reads(message: str, fields: set[str]) -> None:
    assert fields <= _fields(getattr(etcdrpc, message))


def test_the_key_value_message_has_every_field_a_key_value_is_made_from() -> None:
    from etcd3.etcdrpc import kv_pb2

    assert {"key", "value", "create_revision", "mod_revision", "lease", "version"} <= _fields(kv_pb2.KeyValue)
    assert {"kv"} <= _fields(kv_pb2.Event)


def test_compare_has_the_enum_values_the_transactions_use() -> None:
    assert etcdrpc.Compare.EQUAL == etcdrpc.Compare.CompareResult.Value("EQUAL")
    assert etcdrpc.Compare.MOD == etcdrpc.Compare.CompareTarget.Value("MOD")
    assert etcdrpc.Compare.CREATE == etcdrpc.Compare.CompareTarget.Value("CREATE")
    assert etcdrpc.ResponseOp().WhichOneof("response") is None  # the oneof the client asks for by name
