"""How many bytes the node has pinned: each (file, byte) once.

Data-parallel workers map the same blob and each registers it, but the
driver pins the same page-cache pages for all of them: the node's pinned
memory is the UNION of what the registrations cover, not their sum
(issue 23, finding 7). A registration names its pages as
:class:`PinnedRange` s (``AdmitRegistrationRequest.ranges``); one that names
none (an older client) counts its bytes on its own.

Pure functions over records: :mod:`hwr_server.registration.admission` calls
them under its lock.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from hwr_client.core.errors import InvalidArgument

#: Most ranges one request may name (a model of a few hundred blocks in
#: 1 GiB chunks names a few hundred).
MAX_RANGES = 65536
MAX_KEY_CHARS = 256


@dataclasses.dataclass(frozen=True)
class PinnedRange:
    """Bytes ``[offset, offset + length)`` of the pages named ``key``."""

    key: str
    offset: int
    length: int


def check_ranges(what: str, nbytes: int, ranges: Sequence[PinnedRange]) -> None:
    """Validates a request's ranges (none is valid: counted by ``nbytes``).

    Raises:
        InvalidArgument: too many ranges, an empty or overlong key, a
            non-positive length, or lengths that do not sum to ``nbytes``.
    """
    if not ranges:
        return
    if len(ranges) > MAX_RANGES:
        raise InvalidArgument(f"{what}: {len(ranges)} ranges, expected at most {MAX_RANGES}")
    for i, r in enumerate(ranges):
        if not r.key or len(r.key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"{what}: range {i} key {r.key[:40]!r}: expected 1..{MAX_KEY_CHARS} characters")
        if r.length <= 0 or r.offset < 0:
            raise InvalidArgument(f"{what}: range {i} ({r.key}) offset {r.offset} length {r.length}: expected "
                                  f"offset >= 0 and length > 0")
    total = sum(r.length for r in ranges)
    if total != nbytes:
        raise InvalidArgument(f"{what}: ranges cover {total} bytes, expected nbytes ({nbytes})")


def union_bytes(registrations: Iterable[tuple[int, Sequence[PinnedRange]]]) -> int:
    """Bytes pinned on the node by ``registrations`` (each ``(nbytes,
    ranges)``): the union of every range per key, plus the bytes of each
    registration that names no range."""
    anonymous = 0
    by_key: dict[str, list[tuple[int, int]]] = {}
    for nbytes, ranges in registrations:
        if not ranges:
            anonymous += nbytes
        for r in ranges:
            by_key.setdefault(r.key, []).append((r.offset, r.offset + r.length))
    total = anonymous
    for spans in by_key.values():
        spans.sort()
        start, end = spans[0]
        for lo, hi in spans[1:]:
            if lo > end:
                total += end - start
                start, end = lo, hi
            else:
                end = max(end, hi)
        total += end - start
    return total
