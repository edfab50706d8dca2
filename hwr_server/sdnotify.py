"""systemd readiness and watchdog notifications (sd_notify protocol).

The daemon builds a :class:`Notifier` from its environment in CLI code
(``Notifier.from_environ(os.environ)``); without ``NOTIFY_SOCKET`` every call
is a no-op, so the same binary runs under systemd and anywhere else.

- ``ready()`` sends ``READY=1``: the daemon calls it only after recovery, so
  ``systemctl start hwr`` returns when the store can be served.
- ``stopping()`` sends ``STOPPING=1`` at shutdown.
- With ``WATCHDOG_USEC`` set (``WatchdogSec=`` in the unit), a thread sends
  ``WATCHDOG=1`` every half period, once ready.

The protocol: one datagram per message to the AF_UNIX socket named by
``NOTIFY_SOCKET``; a name starting with ``@`` is in the abstract namespace.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from typing import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages; a no-op when ``address`` is empty.

    Args:
        address: the NOTIFY_SOCKET value ("" = no-op).
        watchdog_usec: WATCHDOG_USEC (0 = no watchdog pings).
    """

    def __init__(self, address: str = "", *, watchdog_usec: int = 0):
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The last messages sent (bounded: watchdog pings run for months).
        self.sent: deque[str] = deque(maxlen=64)
        #: Optional liveness probe; a ping is skipped while it returns False,
        #: so systemd restarts a daemon that is alive but wedged.
        self.liveness: Callable[[], bool] | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Notifier":
        """A notifier for ``NOTIFY_SOCKET``/``WATCHDOG_USEC``/``WATCHDOG_PID``.

        The watchdog is armed only when WATCHDOG_PID is absent or names this
        process (systemd sets it so that children do not ping for the parent).
        """
        address = environ.get("NOTIFY_SOCKET", "")
        usec = 0
        pid = environ.get("WATCHDOG_PID", "")
        if environ.get("WATCHDOG_USEC") and (not pid or pid == str(os.getpid())):
            try:
                usec = int(environ["WATCHDOG_USEC"])
            except ValueError:
                log.warning("sdnotify: ignoring WATCHDOG_USEC=%r (not an integer)", environ["WATCHDOG_USEC"])
        return cls(address, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _target(self) -> str | bytes:
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()  # abstract namespace
        return self.address

    def notify(self, message: str) -> bool:
        """Sends one message; returns False (and logs) if it could not.

        A lost notification must never take the daemon down, so errors are
        logged, not raised.
        """
        if self._sock is None:
            return False
        try:
            self._sock.sendto(message.encode(), self._target())
        except OSError as exc:
            log.warning("sdnotify: sending %r to %s failed: %s", message, self.address, exc)
            return False
        self.sent.append(message)
        return True

    def ready(self) -> None:
        """READY=1 (after recovery), and starts watchdog pings if configured."""
        self.notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving")
        if self.enabled and self.watchdog_usec > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watchdog, name="hwr-watchdog", daemon=True)
            self._thread.start()

    def stopping(self) -> None:
        """STOPPING=1 at the start of shutdown; stops the watchdog pings."""
        self._stop.set()
        self.notify("STOPPING=1\nSTATUS=stopping")

    def status(self, text: str) -> None:
        """A free-form STATUS= line shown by ``systemctl status``."""
        self.notify(f"STATUS={text}")

    def _watchdog(self) -> None:
        period = self.watchdog_usec / 1e6 / 2
        # Half the watchdog period, as sd_watchdog_enabled(3) recommends; an
        # event wait so stopping() ends the thread at once.
        while not self._stop.wait(period):
            try:
                alive = self.liveness is None or bool(self.liveness())
            except Exception:  # noqa: BLE001 - a failing probe means "not alive"
                log.exception("sdnotify: liveness probe failed")
                alive = False
            if alive:
                self.notify("WATCHDOG=1")
            else:
                log.warning("sdnotify: liveness probe says wedged; withholding WATCHDOG=1")

    def close(self) -> None:
        """Stops the watchdog thread and closes the socket (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
