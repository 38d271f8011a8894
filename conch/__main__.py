"""``python -m conch`` and the ``conch`` console script."""

import os


def main() -> None:
    """Import the command line and run it; an interrupt during the imports exits 130
    quietly. Where the environment does not set them, sets GRPC_ENABLE_FORK_SUPPORT=false
    and, while grpc is imported, GRPC_VERBOSITY=NONE, for its own process (docs/design.md)."""
    ours = {"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "NONE"}
    ours = {variable: value for variable, value in ours.items() if variable not in os.environ}
    os.environ.update(ours)
    try:
        import conch.etcd

        conch.etcd.FORK_SUPPORT_OFF = "GRPC_ENABLE_FORK_SUPPORT" in ours
        from conch.cli import run
    except KeyboardInterrupt:
        import signal

        from conch.errors import Outcome, exit_code, signalled  # light: no grpc

        raise SystemExit(exit_code(Outcome.INTERRUPTED, signalled(signal.SIGINT))) from None
    finally:
        if "GRPC_VERBOSITY" in ours:
            del os.environ["GRPC_VERBOSITY"]
    run()


if __name__ == "__main__":
    main()
