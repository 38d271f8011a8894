"""``python -m conch`` and the ``conch`` console script."""

import os


def main() -> None:
    """Import the command line and run it; an interrupt during the imports exits 130
    quietly. Where the environment does not set them, sets GRPC_ENABLE_FORK_SUPPORT=false
    and, while grpc is imported, GRPC_VERBOSITY=NONE, for its own process (docs/design.md)."""
    fork_support_off = "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
    if fork_support_off:
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    quieted = "GRPC_VERBOSITY" not in os.environ
    if quieted:
        os.environ["GRPC_VERBOSITY"] = "NONE"
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
            del os.environ["GRPC_VERBOSITY"]
    run()


if __name__ == "__main__":
    main()
