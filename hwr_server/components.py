"""The daemon's components as one record: what :class:`hwr_server.daemon.Daemon`
builds and what every rpc adapter (:mod:`hwr_server.rpc`) is handed.

It sits below both: the daemon imports the adapters to serve them, and the
adapters import this record, never the daemon, so neither imports the other.
"""

from __future__ import annotations

import dataclasses

from hwr_server.access.trust import TrustPolicy
from hwr_server.gc.collector import Collector
from hwr_server.leases.manager import LeaseManager
from hwr_server.metrics import Metrics
from hwr_server.publish.handoff import HandoffListener
from hwr_server.registration.admission import RegistrationAdmission
from hwr_server.remote.remote import Remote
from hwr_server.sources.cache import SourceCache
from hwr_server.store.scrub import Scrubber
from hwr_server.store.store import Store


@dataclasses.dataclass(frozen=True)
class Components:
    """The daemon's components, as the rpc handlers reach them.

    Built by :meth:`Daemon.start` once the locks are held and before any
    socket binds, so a handler never sees a missing one.
    """

    store: Store
    leases: LeaseManager
    sources: SourceCache
    gc: Collector
    scrub: Scrubber
    metrics: Metrics
    registration: RegistrationAdmission
    remote: Remote
    #: Whose artifacts each caller takes (docs/trust.md).
    trust: TrustPolicy
    #: The handoff socket of the publications' handoff transport; None where
    #: it is not offered (not bound, or file leases unavailable).
    handoff: HandoffListener | None = None
