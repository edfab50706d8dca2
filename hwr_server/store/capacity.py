"""Capacity for a transfer's payload, admitted as its bytes arrive.

A publication's plan and a registry's manifest both *claim* sizes; neither
proves a byte will come. Making room (collecting unleased artifacts) for
the claimed total at the start lets a client that sends one chunk, or a
registry that sends 100 bytes and breaks off, delete every unleased
artifact of the node for nothing. So the store's capacity hook is called
twice over:

1. at the start, a dry run for the whole claimed total (``evict=False``):
   what can never fit is refused before anything is staged or fetched;
2. then, as bytes arrive, one step at a time with ``evict=True``: the
   collector makes room for that step only (see
   :meth:`hwr_server.gc.collector.Collector.capacity_hook`).

A publication admits with :class:`ArrivalAdmission`: a step is at least
:data:`MIN_STEP_BYTES` and 1/:data:`STEPS` of the total, so it calls the
hook (a snapshot of the store) at most ~``STEPS`` times, and an attacker's
one chunk makes room for one step at most. A pull admits each layer's
preallocation step as it preallocates it
(:class:`hwr_server.remote.transfer.LayerPolicy`): the store counts
allocated staging bytes, so admission and allocation go together.
"""

from __future__ import annotations

import threading

from hwr_server.interfaces import CapacityHook

#: The smallest step admitted at once, bytes (one default payload chunk).
MIN_STEP_BYTES = 4 * 1024 * 1024
#: A step is at least this fraction (1/STEPS) of the transfer's total.
STEPS = 64


class ArrivalAdmission:
    """Admits a transfer's bytes to the store's capacity as they arrive.
    Thread-safe (a pull's layers arrive on several threads).

    Args:
        hook: the store's capacity hook.
        total: the bytes the transfer claims (steps never go past it, unless
            more arrive: a restarted download is counted by its caller once).
        who: names the publication or pull (and its peer) in the collector's log.
    """

    def __init__(self, hook: CapacityHook, total: int, *, who: str):
        self._hook, self.total, self.who = hook, int(total), who
        self.step = max(MIN_STEP_BYTES, self.total // STEPS)
        self._lock = threading.Lock()
        self.arrived = 0
        self.admitted = 0

    def admit(self, nbytes: int) -> None:
        """``nbytes`` more are about to be written: makes room first when
        they go past what was admitted.

        Raises:
            ResourceExhausted: from the hook; nothing of them may be written.
        """
        with self._lock:
            # Under the lock: two layers crossing the admitted mark at once
            # must not both collect for the same step.
            arrived = self.arrived + nbytes
            if arrived > self.admitted:
                step = max(arrived - self.admitted, min(self.step, self.total - self.admitted))
                self._hook(step, evict=True, who=self.who)
                self.admitted += step
            self.arrived = arrived


__all__ = ["ArrivalAdmission", "MIN_STEP_BYTES", "STEPS"]
