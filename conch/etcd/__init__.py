"""conch's own etcd v3 client layer, directly on the gRPC stubs generated from protos/."""

from conch.etcd.client import Client, Endpoint

# The etcd API version protos/ follows (go.etcd.io/etcd/api/v3).
ETCD_API_VERSION = "3.5"

# Whether the command turned gRPC's fork support off in its own environment (conch.__main__,
# before grpc loads); the library never does. The child must not inherit it
# (supervisor.child_env).
FORK_SUPPORT_OFF = False

__all__ = ["ETCD_API_VERSION", "FORK_SUPPORT_OFF", "Client", "Endpoint"]
