"""etcd v3 access for the whole project (the only package that imports the etcd client library)."""

from elastic.etcd.client import (
    EtcdClient,
    EtcdConnectionError,
    EtcdError,
    KeyValue,
    check_reachable,
    create_client,
)
from elastic.etcd.config import EtcdConfig, parse_endpoints

__all__ = [
    "EtcdClient",
    "EtcdConfig",
    "EtcdConnectionError",
    "EtcdError",
    "KeyValue",
    "check_reachable",
    "create_client",
    "parse_endpoints",
]
