"""Reading a canonical (possibly sharded) safetensors checkpoint, one tensor
at a time: what a canonical load and a contract's producer read.

Two ways to read, one reader (:class:`hwr_client.tensors.SafetensorsFile`
under both):

- ``mmap=True``: views of a copy-on-write mapping of each file; a tensor's
  pages are read when it is first touched, and a write to a view never
  reaches the file;
- ``mmap=False``: each tensor ``readinto`` a buffer of its own and no file is
  ever mapped (what the startup transaction's recovery load uses, since it
  must bypass checkpoint mmap).

Example:
    >>> with CheckpointReader("/models/tiny", mmap=False) as reader:   # doctest: +SKIP
    ...     w = reader.take("blocks.0.attn.to_q.weight")
    ...     reader.check_consumed("my-contract")
"""

from __future__ import annotations

import glob
import os
from typing import Iterator, Sequence

import torch

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.layout import HeaderEntry
from hwr_client.tensors import SafetensorsFile


def checkpoint_files(checkpoint_dir: str) -> list[str]:
    """The ``*.safetensors`` files of a checkpoint directory, sorted.

    Raises:
        InvalidArgument: there are none.
    """
    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if not files:
        raise InvalidArgument(f"checkpoint {checkpoint_dir}: no *.safetensors files; expected a safetensors checkpoint")
    return files


class CheckpointReader:
    """Reads tensors from a checkpoint by name, each once, and tracks which
    were consumed.

    Args:
        source: a checkpoint directory (its ``*.safetensors`` files) or a
            list of safetensors files.
        mmap: read through a mapping (default) or ``readinto`` private
            buffers with no mapping at all; see the module docstring.

    Raises:
        InvalidArgument: no safetensors file, or a malformed one.
        FailedPrecondition: a tensor name in two files (which one is meant?).
    """

    def __init__(self, source: str | Sequence[str], *, mmap: bool = True):
        paths = checkpoint_files(source) if isinstance(source, str) else list(source)
        self.mmap = mmap
        self._files: list[SafetensorsFile] = []
        #: name -> (index of its file, its entry), for the names not taken yet.
        self._where: dict[str, tuple[int, HeaderEntry]] = {}
        try:
            for i, path in enumerate(paths):
                # Copy-on-write: a transform that writes into a source view
                # must never change the checkpoint file.
                f = SafetensorsFile(path, mmap=mmap, writable=True)
                self._files.append(f)
                for e in f.entries:
                    if e.name in self._where:
                        raise FailedPrecondition(f"checkpoint: tensor {e.name!r} is in both "
                                                 f"{paths[self._where[e.name][0]]} and {path}; expected one")
                    self._where[e.name] = (i, e)
        except BaseException:
            self.close()
            raise
        #: Payload bytes handed out so far.
        self.bytes_read = 0

    def names(self) -> list[str]:
        """The names not yet taken, sorted (so whatever the files' layout,
        a producer iterating them emits the same order)."""
        return sorted(self._where)

    def file_order(self) -> list[str]:
        """The names not yet taken, in file and offset order (sequential
        reads)."""
        return sorted(self._where, key=lambda name: (self._where[name][0], self._where[name][1].begin))

    def take(self, name: str) -> torch.Tensor:
        """The tensor called ``name``; each can be taken once.

        Raises:
            FailedPrecondition: ``name`` is not in the checkpoint, or was
                taken already.
        """
        found = self._where.pop(name, None)
        if found is None:
            raise FailedPrecondition(f"checkpoint: tensor {name!r} missing (or read twice); the contract needs it")
        i, e = found
        tensor = self._files[i].tensor(e)
        self.bytes_read += tensor.nbytes
        return tensor

    def check_consumed(self, contract: str) -> None:
        """Raises unless every tensor was taken.

        Raises:
            FailedPrecondition: naming the first unused tensors.
        """
        if self._where:
            raise FailedPrecondition(
                f"contract {contract}: checkpoint tensors {sorted(self._where)[:5]} are not used by any transform; "
                "wrong checkpoint for this contract?"
            )

    def close(self) -> None:
        """Closes the files (mapped tensors already handed out stay valid)."""
        for f in self._files:
            f.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_checkpoint(paths: Sequence[str], *, mmap: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from safetensors files, one tensor at a time,
    in file order.

    Args:
        paths: checkpoint files.
        mmap: True reads through a mapping; False reads each tensor with
            ``readinto`` into its own buffer (no mapping).

    Raises:
        InvalidArgument: a malformed safetensors header.
    """
    with CheckpointReader(paths, mmap=mmap) as reader:
        for name in reader.file_order():
            # No local keeps the tensor: the generator frame must not hold
            # it while the caller copies it.
            yield name, reader.take(name)
