"""etcd v3 access for the whole project (the only package that imports the etcd client library).

:class:`EtcdClient` is the interface (:class:`EtcdAuth` the users and roles one, which the same clients
implement: :func:`auth_of`); :func:`create_client` makes the real (gRPC) one,
:class:`MemoryEtcdClient` is an in-memory model of a cluster for unit tests. :meth:`EtcdClient.txn` runs a
general transaction of the :mod:`elastic.etcd.txn` parts (re-exported here).
"""

from elastic.etcd.api import (
    EtcdAuth,
    EtcdClient,
    EtcdClientClosedError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdResponseTooLargeError,
    KeyValue,
    auth_of,
)
from elastic.etcd.client import GrpcEtcdClient, check_reachable, create_client
from elastic.etcd.config import EtcdConfig, parse_endpoints
from elastic.etcd.memory import ManualClock, MemoryEtcdClient, MemoryEtcdServer
from elastic.etcd.txn import (
    Compare,
    CompareOp,
    CompareTarget,
    DeleteOp,
    GetOp,
    GetResult,
    PutOp,
    TxnOp,
    TxnResult,
)

__all__ = [
    "Compare",
    "CompareOp",
    "CompareTarget",
    "DeleteOp",
    "EtcdAuth",
    "EtcdClient",
    "EtcdClientClosedError",
    "EtcdCompactedError",
    "EtcdConfig",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseNotFoundError",
    "EtcdResponseTooLargeError",
    "GetOp",
    "GetResult",
    "GrpcEtcdClient",
    "KeyValue",
    "ManualClock",
    "MemoryEtcdClient",
    "MemoryEtcdServer",
    "PutOp",
    "TxnOp",
    "TxnResult",
    "auth_of",
    "check_reachable",
    "create_client",
    "parse_endpoints",
]
