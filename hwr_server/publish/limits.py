"""A publication's limits (DESIGN §16): the plan limits of a config, the
idle deadline and the minimum rate on the request stream, and the per-uid
slot cap (each peer's and uid's share of slots and reserved bytes is counted
by :class:`hwr_server.access.shares.PeerShares`). Every limit is a
ServerConfig field; :mod:`hwr_server.publish.publication` applies them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

from hwr_client.core.defaults import MAX_MESSAGE_BYTES
from hwr_client.core.errors import Aborted, InvalidArgument
from hwr_client.core.layout import MAX_HEADER_BYTES
from hwr_client.core.plan import PlanLimits
from hwr_server.access.peers import Peer, privileged

#: The largest manifest ever published, whatever the config says: it must
#: fit one gRPC message (Lookup, AcquireLease) with room for the reply's
#: other fields.
MANIFEST_CEILING_BYTES = MAX_MESSAGE_BYTES * 3 // 4
#: The largest tensor name the format allows (layout.check_tensor_name).
NAME_CEILING_BYTES = 1024
HEX_DIGITS = "0123456789abcdef"



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


def uid_publication_cap(config: Any, peer: Peer) -> int:
    """Publications the processes of ``peer``'s uid may run together:
    ``max_publications_per_uid`` (0 = half of ``max_publications``, at
    least 1); 0 (no cap) for root and the daemon's own uid."""
    if privileged(peer):
        return 0
    return int(config.max_publications_per_uid) or max(1, int(config.max_publications) // 2)


#: The rate window when publications have no idle deadline. Seconds.
_RATE_WINDOW_S = 60.0


class RequestPump:
    """Reads a request stream on its own thread, so the handler can wait for
    the next message with a deadline (grpc's request iterator has none).

    At most one message waits in the hand-over queue and one in the reader's
    hand: memory stays bounded and a fast sender is throttled as before. The
    reader ends by itself once the call ends (grpc then ends the iterator).

    Two deadlines: no message for ``idle_s`` (``publication_idle_s``), and
    fewer than ``min_bytes_per_s`` bytes per second of the time the handler
    spent waiting in :meth:`next`, over each ``idle_s`` (60 s without an
    idle deadline) of such waiting. Only the waiting counts: time the
    daemon spends writing, hashing or collecting is its own, not the
    client's. A client that sends one byte every few seconds stays under the
    idle deadline for ever; the rate ends it.

    Args:
        requests: the rpc's request iterator.
        idle_s: longest wait for a message, seconds; 0 = no deadline.
        what: names the publication in the Aborted error.
        min_bytes_per_s: the rate floor; 0 = none.
        size_of: a message's payload bytes (what the rate counts).
    """

    _END = object()

    def __init__(self, requests: Iterator[Any], *, idle_s: float, what: str, min_bytes_per_s: float = 0.0,
                 size_of: Callable[[Any], int] = lambda _: 0):
        self.idle_s = idle_s
        self.what = what
        self.min_bytes_per_s = float(min_bytes_per_s)
        self.window_s = float(idle_s) or _RATE_WINDOW_S
        self._size_of = size_of
        #: The current rate window: seconds waited in next(), bytes received.
        self._waited = 0.0
        self._bytes = 0
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
            Aborted: no message within ``idle_s`` (``publication_idle_s``),
                or slower than ``min_bytes_per_s`` (``publication_min_bytes_per_s``).
            Whatever reading the stream raised (a cancelled call).
        """
        idle_left = self.idle_s or float("inf")
        while True:
            timeout = idle_left
            if self.min_bytes_per_s:
                timeout = min(timeout, max(0.0, self.window_s - self._waited))
            t0 = time.monotonic()
            try:
                item = self._q.get(timeout=None if timeout == float("inf") else timeout)
            except queue.Empty:
                item = None
            waited = time.monotonic() - t0
            self._waited += waited
            idle_left -= waited
            if item is None and idle_left <= 0:  # silence is the idle deadline's, whatever the rate says
                raise Aborted(
                    f"{self.what}: no message for {self.idle_s:g} s (ServerConfig.publication_idle_s); the "
                    "publication is ended, its staging removed and its reservation freed; publish again"
                )
            if item is not None and item is not self._END and not isinstance(item, BaseException):
                self._bytes += self._size_of(item)
            self._check_rate()
            if item is not None:
                break
        if item is self._END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _check_rate(self) -> None:
        """At the end of each rate window: Aborted if the client sent fewer
        bytes than the floor asks for the time waited; a new window either way."""
        if not self.min_bytes_per_s or self._waited < self.window_s:
            return
        waited, got = self._waited, self._bytes
        self._waited, self._bytes = 0.0, 0
        if got < self.min_bytes_per_s * waited:
            raise Aborted(
                f"{self.what}: {got} payload bytes in {waited:.1f} s of waiting for the client, under the floor "
                f"of {self.min_bytes_per_s:g} bytes/s (ServerConfig.publication_min_bytes_per_s); the publication "
                "is ended, its staging removed and its slot freed; publish again"
            )

    def close(self) -> None:
        """Tells the reader to stop handing over; it exits when the call ends."""
        self._stop.set()


def declared_tensors(msg: Any) -> dict[str, str]:
    """The plan's declared tensor digests by name (checked at commit).

    Raises:
        InvalidArgument: a declared digest that is not 64 lowercase hex.
    """
    out = {}
    for f in msg.files:
        for t in f.tensors:
            if t.declared_sha256:
                if len(t.declared_sha256) != 64 or any(c not in HEX_DIGITS for c in t.declared_sha256):
                    raise InvalidArgument(f"publication plan: tensor {t.name!r} declared_sha256 must be 64 lowercase hex")
                out[t.name] = t.declared_sha256
    return out
