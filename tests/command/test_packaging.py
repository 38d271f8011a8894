"""What a user installs: a wheel that runs without grpcio-tools, with its man page."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.etcd_server import EtcdCluster

ROOT = Path(__file__).resolve().parents[2]


def test_man_page_renders_cleanly() -> None:
    if shutil.which("man") is None:
        pytest.skip("man is not installed")
    result = subprocess.run(
        ["man", "--warnings", "-l", str(ROOT / "man" / "conch.1")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0
    assert result.stderr == ""
    for section in ("SYNOPSIS", "EXIT STATUS", "ENVIRONMENT", "EXAMPLES", "FAILURE SEMANTICS"):
        assert section in result.stdout
    assert "CONCH_TTL" in result.stdout and "--kill-after" in result.stdout


def test_built_wheel_installs_and_runs_without_grpcio_tools(
    etcd: EtcdCluster, tmp_path: Path, name: str
) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = wheels.glob("conch-*.whl")
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    freeze = subprocess.run(
        [str(venv / "bin" / "pip"), "freeze"], capture_output=True, text=True, check=True
    ).stdout.lower()
    assert "grpcio-tools" not in freeze and "grpcio==" in freeze and "protobuf==" in freeze
    conch = str(venv / "bin" / "conch")
    version = subprocess.run([conch, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("conch ") and "etcd API v3.5" in version.stdout
    run = subprocess.run(
        [conch, "sema", name, "--max", "1", "--endpoints", etcd.endpoints, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert (venv / "share" / "man" / "man1" / "conch.1").is_file()
    for completion in (
        "bash-completion/completions/conch",
        "zsh/site-functions/_conch",
        "fish/vendor_completions.d/conch.fish",
    ):
        assert (venv / "share" / completion).is_file(), completion


@pytest.mark.parametrize("typed", ["--", "--w"])
def test_bash_completes_the_flags_of_conch_sema(typed: str) -> None:
    """``conch sema NAME --<TAB>`` with the completion file as installed, in a plain bash."""
    script = (
        "source completions/bash/conch\n"
        f"COMP_WORDS=(conch sema nightly-backup {typed}); COMP_CWORD=3\n"
        "_shtab_conch\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    offered = result.stdout.split()
    if typed == "--":
        assert {"--max", "--who", "--wait", "--kill-after", "--endpoints"} <= set(offered)
    else:
        assert sorted(offered) == ["--wait", "--who"]


def _printed_by(code: str) -> str:
    """What a fresh interpreter prints running ``code``: what importing costs shows only there."""
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_the_command_imports_the_listing_only_for_who() -> None:
    """Every start pays for what conch.cli imports; only --who lists the holders."""
    assert _printed_by("import sys, conch.cli; print('conch.listing' in sys.modules)") == "False"


def test_building_the_parser_imports_no_shutil() -> None:
    """argparse sizes each formatter it makes (one per add_argument) with shutil, whose
    import (bz2, lzma) cost every start 2-3 ms; conch's formatter asks os instead."""
    code = "import sys, conch.cli; conch.cli.build_parser(); print('shutil' in sys.modules)"
    assert _printed_by(code) == "False"


@pytest.mark.parametrize("columns", [50, 120])
def test_help_is_wrapped_to_the_terminal_width(columns: int) -> None:
    """As argparse's own formatter: $COLUMNS (else the terminal's width) less 2."""
    result = subprocess.run(
        [sys.executable, "-m", "conch", "sema", "--help"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    description = result.stdout.split("\n\n")[1].splitlines()  # the paragraph after usage
    assert len(description) > 1
    assert max(len(line) for line in description) <= columns - 2
    assert max(len(line) for line in description) > columns - 20
