"""One reader for a model's weight files, safetensors or ``.bin``: what the
key plan (:mod:`dlo_runtime.pretrained.keys`) reads names, shapes and dtypes
from, and what the canonical load takes tensors from.

- safetensors: :class:`~dlo_runtime.checkpoint.CheckpointReader` (headers
  parsed strictly; tensors as views of a copy-on-write mapping, or read into
  buffers of their own with ``mmap=False``).
- ``.bin``: ``torch.load(weights_only=True)``, as both libraries read it
  (only tensors and plain containers unpickle: no code runs); zip-format
  files are mapped (``mmap=True``, the libraries' choice too), so listing
  the names reads the pickle, not the payload. A legacy (pre-zip) file
  cannot be mapped and is read whole, as the libraries read it.

The file bytes are the identity's sources either way
(:meth:`~dlo_runtime.pretrained.contract.PretrainedContract.source_files`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zipfile
from typing import Any, Protocol, Sequence

import torch

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.tensors import TORCH_DTYPES

from dlo_runtime.checkpoint import CheckpointReader


@dataclasses.dataclass(frozen=True)
class WeightEntry:
    """One checkpoint tensor: index of its file, shape, dtype."""

    file: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightReader(Protocol):
    """What the key plan and the canonical load need of a checkpoint."""

    #: checkpoint key -> entry, for every tensor in the files.
    entries: dict[str, WeightEntry]
    @property
    def bytes_read(self) -> int:
        """Payload bytes handed out so far."""

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (each once)."""

    def file_order(self) -> list[str]:
        """The names not yet taken, in file order (sequential reads)."""

    def close(self) -> None:
        """Closes the files; tensors handed out stay valid."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


class _Safetensors:
    def __init__(self, paths: Sequence[str], *, mmap: bool):
        self._reader = CheckpointReader(list(paths), mmap=mmap)
        self.entries = {n: WeightEntry(i, tuple(e.shape), TORCH_DTYPES[e.dtype])
                        for n, (i, e) in self._reader._where.items()}

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read

    def take(self, name: str) -> torch.Tensor:
        return self._reader.take(name)

    def file_order(self) -> list[str]:
        return self._reader.file_order()

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "_Safetensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pickles:
    def __init__(self, paths: Sequence[str], *, mmap: bool):
        self._tensors: dict[str, torch.Tensor] = {}
        self.entries: dict[str, WeightEntry] = {}
        for i, path in enumerate(paths):
            state = load_bin(path, mmap=mmap)
            for name, t in state.items():
                if name in self.entries:
                    raise FailedPrecondition(f"checkpoint: tensor {name!r} is in both "
                                             f"{paths[self.entries[name].file]} and {path}; expected one")
                self._tensors[name] = t
                self.entries[name] = WeightEntry(i, tuple(t.shape), t.dtype)
        self._order = list(self._tensors)
        self._bytes_read = 0

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    def take(self, name: str) -> torch.Tensor:
        t = self._tensors.pop(name, None)
        if t is None:
            raise FailedPrecondition(f"checkpoint: tensor {name!r} missing (or read twice); the contract needs it")
        self._bytes_read += t.nbytes
        return t

    def file_order(self) -> list[str]:
        return [n for n in self._order if n in self._tensors]

    def close(self) -> None:
        self._tensors = {}  # the mapping goes with the last tensor handed out

    def __enter__(self) -> "_Pickles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_bin(path: str, *, mmap: bool = True) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, read as the libraries read it: ``torch.load``
    with ``weights_only=True`` on the CPU, mapped when it is a zip file.

    Raises:
        InvalidArgument: not a torch checkpoint, or not a flat dict of
            tensors (naming the file).
    """
    can_map = mmap and zipfile.is_zipfile(path)
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=can_map)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError...
        raise InvalidArgument(f"{path}: not a torch checkpoint readable with weights_only=True "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise InvalidArgument(f"{path}: expected a state dict (names to tensors), got {type(state).__name__}")
    return state


def open_weights(paths: Sequence[str], fmt: str, *, mmap: bool = True) -> WeightReader:
    """A reader over ``paths`` (``fmt``: ``"safetensors"`` or ``"bin"``).

    Raises:
        InvalidArgument: a malformed file; FailedPrecondition: a tensor in
            two files.
    """
    if fmt == "safetensors":
        return _Safetensors(paths, mmap=mmap)
    if fmt == "bin":
        return _Pickles(paths, mmap=mmap)
    raise InvalidArgument(f"weight format {fmt!r}: expected 'safetensors' or 'bin'")


#: Largest safetensors header :func:`peek_entries` reads (the format's own cap).
_MAX_HEADER = 100 << 20


def peek_entries(paths: Sequence[str], fmt: str) -> dict[str, WeightEntry]:
    """Names, shapes and dtypes of every tensor, for the key plan: a
    safetensors file's JSON header only (its 8-byte length and the JSON,
    no payload byte and no mapping; the strict parse, offsets included,
    comes with the canonical load), a ``.bin`` file's pickle (mapped).

    Raises:
        InvalidArgument: a header that is not a safetensors header;
        FailedPrecondition: a tensor in two files.
    """
    if fmt != "safetensors":
        with open_weights(paths, fmt) as reader:
            return dict(reader.entries)
    out: dict[str, WeightEntry] = {}
    for i, path in enumerate(paths):
        for name, e in _header(path).items():
            if name == "__metadata__":
                continue
            if name in out:
                raise FailedPrecondition(f"checkpoint: tensor {name!r} is in both {paths[out[name].file]} and "
                                         f"{path}; expected one")
            try:
                out[name] = WeightEntry(i, tuple(int(d) for d in e["shape"]), TORCH_DTYPES[e["dtype"]])
            except (KeyError, TypeError, ValueError):
                raise InvalidArgument(f"{path}: tensor {name!r} has a malformed header entry {e!r}; expected "
                                      "a known dtype and an integer shape") from None
    return out


def _header(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise InvalidArgument(f"{path}: not a safetensors file (header length {size})")
        try:
            doc = json.loads(f.read(size))
        except ValueError as exc:
            raise InvalidArgument(f"{path}: not a safetensors file (header: {exc})") from None
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise InvalidArgument(f"{path}: not a safetensors file (the header is not an object of tensor entries)")
    return doc


def short(path: str) -> str:
    """A file's name for messages."""
    return os.path.basename(path)
