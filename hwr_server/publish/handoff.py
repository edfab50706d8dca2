"""The handoff socket: staging-file descriptors for local publishers.

A publication on the handoff transport (``PublishPlan.file_handoff``) never
carries its payload in messages. Its client asks this socket for each
staging file and receives an open, write-only descriptor of it (SCM_RIGHTS),
writes the file's data region straight from its tensors, closes the
descriptor and says so on its Publish stream; the daemon then seals the file
(:mod:`hwr_server.publish.handed`), hashes what it holds and fsyncs it. The
daemon keeps naming, hashing, durability and the commit; the bytes cross
from the client's memory into the page cache once, by the client's
``pwrite``, instead of being copied into messages, through gRPC and out of
them on both sides.

Protocol, one connection per file (:data:`~hwr_client.core.defaults.HANDOFF_SOCKET_SUFFIX`
next to the runtime socket, with its mode and group):

1. The client sends one line, ``<token> <file index>\\n`` (the token is the
   publication's ``PublishAccepted.handoff_token``, 32 hex).
2. The daemon answers ``ok\\n`` with the descriptor attached, or
   ``error <CODE> <message>\\n`` (CODE a gRPC status name), and closes.

Who may receive a descriptor: the holder of the token (a secret only the
publication's own stream carried) whose kernel-checked uid (``SO_PEERCRED``)
is the publication's peer's uid where the daemon knows it. A line that does
not come within :data:`READ_TIMEOUT_S` is closed; an unknown token or a
sealed file gets an error and nothing else. One thread reads the request
lines of every connection (a silent client holds no thread); a few answer
them; a burst beyond :data:`MAX_WAITING` waiting connections is closed
unanswered.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from hwr_client.core.errors import HwrError, InvalidArgument, NotFound, status_code_of
from hwr_server.access.runtime_dir import listening_socket

log = logging.getLogger(__name__)

#: Seconds a connection may take to send its line (it holds no thread
#: meanwhile: a busy client's thread may be descheduled that long).
READ_TIMEOUT_S = 30.0
#: Longest request line accepted, bytes (a token, a space, an index, "\n").
MAX_LINE = 96
#: Threads answering complete requests; connections whose line is not
#: complete yet, at most (beyond, a new one is closed unanswered).
THREADS = 4
MAX_WAITING = 64
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ACCEPT_POLL_S = 0.5


class HandoffTarget(Protocol):
    """A publication on the handoff transport, as this socket sees it."""

    def open_for_client(self, index: int, *, uid: int) -> int:
        """A new write-only descriptor of staging file ``index`` for a
        client running as ``uid``; the caller sends and closes it.

        Raises:
            HwrError: refused (the error line names why).
        """
        ...


class HandoffListener:
    """The handoff socket and its registry of open publications.

    Args:
        path: where to listen (``<runtime socket>.pub``).
    """

    def __init__(self, path: str):
        self.path = path
        #: True once bound and serving: only then may a publication take the
        #: handoff transport.
        self.serving = False
        self._targets: dict[str, HandoffTarget] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="hwr-handoff")

    # -- registry ----------------------------------------------------------------

    def register(self, target: HandoffTarget) -> str:
        """Makes ``target`` reachable; returns its token."""
        token = secrets.token_hex(16)
        with self._lock:
            self._targets[token] = target
        return token

    def unregister(self, token: str) -> None:
        """Forgets a token (idempotent): later requests for it are refused."""
        with self._lock:
            self._targets.pop(token, None)

    def _target(self, token: str) -> HandoffTarget:
        with self._lock:
            target = self._targets.get(token)
        if target is None:
            raise NotFound("handoff: no open publication has this token (ended, or never granted)")
        return target

    # -- socket ------------------------------------------------------------------

    def bind(self, *, mode: int, gid: int) -> None:
        """Binds ``path`` with ``mode`` (and group ``gid`` unless -1) and serves.

        Raises:
            OSError: the path cannot be bound.
        """
        sock = listening_socket(self.path, mode=mode, gid=gid)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="hwr-handoff-accept", daemon=True)
        self._thread.start()
        self.serving = True

    def _serve(self) -> None:
        """One thread reads every connection's request line (a selector: a
        slow or silent client holds no thread); a line complete, the answer
        (which may collect for capacity) runs on the pool."""
        sock = self._sock
        assert sock is not None
        sock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ, None)
        waiting: dict[socket.socket, _Waiting] = {}
        try:
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=_ACCEPT_POLL_S):
                    if key.data is None:
                        self._accept(sock, sel, waiting)
                    else:
                        self._read(key.fileobj, sel, waiting)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, w in waiting.items() if w.deadline < now]:
                    log.debug("handoff socket %s: no request line within %.0f s", self.path, READ_TIMEOUT_S)
                    self._drop(conn, sel, waiting)
        finally:
            for conn in list(waiting):
                self._drop(conn, sel, waiting)
            sel.close()

    def _accept(self, sock: socket.socket, sel: selectors.BaseSelector, waiting: dict) -> None:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            # Out of fds or memory: say so and keep serving; the client's
            # publication fails with UNAVAILABLE and the others go on.
            log.warning("handoff socket %s: accept failed (%s)", self.path, errno.errorcode.get(exc.errno or 0, exc))
            self._closed.wait(0.1)
            return
        if len(waiting) >= MAX_WAITING:
            conn.close()  # a burst beyond MAX_WAITING: the client sees EOF and reports it
            return
        conn.setblocking(False)
        waiting[conn] = _Waiting(time.monotonic() + READ_TIMEOUT_S)
        sel.register(conn, selectors.EVENT_READ, True)

    def _read(self, conn: socket.socket, sel: selectors.BaseSelector, waiting: dict) -> None:
        w = waiting[conn]
        try:
            chunk = conn.recv(MAX_LINE + 1 - len(w.data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        w.data += chunk
        if not chunk or len(w.data) > MAX_LINE:
            self._drop(conn, sel, waiting)  # closed early, or not our protocol
        elif w.data.endswith(b"\n"):
            sel.unregister(conn)
            del waiting[conn]
            self._pool.submit(self._answer_and_close, conn, w.data)

    @staticmethod
    def _drop(conn: socket.socket, sel: selectors.BaseSelector, waiting: dict) -> None:
        sel.unregister(conn)
        del waiting[conn]
        conn.close()

    def _answer_and_close(self, conn: socket.socket, line: bytes) -> None:
        with conn:
            conn.setblocking(True)
            conn.settimeout(READ_TIMEOUT_S)
            self._answer(conn, line)

    def _answer(self, conn: socket.socket, line: bytes) -> None:
        fd = -1
        try:
            _pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            token, index = _parse(line)
            fd = self._target(token).open_for_client(index, uid=uid)
            # The descriptor travels in the kernel's message; this process's
            # copy is closed right after, so the client's is the only one.
            conn.sendmsg([b"ok\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
        except HwrError as exc:
            _send_error(conn, exc)
        except OSError as exc:
            log.info("handoff socket %s: answer failed (%s)", self.path, exc)
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        """Stops answering, removes the socket file. Idempotent."""
        if self._closed.is_set():
            return
        self.serving = False
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)
        self._pool.shutdown(wait=True)
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _Waiting:
    """A connection whose request line is not complete yet."""

    __slots__ = ("deadline", "data")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.data = b""


def _parse(line: bytes) -> tuple[str, int]:
    parts = line.decode("ascii", "replace").split()
    if len(parts) != 2 or len(parts[0]) != 32 or not parts[1].isdigit() or len(parts[1]) > 9:
        raise InvalidArgument("handoff: expected one line '<32-hex token> <file index>'")
    return parts[0], int(parts[1])


def _send_error(conn: socket.socket, exc: HwrError) -> None:
    text = " ".join(str(exc).split())[:1000]
    try:
        conn.sendall(f"error {status_code_of(exc).name} {text}\n".encode("utf-8", "replace"))
    except OSError:
        pass


__all__ = ["HandoffListener", "HandoffTarget", "MAX_LINE", "READ_TIMEOUT_S"]
