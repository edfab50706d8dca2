"""HWR client: identities, publication, leases and zero-copy tensor views.

The torch-free shared core (errors, identity, layout, plan, manifest,
digests, defaults, stubs) is :mod:`hwr_client.core`; the daemon imports only
that. The public names below are resolved lazily (PEP 562), so importing a
submodule, e.g. ``hwr_client.core.errors``, costs only what that submodule
imports: ``import hwr_client`` itself loads neither torch nor grpc.

Example:
    >>> from hwr_client import connect, NotFound          # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
    **{name: "hwr_client.core.errors" for name in (
        "Aborted", "AlreadyExists", "DataLoss", "FailedPrecondition", "HwrError", "Internal",
        "InvalidArgument", "NotFound", "PermissionDenied", "ResourceExhausted", "Unavailable",
    )},
    "Identity": "hwr_client.core.identity",
    "Manifest": "hwr_client.core.manifest",
    "Client": "hwr_client.client",
    "connect": "hwr_client.client",
    "build_identity": "hwr_client.sources",
    "LeaseCarrier": "hwr_client.carrier",
    "Lease": "hwr_client.lease",
    **{name: "hwr_client.resolve" for name in (
        "CANONICAL_FALLBACK", "FAILED", "LOCAL_HIT", "Mode", "Outcome", "PublishAfterLoadReport", "Resolution",
    )},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what a type checker and an IDE see; nothing at run time
    from hwr_client.carrier import LeaseCarrier
    from hwr_client.client import Client, connect
    from hwr_client.core.errors import (
        Aborted, AlreadyExists, DataLoss, FailedPrecondition, HwrError, Internal, InvalidArgument, NotFound,
        PermissionDenied, ResourceExhausted, Unavailable,
    )
    from hwr_client.core.identity import Identity
    from hwr_client.core.manifest import Manifest
    from hwr_client.lease import Lease
    from hwr_client.resolve import (
        CANONICAL_FALLBACK, FAILED, LOCAL_HIT, Mode, Outcome, PublishAfterLoadReport, Resolution,
    )
    from hwr_client.sources import build_identity


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hwr_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
