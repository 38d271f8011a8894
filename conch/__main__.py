"""``python -m conch`` and the ``conch`` console script."""

import os

FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"


def main() -> None:
    """Import the command line and run it. An interrupt during the ~100 ms of imports (nothing
    has been sent to etcd yet) exits 130 quietly instead of with a traceback.

    The command forks only to exec (the child, the watchdog): gRPC's fork handlers are of no
    use to it and are known to hang fork() while streams are active, so it turns them off
    for its own process, before grpc loads, unless its environment says otherwise. The child
    does not inherit that (supervisor.child_env). The library never does this: a service that
    embeds conch and forks workers needs gRPC's fork support (docs/embedding.md)."""
    off = FORK_SUPPORT not in os.environ
    if off:
        os.environ[FORK_SUPPORT] = "false"
    try:
        import conch.etcd

        conch.etcd.FORK_SUPPORT_OFF = off
        from conch.cli import run
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
