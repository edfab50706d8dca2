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

__all__ = [
    "Aborted", "AlreadyExists", "Client", "build_identity", "DataLoss", "FailedPrecondition", "HwrError", "Identity", "Internal",
    "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted", "Unavailable", "connect",
]
