"""The writer a vLLM-Omni producer writes into: staged files in the store's
scratch directory, checked as vLLM-Omni's own writer checks them.

Why stage at all: an HWR publication states every payload file in its plan
before the first byte, while a vLLM-Omni producer declares its files one at
a time (``open_tensor_file``) and may write a file's tensors in any order
(``ordered=False``) and in row chunks. So each declared file is preallocated
in the scratch directory, filled with ``pwrite`` and checked; when the
producer returns, :meth:`StagingWriter.finish` hands the complete set to
the store, which publishes it in one ordered stream (the daemon hashes
while it writes) and removes the scratch. Memory stays bounded: the staged
bytes live in files (page cache), never in a buffer of the artifact's size.

Checks (each an :class:`~hwr_client.core.errors.InvalidArgument` raised
into the producer, naming the file and tensor): a safe ``.safetensors``
basename declared once; at least one tensor, unique names across the
artifact, names HWR can store, dtypes HWR can store; every write inside its
tensor, of the declared dtype and trailing shape, never overlapping an
earlier one; with ``ordered=True``, every write exactly where the previous
one ended (tensors in name order, the layout order); at close, every byte
of every tensor written. Capacity (``CapacityPolicy.max_artifact_bytes``,
``min_free_bytes`` of the scratch disk) is checked when a file is declared,
as a typed ``HostWeightError`` the store passes through.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import shutil
from pathlib import Path, PurePosixPath
from types import TracebackType

import torch
from vllm_omni.host_weight_runtime import (
    FailureCode,
    HostWeightError,
    ProductionMetadata,
    ResolutionStage,
    TensorWriteSpec,
    WeightArtifactIdentity,
)

from dlo_runtime.integrations.vllm_omni.failures import failure
from hwr_client.core.digests import check_label_text
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.layout import ALIGN, check_tensor_name
from hwr_client.mapping import per_tensor_view
from hwr_client.core.manifest import TensorEntry
from hwr_client.tensors import dtype_name


@dataclasses.dataclass(frozen=True)
class StagedFile:
    """One complete staged payload file: its producer-given name, its tensor
    specs in layout (name) order, each one's offset in the scratch file, and
    the scratch file's path."""

    name: str
    specs: tuple[TensorWriteSpec, ...]
    offsets: tuple[int, ...]
    path: str
    size: int


class _Coverage:
    """The byte ranges written into one tensor: overlaps refused at once,
    gaps found by :meth:`complete`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranges: list[tuple[int, int]] = []
        self.written = 0

    def add(self, begin: int, end: int, what: str) -> None:
        if begin < 0 or end > self.size:
            raise InvalidArgument(f"{what}: write [{begin}, {end}) runs outside the tensor's {self.size} bytes")
        for b, e in self.ranges:
            if begin < e and b < end:
                raise InvalidArgument(f"{what}: write [{begin}, {end}) overlaps the earlier write [{b}, {e})")
        if end > begin:
            self.ranges.append((begin, end))
            self.written += end - begin

    def complete(self) -> bool:
        # Writes never overlap, so covering every byte is having written as many.
        return self.written == self.size


class StagedTensorFile:
    """One declared payload file being filled (vLLM-Omni's ``TensorFileWriter``)."""

    def __init__(self, owner: "StagingWriter", name: str, specs: tuple[TensorWriteSpec, ...], *, ordered: bool):
        self._owner = owner
        self.name = name
        self.specs = tuple(sorted(specs, key=lambda s: s.name))
        self._by_name = {s.name: s for s in self.specs}
        offsets, pos = [], 0
        for s in self.specs:
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN  # aligned, so each view can take its dtype
            offsets.append(pos)
            pos += s.nbytes
        self.offsets = tuple(offsets)
        self._offset = dict(zip((s.name for s in self.specs), offsets))
        self._coverage = {s.name: _Coverage(s.nbytes) for s in self.specs}
        self._ordered = ordered
        self._cursor = 0  # ordered: index of the tensor being written
        self.path = str(owner.directory / f"{owner.next_file_number():05d}.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.size = pos
        self._closed = False
        try:
            if pos:
                # Reserve the space now: a full scratch disk fails here, with
                # ENOSPC, not in the middle of the producer's writes.
                os.posix_fallocate(self._fd, 0, pos)
        except BaseException:
            self.abort()
            raise

    # -- vLLM-Omni's TensorFileWriter ----------------------------------------------

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Writes all of tensor ``name`` (its declared dtype and shape)."""
        spec = self._spec(name)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise InvalidArgument(f"{self._what(name)}: got {tuple(tensor.shape)} {tensor.dtype}, declared "
                                  f"{spec.shape} {spec.dtype}")
        self._write(name, 0, tensor)

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None:
        """Writes rows ``start_row...`` of tensor ``name`` (dim 0 chunks)."""
        spec = self._spec(name)
        if not spec.shape:
            if start_row != 0 or tuple(tensor.shape) != ():
                raise InvalidArgument(f"{self._what(name)}: a scalar takes one whole write at row 0")
            self.write_tensor(name, tensor)
            return
        if tensor.dtype != spec.dtype or tuple(tensor.shape[1:]) != spec.shape[1:]:
            raise InvalidArgument(f"{self._what(name)}: rows of {tensor.dtype} {tuple(tensor.shape[1:])}, declared "
                                  f"{spec.dtype} {spec.shape[1:]}")
        if isinstance(start_row, bool) or not isinstance(start_row, int) or start_row < 0 \
                or start_row + tensor.shape[0] > spec.shape[0]:
            raise InvalidArgument(f"{self._what(name)}: rows [{start_row}, {start_row + tensor.shape[0]}) outside "
                                  f"the declared {spec.shape[0]}")
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
        self._write(name, start_row * row_bytes, tensor)

    def close(self) -> None:
        """Ends the file; every byte of every tensor must have been written.

        Raises:
            InvalidArgument: a tensor with unwritten bytes (the file is
                aborted: nothing of it is published).
        """
        if self._closed:
            return
        missing = [n for n, c in self._coverage.items() if not c.complete()]
        if missing:
            self.abort()
            raise InvalidArgument(f"payload file {self.name!r}: closed with tensors not fully written: {missing[:5]}")
        self._closed = True
        os.close(self._fd)
        self._owner._finished(self)

    def abort(self) -> None:
        """Drops the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._owner._aborted(self)

    def __enter__(self) -> "StagedTensorFile":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- checks and the write -------------------------------------------------------

    def _what(self, name: str) -> str:
        return f"payload file {self.name!r} tensor {name!r}"

    def _spec(self, name: str) -> TensorWriteSpec:
        if self._closed:
            raise InvalidArgument(f"payload file {self.name!r}: written after close")
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidArgument(f"{self._what(name)}: not declared in this file") from None

    def _write(self, name: str, begin: int, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.is_meta:
            raise InvalidArgument(f"{self._what(name)}: expected a materialized CPU tensor, got {tensor.device}")
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
        what = self._what(name)
        if not data:
            self._coverage[name].add(begin, begin, what)  # bounds only: nothing to write, in any order
            return
        if self._ordered:
            self._check_order(name, begin, what)
        self._coverage[name].add(begin, begin + len(data), what)
        pos, end = self._offset[name] + begin, self._offset[name] + begin + len(data)
        while pos < end:
            n = os.pwrite(self._fd, data[pos - self._offset[name] - begin:], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to the staged {self.name!r}")
            pos += n

    def _check_order(self, name: str, begin: int, what: str) -> None:
        """Ordered files: skip the tensors already complete, then the write
        must be the current tensor at its next byte."""
        while self._cursor < len(self.specs) and self._coverage[self.specs[self._cursor].name].complete():
            self._cursor += 1
        current = self.specs[self._cursor].name if self._cursor < len(self.specs) else None
        expected = self._coverage[current].written if current is not None else 0
        if name != current or begin != expected:
            raise InvalidArgument(f"{what}: ordered file expects tensor {current!r} at byte {expected}, got byte "
                                  f"{begin} (tensors are laid out in name order; declare ordered=False to write "
                                  "in any order)")


class StagingWriter:
    """vLLM-Omni's ``ArtifactWriter`` over one scratch directory.

    Args:
        directory: an empty directory of this build (removed by the store).
        max_artifact_bytes: ``CapacityPolicy.max_artifact_bytes`` (None: no limit).
        min_free_bytes: ``CapacityPolicy.min_free_bytes`` of the scratch disk.
    """

    def __init__(self, directory: Path, *, max_artifact_bytes: int | None = None, min_free_bytes: int = 0):
        self.directory = directory
        self.max_artifact_bytes = max_artifact_bytes
        self.min_free_bytes = min_free_bytes
        self.files: list[StagedFile] = []
        self.open_files: list[StagedTensorFile] = []
        self._names: set[str] = set()
        self._tensors: dict[str, str] = {}  # tensor name -> its file's name
        self._numbers = 0

    def next_file_number(self) -> int:
        """A number no staged file of this writer had (an aborted one's
        name is not reused while another file is open)."""
        self._numbers += 1
        return self._numbers - 1

    def open_tensor_file(self, relative_name: str, specs: tuple[TensorWriteSpec, ...], *,
                         ordered: bool = False) -> StagedTensorFile:
        """Declares one payload file (vLLM-Omni's ``ArtifactWriter``).

        Raises:
            InvalidArgument: a bad name or spec (see the module doc).
            HostWeightError: over ``max_artifact_bytes`` or ``min_free_bytes``.
        """
        self._check_name(relative_name)
        if not specs:
            raise InvalidArgument(f"payload file {relative_name!r}: declares no tensor; expected at least one")
        for s in specs:
            if not isinstance(s, TensorWriteSpec):
                raise InvalidArgument(f"payload file {relative_name!r}: {s!r} is not a TensorWriteSpec")
            check_tensor_name(s.name)
            dtype_name(s.dtype)  # a dtype HWR cannot store is refused here, not at publication
            if s.name in self._tensors:
                raise InvalidArgument(f"payload file {relative_name!r}: tensor {s.name!r} already declared in "
                                      f"{self._tensors[s.name]!r}")
        if len({s.name for s in specs}) != len(specs):
            raise InvalidArgument(f"payload file {relative_name!r}: declares a tensor name twice")
        self._check_capacity(relative_name, sum(s.nbytes for s in specs))
        f = StagedTensorFile(self, relative_name, tuple(specs), ordered=ordered)
        self._names.add(relative_name)
        self._tensors.update((s.name, relative_name) for s in specs)
        self.open_files.append(f)
        return f

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str):
            raise InvalidArgument(f"payload file name {name!r}: expected a string")
        path = PurePosixPath(name)
        if not name or path.is_absolute() or len(path.parts) != 1 or path.name != name or name in {".", ".."} \
                or not name.endswith(".safetensors"):
            raise InvalidArgument(f"payload file name {name!r}: expected one safe basename ending in .safetensors")
        check_label_text(name, f"payload file name {name!r}")
        if name in self._names:
            raise InvalidArgument(f"payload file {name!r}: declared twice")

    def _check_capacity(self, name: str, nbytes: int) -> None:
        projected = sum(f.size for f in self.open_files) + sum(f.size for f in self.files) + nbytes
        limit = self.max_artifact_bytes
        if limit is not None and projected > limit:
            raise HostWeightError(failure(ResolutionStage.CAPACITY, FailureCode.ARTIFACT_TOO_LARGE,
                                          f"payload file {name!r}: the artifact would hold {projected} bytes, over "
                                          f"CapacityPolicy.max_artifact_bytes {limit}", retryable=True))
        free = shutil.disk_usage(self.directory).free
        if free - nbytes < self.min_free_bytes:
            raise HostWeightError(failure(ResolutionStage.CAPACITY, FailureCode.INSUFFICIENT_CAPACITY,
                                          f"payload file {name!r}: staging {nbytes} bytes would leave less than "
                                          f"CapacityPolicy.min_free_bytes {self.min_free_bytes} free in "
                                          f"{self.directory}", retryable=True))

    def _finished(self, f: StagedTensorFile) -> None:
        self.open_files.remove(f)
        self.files.append(StagedFile(f.name, f.specs, f.offsets, f.path, f.size))

    def _aborted(self, f: StagedTensorFile) -> None:
        if f in self.open_files:
            self.open_files.remove(f)
        self._names.discard(f.name)
        for s in f.specs:
            self._tensors.pop(s.name, None)

    def finish(self, identity: WeightArtifactIdentity, metadata: ProductionMetadata) -> "Staged":
        """The complete artifact, once the producer returned.

        Raises:
            InvalidArgument: files left open, no file, or metadata whose
                schemas differ from the identity's producer.
        """
        if self.open_files:
            raise InvalidArgument(f"producer left payload files open: {[f.name for f in self.open_files]}")
        if not self.files:
            raise InvalidArgument("producer wrote no payload file; expected at least one")
        if not isinstance(metadata, ProductionMetadata):
            raise InvalidArgument(f"producer returned {type(metadata).__name__}, expected ProductionMetadata")
        producer = identity.producer
        if (metadata.producer_schema, metadata.restorer_schema) != (producer.manifest_schema, producer.restorer_schema):
            raise InvalidArgument(
                f"production metadata schemas ({metadata.producer_schema!r}, {metadata.restorer_schema!r}) differ "
                f"from the identity's ({producer.manifest_schema!r}, {producer.restorer_schema!r})")
        return Staged(tuple(sorted(self.files, key=lambda f: f.name)), metadata)

    def abort(self) -> None:
        """Drops every open file (the store removes the directory)."""
        for f in list(self.open_files):
            f.abort()


class Staged:
    """A complete staged artifact: its files in name order and the
    producer's metadata. :meth:`tensors` maps the files read-only."""

    def __init__(self, files: tuple[StagedFile, ...], metadata: ProductionMetadata):
        self.files = files
        self.metadata = metadata
        self._maps: list[mmap.mmap] = []

    def classes(self) -> dict[str, tuple[str, str]]:
        """Tensor name -> (kind, role)."""
        return {s.name: (s.kind.value, s.role) for f in self.files for s in f.specs}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Read-only views of every staged tensor (no copy)."""
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            mm = _map(f.path) if f.size else None
            if mm is not None:
                self._maps.append(mm)
            for s, off in zip(f.specs, f.offsets):
                entry = TensorEntry(s.name, 0, dtype_name(s.dtype), s.shape, off, s.nbytes, "")
                out[s.name] = per_tensor_view(mm, entry) if mm is not None else torch.empty(s.shape, dtype=s.dtype)
        return out

    def close(self) -> None:
        """Drops this object's mappings (views keep theirs alive)."""
        self._maps.clear()


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping holds its own reference to the file

