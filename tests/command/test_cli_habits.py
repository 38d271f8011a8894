"""The command as operators already type it: etcdctl's environment, connection flags before
the subcommand, hints that name the flag meant, no arguments written into etcd unless asked,
no gRPC log lines, completion after ``--``. Real etcd servers, a real bash."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conch.etcd import Client
from tests.conftest import Conch, Gate, Runner, poll, sema_keys, who_json
from tests.etcd_server import EtcdCluster, free_port
from tests.faults.test_security import make_pki, tls_cluster

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("ENDPOINTS", "DIAL_TIMEOUT", "CACERT", "CERT", "KEY", "USER", "PASSWORD")


def closed_endpoint() -> str:
    """A loopback port nothing listens on."""
    return f"127.0.0.1:{free_port()}"


def bare_env(**extra: str) -> dict[str, str]:
    """The test's environment without any conch or etcdctl connection setting, plus
    ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONCH_", "ETCDCTL_", "GRPC_VERBOSITY", "GRPC_TRACE"))
    }
    env.update(PYTHONUNBUFFERED="1", CONCH_TTL="10s", **extra)
    return env


def start(runner: Runner, args: list[str], env: dict[str, str]) -> Conch:
    """A conch with exactly ``env`` (Runner.start always sets CONCH_ENDPOINTS)."""
    proc = Conch(args, env, runner.tmp_path / f"conch-{len(runner.started)}.log")
    runner.started.append(proc)
    return proc


def run(runner: Runner, args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    proc = start(runner, args, env)
    code = proc.wait()
    return code, proc.stdout(), proc.log()


def holds_in(client: Client, name: str) -> bool:
    return any(b'"pid"' in item.value for item in sema_keys(client, name))


# -- etcdctl's environment -------------------------------------------------------------


def test_etcdctl_endpoints_are_used_when_conch_is_given_none(
    conch: Runner, etcd: EtcdCluster, client: Client, gate: Gate, name: str
) -> None:
    env = bare_env(ETCDCTL_ENDPOINTS=etcd.endpoints)
    proc = start(conch, ["sema", name, "--max", "1", "--", *gate.cmd("a")], env)
    poll(lambda: "a" in gate.now_running(), what="the child to run")
    assert holds_in(client, name)  # the hold is in the etcd ETCDCTL_ENDPOINTS names
    gate.release("a")
    assert proc.wait() == 0, proc.log()


def test_conch_endpoints_beat_etcdctl_endpoints_and_a_flag_beats_both(
    conch: Runner, etcd: EtcdCluster, name: str
) -> None:
    env = bare_env(ETCDCTL_ENDPOINTS=closed_endpoint(), CONCH_ENDPOINTS=etcd.endpoints)
    code, out, err = run(conch, ["sema", name, "--max", "1", "--debug", "--", "echo", "ran"], env)
    assert code == 0, err
    assert out == "ran\n"
    assert f"setting=endpoints value={etcd.endpoints} source=CONCH_ENDPOINTS" in err

    env = bare_env(ETCDCTL_ENDPOINTS=closed_endpoint(), CONCH_ENDPOINTS=closed_endpoint())
    args = ["sema", name, "--max", "1", "--endpoints", etcd.endpoints, "--debug", "--", "true"]
    code, _, err = run(conch, args, env)
    assert code == 0, err
    assert "source=--endpoints" in err


def test_etcdctl_dial_timeout_is_used(conch: Runner, name: str) -> None:
    env = bare_env(ETCDCTL_ENDPOINTS=closed_endpoint(), ETCDCTL_DIAL_TIMEOUT="700ms")
    code, _, err = run(conch, ["sema", name, "--max", "1", "--debug", "--", "true"], env)
    assert code == 69, err
    assert "setting=dial-timeout value=700ms source=ETCDCTL_DIAL_TIMEOUT" in err
    assert "within 700ms" in err or "within 0.7s" in err, err


def test_a_bad_etcdctl_value_is_a_usage_error_naming_the_variable(conch: Runner, name: str) -> None:
    env = bare_env(ETCDCTL_DIAL_TIMEOUT="soon")
    code, _, err = run(conch, ["sema", name, "--max", "1", "--", "true"], env)
    assert code == 64
    assert err.strip() == (
        "conch: bad ETCDCTL_DIAL_TIMEOUT 'soon': want a duration like 500ms, 10s, 1.5s, 2m, 1h30m"
    )
    env = bare_env(ETCDCTL_ENDPOINTS="etcd1,etcd2:2379")
    code, _, err = run(conch, ["sema", name, "--max", "1", "--", "true"], env)
    assert code == 64
    assert err == (
        "conch: bad endpoint 'etcd1' in ETCDCTL_ENDPOINTS: want host:port or http(s)://host:port\n"
    )
    code, _, err = run(
        conch, ["sema", name, "--max", "1", "--endpoints", "h" * 5000, "--", "true"], env
    )
    assert code == 64
    assert len(err) < 200 and "(5000 characters) in --endpoints" in err, err


def test_the_debug_line_says_where_the_password_came_from_never_what_it_is(
    conch: Runner, name: str
) -> None:
    secret = "hunter2-Zq"
    for env in (
        bare_env(ETCDCTL_USER=f"alice:{secret}"),
        bare_env(CONCH_USER="alice", ETCDCTL_PASSWORD=secret),
    ):
        env.update(ETCDCTL_ENDPOINTS=closed_endpoint(), ETCDCTL_DIAL_TIMEOUT="500ms")
        code, _, err = run(conch, ["sema", name, "--max", "1", "--debug", "--", "true"], env)
        assert code == 69, err
        assert "setting=user value=alice" in err
        assert "setting=password" in err
        assert secret not in err
    assert "source=ETCDCTL_PASSWORD" in err


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[EtcdCluster]:
    cluster = tls_cluster(tmp_path_factory.mktemp("tls"), pki, mutual=True)
    yield cluster
    cluster.stop()


def test_etcdctl_tls_settings_reach_a_mutual_tls_etcd(
    conch: Runner, tls_etcd: EtcdCluster, pki: Path, name: str
) -> None:
    env = bare_env(
        ETCDCTL_ENDPOINTS=tls_etcd.endpoints,
        ETCDCTL_CACERT=str(pki / "ca.pem"),
        ETCDCTL_CERT=str(pki / "client.pem"),
        ETCDCTL_KEY=str(pki / "client.key"),
    )
    code, out, err = run(conch, ["sema", name, "--max", "1", "--", "echo", "inside"], env)
    assert code == 0, err
    assert out == "inside\n"


def test_no_grpc_log_line_on_a_tls_failure(
    conch: Runner, tls_etcd: EtcdCluster, pki: Path, name: str
) -> None:
    args = ["sema", name, "--max", "1", "--endpoints", tls_etcd.endpoints]
    args += ["--cacert", str(pki / "other-ca.pem"), "--dial-timeout", "2s"]
    for quiet in ([], ["-q"]):
        code, _, err = run(conch, [*args, *quiet, "--", "true"], bare_env())
        assert code == 69
        lines = err.splitlines()
        assert len(lines) == 1, err  # no "I1201 ... ssl_transport_security.cc" lines
        assert lines[0].startswith("conch: level=error event=unavailable"), err


def test_an_operators_grpc_verbosity_is_left_as_given(
    conch: Runner, tls_etcd: EtcdCluster, pki: Path, name: str
) -> None:
    args = ["sema", name, "--max", "1", "--endpoints", tls_etcd.endpoints]
    args += ["--cacert", str(pki / "other-ca.pem"), "--dial-timeout", "2s", "--", "true"]
    code, _, err = run(conch, args, bare_env(GRPC_VERBOSITY="INFO"))
    assert code == 69
    assert "ssl_transport_security" in err  # gRPC's own lines, asked for


def test_the_child_gets_no_grpc_setting_the_command_made_for_itself(
    conch: Runner, etcd: EtcdCluster, name: str
) -> None:
    """A guard: gRPC's verbosity is set for the command's own import of grpc only."""
    script = 'echo "${GRPC_VERBOSITY-unset}"'
    args = ["sema", name, "--max", "1", "--", "sh", "-c", script]
    code, out, err = run(conch, args, bare_env(CONCH_ENDPOINTS=etcd.endpoints))
    assert code == 0, err
    assert out == "unset\n"
    code, out, err = run(
        conch, args, bare_env(CONCH_ENDPOINTS=etcd.endpoints, GRPC_VERBOSITY="INFO")
    )
    assert code == 0, err
    assert out == "INFO\n"


# -- connection flags before the subcommand ---------------------------------------------


def test_connection_flags_before_the_subcommand(
    conch: Runner, etcd: EtcdCluster, name: str
) -> None:
    env = bare_env(CONCH_ENDPOINTS=closed_endpoint())
    args = ["--endpoints", etcd.endpoints, "--dial-timeout", "5s", "sema", name, "--max", "1"]
    code, out, err = run(conch, [*args, "--", "echo", "ran"], env)
    assert code == 0, err
    assert out == "ran\n"
    code, _, err = run(
        conch, ["--debug", "--endpoints", etcd.endpoints, "sema", name, "--who"], env
    )
    assert code == 1, err
    assert "source=--endpoints" in err


def test_a_connection_flag_before_and_after_the_subcommand_is_refused(conch: Runner) -> None:
    args = ["--endpoints", closed_endpoint(), "sema", "x", "--max", "1"]
    code, _, err = run(conch, [*args, "--endpoints", closed_endpoint(), "--", "true"], bare_env())
    assert code == 64
    assert err == "conch: --endpoints given twice: give it once\n"


# -- what the holder's key stores -------------------------------------------------------


def held_value(client: Client, name: str) -> dict[str, object]:
    (item,) = sema_keys(client, name)
    value: dict[str, object] = json.loads(item.value)
    return value


@pytest.mark.parametrize(
    ("flags", "env", "whole"),
    [
        ([], {}, False),
        (["--record-args"], {}, True),
        ([], {"CONCH_RECORD_ARGS": "1"}, True),
    ],
)
def test_the_holders_key_stores_the_program_name_unless_asked_for_the_command_line(
    conch: Runner,
    client: Client,
    gate: Gate,
    name: str,
    flags: list[str],
    env: dict[str, str],
    whole: bool,
) -> None:
    cmd = gate.cmd("a")  # sh -c '<script>'
    proc = conch.start("sema", name, "--max", "1", *flags, "--", *cmd, **env)
    poll(lambda: "a" in gate.now_running(), what="the child to run")
    stored = held_value(client, name)["cmd"]
    shown = who_json(conch, name)
    gate.release("a")
    assert proc.wait() == 0, proc.log()
    if whole:
        assert isinstance(stored, str) and stored.startswith("sh -c trap")
    else:
        assert stored == "sh"  # the script, which could hold a secret, stays on this host
    assert [record["cmd"] for record in shown] == [stored]


# -- hints ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["-w", "10"], "unknown option '-w': did you mean --wait?"),
        (["-timeout", "10s"], "unknown option '-timeout': did you mean --wait?"),
        (["--timeout", "10"], "unknown option '--timeout': did you mean --wait?"),
        (["--wiat", "10s"], "unknown option '--wiat': did you mean --wait?"),
        (["-c", "echo hi"], "sh -c '...'"),
        (["-v"], "unknown option '-v' (conch logs every state change unless -q"),
        (["--no"], "unknown option '--no': did you mean --nonblock?"),
        (["--wait", "-1s"], "bad --wait '-1s': a duration is not negative"),
        (["--kill-after", "-2"], "bad --kill-after '-2': a duration is not negative"),
        (["--max", "2"], "--max given twice"),
        (["--wait", "1s", "--wait", "2s"], "--wait given twice"),
    ],
)
def test_a_habit_from_another_tool_gets_the_flag_meant(
    conch: Runner, words: list[str], says: str
) -> None:
    code, _, err = run(conch, ["sema", "x", "--max", "1", *words, "--", "true"], bare_env())
    assert code == 64
    assert err.startswith("conch: ") and err.count("\n") == 1, err
    assert says in err
    assert "goes after --" not in err  # it is already there


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["-w", "10", "sema", "x"], "conch: unknown option '-w': did you mean --wait?"),
        (["--wait", "10s", "sema", "x"], "conch: --wait goes after the subcommand"),
        (["-q", "sema", "x"], "conch: -q goes after the subcommand"),
    ],
)
def test_an_option_before_the_subcommand_is_named_not_its_value(
    conch: Runner, words: list[str], says: str
) -> None:
    """flock's order (flock -w 10 FILE CMD): not "invalid choice: '10'"."""
    code, _, err = run(conch, [*words, "--max", "1", "--", "true"], bare_env())
    assert code == 64
    assert err.startswith(says) and err.count("\n") == 1, err


def test_a_command_without_dashdash_is_told_where_it_goes(conch: Runner) -> None:
    code, _, err = run(conch, ["sema", "x", "--max", "1", "echo", "hi"], bare_env())
    assert code == 64
    assert err == (
        "conch: unexpected argument 'echo': the command goes after --: "
        "conch sema NAME --max N -- CMD...\n"
    )


@pytest.mark.parametrize(
    "words",
    [
        ["sema", "n" * 10_000, "--max", "1", "--", "true"],  # our check of the name
        ["n" * 10_000, "--", "true"],  # argparse's invalid choice
    ],
)
def test_a_long_value_is_cut_in_its_message(conch: Runner, words: list[str]) -> None:
    code, _, err = run(conch, words, bare_env())
    assert code == 64
    assert len(err) < 300, err
    assert "(10000 characters)" in err


def test_a_shell_line_as_the_command_gets_a_hint_at_sh_c(
    conch: Runner, etcd: EtcdCluster, client: Client, name: str
) -> None:
    env = bare_env(CONCH_ENDPOINTS=etcd.endpoints)
    code, _, err = run(conch, ["sema", name, "--max", "1", "-q", "--", "echo hi; true"], env)
    assert code == 127
    (line,) = err.splitlines()
    assert line.startswith("conch: level=error event=child-not-found")
    assert "sh -c" in line
    assert sema_keys(client, name) == []
    code, _, err = run(conch, ["sema", name, "--max", "1", "-q", "--", "no-such-cmd-x"], env)
    assert code == 127
    assert "sh -c" not in err  # a plain missing command gets no such hint


# -- completion after -- -----------------------------------------------------------------


def complete(words: list[str], cwd: Path, preamble: str = "") -> list[str]:
    """The candidates bash's completion for conch offers for the last of ``words``, in a
    bash without bash-completion (``preamble`` runs first)."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    script = (
        f"{preamble}\nsource {ROOT / 'completions/bash/conch'}\n"
        "spec=$(complete -p conch); fn=${spec##*-F }; fn=${fn%% *}\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}\n'
        '"$fn" conch "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script, "bash", *words],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if line]


def test_bash_completes_commands_then_files_after_dashdash(tmp_path: Path) -> None:
    (tmp_path / "data.txt").touch()
    (tmp_path / "dance").touch()
    (tmp_path / "other").touch()
    base = ["conch", "sema", "x", "--max", "1", "--"]
    assert sorted(complete([*base, "./da"], tmp_path)) == ["./dance", "./data.txt"]
    assert "printf" in complete([*base, "print"], tmp_path)
    assert sorted(complete([*base, "cat", "da"], tmp_path)) == ["dance", "data.txt"]
    # before --, the options as before
    assert "--max" in complete(["conch", "sema", "x", "--ma"], tmp_path)


def test_bash_hands_the_words_after_dashdash_to_the_commands_own_completion(
    tmp_path: Path,
) -> None:
    """With bash-completion loaded, as sudo's completion does: _command_offset at the
    command's word (a stand-in here records where it was asked to start)."""
    stand_in = '_command_offset() { COMPREPLY=("offset=$1" "word=${COMP_WORDS[$1]}"); }'
    words = ["conch", "--debug", "sema", "x", "--max", "1", "--", "git", "chec"]
    assert complete(words, tmp_path, stand_in) == ["offset=7", "word=git"]


def test_fish_completes_commands_then_files_after_dashdash(tmp_path: Path) -> None:
    """fish's own ``complete -C``: what TAB would offer for a command line."""
    if shutil.which("fish") is None:
        pytest.skip("needs fish")
    (tmp_path / "dance").touch(mode=0o755)
    (tmp_path / "data.txt").touch()

    def fish(line: str) -> list[str]:
        script = f"source {ROOT / 'completions/fish/conch.fish'}; complete -C {line!r}"
        out = subprocess.run(
            ["fish", "--no-config", "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return [candidate.split("\t")[0] for candidate in out.stdout.splitlines()]

    assert fish("conch sema x --max 1 -- ./da") == ["./dance"]  # executables, as fish does
    assert "printenv" in fish("conch sema x --max 1 -- printen")
    assert sorted(fish("conch sema x --max 1 -- cat da")) == ["dance", "data.txt"]
    assert fish("conch sema x --max 1 -- --ma") == []  # no conch option after --
    assert fish("conch sema x --ma") == ["--max"]


# Drives an interactive zsh on a pseudo-terminal (zsh/zpty): types the line and a TAB, then
# ^E and a marker; zle handles the keys in order, so the completion is done by the marker.
ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty z 'zsh -f -i'
zpty -w z "PS1='> '; fpath=($1 \$fpath); autoload -Uz compinit; compinit -u -D; print READY"
zpty -r z out '*READY*'
zpty -r z out '*> '
zpty -w -n z "$2"$'\t\x05 #END\n'
zpty -r z out '*#END*'
print -r -- "$out"
zpty -d z
"""


def _as_shown(echoed: str) -> str:
    """A terminal line as it shows once its backspaces moved the cursor back."""
    cells: list[str] = []
    at = 0
    for c in echoed:
        if c == "\b":
            at = max(0, at - 1)
            continue
        if at < len(cells):
            cells[at] = c
        else:
            cells.append(c)
        at += 1
    return "".join(cells)


def test_zsh_completes_commands_then_files_after_dashdash(tmp_path: Path) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("needs zsh")
    (tmp_path / "uniq-file-xyz").touch()

    def zsh(line: str) -> str:
        """The line as TAB left it."""
        out = subprocess.run(
            ["zsh", "-f", "-c", ZSH_DRIVER, "zsh", str(ROOT / "completions/zsh"), line],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out).replace("\r", "")
        return _as_shown(plain.splitlines()[-1].split("#END")[0]).strip()

    assert zsh("conch sema x --max 1 -- ./uni").endswith("-- ./uniq-file-xyz")
    assert zsh("conch sema x --max 1 -- printen").endswith("-- printenv")
    assert zsh("conch --debug sema x -- cat uni").endswith("-- cat uniq-file-xyz")
    assert zsh("conch sema x --ma").endswith("sema x --max")


# -- --spread waiters in --who -------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="a --spread waiter whose host holds the key writes no key of its own "
    "(Semaphore._enqueue waits on the host's key): there is nothing in etcd to list",
)
def test_a_spread_waiter_on_the_same_host_shows_in_who(
    conch: Runner, gate: Gate, name: str
) -> None:
    a = conch.start("sema", name, "--max", "2", "--spread", "--", *gate.cmd("a"), CONCH_HOST="h")
    poll(lambda: "a" in gate.now_running(), what="the first on h to hold")
    b = conch.start("sema", name, "--max", "2", "--spread", "--", *gate.cmd("b"), CONCH_HOST="h")
    try:
        poll(lambda: "event=spread-busy" in b.log(), what="the second on h to wait")

        def both() -> list[dict[str, object]] | None:
            records = who_json(conch, name)
            return records if len(records) == 2 else None

        records = poll(both, timeout=10, what="both in --who") or []
        states = sorted((r["state"], r["host"], r["pid"]) for r in records)
        assert states == sorted([("HELD", "h", a.pid), ("WAIT", "h", b.pid)])
    finally:
        gate.release("a")
        gate.release("b")
        assert a.wait() == 0 and b.wait() == 0
