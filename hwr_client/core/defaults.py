"""Defaults shared by the daemon and the client: paths, message limits and
the size syntax of every ``--size``/``capacity`` option.

Torch-free and client-free (the daemon imports it). Nothing here reads the
environment at import; :func:`default_paths` reads it only when called (from
CLI code or a client choosing its socket).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Mapping

from hwr_client.core.errors import FailedPrecondition, InvalidArgument

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
#: reads the kernel's SO_PEERCRED and answers a token (hwr_server.access.peers).
PEER_SOCKET_SUFFIX = ".cred"

#: gRPC metadata key under which a client sends that token on every call.
PEER_TOKEN_METADATA = "hwr-peer-token"

#: The daemon's handoff socket is the runtime socket's path plus this suffix
#: (same directory, same mode): a publisher on the handoff transport gets
#: each staging file's descriptor there (hwr_server.publish.handoff).
HANDOFF_SOCKET_SUFFIX = ".pub"

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
    XDG data/runtime directories for a normal user.

    Without ``XDG_RUNTIME_DIR`` the sockets go under ``/tmp/hwr-<uid>-run/``,
    a name anyone can predict and pre-create: the daemon and a client that
    uses these defaults check it with :func:`check_trusted_dir` first."""
    uid = os.getuid() if uid is None else uid
    env = os.environ if env is None else env  # read at call time, never at import
    if uid == 0:
        return "/var/lib/hwr", "/run/hwr/hwr.sock", "/run/hwr/admin.sock"
    data = env.get("XDG_DATA_HOME") or os.path.join(env.get("HOME", f"/tmp/hwr-{uid}"), ".local", "share")
    run = env.get("XDG_RUNTIME_DIR") or f"/tmp/hwr-{uid}-run"
    return os.path.join(data, "hwr"), os.path.join(run, "hwr", "hwr.sock"), os.path.join(run, "hwr", "admin.sock")


#: Symbolic links followed while checking one path before giving up (the
#: kernel's own limit, ELOOP).
_MAX_LINKS = 40


def check_trusted_dir(path: str, *, uid: int | None = None) -> None:
    """Refuses a directory that a user other than root and ``uid`` could
    change: where a socket or lock file lives, anyone who can rename or
    create entries in it (or in any directory above it) can swap the socket
    for an impostor's or plant a symbolic link that the daemon then writes
    through.

    The rule is OpenSSH's ``safe_path`` and systemd's: every directory from
    ``/`` down to ``path`` is owned by root or ``uid`` and is not writable by
    group or others, except a sticky directory (``/tmp``), where others may
    create entries but never rename or remove ours (the next component's
    owner is then checked in turn). A symbolic link on the way must itself
    be owned by root or ``uid``; its target is checked the same way. The walk
    stops at the first component that does not exist: nothing is there to
    trust yet, and whoever creates it (the daemon, 0700) is checked next
    time.

    Args:
        path: the directory (absolute or relative to the working directory).
        uid: the user it must be safe for; default the effective uid.

    Raises:
        FailedPrecondition: naming the component, its owner and mode, and
            the fix.

    Example:
        >>> check_trusted_dir("/run/hwr")  # doctest: +SKIP
    """
    uid = os.geteuid() if uid is None else uid
    pending = [p for p in os.path.abspath(path).split("/") if p]
    resolved: list[str] = []  # the components walked so far, no link among them
    _check_component("/", os.lstat("/"), uid, path)
    links = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            # `resolved` holds no link, so ".." is its lexical parent.
            if resolved:
                resolved.pop()
            continue
        here = "/" + "/".join(resolved + [name])
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise FailedPrecondition(f"directory {path}: more than {_MAX_LINKS} symbolic links on the way")
            _check_owner(here, st, uid, path, "symbolic link")
            target = os.readlink(here)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        _check_component(here, st, uid, path)
        resolved.append(name)


def _where(here: str, path: str, kind: str = "directory") -> str:
    """Names ``here`` in a message: the directory itself or one on its way."""
    if here == os.path.abspath(path):
        return f"{kind} {here}"
    return f"directory {path}: {kind} {here} on its way"


def _check_owner(here: str, st: os.stat_result, uid: int, path: str, kind: str) -> None:
    if st.st_uid not in (0, uid):
        raise FailedPrecondition(
            f"{_where(here, path, kind)} is owned by uid {st.st_uid}, expected root or uid {uid}; "
            "another user could replace what is in it. Remove it, or set XDG_RUNTIME_DIR or the socket "
            "path to a directory of your own (mode 0700)"
        )


def _check_component(here: str, st: os.stat_result, uid: int, path: str) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{_where(here, path)} is not a directory ({stat.filemode(st.st_mode)})")
    _check_owner(here, st, uid, path, "directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise FailedPrecondition(
            f"{_where(here, path)} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by group or others, "
            "who could replace what is in it; expected no group/other write (e.g. chmod 0700 or 0750)"
        )
