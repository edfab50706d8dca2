"""Where a compile artifact's publication runs: a seam.

The first compiled output never waits for publication: the job (read the
cache folder, stream it to the daemon) runs on a :class:`Publisher`. The
default, :class:`ThreadPublisher`, is one plain thread per job, not a
daemon thread: a short script's first output is often its last act, and
a daemon thread would be killed mid-stream at exit (nothing visible, the
publication lost), while this one holds the exit for the time a few MiB
take. A node-wide background publisher (bounded exit wait, one queue for
weights and compile artifacts) plugs in here through the same Protocol.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol


class Publisher(Protocol):
    """Runs a publication job off the caller's thread. ``job`` never raises
    (it reports its own failures)."""

    def submit(self, name: str, job: Callable[[], None]) -> None: ...


class ThreadPublisher:
    """One non-daemon thread per job (module doc)."""

    def submit(self, name: str, job: Callable[[], None]) -> None:
        threading.Thread(target=job, name=name, daemon=False).start()


__all__ = ["Publisher", "ThreadPublisher"]
