"""Single-take, process-local hand-over of a lease from loader to backend.

The loader puts the lease in a carrier after restore commit; the backend
takes it exactly once, before any asynchronous work. A second ``take()``
raises; so does pickling (a lease maps this process's memory and is bound to
this process's session — a copy in another process would be a lie). Closing
a carrier that still owns its lease closes the lease, so an abandoned
hand-over never leaks it.
"""

from __future__ import annotations

import threading
from typing import Any

from hwr_client.core.errors import FailedPrecondition


class LeaseCarrier:
    """Owns a lease until :meth:`take` moves ownership to the caller.

    Example:
        >>> carrier = LeaseCarrier(lease)       # doctest: +SKIP
        >>> backend_lease = carrier.take()      # doctest: +SKIP
        >>> carrier.take()                      # doctest: +SKIP
        Traceback (most recent call last):
        FailedPrecondition: lease carrier: already taken
    """

    def __init__(self, lease: Any):
        self._lease = lease
        self._taken = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def owns(self) -> bool:
        """True while the carrier still owns its lease."""
        return self._lease is not None

    def take(self) -> Any:
        """Moves the lease to the caller.

        Raises:
            FailedPrecondition: taken before, or the carrier was closed.
        """
        with self._lock:
            if self._taken:
                raise FailedPrecondition("lease carrier: already taken; a lease has exactly one owner")
            if self._closed:
                raise FailedPrecondition("lease carrier: closed before take(); its lease was released")
            lease, self._lease, self._taken = self._lease, None, True
            return lease

    def close(self) -> None:
        """Closes the lease if it was never taken. Idempotent."""
        with self._lock:
            lease, self._lease, self._closed = self._lease, None, True
        if lease is not None:
            lease.close()

    def __enter__(self) -> "LeaseCarrier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("LeaseCarrier is process-local and cannot be pickled or copied to another process")
