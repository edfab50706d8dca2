"""Canonical (miss-path) loading that never holds checkpoint + model.

A naive load drains the checkpoint into a dict, then copies it into the model:
every checkpoint tensor (or the mapped page behind it) stays referenced until
the whole copy ends, so peak host memory is checkpoint + model. Here each
checkpoint tensor is released as soon as it has been copied: the dict is
*drained* (``pop``), and file readers yield one tensor at a time. Peak is the
model plus one tensor.

The file reader is :func:`dlo_runtime.checkpoint.iter_checkpoint`, mapped
(``mmap=True``) or reading each tensor into its own buffer (``mmap=False``:
no mapping at all, what the startup transaction uses when it must bypass
checkpoint mmap).

Example:
    >>> skeleton.to_empty(device="cpu")                                   # doctest: +SKIP
    >>> load_canonical_into(skeleton, iter_checkpoint(paths, mmap=False))
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Iterator, MutableMapping

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition

from dlo_runtime.restore import module_tensors

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CanonicalOptions:
    """What a canonical load may use. The startup transaction's recovery
    attempt sets all three to False."""

    use_hwr: bool = True  # look up / lease an artifact
    publish: bool = True  # publish after load for the next start
    checkpoint_mmap: bool = True  # read checkpoint files through mmap


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_canonical_into` copied.

    Attributes:
        tensors: tensors copied.
        nbytes: source bytes copied.
        unexpected: source names the module has no tensor for.
        missing: module tensors no source provided.
    """

    tensors: int
    nbytes: int
    unexpected: tuple[str, ...]
    missing: tuple[str, ...]


def _drain(source: MutableMapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(source, MutableMapping):
        while source:
            name = next(iter(source))
            # pop, not iterate: the dict must not keep the tensor alive once
            # it is copied (every continue path releases it too).
            yield name, source.pop(name)
    else:
        yield from source


def load_canonical_into(
    module: nn.Module,
    source: MutableMapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
    on_copied: Callable[[str], None] | None = None,
) -> LoadReport:
    """Copies checkpoint tensors into ``module``, releasing each at once.

    Args:
        module: a materialized module (not meta; use ``to_empty`` first).
        source: a dict (drained: empty afterwards) or an iterator of
            (name, tensor); the caller must hold no other reference to the
            tensors for the release to free memory.
        strict: raise on unexpected or missing names.
        on_copied: called with each name after its tensor was copied and
            released (tests count live checkpoint bytes here).

    Returns:
        Counts and the unexpected / missing names.

    Raises:
        FailedPrecondition: shape mismatch, a meta target, or (strict)
            unexpected / missing tensors.
    """
    targets = {name: t for name, _, _, t, _ in module_tensors(module)}
    seen, unexpected, nbytes = set(), [], 0
    for name, tensor in _drain(source):
        target = targets.get(name)
        if target is None:
            unexpected.append(name)
            del tensor
            continue
        if target.is_meta or tuple(target.shape) != tuple(tensor.shape):
            raise FailedPrecondition(
                f"canonical load: {name} is {tensor.dtype} {list(tensor.shape)}, target is "
                f"{target.dtype} {list(target.shape)} on {target.device}; expected equal shapes on a real device"
            )
        with torch.no_grad():
            target.copy_(tensor)  # casts dtype if the representation differs
        nbytes += tensor.numel() * tensor.element_size()
        seen.add(name)
        del tensor  # released before the next one is read
        if on_copied is not None:
            on_copied(name)
    missing = sorted(set(targets) - seen)
    if strict and (unexpected or missing):
        raise FailedPrecondition(f"canonical load: unexpected {unexpected[:5]}, missing {missing[:5]}")
    log.info("canonical load: %d tensors, %d bytes copied", len(seen), nbytes)
    return LoadReport(len(seen), nbytes, tuple(unexpected), tuple(missing))
