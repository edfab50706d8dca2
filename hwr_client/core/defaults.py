"""Defaults shared by the daemon and the client: paths, message limits and
the size syntax of every ``--size``/``capacity`` option.

Torch-free and client-free (the daemon imports it). Nothing here reads the
environment at import; :func:`default_paths` reads it only when called (from
CLI code or a client choosing its socket).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from hwr_client.core.errors import InvalidArgument

#: gRPC message limit on both sides: a 4 MiB payload chunk plus framing, and
#: large manifests.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Channel/server options that apply that limit in both directions.
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

#: The daemon's peer-credentials socket is the runtime socket's path plus
#: this suffix (same directory, same mode): a client connects, the daemon
#: reads the kernel's SO_PEERCRED and answers a token (hwr_server.peers).
PEER_SOCKET_SUFFIX = ".cred"

#: gRPC metadata key under which a client sends that token on every call.
PEER_TOKEN_METADATA = "hwr-peer-token"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# One letter (k, m, g, t, p) and the IEC names are binary; "KB", "MB"... are
# decimal, as on a disk's label.
_UNITS = {"": 1, "B": 1,
          "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30,
          "T": 2**40, "TIB": 2**40, "P": 2**50, "PIB": 2**50,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}


def parse_size(text: str | int) -> int:
    """Bytes from ``"100MiB"``, ``"2TiB"``, ``"1.5GB"``, ``"512m"``,
    ``"4096"`` or an int.

    Raises:
        InvalidArgument: anything else, or a negative int.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgument(f"size {text}: expected >= 0")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidArgument(
            f"size {text!r}: expected a number with an optional unit like 64MiB, 2TiB, 1.5GB or 512m"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float) -> str:
    """``n`` bytes as ``"1.5 GiB"`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def default_paths(uid: int | None = None, env: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """(root, socket, admin socket) defaults: system paths for root, the
    XDG data/runtime directories for a normal user."""
    uid = os.getuid() if uid is None else uid
    env = os.environ if env is None else env  # read at call time, never at import
    if uid == 0:
        return "/var/lib/hwr", "/run/hwr/hwr.sock", "/run/hwr/admin.sock"
    data = env.get("XDG_DATA_HOME") or os.path.join(env.get("HOME", f"/tmp/hwr-{uid}"), ".local", "share")
    run = env.get("XDG_RUNTIME_DIR") or f"/tmp/hwr-{uid}-run"
    return os.path.join(data, "hwr"), os.path.join(run, "hwr", "hwr.sock"), os.path.join(run, "hwr", "admin.sock")
