"""Hashing for publication and verification: the whole-file hasher
(SHA-256 + xxh3-128), the per-tensor/per-block hasher fed bytes strictly in
order, the bounded pipeline stage that runs a hasher on its own thread, the
read-back used by unordered commits and deep verification, and the mapped
passes of a handed-off staging file.

One SHA-256 pass per byte: a file's SHA-256 names its blob; a tensor's
digest (manifest format 2) is the xxh3-128 of its bytes, taken from the same
bytes in the same pass (a second SHA-256 per tensor cost as much again:
0.59 CPU-s/GB here, against 0.04 for xxh3). Format-1 manifests, whose
tensors carry SHA-256, are verified with SHA-256 per tensor; a tensor whose
SHA-256 a plan declares is SHA-256-hashed too (only that tensor).

Also the two process-level tunings the hashing pipeline needs (glibc
allocator retention and native thread names).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import mmap
import os
import queue
import threading
from typing import Any, Callable, Collection, Sequence

import xxhash

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import CheckedPlan

#: Chunks queued per hashing thread; bounds in-flight memory per publication
#: to about (QUEUE_DEPTH + 2) x max_chunk_bytes.
QUEUE_DEPTH = 4
#: Read size of the read-back hashers (unordered commit, verify), and the
#: slice a mapped pass hands a hasher at a time.
READ_BYTES = 8 * 1024 * 1024
#: Bytes of a staging file mapped at once by a mapped pass: the pages it
#: maps count in the daemon's RSS until the window is unmapped, so memory
#: stays bounded whatever the file's size (two passes per file, files in
#: parallel: 4 x 16 MiB on 2 cores). Larger windows save nothing measurable.
WINDOW_BYTES = 16 * 1024 * 1024


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


def background_thread(name: str, nice: int) -> None:
    """Names the calling OS thread and lowers its priority by ``nice``
    (Linux: per thread); best effort. A pool initializer."""
    set_native_thread_name(name)
    if nice:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
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
    """Per-tensor digests, per-block xxh3-128 and the zero check of padding,
    over absolute file offsets, fed in order starting at ``start``.

    Args:
        tensors: (name, begin, end) absolute ranges.
        blocks: (index, begin, end) absolute ranges.
        pads: (begin, end) absolute ranges that must hold zero bytes.
        start: offset of the first byte fed.
        tensor_algorithm: ``"xxh3_128"`` (manifest format 2) or
            ``"sha256"`` (format 1): what :meth:`tensor_digests` holds.
        sha256_tensors: names whose SHA-256 is wanted as well
            (:meth:`tensor_sha256`: a plan's declared tensor digests).
    """

    def __init__(self, tensors: Sequence[tuple[str, int, int]], blocks: Sequence[tuple[int, int, int]],
                 pads: Sequence[tuple[int, int]], start: int, what: str, *,
                 tensor_algorithm: str = "xxh3_128", sha256_tensors: Collection[str] = ()):
        self.what = what
        self.pos = start
        new = _TENSOR_HASHES[tensor_algorithm]
        self.tensor_hash = {name: new() for name, _, _ in tensors}
        self.tensor_sha = {name: hashlib.sha256() for name, _, _ in tensors if name in sha256_tensors}
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
            self.tensor_hash[seg[3]].update(piece)
            sha = self.tensor_sha.get(seg[3])
            if sha is not None:
                sha.update(piece)
        elif any(piece):  # padding is < 64 bytes per tensor: a Python scan is cheap
            self.problems.append(f"{self.what}: alignment padding at offset {at} is not zero; padding must be zero bytes")

    def _block(self, seg: tuple, piece: memoryview, at: int) -> None:
        self.block_xxh[seg[2]].update(piece)

    def tensor_digests(self) -> dict[str, str]:
        """Name -> digest hex of ``tensor_algorithm``."""
        return {n: h.hexdigest() for n, h in self.tensor_hash.items()}

    def tensor_sha256(self) -> dict[str, str]:
        """Name -> SHA-256 hex of each tensor in ``sha256_tensors``."""
        return {n: h.hexdigest() for n, h in self.tensor_sha.items()}

    def block_digests(self) -> dict[int, str]:
        return {i: h.hexdigest() for i, h in self.block_xxh.items()}


_TENSOR_HASHES: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def parts_from_plan(checked: CheckedPlan, fi: int, *, sha256_tensors: Collection[str] = ()) -> PartsHasher:
    """The PartsHasher of planned file ``fi`` (format-2 tensor digests, plus
    SHA-256 of the tensors named in ``sha256_tensors``)."""
    lay = checked.layouts[fi]
    ds = lay.data_start
    tensors = [(s.name, ds + o, ds + o + s.nbytes) for s, o in zip(lay.tensors, lay.tensor_offsets)]
    pads = [(ds + b, ds + e) for b, e in lay.padding_ranges()]
    blocks = [(b.index, b.begin, b.end) for b in checked.blocks if b.file == fi]
    return PartsHasher(tensors, blocks, pads, ds, f"file {fi} ({checked.plan.files[fi].name})",
                       sha256_tensors=sha256_tensors)


def parts_from_manifest(manifest: Manifest, fi: int) -> PartsHasher:
    """The PartsHasher of manifest file ``fi`` (padding = gaps between
    tensors), with the tensor digest of the manifest's format."""
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
    algorithm = "sha256" if manifest.format_version == 1 else "xxh3_128"
    return PartsHasher(ts, blocks, pads, f.data_start, f"file {fi} (blob {f.blob[:12]})", tensor_algorithm=algorithm)


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
    """Hashes a file from disk: the caller's thread reads and runs the
    xxh3 passes (``whole``'s and ``parts``) while a helper thread runs the
    file's SHA-256 (``parts`` holds SHA-256 too for a format-1 manifest: the
    two SHA-256 streams then overlap).

    Args:
        fd: the file, already opened and trust-checked by the caller
            (``access.files.open_stored``). Read by offset from 0 (``pread``):
            the fd's own offset is neither used nor moved. Never a path: a
            name re-opened after the check could meanwhile name another file.

    Returns:
        Bytes read.
    """
    helper = _Stage(whole.sha.update, "hwr-readback-file")
    helper.start()
    total = 0
    try:
        while True:
            buf = os.pread(fd, READ_BYTES, total)
            if not buf:
                break
            helper.q.put(buf)
            whole.xxh.update(buf)
            if total + len(buf) > data_start:
                skip = max(0, data_start - total)
                parts.update(memoryview(buf)[skip:])
            total += len(buf)
    finally:
        helper.finish()
    return total


# ---------------------------------------------------------------------------
# Mapped passes over a sealed staging file (the handoff transport)
# ---------------------------------------------------------------------------


def mapped_pass(fd: int, size: int, feed: Callable[[memoryview], bool | None]) -> None:
    """Feeds the file's bytes ``[0, size)`` to ``feed`` in order, in slices
    of :data:`READ_BYTES`, from read-only windows of :data:`WINDOW_BYTES`
    mapped one at a time: no copy out of the page cache (a ``pread`` costs
    a copy, about 0.03 CPU-s/GB here), and no more than one window counted
    in the daemon's RSS per pass. ``feed`` returning False stops the pass.

    Args:
        fd: the file, opened by the daemon (never a path: see ``readback``).
        size: bytes to feed; the caller checked the file holds them.
    """
    for start in range(0, size, WINDOW_BYTES):
        length = min(WINDOW_BYTES, size - start)
        error: BaseException | None = None
        with mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start) as window:
            view = memoryview(window)
            try:
                for a in range(0, length, READ_BYTES):
                    if feed(view[a:a + READ_BYTES]) is False:
                        view.release()
                        return
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once the window can close
                # Its traceback's frames hold slices of the window, which
                # could then never be unmapped (BufferError): dropped.
                error = exc.with_traceback(None)
            view.release()
        if error is not None:
            raise error


def sha256_pass(fd: int, size: int) -> str:
    """The SHA-256 hex of the file's first ``size`` bytes: its blob name."""
    sha = hashlib.sha256()
    mapped_pass(fd, size, sha.update)  # hashlib releases the GIL for large slices
    return sha.hexdigest()


def xxh3_pass(fd: int, size: int, parts: PartsHasher, header: bytes, what: str) -> str:
    """The xxh3-128 hex of the file's first ``size`` bytes, feeding ``parts``
    (tensor and block digests, the padding check) from the same slices and
    checking that the file starts with ``header``.

    Raises:
        InvalidArgument: the file's header is not ``header`` (the daemon
            wrote it; someone overwrote it).
    """
    xxh = xxhash.xxh3_128()
    seen = [0]
    intact = [True]

    def feed(piece: memoryview) -> bool:
        at = seen[0]
        if at < len(header) and piece[:len(header) - at] != header[at:at + len(piece)]:
            intact[0] = False
            return False
        xxh.update(piece)
        if at + len(piece) > parts.pos:
            parts.update(piece[max(0, parts.pos - at):])
        seen[0] = at + len(piece)
        return True

    mapped_pass(fd, size, feed)
    if not intact[0]:
        raise InvalidArgument(f"{what}: the safetensors header the daemon wrote was overwritten; a client "
                              "writes only the data region")
    return xxh.hexdigest()
