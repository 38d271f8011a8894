"""``python -m conch`` and the ``conch`` console script."""

import contextlib
import os
import sys


def main() -> None:
    """Import the command line and run it; an interrupt during the imports exits 130
    quietly. A run's watchdog (``--`` in the arguments) starts first: its start-up overlaps
    the imports. Where the environment does not set them, sets GRPC_ENABLE_FORK_SUPPORT=false
    and, while grpc is imported, GRPC_VERBOSITY=NONE, for its own process (docs/design.md)."""
    ours = {"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "NONE"}
    ours = {variable: value for variable, value in ours.items() if variable not in os.environ}
    watchdog = None
    try:
        from conch import procs
        from conch.watchdog import Watchdog  # light: no grpc

        procs.reopen_closed_std_fds()  # before the watchdog's pipes could take fd 0, 1 or 2
        procs.undo_locale_coercion()
        if "--" in sys.argv:
            with contextlib.suppress(OSError):  # else supervise() tries again, and reports it
                watchdog = Watchdog()
        os.environ.update(ours)
        import conch.etcd

        conch.etcd.FORK_SUPPORT_OFF = "GRPC_ENABLE_FORK_SUPPORT" in ours
        from conch.cli import run
    except KeyboardInterrupt:
        import signal

        from conch.errors import Outcome, exit_code, signalled  # light: no grpc

        raise SystemExit(exit_code(Outcome.INTERRUPTED, signalled(signal.SIGINT))) from None
    finally:
        if "GRPC_VERBOSITY" in ours:
            os.environ.pop("GRPC_VERBOSITY", None)
    run(watchdog)


if __name__ == "__main__":
    main()
