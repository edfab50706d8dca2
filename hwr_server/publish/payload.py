"""What a publication's two payload transports share: the staged files they
fill (:class:`StagedFiles`), the digests they hand the commit
(:class:`Digests`), and the seam the publication drives them through
(:class:`Payload`).

The transports: :class:`~hwr_server.publish.streamed.StreamedPayload` (the
bytes arrive in messages: remote or unprivileged clients, raw gRPC) and
:class:`~hwr_server.publish.handed.HandedPayload` (the client writes the
staging files through descriptors the daemon hands it; the default for a
local client).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Protocol, Sequence

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.plan import CheckedPlan
from hwr_server.store.hashing import PartsHasher, parts_from_plan
from hwr_server.store.staging_io import fsync_close


@dataclasses.dataclass(frozen=True)
class StagedFiles:
    """A publication's staging files, as its payload transport sees them.

    Attributes:
        checked: the checked plan (layouts, blocks).
        paths: the staging path of each planned file (header already written).
        what: names the publication in errors and logs.
        threads: hashing / fsync threads it may use.
        max_chunk_bytes: the largest message chunk (streamed transport).
        max_pending_fsyncs: finished files whose fsync may be pending.
        admit: makes room for this many payload bytes before they may be
            written (the publication's arrival admission): each chunk on the
            message transport, each file's data size on the handoff one.
        sha256_tensors: tensors whose SHA-256 the plan declared.
        nice: nice increment of the transport's own hashing and fsync
            threads (ServerConfig.publication_nice).
    """

    checked: CheckedPlan
    paths: Sequence[str]
    what: str
    threads: int
    max_chunk_bytes: int
    max_pending_fsyncs: int
    admit: Callable[[int], None]
    sha256_tensors: frozenset[str]
    nice: int = 0

    @property
    def ordered(self) -> bool:
        return self.checked.plan.ordered

    def parts(self, index: int) -> PartsHasher:
        return parts_from_plan(self.checked, index, sha256_tensors=self.sha256_tensors)

    def fsync_path(self, index: int) -> None:
        """fsyncs staging file ``index`` through a descriptor opened for it."""
        fsync_close(os.open(self.paths[index], os.O_RDONLY | os.O_CLOEXEC))


@dataclasses.dataclass(frozen=True)
class Digests:
    """Every digest a manifest needs, computed by the daemon from the bytes.

    Attributes:
        files: per file (sha256 hex, xxh3_128 hex).
        tensors: tensor name -> xxh3_128 hex.
        tensor_sha256: SHA-256 hex of the tensors the plan declared one for.
        blocks: per block xxh3_128 hex, in block order.
    """

    files: list[tuple[str, str]]
    tensors: dict[str, str]
    tensor_sha256: dict[str, str]
    blocks: list[str]


def collect(checked: CheckedPlan, files: list[tuple[str, str]], parts: Sequence[PartsHasher]) -> Digests:
    """The digests of finished hashers.

    Raises:
        InvalidArgument: non-zero alignment padding (naming where).
    """
    problems = [p for ph in parts for p in ph.problems]
    if problems:
        raise InvalidArgument("; ".join(problems[:5]))
    tensors: dict[str, str] = {}
    shas: dict[str, str] = {}
    blocks: dict[int, str] = {}
    for ph in parts:
        tensors.update(ph.tensor_digests())
        shas.update(ph.tensor_sha256())
        blocks.update(ph.block_digests())
    return Digests(files, tensors, shas, [blocks[b.index] for b in checked.blocks])


class Payload(Protocol):
    """A payload transport, as the publication drives it (one gRPC stream;
    the handed transport also answers the handoff socket's threads)."""

    def write(self, index: int, offset: int, data: bytes) -> int:
        """A message chunk; returns the bytes written (InvalidArgument
        where the transport takes none)."""
        ...

    def written(self, index: int, data_bytes: int, complete: bool) -> None:
        """A handoff progress or completion (InvalidArgument where the
        transport takes none)."""
        ...

    def reported_bytes(self, index: int, data_bytes: int, complete: bool) -> int:
        """The bytes a ``written`` with these fields would newly report (0
        where the transport takes none); changes nothing."""
        ...

    def digests(self) -> Digests:
        """Waits until every byte is in and hashed; the commit's digests.

        Raises:
            InvalidArgument: missing bytes, non-zero padding, a file never
                completed, a header someone overwrote.
        """
        ...

    def sync(self) -> None:
        """Commit step 1: every staging file durable (raises OSError)."""
        ...

    def close(self) -> None:
        """Stops the transport's threads and closes its descriptors; idempotent."""
        ...


__all__ = ["Digests", "Payload", "StagedFiles", "collect"]
