"""What a pull on a miss may cost the node (docs/many-nodes.md).

``PullOnMiss`` is a runtime rpc: any user who can reach the socket can ask
the daemon to fetch any key from its registry. Without bounds, 1,320 calls
against a hung registry left 1,398 daemon threads and 64 of them blocked
everyone's lookups. The rules, besides the stream admission every
``PullOnMiss`` call passes (it holds a server thread like a stream, so it
counts against its process's ``max_streams_per_peer`` and the socket's
stream capacity):

* **Per node**: at most ``[remote] max_pulls`` pulls on a miss in flight
  (distinct keys; a caller of a key in flight joins that pull and costs
  nothing more). One more: RESOURCE_EXHAUSTED at once, naming the field.
* **Per user**: at most ``max_pulls_per_peer`` of them started by one uid
  (every caller without a peer token counts as one user): forking
  processes does not multiply a user's share. A pull whose callers went
  away still counts against its starter until it ends.
* **Recent failures**: a pull on a miss that failed (not found, refused,
  unreachable, not an HWR artifact, over a limit) is answered from memory
  for ``miss_cache_s``, with the original error class and message, instead
  of asking the registry again; at most :data:`MAX_CACHED` keys are
  remembered (the oldest forgotten first), so random keys cannot grow it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from hwr_client.core.errors import (
    DataLoss, FailedPrecondition, HwrError, NotFound, PermissionDenied, ResourceExhausted, Unavailable,
)

#: Failed keys remembered at most.
MAX_CACHED = 4096
#: The error classes a failure is remembered with (Aborted, a publication
#: of the key in flight, is not: it resolves by itself).
_CACHED = (NotFound, FailedPrecondition, PermissionDenied, DataLoss, ResourceExhausted, Unavailable)


class PullGate:
    """The bounds of the module docstring. Thread-safe.

    Args:
        max_pulls: pulls on a miss in flight on the node.
        max_per_peer: of them, started by one owner.
        miss_cache_s: seconds a failure is answered from memory (0 = never).
        clock: monotonic seconds (a seam for tests).
    """

    def __init__(self, *, max_pulls: int, max_per_peer: int, miss_cache_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_pulls, self.max_per_peer, self.miss_cache_s = int(max_pulls), int(max_per_peer), float(miss_cache_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._owners: collections.Counter[str] = collections.Counter()
        self._failed: collections.OrderedDict[str, tuple[float, HwrError]] = collections.OrderedDict()
        self.refused = 0
        self.cached_answers = 0

    def cached(self, key: str) -> None:
        """Raises the remembered failure of ``key`` if it is recent."""
        with self._lock:
            entry = self._failed.get(key)
            if entry is None:
                return
            at, error = entry
            age = self._clock() - at
            if age >= self.miss_cache_s:
                del self._failed[key]
                return
            self.cached_answers += 1
        raise type(error)(f"{error} (remembered from {age:.0f} s ago; asked again after [remote] miss_cache_s = "
                          f"{self.miss_cache_s:g} s)")

    def enter(self, owner: str, key: str) -> None:
        """Counts a new pull of ``owner``, or refuses it.

        Raises:
            ResourceExhausted: the node's or the owner's bound, naming its field.
        """
        with self._lock:
            total = sum(self._owners.values())
            mine = self._owners[owner]
            if total >= self.max_pulls:
                refusal = (f"PullOnMiss {key[:12]}: {total} pulls on a miss are in flight on this node, the limit is "
                           f"{self.max_pulls} ([remote] max_pulls); load canonically or retry later")
            elif mine >= self.max_per_peer:
                refusal = (f"PullOnMiss {key[:12]}: {owner} has {mine} pulls on a miss in flight, the limit is "
                           f"{self.max_per_peer} per user ([remote] max_pulls_per_peer); retry when one ends")
            else:
                self._owners[owner] = mine + 1
                return
            self.refused += 1
        raise ResourceExhausted(refusal)

    def leave(self, owner: str, key: str, error: BaseException | None) -> None:
        """A pull of ``owner`` ended; remembers ``error`` when it is one to cache."""
        with self._lock:
            self._owners[owner] -= 1
            if self._owners[owner] <= 0:
                del self._owners[owner]
            if error is None:
                self._failed.pop(key, None)
            elif isinstance(error, _CACHED) and self.miss_cache_s > 0:
                self._failed.pop(key, None)
                self._failed[key] = (self._clock(), error)
                while len(self._failed) > MAX_CACHED:
                    self._failed.popitem(last=False)

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._owners.values())

    def stats(self) -> dict[str, float]:
        """Figures for GetStats / Prometheus."""
        with self._lock:
            return {"hwr_remote_pulls_on_miss_active": float(sum(self._owners.values())),
                    "hwr_remote_pulls_on_miss_refused_total": float(self.refused),
                    "hwr_remote_pulls_on_miss_cached_total": float(self.cached_answers)}


__all__ = ["MAX_CACHED", "PullGate"]
