"""A publication's limits (DESIGN §16): the plan limits of a config, each
peer's share of slots and reserved bytes, and the idle deadline on the
request stream. Every limit is a ServerConfig field; :mod:`hwr_server.publication`
applies them.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

from hwr_client.core.defaults import MAX_MESSAGE_BYTES
from hwr_client.core.errors import Aborted, InvalidArgument, ResourceExhausted
from hwr_client.core.layout import MAX_HEADER_BYTES
from hwr_client.core.plan import PlanLimits

#: The largest manifest ever published, whatever the config says: it must
#: fit one gRPC message (Lookup, AcquireLease) with room for the reply's
#: other fields.
MANIFEST_CEILING_BYTES = MAX_MESSAGE_BYTES * 3 // 4
#: The largest tensor name the format allows (layout.check_tensor_name).
NAME_CEILING_BYTES = 1024



def plan_limits(config: Any) -> PlanLimits:
    """The plan limits of a ServerConfig, each capped by what the format and
    the wire allow (a config asking for more gets the ceiling)."""
    return PlanLimits(
        max_artifact_tensors=int(config.max_artifact_tensors),
        max_artifact_files=int(config.max_artifact_files),
        max_tensor_name_bytes=min(int(config.max_tensor_name_bytes), NAME_CEILING_BYTES),
        max_tensor_dims=int(config.max_tensor_dims),
        max_header_bytes=min(int(config.max_header_bytes), MAX_HEADER_BYTES),
        max_manifest_bytes=min(int(config.max_manifest_bytes), MANIFEST_CEILING_BYTES),
    )


class PeerShares:
    """Per-peer publication accounting (DESIGN §16), keyed by ``Peer.key``:
    the slots each peer's publications hold and the bytes they reserved.
    Thread-safe; one per store."""

    def __init__(self) -> None:
        #: Guards both maps; notified when a slot is released.
        self._cond = threading.Condition()
        self._slots: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def acquire_slot(self, peer: str, cap: int, is_active: Callable[[], bool], what: str) -> None:
        """Waits until ``peer`` holds fewer than ``cap`` slots, then takes one.

        A peer over its share waits for one of its OWN publications to end,
        holding no global slot meanwhile, so it cannot keep others waiting.

        Raises:
            InvalidArgument: the caller went away while waiting.
        """
        with self._cond:
            while self._slots.get(peer, 0) >= cap:
                # A timed wait: a caller that left must be noticed even when
                # no slot is released.
                self._cond.wait(timeout=0.5)
                if not is_active():
                    raise InvalidArgument(f"{what}: caller went away while waiting for one of its "
                                          f"{cap} publication slots (max_publications_per_peer)")
            self._slots[peer] = self._slots.get(peer, 0) + 1

    def release_slot(self, peer: str) -> None:
        """Returns a slot taken by :meth:`acquire_slot`."""
        with self._cond:
            left = self._slots.get(peer, 0) - 1
            if left > 0:
                self._slots[peer] = left
            else:
                self._slots.pop(peer, None)
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


class RequestPump:
    """Reads a request stream on its own thread, so the handler can wait for
    the next message with a deadline (grpc's request iterator has none).

    At most one message waits in the hand-over queue and one in the reader's
    hand: memory stays bounded and a fast sender is throttled as before. The
    reader ends by itself once the call ends (grpc then ends the iterator).

    Args:
        requests: the rpc's request iterator.
        idle_s: longest wait for a message, seconds; 0 = no deadline.
        what: names the publication in the Aborted error.
    """

    _END = object()

    def __init__(self, requests: Iterator[Any], *, idle_s: float, what: str):
        self.idle_s = idle_s
        self.what = what
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(requests,), name="hwr-pub-reader", daemon=True)
        self._thread.start()

    def _read(self, requests: Iterator[Any]) -> None:
        try:
            for req in requests:
                if not self._put(req):
                    return
            self._put(self._END)
        except BaseException as exc:  # noqa: BLE001 - handed to the handler (a cancelled call, mostly)
            self._put(exc)

    def _put(self, item: object) -> bool:
        # Timed puts: when the handler stopped taking (it failed or timed
        # out), the reader must notice and end rather than block for ever.
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Any:
        """The next request, or None when the stream ended.

        Raises:
            Aborted: no message within ``idle_s`` (``publication_idle_s``).
            Whatever reading the stream raised (a cancelled call).
        """
        try:
            item = self._q.get(timeout=self.idle_s or None)
        except queue.Empty:
            raise Aborted(
                f"{self.what}: no message for {self.idle_s:g} s (ServerConfig.publication_idle_s); the "
                "publication is ended, its staging removed and its reservation freed; publish again"
            ) from None
        if item is self._END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Tells the reader to stop handing over; it exits when the call ends."""
        self._stop.set()
