"""Who sees what in the read-only listings on the runtime socket.

The runtime socket (mode 0660, group ``socket_group``) is shared by every
user who may run workers; the admin socket (0600) only by the daemon's own
user. The listings the ``hwr`` CLI reads over the runtime socket (``hwr
sources``, ``hwr leases``, ``hwr ls``, ``hwr inspect``) answer each caller
for itself there:

* **ListSources**: only the records of files the caller could read itself,
  by the same rule ResolveSources applies (:mod:`hwr_server.sources.access`),
  and only while the record still describes that file. Another user's
  root-only checkpoint shows neither its path nor its SHA-256.
* **ListLeases**, and the lease holders of **InspectArtifact**: only leases
  held by processes running as the caller's uid now (a lease whose process
  is gone, awaiting re-attach, shows to the privileged only). Other users'
  pids, program names and the keys they use stay theirs.
* **ListArtifacts** / **InspectArtifact** summaries: the store's index is
  shared by design (one copy per node; any worker may look up any key), so
  every artifact is listed, but its ``lease_count`` counts only the caller's
  own leases and ``last_leased_unix`` is not shown.

The admin socket, root and the daemon's own uid see everything
(:func:`hwr_server.access.peers.privileged`). A caller without a peer
token (anonymous) sees no source record and no lease.
"""

from __future__ import annotations

import dataclasses

import grpc

from hwr_server.access.peers import Peer, peer_of, privileged, process_euid


@dataclasses.dataclass(frozen=True)
class Viewer:
    """The caller of a listing and what it may see.

    Attributes:
        peer: the caller (:func:`hwr_server.access.peers.peer_of`).
        everything: the admin socket, root or the daemon's uid.
    """

    peer: Peer
    everything: bool

    def sees_process(self, pid: int) -> bool:
        """Whether a record of process ``pid`` (a lease holder) is shown:
        to everyone who sees everything; else only while that process runs
        as the caller's uid."""
        if self.everything:
            return True
        return self.peer.uid is not None and pid > 0 and process_euid(pid) == self.peer.uid


def viewer_of(context: grpc.ServicerContext, *, admin: bool) -> Viewer:
    """The viewer of the call ``context`` belongs to, on the admin socket
    when ``admin``."""
    peer = peer_of(context)
    return Viewer(peer, admin or privileged(peer))
