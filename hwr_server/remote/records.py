"""The records of a transfer (:mod:`hwr_server.remote.remote`): where it
stands (:class:`Progress`), what it did (:class:`Transfer`), the progress
its layer threads share, and one pull of a key with everyone waiting on it
(:class:`Flight`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a transfer stands."""

    bytes_done: int
    bytes_total: int
    layers_done: int
    layers_total: int


ProgressFn = Callable[[Progress], None]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """What a push or a pull did.

    Attributes:
        key: the artifact's identity key.
        reference: ``host/repository@sha256:…`` of the OCI manifest.
        manifest_digest: the OCI manifest's digest.
        bytes_transferred: payload bytes that went over the wire.
        layers_transferred / layers_skipped: layers sent or fetched, and
            those the other side already had.
        seconds: wall time.
        already_present: a pull found the artifact in the store (nothing done).
        signature_digest: a push's signature artifact ("" unsigned).
        signer: the key that signed a push, or whose signature a pull verified.
    """

    key: str
    reference: str
    manifest_digest: str
    bytes_transferred: int
    layers_transferred: int
    layers_skipped: int
    seconds: float
    already_present: bool = False
    signature_digest: str = ""
    signer: str = ""


class Flight:
    """One pull of a key and everyone waiting on it. The leader's progress
    goes to every listener (a waiter that heard nothing would give up: see
    the no-progress bound of ``Client.pull_on_miss``); a listener that went
    away is dropped (:meth:`leave`), so a thousand cancelled callers leave
    nothing behind."""

    def __init__(self, progress: ProgressFn = lambda p: None) -> None:
        self.done = threading.Event()
        self.result: Transfer | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._listeners = [progress]
        self._last: Progress | None = None

    def join(self, progress: ProgressFn) -> None:
        with self._lock:
            self._listeners.append(progress)
            last = self._last
        if last is not None:
            progress(last)  # a late waiter hears where the pull stands at once

    def leave(self, progress: ProgressFn) -> None:
        with self._lock:
            if progress in self._listeners:
                self._listeners.remove(progress)

    def progress(self, p: Progress) -> None:
        with self._lock:
            self._last = p
            listeners = list(self._listeners)
        for fn in listeners:
            fn(p)

    def outcome(self) -> Transfer:
        """The result once :attr:`done` is set; raises the pull's error."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class Counter:
    """Progress shared by the layer threads of one transfer."""

    def __init__(self, total: int, layers: int, progress: ProgressFn):
        self._lock = threading.Lock()
        self.bytes, self.layers, self.total, self.n_layers = 0, 0, total, layers
        self._progress = progress

    def add(self, nbytes: int = 0, layers: int = 0) -> None:
        # Reported under the lock: events leave in the order of their counts
        # (the callback only queues or drops an event).
        with self._lock:
            self.bytes += nbytes
            self.layers += layers
            self._progress(Progress(self.bytes, self.total, self.layers, self.n_layers))

    def grow(self, nbytes: int) -> None:
        """One more layer of ``nbytes`` to fetch (a stored copy that failed its check)."""
        with self._lock:
            self.total += nbytes
            self.n_layers += 1


__all__ = ["Counter", "Flight", "Progress", "ProgressFn", "Transfer"]
