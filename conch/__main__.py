"""``python -m conch`` and the ``conch`` console script."""

import os

FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
VERBOSITY = "GRPC_VERBOSITY"


def main() -> None:
    """Import the command line and run it; an interrupt during the imports exits 130
    quietly. For its own process only, and only where the environment does not set them,
    the command sets GRPC_ENABLE_FORK_SUPPORT=false (it forks only to exec; gRPC's fork
    handlers can hang fork() while streams are active) and, while grpc is imported,
    GRPC_VERBOSITY=NONE (no absl lines around conch's own report of a failure).
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
