"""``python -m conch`` and the ``conch`` console script."""

import os

FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
VERBOSITY = "GRPC_VERBOSITY"


def main() -> None:
    """Import the command line and run it. An interrupt during the ~100 ms of imports (nothing
    has been sent to etcd yet) exits 130 (``Outcome.INTERRUPTED``) quietly instead of with a
    traceback.

    The command sets two of gRPC's settings for its own process, before grpc loads, each only
    when its environment does not set it already. The library never does this: a library
    does not change process-wide state it does not own.

    - GRPC_ENABLE_FORK_SUPPORT=false: the command forks only to exec (the child, the
      watchdog): gRPC's fork handlers are of no use to it and are known to hang fork() while
      streams are active. The child does not inherit it (supervisor.child_env). A service
      that embeds conch and forks workers needs them (docs/embedding.md).
    - GRPC_VERBOSITY=NONE: gRPC's C core logs through absl to stderr, ``I1201 ...
      ssl_transport_security.cc:...] Handshake failed`` lines on a TLS failure even with -q,
      around conch's own one-line report of the same failure. gRPC reads it once, when grpc
      is imported, so it is taken out of the environment again right after: the process has
      one thread then (no putenv races), and the child starts from the environment as the
      operator gave it. An operator who wants gRPC's lines sets GRPC_VERBOSITY (and
      GRPC_TRACE, which is off unless set).
    """
    fork_support_off = FORK_SUPPORT not in os.environ
    if fork_support_off:
        os.environ[FORK_SUPPORT] = "false"
    quieted = VERBOSITY not in os.environ
    if quieted:
        os.environ[VERBOSITY] = "NONE"
    try:
        import conch.etcd

        conch.etcd.FORK_SUPPORT_OFF = fork_support_off
        from conch.cli import run
    except KeyboardInterrupt:
        import signal

        from conch.errors import Outcome, exit_code, signalled  # light: no grpc

        raise SystemExit(exit_code(Outcome.INTERRUPTED, signalled(signal.SIGINT))) from None
    finally:
        if quieted:
            del os.environ[VERBOSITY]
    run()


if __name__ == "__main__":
    main()
