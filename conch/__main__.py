"""``python -m conch`` and the ``conch`` console script."""


def main() -> None:
    """Import the command line and run it. An interrupt during the ~100 ms of imports (nothing
    has been sent to etcd yet) exits 130 quietly instead of with a traceback."""
    try:
        from conch.cli import run
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
