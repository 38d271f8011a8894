"""The key schema (contract section 5): the only module that knows ``/conch/v1``.

/conch/v1/sema/<name>/<max>/<lease-id>   one leased key per holder or waiter
/conch/v1/sema/<name>/<max>/<lease-id>-<n>  more holds of one semaphore on one session
/conch/v1/sema/<name>/<max>/<host>       the same with --spread

Every reader ranks the keys under ``<name>/<max>/`` by create_revision and takes the lease
from the key's own lease field, never from its name: the ``-<n>`` form reads as any other.
"""

from __future__ import annotations

from conch.errors import UsageError
from conch.hints import SHOWN_MAX, shown

ROOT = b"/conch/v1/sema/"
NAME_MAX_BYTES = 200
MAX_CAPACITY = 1_000_000


def check_host(host: str) -> None:
    """The node name (``CONCH_HOST``) goes into the value of every key and, with --spread,
    into the key: the same rules as a name. Raises UsageError."""
    check_name(host, "CONCH_HOST")


def check_name(name: str, what: str = "name") -> None:
    """Raise UsageError naming ``what`` unless ``name`` is 1..200 bytes of UTF-8, no control
    characters, not ``.`` or ``..``."""
    if not isinstance(name, str):
        raise UsageError(f"bad {what} {repr(name)[:SHOWN_MAX]}: want a str")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise UsageError(f"bad {what} {shown(name)}: not valid UTF-8") from None
    if not 1 <= size <= NAME_MAX_BYTES:
        raise UsageError(f"bad {what} {shown(name)}: must be 1 to {NAME_MAX_BYTES} bytes of UTF-8")
    if name in (".", ".."):
        raise UsageError(f"bad {what} {shown(name)}: '.' and '..' are not names")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        raise UsageError(f"bad {what} {shown(name)}: control characters are not allowed")


def encode_segment(text: str) -> bytes:
    """``%`` and ``/`` percent-encoded, so no name's keys fall under another name's prefix."""
    return text.replace("%", "%25").replace("/", "%2F").encode("utf-8")


def name_prefix(name: str) -> bytes:
    """Every capacity of one name: ``/conch/v1/sema/<name>/``."""
    check_name(name)
    return ROOT + encode_segment(name) + b"/"


def sema_prefix(name: str, max_holders: int) -> bytes:
    """One semaphore (name, max): ``/conch/v1/sema/<name>/<max>/`` (always ends in ``/``)."""
    return name_prefix(name) + str(max_holders).encode() + b"/"


def holder_key(name: str, max_holders: int, lease_id: int) -> bytes:
    """Our key: the lease ID in lowercase hex, no ``0x``."""
    return sema_prefix(name, max_holders) + f"{lease_id:x}".encode()


def spread_key(name: str, max_holders: int, host: str) -> bytes:
    """Our key with --spread: one per host."""
    return sema_prefix(name, max_holders) + encode_segment(host)


def capacity_of(name: str, key: bytes) -> int | None:
    """The capacity of a key found under ``name_prefix(name)``: None unless the key is
    ``<max>/<tail>`` with ``<max>`` as conch writes it (1 to MAX_CAPACITY, no leading 0)."""
    max_raw, sep, tail = key[len(name_prefix(name)) :].partition(b"/")
    text = max_raw.decode("ascii", "replace")
    whole = sep and tail and text.isdigit() and str(int(text)) == text
    return int(text) if whole and 1 <= int(text) <= MAX_CAPACITY else None


def check_max(max_holders: int, parameter: str = "max") -> None:
    """Raise UsageError naming ``parameter`` (the CLI: ``--max``) unless ``max_holders`` is
    a whole number, 1 to MAX_CAPACITY."""
    if type(max_holders) is not int or not 1 <= max_holders <= MAX_CAPACITY:
        raise UsageError(
            f"bad {parameter} {max_holders!r}: want a whole number, 1 to {MAX_CAPACITY}"
        )
