"""The store's records (frozen dataclasses): what ``hwr ls`` shows, what a
deep verification found, what the store counts, a staging or quarantine
directory."""

from __future__ import annotations

import dataclasses

from hwr_client.core.manifest import Manifest


@dataclasses.dataclass(frozen=True)
class ArtifactSummary:
    """One row of ``hwr ls``: a published or quarantined artifact."""

    key: str
    state: str  # "published" | "quarantined"
    contract_name: str = ""
    contract_version: int = 0
    producer_id: str = ""
    producer_version: str = ""
    size_bytes: int = 0
    file_count: int = 0
    tensor_count: int = 0
    block_count: int = 0
    created_unix: int = 0
    reason: str = ""
    entry: str = ""  # quarantine directory name, empty when published


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Outcome of a deep verification of one artifact."""

    key: str
    ok: bool
    problems: tuple[str, ...]
    bytes_checked: int
    bad_blobs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StoreFigures:
    """What the store counts and holds; :func:`hwr_server.metrics.store_stats`
    gives them their GetStats / Prometheus names."""

    #: Publication outcome (committed, already_published, conflict,
    #: rejected, failed) -> count since start.
    publications: dict[str, int]
    #: Payload bytes received by publications (counted at their end).
    publication_bytes: int
    #: Seconds spent in publications.
    publication_seconds: float
    #: Deep verifications that found corruption.
    verify_failures: int
    artifacts_published: int
    artifacts_quarantined: int
    #: Unique payload bytes of published artifacts (a shared blob once).
    bytes_published: int
    bytes_quarantined: int
    bytes_staging: int


@dataclasses.dataclass(frozen=True)
class DirEntry:
    """A staging or quarantine directory and the bytes it holds."""

    name: str
    bytes: int
    #: staging only: a publication (or a delete) is using it right now.
    in_flight: bool = False


def summary_of(manifest: Manifest, state: str = "published", *, reason: str = "", entry: str = "") -> ArtifactSummary:
    """The ``hwr ls`` row of ``manifest``."""
    doc = manifest.identity.document
    return ArtifactSummary(
        manifest.key, state, doc["contract"]["name"], doc["contract"]["version"], doc["producer"]["id"],
        doc["producer"]["version"], manifest.size_bytes, len(manifest.files), len(manifest.tensors),
        len(manifest.blocks), manifest.created_unix, reason, entry,
    )
