"""Per-peer shares of the store's publication resources (DESIGN §16).

Kept apart from the publication that takes them: the store owns one
:class:`PeerShares` for all its publications, and the store sits below the
publication package.
"""

from __future__ import annotations

import threading
from typing import Callable

from hwr_client.core.errors import InvalidArgument, ResourceExhausted


class PeerShares:
    """Per-peer publication accounting (DESIGN §16), keyed by ``Peer.key``:
    the slots each peer's publications hold and the bytes they reserved;
    and per uid (``Peer.uid_key``), the slots all processes of one uid hold
    together. Thread-safe; one per store."""

    def __init__(self) -> None:
        #: Guards the maps; notified when a slot is released.
        self._cond = threading.Condition()
        self._slots: dict[str, int] = {}
        self._uid_slots: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def acquire_slot(self, peer: str, cap: int, is_active: Callable[[], bool], what: str, *,
                     uid: str = "", uid_cap: int = 0) -> None:
        """Waits until ``peer`` holds fewer than ``cap`` slots and its uid
        ``uid`` fewer than ``uid_cap`` (0: no uid cap, root and the daemon's
        uid), then takes one of each.

        A peer over its share (or whose uid is over its own) waits for one of
        its uid's OWN publications to end, holding no global slot meanwhile,
        so it cannot keep others waiting: four processes of one user each
        trickling a publication no longer hold every slot of the node.

        Raises:
            InvalidArgument: the caller went away while waiting.
        """
        with self._cond:
            while self._slots.get(peer, 0) >= cap or (uid_cap and self._uid_slots.get(uid, 0) >= uid_cap):
                # A timed wait: a caller that left must be noticed even when
                # no slot is released.
                self._cond.wait(timeout=0.5)
                if not is_active():
                    raise InvalidArgument(
                        f"{what}: caller went away while waiting for one of its {cap} publication slots "
                        f"(max_publications_per_peer) or one of {uid or 'its uid'}'s {uid_cap} "
                        "(max_publications_per_uid)")
            self._slots[peer] = self._slots.get(peer, 0) + 1
            self._uid_slots[uid] = self._uid_slots.get(uid, 0) + 1

    def release_slot(self, peer: str, *, uid: str = "") -> None:
        """Returns a slot taken by :meth:`acquire_slot` (the same ``uid``)."""
        with self._cond:
            for table, k in ((self._slots, peer), (self._uid_slots, uid)):
                left = table.get(k, 0) - 1
                if left > 0:
                    table[k] = left
                else:
                    table.pop(k, None)
            self._cond.notify_all()

    def reserve(self, peer: str, nbytes: int, cap: int, what: str) -> None:
        """Adds ``nbytes`` to what ``peer`` has reserved, unless it already
        reserves something and the sum would exceed ``cap``: a peer's first
        publication may be as large as capacity allows (the capacity check
        decides), but it cannot hold more than ``cap`` bytes in several.

        Raises:
            ResourceExhausted: naming the peer's figures and the config field.
        """
        with self._cond:
            held = self._bytes.get(peer, 0)
            if held and held + nbytes > cap:
                raise ResourceExhausted(
                    f"{what}: {nbytes} bytes on top of the {held} bytes the peer's other publications reserve "
                    f"exceeds the per-peer limit {cap} bytes (ServerConfig.peer_reserved_bytes); finish or "
                    "cancel those first"
                )
            self._bytes[peer] = held + nbytes

    def unreserve(self, peer: str, nbytes: int) -> None:
        """Returns bytes added by :meth:`reserve`."""
        with self._cond:
            left = self._bytes.get(peer, 0) - nbytes
            if left > 0:
                self._bytes[peer] = left
            else:
                self._bytes.pop(peer, None)

    def held(self, peer: str) -> tuple[int, int]:
        """(slots, reserved bytes) ``peer`` holds now."""
        with self._cond:
            return self._slots.get(peer, 0), self._bytes.get(peer, 0)

    def uid_slots(self, uid: str) -> int:
        """Slots the processes of ``uid`` hold now."""
        with self._cond:
            return self._uid_slots.get(uid, 0)
