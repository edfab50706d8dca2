"""A publication's limits (DESIGN §16): the plan limits of a config and the
idle deadline on the request stream (each peer's share of slots and reserved
bytes is :class:`hwr_server.access.shares.PeerShares`). Every limit is a ServerConfig field; :mod:`hwr_server.publish.publication`
applies them.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from hwr_client.core.defaults import MAX_MESSAGE_BYTES
from hwr_client.core.errors import Aborted, InvalidArgument
from hwr_client.core.layout import MAX_HEADER_BYTES
from hwr_client.core.plan import PlanLimits

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
