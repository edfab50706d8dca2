"""What to pin and in which calls: the pure half of host registration.

Two facts shape the plan (issue 23, findings 4, 7 and 8):

- **A copy must come out of ONE registration.** The backend moves a block
  in one ``copy_`` (:mod:`dlo_runtime.copy_engine`); the CUDA runtime treats
  a source as pinned only when the whole range lies in one registered
  allocation. A copy that straddles two registrations is not a pinned copy
  (a batched copy rejects it; a plain one may stage through the driver and
  synchronize the host). So chunks are cut right after a block
  (:func:`plan_chunks`), a block larger than the chunk size is one chunk of
  its own (its report to the daemon is split into pieces of at most the
  daemon's chunk size: :func:`report_pieces`), and where blocks share a page
  the one block cut by less than a page is copied in two pieces
  (:func:`copy_cuts`).
- **The node pins page-cache pages, not virtual ranges.** Every worker
  mapping the same blob pins the same physical pages, and a stitched
  checkpoint block maps file pages a second time at another address. Each
  registered chunk is therefore described to the daemon as file
  :class:`Extent` s (identity of the file's pages, offset, length), and the
  daemon counts each (file, byte) once across the node
  (:mod:`hwr_server.registration.accounting`).

Nothing here calls CUDA; :mod:`dlo_runtime.transports` runs the plan.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol, Sequence, runtime_checkable

from hwr_client.core.errors import Internal
from hwr_client.mapping import PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class Extent:
    """Bytes of one file's pages (or of one anonymous mapping).

    ``key`` names the pages, not the path: ``inode:<dev>:<ino>`` for a file
    (what the page cache indexes by, identical in every worker),
    ``anon:<pid>:<address>`` for private anonymous memory (never shared).
    """

    key: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class PinRegion:
    """One virtual range to register: ``path`` (for logs), its page-aligned
    ``address`` and ``length``, and the extents it maps, back to back from
    ``address`` (empty: the whole of one file from offset 0, resolved by
    :func:`pin_regions`)."""

    path: str
    address: int
    length: int
    extents: tuple[Extent, ...] = ()

    @property
    def aligned_length(self) -> int:
        """``length`` rounded up to whole pages: what a registrar registers."""
        return page_ceil(self.length)


@runtime_checkable
class PinSource(Protocol):
    """A source that names its own registration ranges (the checkpoint
    mapping: merged block spans, each page of a file once). A lease does
    not: its mapped files are registered whole."""

    def registration_regions(self) -> list[PinRegion]:
        """The ranges to register, with their file extents."""
        ...


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One page-aligned range of one region, registered in one call."""

    address: int
    nbytes: int
    path: str


def page_floor(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


def page_ceil(n: int) -> int:
    return -(-n // PAGE_SIZE) * PAGE_SIZE


def file_key(path: str) -> str:
    """The identity of a file's page-cache pages: ``inode:<dev>:<ino>``
    (``path:<path>`` where the file cannot be stat'ed)."""
    try:
        st = os.stat(path)
    except OSError:
        return f"path:{path}"
    return f"inode:{st.st_dev}:{st.st_ino}"


def pin_regions(regions: Sequence[object]) -> list[PinRegion]:
    """``regions`` (:class:`PinRegion` or a lease's ``Region``: one whole
    mapped file) as :class:`PinRegion` s with their extents."""
    out: list[PinRegion] = []
    for r in regions:
        if isinstance(r, PinRegion) and r.extents:
            out.append(r)
            continue
        path, address, length = r.path, r.address, r.length  # type: ignore[attr-defined]
        out.append(PinRegion(path, address, length, (Extent(file_key(path), 0, page_ceil(length)),)))
    return out


def _blocks_in(region: PinRegion, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The blocks inside ``region`` as sorted [start, end) addresses."""
    lo, hi = region.address, region.address + region.aligned_length
    return sorted((max(lo, a), min(hi, a + n)) for a, n in spans if n > 0 and a + n > lo and a < hi)


def plan_chunks(regions: Sequence[object], chunk_bytes: int, spans: Sequence[tuple[int, int]] = ()) -> list[Chunk]:
    """Page-aligned chunks covering every region, cut between blocks.

    Each cut is the page boundary right after the LAST block that ends
    within ``chunk_bytes`` of the chunk's start, so no block is split
    except by less than a page where blocks share a page (an artifact packs
    blocks back to back, 64-byte aligned, not page-aligned): such a block's
    first bytes lie in the previous chunk and its copy is issued in two
    pieces, each inside one registration (:func:`copy_cuts`). Where no
    block ends within ``chunk_bytes``, the block in the way is taken whole:
    the chunk is larger than ``chunk_bytes`` (its report to the daemon is
    split, :func:`report_pieces`).

    Args:
        regions: what to register (page-aligned addresses).
        chunk_bytes: the largest chunk, unless one block alone is larger.
        spans: ``(address, nbytes)`` of every streamed block (none: cuts
            every ``chunk_bytes``).

    Raises:
        Internal: a region whose address is not page-aligned, or a chunk
            size that is not a positive multiple of the page size.
    """
    if chunk_bytes <= 0 or chunk_bytes % PAGE_SIZE:
        raise Internal(f"registration chunk size {chunk_bytes}: expected a positive multiple of {PAGE_SIZE}")
    out: list[Chunk] = []
    for r in regions:
        address, path = r.address, r.path  # type: ignore[attr-defined]
        if address % PAGE_SIZE:
            raise Internal(f"mapped file {path}: address {address:#x} is not page-aligned")
        region = r if isinstance(r, PinRegion) else PinRegion(path, address, r.length)  # type: ignore[attr-defined]
        end = address + region.aligned_length
        blocks = _blocks_in(region, spans)
        pos = address
        while pos < end:
            target = min(pos + chunk_bytes, end)
            cover = next((e for s, e in blocks if s < target < e), None) if target < end else None
            if cover is not None:  # the cut would split a block
                ends = [page_ceil(e) for _, e in blocks if pos < page_ceil(e) <= target]
                # Right after the last block that fits; else the block in the
                # way (larger than a chunk) whole.
                target = max(ends) if ends else min(end, page_ceil(cover))
            out.append(Chunk(pos, target - pos, path))
            pos = target
    return out


def copy_cuts(address: int, nbytes: int, chunks: Sequence[Chunk]) -> tuple[int, ...]:
    """Offsets inside the block ``[address, address + nbytes)`` where a
    registered chunk ends: the block's copy is issued in pieces split there,
    so each piece is a copy out of ONE registration (empty: one copy)."""
    return tuple(c.address + c.nbytes - address for c in chunks
                 if address < c.address + c.nbytes < address + nbytes)


def chunk_extents(regions: Sequence[PinRegion], chunk: Chunk) -> list[Extent]:
    """The file extents ``chunk`` pins (one region's extents, sliced)."""
    for r in regions:
        if r.address <= chunk.address < r.address + r.aligned_length:
            lo, hi = chunk.address - r.address, chunk.address - r.address + chunk.nbytes
            out, pos = [], 0
            for e in r.extents:
                a, b = max(lo, pos), min(hi, pos + e.length)
                if b > a:
                    out.append(Extent(e.key, e.offset + a - pos, b - a))
                pos += e.length
            return out
    raise Internal(f"chunk {chunk.address:#x} ({chunk.path}) lies in no region")


def admission_extents(regions: Sequence[PinRegion], chunks: Sequence[Chunk]) -> list[Extent]:
    """Every chunk's extents, neighbours of one file merged; their lengths
    sum to the chunks' bytes (overlaps between chunks stay: the daemon
    counts the union)."""
    out: list[Extent] = []
    for c in chunks:
        for e in chunk_extents(regions, c):
            last = out[-1] if out else None
            if last is not None and last.key == e.key and last.offset + last.length == e.offset:
                out[-1] = Extent(e.key, last.offset, last.length + e.length)
            else:
                out.append(e)
    return out


def report_pieces(nbytes: int, seconds: float, limit: int) -> list[tuple[int, float]]:
    """One registered chunk as reports of at most ``limit`` bytes each (the
    daemon's chunk size; 0 = one report), seconds shared in proportion."""
    if limit <= 0 or nbytes <= limit:
        return [(nbytes, seconds)]
    return [(min(limit, nbytes - o), seconds * min(limit, nbytes - o) / nbytes) for o in range(0, nbytes, limit)]
