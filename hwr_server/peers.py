"""Who is calling: the peer identity every per-client limit is keyed by.

DESIGN §16: no single client may take more than its share of server threads,
publication slots, reserved bytes, file descriptors, leases or verify work.
Those caps are counted per :class:`Peer`. :func:`peer_of` is the one place a
handler learns its peer from the gRPC context.

Seam status: until the peer-credentials handshake lands, every call maps to
one anonymous peer (per-peer caps then act as caps in total).
"""

from __future__ import annotations

import dataclasses

import grpc


@dataclasses.dataclass(frozen=True)
class Peer:
    """A calling process as far as the daemon can prove it.

    Attributes:
        pid: the process id (kernel-checked), or None when unknown.
        uid: the user id (kernel-checked), or None when unknown.
    """

    pid: int | None = None
    uid: int | None = None

    @property
    def key(self) -> str:
        """A stable label for logs and per-peer accounting."""
        return "anonymous" if self.pid is None else f"pid {self.pid} (uid {self.uid})"


ANONYMOUS = Peer()


def peer_of(context: grpc.ServicerContext) -> Peer:
    """The peer of the call ``context`` belongs to."""
    return ANONYMOUS
