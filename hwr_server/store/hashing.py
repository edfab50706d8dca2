"""Hashing for publication and verification: the whole-file hasher
(SHA-256 + xxh3-128), the per-tensor/per-block hasher fed bytes strictly in
order, the bounded pipeline stage that runs a hasher on its own thread, and
the read-back used by unordered commits and deep verification.

Also the two process-level tunings the hashing pipeline needs (glibc
allocator retention and native thread names).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import queue
import threading
from typing import Any, Callable, Sequence

import xxhash

from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import CheckedPlan

#: Chunks queued per hashing thread; bounds in-flight memory per publication
#: to about (QUEUE_DEPTH + 2) x max_chunk_bytes.
QUEUE_DEPTH = 4
#: Read size of the read-back hashers (unordered commit, verify).
READ_BYTES = 8 * 1024 * 1024


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_tuned = False


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_allocator() -> bool:
    """Makes glibc keep freed multi-MiB buffers for reuse (process-wide, once).

    Why: every payload message allocates a few 4 MiB buffers (the received
    message, its ``data`` bytes). By default glibc returns such buffers to the
    kernel on free (munmap, or trimming the heap top), so the next message
    page-faults and zeroes 4 MiB afresh: measured 0.70 CPU-s/GB just to read
    ``chunk.data``, against 0.11 with these settings, on a box where the
    daemon needs every cycle for hashing. The cost is that up to
    64 MiB of freed memory may stay mapped per arena.

    Returns:
        True when the settings were applied (glibc), False otherwise.
    """
    global _tuned
    if _tuned:
        return True
    try:
        libc = _libc()
        ok = (
            bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024))
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024))
            # Few arenas: each gRPC worker thread would otherwise get its own arena
            # and keep its own freed buffers, so retained memory grew with the
            # number of threads that ever served a publication.
            and bool(libc.mallopt(_M_ARENA_MAX, 2))
        )
    except (OSError, AttributeError):
        return False
    _tuned = ok
    return ok


def set_native_thread_name(name: str) -> None:
    """Names the calling OS thread (first 15 bytes), so `top -H` and
    /proc/<pid>/task/*/comm show which thread hashes; best effort."""
    try:
        _libc().pthread_setname_np(ctypes.c_ulong(threading.get_ident()), name.encode()[:15])
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------
# Hashers: one file, bytes fed strictly in order
# ---------------------------------------------------------------------------


class WholeHasher:
    """SHA-256 and xxh3-128 of a whole file (header included)."""

    def __init__(self, header: bytes = b""):
        self.sha = hashlib.sha256(header)
        self.xxh = xxhash.xxh3_128(header)

    def update(self, data: Any) -> None:
        self.sha.update(data)  # releases the GIL for large buffers
        self.xxh.update(data)

    def digests(self) -> tuple[str, str]:
        return self.sha.hexdigest(), self.xxh.hexdigest()


class PartsHasher:
    """Per-tensor SHA-256, per-block xxh3-128 and the zero check of padding,
    over absolute file offsets, fed in order starting at ``start``.

    Args:
        tensors: (name, begin, end) absolute ranges.
        blocks: (index, begin, end) absolute ranges.
        pads: (begin, end) absolute ranges that must hold zero bytes.
        start: offset of the first byte fed.
    """

    def __init__(self, tensors: Sequence[tuple[str, int, int]], blocks: Sequence[tuple[int, int, int]],
                 pads: Sequence[tuple[int, int]], start: int, what: str):
        self.what = what
        self.pos = start
        self.tensor_sha = {name: hashlib.sha256() for name, _, _ in tensors}
        self.block_xxh = {i: xxhash.xxh3_128() for i, _, _ in blocks}
        segs = [(b, e, 0, n) for n, b, e in tensors] + [(b, e, 1, None) for b, e in pads]
        self._segs = sorted(segs, key=lambda s: (s[0], s[1]))
        self._blocks = sorted(((b, e, i) for i, b, e in blocks))
        self._si = self._bi = 0
        self.problems: list[str] = []

    def update(self, data: Any) -> None:
        mv = memoryview(data)
        start, end = self.pos, self.pos + len(mv)
        self._si = self._walk(self._segs, self._si, mv, start, end, self._segment)
        self._bi = self._walk(self._blocks, self._bi, mv, start, end, self._block)
        self.pos = end

    @staticmethod
    def _walk(segs: list, i: int, mv: memoryview, start: int, end: int, fn: Callable) -> int:
        while i < len(segs):
            seg = segs[i]
            b, e = seg[0], seg[1]
            if b >= end and e > b:
                break
            lo, hi = max(b, start), min(e, end)
            if hi > lo:
                fn(seg, mv[lo - start : hi - start], lo)
            if e > end:
                break
            i += 1
        return i

    def _segment(self, seg: tuple, piece: memoryview, at: int) -> None:
        if seg[2] == 0:
            self.tensor_sha[seg[3]].update(piece)
        elif any(piece):  # padding is < 64 bytes per tensor: a Python scan is cheap
            self.problems.append(f"{self.what}: alignment padding at offset {at} is not zero; padding must be zero bytes")

    def _block(self, seg: tuple, piece: memoryview, at: int) -> None:
        self.block_xxh[seg[2]].update(piece)

    def tensor_digests(self) -> dict[str, str]:
        return {n: h.hexdigest() for n, h in self.tensor_sha.items()}

    def block_digests(self) -> dict[int, str]:
        return {i: h.hexdigest() for i, h in self.block_xxh.items()}


def parts_from_plan(checked: CheckedPlan, fi: int) -> PartsHasher:
    """The PartsHasher of planned file ``fi``."""
    lay = checked.layouts[fi]
    ds = lay.data_start
    tensors = [(s.name, ds + o, ds + o + s.nbytes) for s, o in zip(lay.tensors, lay.tensor_offsets)]
    pads = [(ds + b, ds + e) for b, e in lay.padding_ranges()]
    blocks = [(b.index, b.begin, b.end) for b in checked.blocks if b.file == fi]
    return PartsHasher(tensors, blocks, pads, ds, f"file {fi} ({checked.plan.files[fi].name})")


def parts_from_manifest(manifest: Manifest, fi: int) -> PartsHasher:
    """The PartsHasher of manifest file ``fi`` (padding = gaps between tensors)."""
    f = manifest.files[fi]
    ts = sorted(((t.name, t.offset, t.offset + t.nbytes) for t in manifest.tensors if t.file == fi),
                key=lambda x: x[1])
    pads, pos = [], f.data_start
    for _, b, e in ts:
        if b > pos:
            pads.append((pos, b))
        pos = max(pos, e)
    if f.size > pos:
        pads.append((pos, f.size))
    blocks = [(b.index, b.begin, b.end) for b in manifest.blocks if b.file == fi]
    return PartsHasher(ts, blocks, pads, f.data_start, f"file {fi} (blob {f.blob[:12]})")


class _Stage(threading.Thread):
    """A pipeline thread applying ``fn`` to queued items, in order.

    The queue is bounded so a slow hasher throttles the writer instead of
    letting chunks pile up in memory.
    """

    def __init__(self, fn: Callable[[Any], None], name: str):
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.q: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        self.error: BaseException | None = None

    def run(self) -> None:
        set_native_thread_name(self.name)
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    self.fn(item)
                except BaseException as exc:  # noqa: BLE001 - reported by finish()
                    self.error = exc

    def finish(self) -> None:
        self.q.put(None)
        self.join()
        if self.error is not None:
            raise self.error


def readback(fd: int, whole: WholeHasher, parts: PartsHasher, data_start: int, size: int) -> int:
    """Hashes a file from disk: the caller's thread reads and runs ``parts``
    while a helper thread runs ``whole`` (two SHA-256 streams overlap).

    Args:
        fd: the file, already opened and trust-checked by the caller
            (``access.files.open_stored``). Read by offset from 0 (``pread``):
            the fd's own offset is neither used nor moved. Never a path: a
            name re-opened after the check could meanwhile name another file.

    Returns:
        Bytes read.
    """
    helper = _Stage(whole.update, "hwr-readback-file")
    helper.start()
    total = 0
    try:
        while True:
            buf = os.pread(fd, READ_BYTES, total)
            if not buf:
                break
            helper.q.put(buf)
            if total + len(buf) > data_start:
                skip = max(0, data_start - total)
                parts.update(memoryview(buf)[skip:])
            total += len(buf)
    finally:
        helper.finish()
    return total
