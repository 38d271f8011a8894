from conch.cli import run

run()
