"""conch's own etcd v3 client layer, directly on the gRPC stubs generated from protos/."""

from conch.etcd.client import Client, Endpoint

# The etcd API version protos/ follows (go.etcd.io/etcd/api/v3).
ETCD_API_VERSION = "3.5"

__all__ = ["ETCD_API_VERSION", "Client", "Endpoint"]
