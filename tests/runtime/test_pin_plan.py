"""The registration plan (pure): chunks cut between blocks, copies split
where a registration ends, file extents for the node's admission."""

from __future__ import annotations

import os

import pytest

from dlo_runtime.copy_engine import pieces
from dlo_runtime.pin_plan import (
    Extent, PinRegion, admission_extents, chunk_extents, copy_cuts, file_key, pin_regions, plan_chunks, report_pieces,
)
from hwr_client.mapping import PAGE_SIZE, Region

P = PAGE_SIZE
BASE = 1024 * P


def _check_copies_pinned(spans, chunks):
    """Every piece of every block's copy lies in exactly one chunk."""
    for address, nbytes in spans:
        for lo, hi in pieces(nbytes, copy_cuts(address, nbytes, chunks)):
            inside = [c for c in chunks if c.address <= address + lo and address + hi <= c.address + c.nbytes]
            assert len(inside) == 1, (address, nbytes, lo, hi)


def test_page_aligned_blocks_are_never_cut_and_chunks_stay_bounded():
    spans = [(BASE + i * 3 * P, 3 * P) for i in range(4)]  # four 3-page blocks
    chunks = plan_chunks([Region("f", BASE, 12 * P)], 7 * P, spans)
    assert [(c.address - BASE) // P for c in chunks] == [0, 6]  # cut after block 1 (6 pages <= 7)
    assert all(c.nbytes <= 7 * P for c in chunks)
    assert all(copy_cuts(a, n, chunks) == () for a, n in spans)


def test_blocks_sharing_pages_are_cut_by_less_than_a_page_and_copied_in_pieces():
    # Back to back, 64-byte aligned, as an artifact packs them: 2.5 pages each.
    size = 5 * P // 2
    spans = [(BASE + 64 + i * size, size) for i in range(6)]
    region = Region("f", BASE, 64 + 6 * size)
    chunks = plan_chunks([region], 4 * P, spans)
    assert sum(c.nbytes for c in chunks) == region.aligned_length
    assert all(c.nbytes <= 4 * P for c in chunks)
    cuts = [copy_cuts(a, n, chunks) for a, n in spans]
    assert any(cuts)
    assert all(len(c) <= 1 and all(x < P for x in c) for c in cuts)  # the head, under a page
    _check_copies_pinned(spans, chunks)


def test_a_block_larger_than_a_chunk_is_one_chunk():
    spans = [(BASE, P), (BASE + P, 10 * P), (BASE + 11 * P, P)]
    chunks = plan_chunks([Region("f", BASE, 12 * P)], 2 * P, spans)
    assert [(c.address - BASE) // P for c in chunks] == [0, 1, 11]
    assert chunks[1].nbytes == 10 * P
    _check_copies_pinned(spans, chunks)


def test_without_spans_the_old_fixed_cut_remains():
    chunks = plan_chunks([Region("a", BASE, 5 * P + 7)], 2 * P)
    assert [c.nbytes // P for c in chunks] == [2, 2, 2]


def test_bad_input_is_refused():
    with pytest.raises(Exception, match="not page-aligned"):
        plan_chunks([Region("c", 3, 10)], 2 * P)
    with pytest.raises(Exception, match="multiple of"):
        plan_chunks([Region("c", BASE, 10)], P + 1)


def test_extents_of_a_stitched_region_follow_its_pieces():
    # Two files' pages mapped back to back: 3 pages of a, then 2 of b.
    r = PinRegion("a+b", BASE, 5 * P, (Extent("ka", 8 * P, 3 * P), Extent("kb", 0, 2 * P)))
    chunks = plan_chunks([r], 2 * P)
    assert [chunk_extents([r], c) for c in chunks] == [
        [Extent("ka", 8 * P, 2 * P)], [Extent("ka", 10 * P, P), Extent("kb", 0, P)], [Extent("kb", P, P)]]
    merged = admission_extents([r], chunks)
    assert merged == [Extent("ka", 8 * P, 3 * P), Extent("kb", 0, 2 * P)]
    assert sum(e.length for e in merged) == sum(c.nbytes for c in chunks)


def test_a_lease_region_is_its_whole_file_named_by_inode(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (P + 1))
    os.link(path, tmp_path / "other-name")
    (r,) = pin_regions([Region(str(path), BASE, P + 1)])
    assert r.extents == (Extent(file_key(str(path)), 0, 2 * P),)
    assert file_key(str(tmp_path / "other-name")) == file_key(str(path))  # the pages, not the path
    (tmp_path / "third").write_bytes(b"y")
    assert file_key(str(tmp_path / "third")) != file_key(str(path))
    assert file_key(str(tmp_path / "missing")).startswith("path:")


def test_report_pieces_split_a_large_chunk_for_the_daemon():
    assert report_pieces(10, 1.0, 0) == [(10, 1.0)]
    assert report_pieces(10, 1.0, 10) == [(10, 1.0)]
    got = report_pieces(10, 1.0, 4)
    assert [n for n, _ in got] == [4, 4, 2] and sum(s for _, s in got) == pytest.approx(1.0)
