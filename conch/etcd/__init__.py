"""conch's own etcd v3 client layer, directly on the gRPC stubs generated from protos/."""

import os

# conch forks only to exec (the child, the watchdog): gRPC's fork handlers are of no use
# then and are known to hang fork() while streams are active. Set before grpc loads; the
# child does not inherit it (see supervisor.child_env).
FORK_SUPPORT_OFF = "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
if FORK_SUPPORT_OFF:
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

from conch.etcd.client import Client, Endpoint  # noqa: E402

# The etcd API version protos/ follows (go.etcd.io/etcd/api/v3).
ETCD_API_VERSION = "3.5"

__all__ = ["ETCD_API_VERSION", "FORK_SUPPORT_OFF", "Client", "Endpoint"]
