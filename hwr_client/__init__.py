"""HWR client: identities, publication, leases and zero-copy tensor views.

``hwr_client`` is the dependency base of the project: the daemon imports its
shared modules (errors, identity, layout, manifest, plan, generated stubs);
it never imports the daemon at import time.
"""

from hwr_client.client import Client, connect
from hwr_client.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    HwrError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from hwr_client.identity import Identity
from hwr_client.sources import build_identity  # issue 4: identities from real checkpoints
from hwr_client.carrier import LeaseCarrier  # issue 3: leases and resolve
from hwr_client.lease import Lease
from hwr_client.resolve import (
    CANONICAL_FALLBACK, FAILED, LOCAL_HIT, Mode, Outcome, PublishAfterLoadReport, Resolution,
)

__all__ = [
    "Aborted", "AlreadyExists", "Client", "build_identity", "DataLoss", "FailedPrecondition", "HwrError", "Identity", "Internal",
    "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted", "Unavailable", "connect",
    "CANONICAL_FALLBACK", "FAILED", "LOCAL_HIT", "Lease", "LeaseCarrier", "Mode", "Outcome",  # issue 3
    "PublishAfterLoadReport", "Resolution",
]
