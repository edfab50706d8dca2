"""Who is calling: the peer identity every per-client limit is keyed by.

DESIGN §16: no single client may take more than its share of server threads,
publication slots, reserved bytes, file descriptors, leases or verify work.
Those caps are counted per :class:`Peer`. :func:`peer_of` is the one place a
handler learns its peer from the gRPC context.

How the daemon knows a peer. grpcio hands a handler no socket, and
``ServicerContext.peer()`` on a Unix socket is just ``"unix:"``, so the
kernel's ``SO_PEERCRED`` cannot be read on the gRPC connection itself.
Instead, a credentials handshake on a side socket:

1. Next to the runtime socket the daemon listens on ``<socket>.cred``
   (:data:`~hwr_client.core.defaults.PEER_SOCKET_SUFFIX`): same directory,
   mode and group, so whoever may call the daemon may shake hands
   (:class:`PeerListener`).
2. A client connects once per process. The daemon reads ``(pid, uid, gid)``
   from ``SO_PEERCRED`` (the kernel's word, not the client's), writes one
   line, the token ``v2.<pid>.<uid>.<start>.<mac>`` with ``start`` the
   process's start time (``/proc/<pid>/stat``, clock ticks since boot) and
   ``mac = HMAC-SHA256(key, "v2.<pid>.<uid>.<start>")``, and closes. It never
   reads from the client, so one that connects and stalls costs nothing.
3. The client sends the token as gRPC metadata
   (:data:`~hwr_client.core.defaults.PEER_TOKEN_METADATA`) on every call;
   :func:`peer_of` checks the MAC, then that the process it names is alive:
   ``/proc/<pid>`` has that start time (so not a reused pid) and runs as that
   effective uid now (so not a process that changed users since). Then it
   answers ``Peer(pid, uid)``. No token, a malformed one, a wrong MAC or a
   process that is gone: :data:`ANONYMOUS`, which has caps of its own (old
   clients, raw gRPC, a daemon without the side socket).

Why a MAC and not a table of issued tokens: checking needs no state, so a
client that shakes hands a million times grows nothing; and the key lives in
``<root>/peer.key`` (0600, owned by the daemon), so a live worker's token
survives a daemon restart and a re-attaching client keeps its identity.

A token is still a bearer secret while its process lives: the uid a call is
served as (which files ResolveSources vouches for, which leases ListLeases
shows) is the token's. gRPC gives a handler neither the connection's socket
nor its ``SO_PEERCRED``, so the daemon cannot tie a call to the process that
made it; binding the token to the live process bounds a leak to that
process's lifetime (it dies with the process, is refused for a reused pid
and after a setuid). The client keeps it in memory only, never in the
environment, a file or a log, and shakes hands again after a fork or a uid
change (:mod:`hwr_client.channel`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from typing import Callable

import grpc

from hwr_client.core.defaults import PEER_TOKEN_METADATA
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.access.runtime_dir import listening_socket

log = logging.getLogger(__name__)

#: The MAC key's file in the store root.
KEY_FILE = "peer.key"
_KEY_BYTES = 32
#: Longest token we parse; anything longer is not ours (anonymous).
_MAX_TOKEN_CHARS = 96
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: A checked token's answer is reused for this long (one /proc read per
#: process and period, not per call). Bounds how long a token outlives its
#: process. Seconds.
_LIVE_CHECK_S = 1.0
#: Checked tokens remembered at most (the memo is dropped whole when full).
_LIVE_MEMO_MAX = 4096
#: accept() wakes this often to notice close(); a sleep that close() ends
#: early, correctness does not depend on it. Seconds.
_ACCEPT_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Peer:
    """A calling process as far as the daemon can prove it.

    Attributes:
        pid: the process id (kernel-checked), or None when unknown.
        uid: the user id (kernel-checked), or None when unknown.
    """

    pid: int | None = None
    uid: int | None = None

    @property
    def key(self) -> str:
        """A stable label for logs and per-peer accounting."""
        return "anonymous" if self.pid is None else f"pid {self.pid} (uid {self.uid})"

    @property
    def uid_key(self) -> str:
        """The label per-uid shares are counted by: every process of one
        uid together; every caller without a token is one "anonymous"."""
        return "anonymous" if self.uid is None else f"uid {self.uid}"


ANONYMOUS = Peer()


def privileged(peer: Peer) -> bool:
    """Whether ``peer`` runs as root or as the daemon's own uid: the node's
    operator. Per-uid shares (streams, publications, registration budget)
    do not cap it, and the runtime socket's listings show it everything."""
    return peer.uid is not None and (peer.uid == 0 or peer.uid == os.geteuid())


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, field 22 of
    ``/proc/<pid>/stat``), or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        # The command name (field 2) may hold spaces and parentheses: the
        # fields after it start after the LAST ')'. Field 3 is index 0.
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_euid(pid: int) -> int | None:
    """Effective uid of process ``pid`` now (``/proc/<pid>/status``), or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeerAuthority:
    """Issues and checks peer tokens with one MAC key.

    Args:
        key: the secret (see :func:`load_key`).
    """

    def __init__(self, key: bytes, *, clock: Callable[[], float] = time.monotonic):
        self._key = key
        self._clock = clock
        # token -> (peer, checked at): the liveness check's memo.
        self._live: dict[str, tuple[Peer, float]] = {}
        self._live_lock = threading.Lock()

    def _mac(self, pid: int, uid: int, start: int) -> str:
        return hmac.new(self._key, f"v2.{pid}.{uid}.{start}".encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, pid: int, uid: int) -> str:
        """The token of the live process ``pid`` running as ``uid``; "" when
        its start time cannot be read (it is gone): no token, anonymous."""
        start = process_start(pid)
        if start is None:
            return ""
        return f"v2.{pid}.{uid}.{start}.{self._mac(pid, uid, start)}"

    def verify(self, token: str) -> Peer | None:
        """The peer a token names, or None if we did not issue it or its
        process is gone (see the module docstring)."""
        if len(token) > _MAX_TOKEN_CHARS:
            return None
        now = self._clock()
        memo = self._live.get(token)  # a dict read, atomic in CPython
        if memo is not None and now - memo[1] < _LIVE_CHECK_S:
            return memo[0]
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != "v2" or not all(p.isascii() and p.isdigit() for p in parts[1:4]):
            return None
        pid, uid, start = int(parts[1]), int(parts[2]), int(parts[3])
        # compare_digest: the time taken must not tell how much of a guessed
        # MAC was right.
        if not hmac.compare_digest(parts[4], self._mac(pid, uid, start)):
            return None
        # The process the token was issued to, still running as that uid:
        # a reused pid has another start time, a setuid another euid.
        if process_start(pid) != start or process_euid(pid) != uid:
            return None
        peer = Peer(pid, uid)
        with self._live_lock:
            if len(self._live) >= _LIVE_MEMO_MAX:
                self._live.clear()
            self._live[token] = (peer, now)
        return peer


def load_key(root: str) -> bytes:
    """The MAC key from ``<root>/peer.key``, replacing a missing or unfit one.

    The file is opened with ``O_NOFOLLOW`` and used only if it is a regular
    file owned by the daemon's uid, not readable by others, of exactly 32
    bytes: a planted link or a key someone else could read is replaced,
    never trusted. If the root is not writable the key lives in memory only
    (tokens then do not outlive this daemon; logged).
    """
    path = os.path.join(root, KEY_FILE)
    try:
        # The store's one rule for trusting a stored file: no link followed,
        # no blocking open (a planted FIFO), a regular file of our uid.
        fd, st = open_stored(path, what="peer key")
    except FileNotFoundError:
        return _new_key(path, "absent")
    except Untrusted as exc:
        return _new_key(path, str(exc))
    try:
        if st.st_mode & 0o077:
            problem = f"mode {stat.S_IMODE(st.st_mode):04o}, expected 0600"
        else:
            data = os.read(fd, _KEY_BYTES + 1)
            if len(data) == _KEY_BYTES:
                return data
            problem = f"{len(data)} bytes, expected {_KEY_BYTES}"
    finally:
        os.close(fd)
    return _new_key(path, problem)


def _new_key(path: str, why: str) -> bytes:
    key = secrets.token_bytes(_KEY_BYTES)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # unique per attempt
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, key)
        finally:
            os.close(fd)
        # rename replaces a planted link itself, never its target. No fsync:
        # a key lost in a crash only means new tokens after the restart
        # (clients fall back to anonymous until they shake hands again).
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("peer key %s: %s and cannot be written (%s); tokens will not survive a restart", path, why,
                    exc.strerror)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return key
    if why != "absent":
        log.warning("peer key %s: %s; replaced with a new key (clients shake hands again)", path, why)
    return key


class PeerListener:
    """The credentials socket: answers every connection with its token.

    Args:
        path: where to listen (``<runtime socket>.cred``).
        authority: issues the tokens.
    """

    def __init__(self, path: str, authority: PeerAuthority):
        self.path = path
        self.authority = authority
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def bind(self, *, mode: int, gid: int) -> None:
        """Binds ``path`` with ``mode`` (and group ``gid`` unless -1) and starts answering.

        Raises:
            OSError: the path cannot be bound.
        """
        sock = listening_socket(self.path, mode=mode, gid=gid)
        sock.settimeout(_ACCEPT_POLL_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="hwr-peer-cred", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                # Out of fds or memory: say so and keep serving; the client
                # falls back to anonymous and the other calls go on.
                log.warning("peer credentials socket %s: accept failed (%s)", self.path,
                            errno.errorcode.get(exc.errno or 0, exc))
                self._closed.wait(0.1)
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            # pid 0: the peer lives in a pid namespace we cannot see; no
            # token (anonymous) rather than one every such process shares.
            # The peer is alive while it waits for this line, so its pid
            # cannot be reused before issue() reads its start time.
            token = self.authority.issue(pid, uid) if pid > 0 else ""
            # The line fits any socket buffer, so sendall does not wait on a
            # client that never reads; the timeout bounds it regardless.
            conn.settimeout(1.0)
            conn.sendall(token.encode() + b"\n")
        except OSError as exc:
            log.debug("peer credentials socket %s: handshake failed (%s)", self.path, exc)

    def close(self) -> None:
        """Stops answering and removes the socket file. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# The daemon installs its authority once at start (one daemon per process);
# peer_of keeps the signature handlers already call.
_authority: PeerAuthority | None = None


def install(authority: PeerAuthority | None) -> None:
    """Makes :func:`peer_of` check tokens with ``authority`` (None: every
    call is anonymous)."""
    global _authority
    _authority = authority


def peer_of(context: grpc.ServicerContext) -> Peer:
    """The peer of the call ``context`` belongs to (see the module docstring)."""
    authority = _authority
    if authority is None:
        return ANONYMOUS
    for k, v in context.invocation_metadata() or ():
        if k == PEER_TOKEN_METADATA:
            return (authority.verify(v) if isinstance(v, str) else None) or ANONYMOUS
    return ANONYMOUS
