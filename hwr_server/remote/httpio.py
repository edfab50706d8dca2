"""Reading a registry's answers without trusting their size or their pace.

A registry (or whatever answers in its place) chooses how many bytes it
sends and how fast. The registry client reads three kinds of body:

* **Payload** (a layer): streamed to disk by the caller at any size, but
  at a minimum rate (:class:`RateGuard`): a registry that trickles a byte a
  second is cut after one window instead of holding the pull, its staging
  and its disk space for ever.
* **Small documents** (a manifest, a config, a token answer): read up to a
  limit the caller names, within one deadline (:func:`read_capped`).
* **Everything else** (the body of a 401, of a redirect, of an error):
  never read beyond :data:`DETAIL_BYTES`; the connection is closed instead
  (each request has its own connection, so nothing is left to drain).

The response head (status line and headers) is read by ``http.client``,
line by line, each recv bounded by the socket timeout but the whole not at
all: a registry sending a header byte a second would hold the thread for
hours. :class:`Watchdog` bounds it: one thread that shuts down the socket
of a request whose head (or small body) is not in by its deadline, which
wakes the blocked read at once.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import socket
import ssl
import threading
import time
import urllib.parse

from hwr_client.core.errors import FailedPrecondition, HwrError, NotFound, PermissionDenied, Unavailable
from hwr_server.logtext import untrusted
from hwr_server.remote.names import Origin

#: The most bytes read of a body that is not the answer asked for (a 401's,
#: a redirect's, an error's), for the error message.
DETAIL_BYTES = 4096


class Deadline:
    """One armed deadline; ``expired`` tells the reader why its socket died."""

    __slots__ = ("conn", "expired", "seconds")

    def __init__(self, conn: http.client.HTTPConnection | None, seconds: float):
        self.conn, self.seconds, self.expired = conn, seconds, False


class Watchdog:
    """Shuts down the socket of a request past its deadline (module
    docstring). One lazily started daemon thread per registry client."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, conn: http.client.HTTPConnection, seconds: float) -> Deadline:
        """Shuts ``conn``'s socket down in ``seconds`` unless disarmed first."""
        deadline = Deadline(conn, seconds)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._seq), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hwr-registry-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()  # the new deadline may be the earliest
        return deadline

    def disarm(self, deadline: Deadline) -> None:
        """The request finished its bounded part; its entry is dropped when due."""
        with self._cond:
            deadline.conn = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    # Sleeps until the earliest deadline; arm() wakes it.
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                _, _, deadline = heapq.heappop(self._heap)
                conn, deadline.conn = deadline.conn, None
                if conn is not None:
                    deadline.expired = True
            sock = getattr(conn, "sock", None) if conn is not None else None
            if sock is not None:
                try:
                    # Wakes the thread blocked in recv (it reads EOF or an
                    # error); close() alone would not on Linux.
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its owner


def read_capped(resp: http.client.HTTPResponse, limit: int, *, what: str) -> bytes:
    """The whole body of a small answer, at most ``limit`` bytes (the
    caller's watchdog deadline bounds the time).

    Raises:
        FailedPrecondition: the body is larger than ``limit``.
        Unavailable: the connection broke off, or the declared
            Content-Length was not delivered (retry is safe).
    """
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise FailedPrecondition(f"{what}: the registry announces {declared} bytes, more than the {limit} "
                                 "accepted; not read")
    parts: list[bytes] = []
    got = 0
    try:
        while got <= limit:
            part = resp.read1(limit + 1 - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    except (OSError, http.client.HTTPException) as exc:
        raise Unavailable(f"{what}: registry response broke off ({exc}); retry is safe") from None
    if got > limit:
        raise FailedPrecondition(f"{what}: registry response of more than {limit} bytes; not read further")
    data = b"".join(parts)
    # http.client returns a short body without complaint when the
    # connection closes early: the declared length tells.
    if declared is not None and declared.isdigit() and int(declared) != len(data):
        raise Unavailable(f"{what}: registry response truncated: {len(data)} of {declared} bytes; retry is safe")
    return data


def detail(resp: http.client.HTTPResponse) -> str:
    """At most :data:`DETAIL_BYTES` of an error body, as one short line for
    a message (the rest is never read)."""
    try:
        data = resp.read1(DETAIL_BYTES)
    except (OSError, http.client.HTTPException):
        return ""
    return " ".join(data.decode("utf-8", "replace").split())[:300]


class RateGuard:
    """Cuts a payload that arrives slower than ``min_rate`` bytes per second,
    measured over windows of ``window_s`` (0 = off).

    Raises (from :meth:`add`):
        Unavailable: naming the bytes of the last window and the setting.
    """

    def __init__(self, min_rate: int, window_s: float, *, what: str):
        self.min_rate, self.window_s, self.what = int(min_rate), float(window_s), what
        self._start = time.monotonic()
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        """Counts ``nbytes`` that just arrived; checks the window they close."""
        if self.min_rate <= 0:
            return
        self._bytes += nbytes
        now = time.monotonic()
        if now - self._start < self.window_s:
            return
        rate = self._bytes / (now - self._start)
        if rate < self.min_rate:
            raise Unavailable(f"{self.what}: the registry sent {self._bytes} bytes in {now - self._start:.1f} s "
                              f"({rate:.0f} B/s), below [remote] min_rate_bytes = {self.min_rate} B/s")
        self._start, self._bytes = now, 0


def connect_error(exc: BaseException, what: str, host: str, ca_file: str) -> HwrError:
    """A request that got no answer. A certificate the client cannot verify
    is FAILED_PRECONDITION (a retry fails the same way until the
    configuration changes); anything else is UNAVAILABLE (retry is safe)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        trust = f"the CA file {ca_file}" if ca_file else "the system's CA store (no [remote] ca_file)"
        return FailedPrecondition(
            f"{what}: TLS verification of registry {host} failed against {trust}: "
            f"{exc.verify_message or exc.reason or exc}; set [remote] ca_file to the CA that signed its "
            "certificate (insecure = true is plain HTTP, for a loopback registry only)")
    return Unavailable(f"{what}: registry {host} unreachable ({exc}); retry when it is up")


def redirect(origin: Origin, target: str, location: str, what: str) -> tuple[Origin, str]:
    """Where a redirect goes: (origin, path and query).

    Raises:
        FailedPrecondition: not http(s), or from https to http (a downgrade
            would send the request, and any signature in its URL, in clear).
    """
    loc = urllib.parse.urljoin(f"{origin[0]}://{origin[1]}{target}", location)
    nxt = urllib.parse.urlsplit(loc)
    if nxt.scheme not in ("http", "https") or not nxt.netloc or "@" in nxt.netloc:
        raise FailedPrecondition(f"{what}: the registry redirects to {untrusted(loc)!s:.200}, not an http(s) URL; "
                                 "refused")
    if origin[0] == "https" and nxt.scheme != "https":
        raise FailedPrecondition(f"{what}: the registry redirects from https to plain http "
                                 f"({nxt.scheme}://{untrusted(nxt.netloc)}); refused, never downgraded")
    return (nxt.scheme, nxt.netloc.lower()), urllib.parse.urlunsplit(("", "", nxt.path or "/", nxt.query, ""))


def status_error(status: int, what: str, detail: str) -> HwrError:
    text = f"{what}: registry answered {status}" + (f" ({untrusted(detail)})" if detail else "")
    if status in (401, 403):
        return PermissionDenied(text + "; check [remote] credentials_file")
    if status == 404:
        return NotFound(text)
    if status in (408, 429) or status >= 500:
        return Unavailable(text + "; retry later")
    return FailedPrecondition(text)


__all__ = ["DETAIL_BYTES", "Deadline", "RateGuard", "Watchdog", "connect_error", "detail", "read_capped",
           "redirect", "status_error"]
