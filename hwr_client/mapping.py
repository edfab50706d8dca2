"""Read-only shared mappings of an artifact's payload files, and zero-copy
tensor views over them.

Every file is mapped ``PROT_READ`` + ``MAP_SHARED``: all processes that map
the same blob share one copy in the page cache, and a write through a view
faults (SIGSEGV) instead of silently copying a page — the shared bytes can
never be modified from a worker.

Unmapping: views keep their mmap object alive (torch holds a reference to the
buffer's owner), and we never call ``mmap.close()`` ourselves — it would unmap
memory under live views (torch does not hold a buffer export, so close would
succeed). :meth:`MappedArtifact.release` drops OUR references; the kernel
mapping goes away when the last view does. A CUDA registrar must keep its own
reference to the mapping until it has unregistered the range.

Storages: by default every view of one file shares ONE storage (the whole
file; each view is an offset into it), the cheapest way to build a thousand
views. ``tensors(storage="per-tensor")`` instead gives each tensor a storage
of its own that covers exactly its bytes, over the same mapped pages (no
copy): for consumers that treat tensors sharing a storage as aliases of one
another (vLLM-Omni's restorer refuses them) or that hand storages to code
which assumes it owns all of one.

Bytes changed under the mapping. ``PROT_READ`` stops this process from
writing, not the file's owner: ``cp`` over a checkpoint served by the
checkpoint-mmap plan rewrites the mapped inode in place (the output changed
with no error), ``truncate`` leaves pages past the new end that raise SIGBUS
when read (the worker died), and root rewriting a blob in place under a
lease turned weights into NaNs even after ``verify="full"``.
:class:`MappedFileGuard` notices what is cheap to notice: it keeps a
descriptor of every mapped inode (the one mapped, not whatever the name
points to later: a rename over the name changes nothing mapped) with its
size and mtime at map time, and :meth:`MappedFileGuard.check` (one
``fstat`` per file) raises ``DataLoss`` naming the file once either
changed. The offload backend calls it before each block copy and at the
start of each forward, so a change between two fetches is an error before
the changed bytes are used or a truncated page is touched. What it cannot
see: a write between the check and the copy (a race of microseconds), a
same-size write within the same clock tick as the file's last modification
(the kernel's timestamps are coarse; a mapped file is rarely that fresh),
and a writer that puts the mtime back (``touch -d``; only the file's owner
or root can). ``verify="full"`` at lease time and the daemon's read-only
blobs are the other defences.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import warnings
import weakref
from typing import Sequence

import torch

from hwr_client.core.errors import DataLoss, FailedPrecondition, InvalidArgument
from hwr_client.core.layout import DTYPE_SIZES
from hwr_client.tensors import TORCH_DTYPES
from hwr_client.core.manifest import BlockEntry, Manifest, TensorEntry

PAGE_SIZE = mmap.PAGESIZE


@dataclasses.dataclass(frozen=True)
class Region:
    """One mapped file: what a CUDA registrar registers.

    ``address`` is page-aligned (mmap guarantees it); ``length`` is the file
    size. Registration rounds ``length`` up to whole pages.
    """

    path: str
    address: int
    length: int

    @property
    def aligned_length(self) -> int:
        """``length`` rounded up to whole pages: what a registrar registers."""
        return (self.length + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class FileStamp:
    """What :class:`MappedFileGuard` compares: the mapped inode's size and
    modification time. Not the ctime: a hard link, a rename or a chmod
    (the daemon links and moves blobs) changes it without touching a byte."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileStamp":
        return cls(st.st_size, st.st_mtime_ns)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class MappedFileGuard:
    """Notices a mapped file changed in place (see the module docstring).

    Args:
        files: ``(path, fd)`` of each mapped file; the guard owns the
            descriptors (open on the inode that is mapped) and closes them
            in :meth:`close` or when it is collected.
    """

    def __init__(self, files: Sequence[tuple[str, int]]):
        self._files = [(path, fd, FileStamp.of(os.fstat(fd))) for path, fd in files]
        self._finalizer = weakref.finalize(self, _close_fds, [fd for _, fd, _ in self._files])

    @classmethod
    def open(cls, paths: Sequence[str]) -> "MappedFileGuard":
        """A guard over ``paths``, opened now. For files mapped by someone
        else (the checkpoint reader): open it right after mapping, so both
        name the same inode unless the name was replaced in between.

        Raises:
            FailedPrecondition: a file cannot be opened.
        """
        files: list[tuple[str, int]] = []
        try:
            for p in paths:
                files.append((p, os.open(p, os.O_RDONLY | os.O_CLOEXEC)))
        except OSError as exc:
            _close_fds([fd for _, fd in files])
            raise FailedPrecondition(f"mapped file {p}: cannot open ({exc.strerror})") from None
        return cls(files)

    def check(self) -> None:
        """Raises if any mapped file's size or mtime changed since mapping.

        Raises:
            DataLoss: naming the file and what changed; the mapped bytes can
                no longer be trusted (a smaller size: reading past the new
                end would kill the process with SIGBUS).
        """
        if not self._finalizer.alive:
            return  # closed (released): its descriptor numbers may name other files by now
        for path, fd, stamp in self._files:
            now = FileStamp.of(os.fstat(fd))
            if now != stamp:
                raise DataLoss(
                    f"mapped file {path} changed under its mapping: size {stamp.size} -> {now.size}, mtime_ns "
                    f"{stamp.mtime_ns} -> {now.mtime_ns}; its bytes were rewritten or truncated in place "
                    "(never do that to a file a worker maps: write a new file and rename it over the name); "
                    "restart the worker"
                )

    def close(self) -> None:
        """Closes the descriptors. Idempotent."""
        self._finalizer()


def _readonly_frombuffer(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that it cannot enforce read-only; the PROT_READ mapping
        # enforces it (a write faults), which is exactly what we want.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


#: What :meth:`MappedArtifact.tensors` may build: one storage per file
#: (``"shared"``, the default) or one per tensor (``"per-tensor"``).
STORAGE_MODES = ("shared", "per-tensor")


def per_tensor_view(mm: mmap.mmap, t: TensorEntry) -> torch.Tensor:
    """Tensor ``t`` of a mapped file as a read-only view with a storage of
    its own: the storage starts at the tensor's first byte and holds exactly
    its ``nbytes`` (no copy; the storage keeps the mapping alive).

    A tensor of zero bytes has no byte to view: it gets an empty tensor of
    its dtype and shape (torch refuses a zero-length buffer view).

    Raises:
        FailedPrecondition: the tensor's range does not fit the mapping.
    """
    dtype = TORCH_DTYPES[t.dtype]
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype)
    if t.offset < 0 or t.offset + t.nbytes > len(mm):
        raise FailedPrecondition(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) do not fit the "
                                 f"{len(mm)}-byte mapping")
    with warnings.catch_warnings():
        # As _readonly_frombuffer: PROT_READ enforces read-only (a write faults).
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
    return raw.view(dtype).view(t.shape)


#: What MappedArtifact._view_plan returns for values a validated manifest
#: does not hold (no offset is in range, so its tensors take the slice path).
_NO_PLAN = (None, 1, (), -1, -1)


class MappedArtifact:
    """All payload files of one artifact, mapped read-only.

    Args:
        manifest: the artifact's validated manifest.
        paths: absolute blob path of each manifest file, in file order.

    Raises:
        FailedPrecondition: a file is missing or its size differs from the
            manifest (the artifact is damaged; run ``hwr verify KEY``).
    """

    def __init__(self, manifest: Manifest, paths: Sequence[str]):
        if len(paths) != len(manifest.files):
            raise FailedPrecondition(
                f"artifact {manifest.key[:12]}: {len(paths)} blob paths, expected {len(manifest.files)}"
            )
        self.manifest = manifest
        self.paths = tuple(paths)
        self._maps: list[mmap.mmap] = []
        self._bytes: list[torch.Tensor] = []
        fds: list[tuple[str, int]] = []
        try:
            for entry, path in zip(manifest.files, paths):
                self._map_one(entry.size, path, fds)
        except BaseException:
            _close_fds([fd for _, fd in fds])
            raise
        # The descriptors the files were mapped through: the guard checks
        # exactly the mapped inodes.
        self._guard = MappedFileGuard(fds)
        self._tensors: dict[str, torch.Tensor] | None = None
        self._per_tensor: dict[str, torch.Tensor] | None = None

    def _map_one(self, size_expected: int, path: str, fds: list[tuple[str, int]]) -> None:
        key = self.manifest.key
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise FailedPrecondition(
                f"artifact {key[:12]}: cannot open blob {path}: {exc.strerror}; run `hwr verify {key}`"
            ) from None
        fds.append((path, fd))  # kept open for the guard (closed on failure by the caller)
        size = os.fstat(fd).st_size
        if size != size_expected:
            raise FailedPrecondition(
                f"artifact {key[:12]}: blob {path} has {size} bytes, expected {size_expected}; run `hwr verify {key}`"
            )
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._maps.append(mm)
        self._bytes.append(_readonly_frombuffer(mm))

    def check_unchanged(self) -> None:
        """:meth:`MappedFileGuard.check` over every mapped file (one fstat each).

        Raises:
            DataLoss: a file's bytes changed in place since it was mapped.
        """
        self._guard.check()

    def _check_open(self) -> None:
        if not self._bytes:
            raise FailedPrecondition(f"artifact {self.manifest.key[:12]}: mapping already released")

    def file_bytes(self, index: int) -> torch.Tensor:
        """A read-only uint8 view of a whole payload file."""
        self._check_open()
        return self._bytes[index]

    def tensors(self, *, storage: str = "shared") -> dict[str, torch.Tensor]:
        """Zero-copy read-only views with the manifest's names, dtypes and
        shapes, in manifest order. Built once per storage mode; O(tensors).

        Args:
            storage: ``"shared"`` (one storage per file) or ``"per-tensor"``
                (each view's storage holds exactly its bytes; see the
                module doc).

        Raises:
            InvalidArgument: an unknown storage mode.
        """
        if storage != "shared":
            return self._per_tensor_views(storage)
        self._check_open()
        if self._tensors is None:
            out = {}
            # Each view is what _slice_view builds (same storage, data_ptr,
            # shape, strides), made in one call on a view of its whole file
            # at its dtype. Anything else (an offset that is not a multiple
            # of the itemsize, a value a validated manifest does not hold)
            # takes _slice_view itself, errors included.
            plans: dict = {}  # (file, dtype, shape) -> _view_plan's tuple
            bases: dict = {}  # (file, dtype) -> the whole file at dtype
            as_strided = torch.as_strided
            for t in self.manifest.tensors:
                key = (t.file, t.dtype, t.shape)
                try:
                    base, itemsize, strides, size, last = plans[key]
                except KeyError:
                    base, itemsize, strides, size, last = plans[key] = self._view_plan(key, bases)
                except TypeError:  # unhashable
                    base, itemsize, strides, size, last = _NO_PLAN
                offset, nbytes = t.offset, t.nbytes
                if (nbytes == size and type(offset) is int and type(nbytes) is int and offset % itemsize == 0
                        and 0 <= offset <= last):
                    out[t.name] = as_strided(base, t.shape, strides, offset // itemsize)
                else:
                    out[t.name] = self._slice_view(t)
            self._tensors = out
        return self._tensors

    def _per_tensor_views(self, storage: str) -> dict[str, torch.Tensor]:
        """:meth:`tensors` with ``storage="per-tensor"``: one
        :func:`per_tensor_view` per tensor, built once."""
        if storage not in STORAGE_MODES:
            raise InvalidArgument(f"storage={storage!r}: expected one of {', '.join(STORAGE_MODES)}")
        self._check_open()
        if self._per_tensor is None:
            self._per_tensor = {t.name: per_tensor_view(self._maps[t.file], t) for t in self.manifest.tensors}
        return self._per_tensor

    def _slice_view(self, t: TensorEntry) -> torch.Tensor:
        """Tensor ``t``'s view as bytes sliced from its file, then viewed at
        its dtype and shape."""
        raw = self._bytes[t.file][t.offset : t.offset + t.nbytes]
        return raw.view(TORCH_DTYPES[t.dtype]).view(t.shape)

    def _view_plan(self, key: tuple, bases: dict) -> tuple:
        """How :meth:`tensors` views a tensor of ``key`` = (file, dtype,
        shape): (the whole file at dtype, itemsize, contiguous strides,
        nbytes, the largest offset at which it fits the file); or
        :data:`_NO_PLAN` where one of them is not a plain value of this
        artifact. ``bases`` caches the whole-file views by (file, dtype)."""
        file, dtype, shape = key
        if type(file) is not int or not (0 <= file < len(self._bytes)) or type(dtype) is not str or dtype not in DTYPE_SIZES:
            return _NO_PLAN
        if type(shape) is not tuple:
            return _NO_PLAN
        strides, step = [], 1
        for d in reversed(shape):
            if type(d) is not int or d < 0:
                return _NO_PLAN
            # As view() strides a contiguous tensor, a zero-size one too: the
            # product of the later sizes, a size 0 counting as 1.
            strides.append(step)
            step *= d or 1
        strides.reverse()
        torch_dtype, itemsize = TORCH_DTYPES[dtype], DTYPE_SIZES[dtype]
        whole = self._bytes[file]
        size = whole.numel()
        base = bases.get((file, dtype))
        if base is None:
            # The whole file at dtype, less a last partial element.
            base = bases[file, dtype] = whole[: size - size % itemsize].view(torch_dtype)
        nbytes = math.prod(shape) * itemsize
        return base, itemsize, tuple(strides), nbytes, size - nbytes

    def block_bytes(self, index: int) -> torch.Tensor:
        """A read-only uint8 view of block ``index``'s contiguous byte range."""
        self._check_open()
        b = self.manifest.blocks[index]
        return self._bytes[b.file][b.begin : b.end]

    def block_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """The views of block ``index``'s tensors."""
        views = self.tensors()
        return {n: views[n] for n in self.manifest.blocks[index].tensors}

    @property
    def blocks(self) -> tuple[BlockEntry, ...]:
        """The manifest's blocks, in execution order."""
        return self.manifest.blocks

    def regions(self) -> list[Region]:
        """The mapped ranges, one per file, for CUDA host registration."""
        self._check_open()
        return [Region(p, b.data_ptr(), b.numel()) for p, b in zip(self.paths, self._bytes)]

    def release(self) -> None:
        """Drops this object's references to the mappings (and the guard's
        descriptors). Idempotent. Views handed out earlier stay valid (they
        keep the mapping alive)."""
        self._maps.clear()
        self._bytes.clear()
        self._tensors = None
        self._per_tensor = None
        self._guard.close()
