"""Pure functions of the contract: durations, names and keys, identity, endpoints."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable

import pytest

from conch import keys
from conch.cli import parse_duration, parse_ttl
from conch.errors import UsageError
from conch.etcd import Endpoint
from conch.etcd.kv import prefix_end
from conch.flag import Flag
from conch.identity import Identity, cut_utf8


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("10s", 10),
        ("1.5s", 1.5),
        ("2m", 120),
        ("1h30m", 5400),
        ("7", 7),
        ("0.25", 0.25),
        ("1m30s", 90),
        ("250us", 0.00025),
        ("0s", 0),
    ],
)
def test_go_durations_parse_to_seconds(text: str, seconds: float) -> None:
    assert parse_duration("--wait", text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "10x", "-1s", "1.2.3s", "10 s", "1h-5m", "ten"])
def test_bad_durations_name_the_flag_and_value(text: str) -> None:
    with pytest.raises(UsageError, match=r"--wait") as info:
        parse_duration("--wait", text)
    assert repr(text) in str(info.value)


def test_ttl_is_whole_seconds_at_least_one() -> None:
    assert parse_ttl("--ttl", "2m") == 120
    for bad in ("1.5s", "500ms", "0s"):
        with pytest.raises(UsageError, match="whole seconds"):
            parse_ttl("--ttl", bad)


def test_keys_follow_the_schema() -> None:
    assert keys.holder_key("video", 2, 0x2A) == b"/conch/v1/sema/video/2/2a"
    assert keys.spread_key("video", 2, "node1") == b"/conch/v1/sema/video/2/node1"
    assert keys.sema_prefix("a", 1) == b"/conch/v1/sema/a/1/"


def test_slash_and_percent_in_names_are_encoded_so_prefixes_never_nest() -> None:
    assert keys.name_prefix("a/1") == b"/conch/v1/sema/a%2F1/"
    assert keys.name_prefix("50%") == b"/conch/v1/sema/50%25/"
    assert not keys.name_prefix("a/1").startswith(keys.name_prefix("a"))
    assert keys.spread_key("a", 1, "h/x%") == b"/conch/v1/sema/a/1/h%2Fx%25"


@pytest.mark.parametrize("bad", ["", ".", "..", "x" * 201, "tab\there", "nl\n", "del\x7f"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(UsageError, match="bad name"):
        keys.check_name(bad)


def test_a_200_byte_utf8_name_is_accepted() -> None:
    keys.check_name("é" * 100)
    with pytest.raises(UsageError):
        keys.check_name("é" * 100 + "x")


def test_identity_is_one_line_of_json_with_cmd_cut_on_a_character_boundary() -> None:
    ident = Identity.current(["echo", "ü" * 200], host="node9", record_args=True)
    raw = ident.to_json()
    assert b"\n" not in raw
    data = json.loads(raw)
    assert set(data) == {"host", "pid", "started", "cmd"}
    assert data["host"] == "node9"
    assert len(data["cmd"].encode()) <= 256
    assert data["started"].endswith("Z")
    assert cut_utf8("aü", 2) == "a"


def test_endpoints_parse_with_and_without_scheme() -> None:
    assert Endpoint.parse("10.0.0.1:2379") == Endpoint("10.0.0.1", 2379, False)
    assert Endpoint.parse("http://h:1") == Endpoint("h", 1, False)
    assert Endpoint.parse("https://h:2") == Endpoint("h", 2, True)
    assert Endpoint.parse("[::1]:2379").target == "[::1]:2379"
    for bad in ("nohost", "h:", "h:99999", "ftp://h:1x"):
        with pytest.raises(UsageError, match="bad endpoint"):
            Endpoint.parse(bad)


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"


def test_a_flag_callback_that_raises_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    flag = Flag("f")
    got: list[str] = []
    flag.add_callback(lambda f: got.append("first"))
    flag.add_callback(lambda f: [][0])
    flag.add_callback(lambda f: got.append(str(f.reason)))
    flag.set("why")
    assert got == ["first", "why"]
    assert "event=callback-failed" in caplog.text


def test_a_flag_is_set_once_and_each_callback_runs_once_however_calls_race() -> None:
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # make the races likely

    def race(*actions: Callable[[], object]) -> None:
        barrier = threading.Barrier(len(actions))
        threads = [threading.Thread(target=lambda a=a: (barrier.wait(), a())) for a in actions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def set_against_add_callback() -> None:
        flag, calls = Flag("f"), list[Flag]()
        race(lambda: flag.set("r"), lambda: flag.add_callback(calls.append))
        assert len(calls) == 1

    def set_against_set() -> None:
        flag, calls = Flag("f"), list[object]()
        flag.add_callback(lambda f: calls.append(f.reason))
        race(lambda: flag.set("a"), lambda: flag.set("b"))
        assert len(calls) == 1 and calls[0] == flag.reason

    try:
        for _ in range(4000):
            set_against_add_callback()
            set_against_set()
    finally:
        sys.setswitchinterval(switch)


@pytest.mark.parametrize(("field", "value"), [("max", True), ("ttl", True), ("ttl", 10**12)])
def test_semaphore_refuses_booleans_and_absurd_ttls(field: str, value: object) -> None:
    from conch.semaphore import Semaphore

    settings: dict[str, object] = {"max": 1, "ttl": 10, field: value}
    with pytest.raises(UsageError):
        Semaphore(None, "n", **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["", "a\nb", "nul\x00", "x" * 201, ".."])
def test_semaphore_refuses_a_host_name_no_key_could_carry(host: str) -> None:
    from conch.etcd.client import Client, Endpoint
    from conch.semaphore import Semaphore

    identity = Identity(host, 1, "2026-01-01T00:00:00Z", "true")
    client = Client([Endpoint("127.0.0.1", 1, False)])  # never dialled: the host is checked first
    try:
        with pytest.raises(UsageError, match="CONCH_HOST"):
            Semaphore(client, "n", 1, identity=identity)
    finally:
        client.close()


@pytest.mark.parametrize(
    "timeouts",
    [(0.0, 5.0), (5.0, 0.0), (-1.0, 5.0), (float("nan"), 5.0), (float("inf"), 5.0), (5.0, 9e9)],
)
def test_connect_refuses_timeouts_that_are_not_above_zero(timeouts: tuple[float, float]) -> None:
    from conch.etcd.client import connect

    with pytest.raises(UsageError, match="want seconds above 0, at most 10 years"):
        connect("127.0.0.1:1", *timeouts)


def test_a_stream_removed_by_the_server_is_retried_like_an_unavailable_member() -> None:
    """etcd 3.4 under a burst of auth changes reset a LeaseRevoke's stream ("Stream removed",
    status UNKNOWN): the release gave up (revoke-failed) instead of retrying."""
    import grpc

    from conch.errors import Unavailable
    from conch.etcd.client import map_rpc_error

    class Removed(grpc.RpcError, grpc.Call):  # type: ignore[misc]
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNKNOWN

        def details(self) -> str:
            return "Stream removed"

    assert isinstance(map_rpc_error(Removed()), Unavailable)


def test_every_variable_a_password_is_read_from_is_listed_as_a_credential() -> None:
    """watchdog.CREDENTIAL_VARIABLES, for whoever scrubs them from a child's environment:
    a password found through any variable not in it fails this test."""
    from conch.settings import ConnectionFlags, resolve
    from conch.watchdog import CREDENTIAL_VARIABLES

    secret = "pw-Xq7"
    cases = [
        {"CONCH_USER": f"u:{secret}"},
        {"CONCH_USER": "u", "CONCH_PASSWORD": secret},
        {"ETCDCTL_USER": f"u:{secret}"},
        {"ETCDCTL_USER": "u", "ETCDCTL_PASSWORD": secret},
    ]
    for environ in cases:
        connection = resolve(ConnectionFlags(), environ)
        assert connection.credentials is not None
        assert connection.credentials.password == secret
        left = {k: v for k, v in environ.items() if k not in CREDENTIAL_VARIABLES}
        assert resolve(ConnectionFlags(), left).credentials is None


def test_the_child_and_the_watchdog_lose_every_credential_variable_the_settings_read() -> None:
    """The password file and the client certificate and key paths are removed with the
    secrets (conch.watchdog.without_credentials, for both), the CA bundle is not."""
    from conch.watchdog import CREDENTIAL_VARIABLES, without_credentials

    cacerts = {"CONCH_CACERT": "ca.pem", "ETCDCTL_CACERT": "ca.pem"}
    assert without_credentials({**dict.fromkeys(CREDENTIAL_VARIABLES, "x"), **cacerts}) == cacerts
    for prefix in ("CONCH_", "ETCDCTL_"):
        assert {prefix + "CERT", prefix + "KEY"} <= set(CREDENTIAL_VARIABLES)
