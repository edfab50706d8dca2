"""Pinned host buffers of exact size, under the node's admission.

The backend's own host buffers that the device reads by DMA (the two
staging slots, an AllGather rank's shard store, the ordinary transport's
packed blocks) must be pinned for their copies to be asynchronous. They
were allocated with ``torch.empty(..., pin_memory=True)``, which goes through
torch's caching host allocator: it rounds every allocation up to a power of
two (a 24 GiB shard store pins 32 GiB), keeps freed blocks cached, and no
budget on the node sees any of it (issue 23, finding 6).

:class:`PinnedBuffers` instead maps ONE private anonymous range of exactly
the page-rounded sizes and registers it with ``cudaHostRegister`` (default +
portable flags: the CPU writes these buffers, so no read-only flag) through
:func:`dlo_runtime.transports.register_regions`: the daemon's admission
counts it (as ``anon:<pid>:<address>``, never shared), chunks are cut
between buffers, and it is pre-faulted for write first. When registration
is declined or refused the buffers stay pageable: every copy is still
correct, only synchronous.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, Sequence

import torch

from dlo_runtime.cuda_host import HostCapability, Registrar, prefault
from dlo_runtime.pin_plan import Extent, PinRegion, page_ceil
from dlo_runtime.transports import GIB, REGISTERED, RegisteredRanges, TransportChoice, register_regions

log = logging.getLogger(__name__)


def _prefault_write(address: int, nbytes: int) -> str:
    return prefault(address, nbytes, write=True)


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each buffer's page-aligned offset in the mapping, and its length
    (at least one page: an empty mapping cannot exist)."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += page_ceil(max(0, n))
    return offsets, max(pos, page_ceil(1))


class PinnedBuffers:
    """``sizes`` bytes of host buffers in one anonymous mapping, registered.

    Args:
        registrar: the CUDA seam.
        capability: the device's, probed once by the caller.
        sizes: each buffer's exact byte count.
        pin: the pin policy (False: pageable buffers, no call).
        broker: the daemon's admission (None: not admission-controlled).
        label: what the daemon logs.
        limit_gib: the backend's ``registration_limit_gib`` (0 = none).
        chunk_bytes: largest range per call (buffers are never split).

    Raises:
        RegistrationAborted: a failed registration whose rollback failed
            (see :func:`~dlo_runtime.transports.register_regions`).
    """

    def __init__(self, registrar: Registrar, capability: HostCapability, sizes: Sequence[int], *, pin: bool,
                 broker: Any = None, label: str = "", limit_gib: float = 0.0, chunk_bytes: int = 64 * GIB):
        offsets, total = layout(sizes)
        # Private and anonymous: pages are this process's alone, allocated on
        # first touch (the pre-fault below, before the driver pins them).
        self._map = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.nbytes = total
        self.buffers = [raw[o:o + n] for o, n in zip(offsets, sizes)]
        self.address = int(raw.data_ptr())
        region = PinRegion(f"anonymous ({label or 'host buffers'})", self.address, total,
                           (Extent(f"anon:{os.getpid()}:{self.address:#x}", 0, total),))
        if pin:
            self.choice = register_regions(
                registrar, capability, [region], keepalive=(self._map, raw), limit_bytes=int(limit_gib * GIB),
                chunk_bytes=chunk_bytes, prefault_fn=_prefault_write, broker=broker, label=label,
                spans=[(self.address + o, n) for o, n in zip(offsets, sizes)], writable=True)
        else:
            self.choice = TransportChoice("pageable", "pin_memory=False: the pin policy is disabled")
        if not self.pinned:
            log.info("host buffers %s (%d bytes) stay pageable: %s", label, total, self.choice.reason)

    @property
    def pinned(self) -> bool:
        """Whether the buffers are registered (their copies asynchronous)."""
        return self.choice.kind == REGISTERED

    @property
    def ranges(self) -> RegisteredRanges | None:
        """The registration (None when not pinned)."""
        return self.choice.ranges

    def unregister(self) -> None:
        """Unregisters (after every copy out of the buffers finished) and
        returns the admitted bytes. Retryable.

        Raises:
            UnregisterFailed: see :meth:`RegisteredRanges.unregister`.
        """
        if self.choice.ranges is not None and self.choice.ranges.active:
            self.choice.ranges.unregister(reason="host buffers released")
