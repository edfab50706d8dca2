"""The layerwise offload (DLO) backend: two rotating device buffers fed from
a lease's mapped bytes (or from packed ordinary tensors).

Each streamed block is ONE contiguous byte range with the artifact's aligned
layout (every tensor 64-byte aligned, see :mod:`hwr_client.core.layout`). Moving a
block is one copy into a uint8 device buffer sized to the largest block; the
block's parameters then become dtype views into that buffer for the duration
of its forward, and point back at their host views afterwards, so between
uses a block's parameters hold no device memory.

Schedule (streamed blocks 0..n-1, slots A/B): setup loads blocks 0 and 1.
Block j's forward pre-hook waits for its copy and binds its views; its
forward hook records "compute done" on the slot, unbinds, and issues the copy
of block j+2 into the same slot on the copy stream, which waits for that
event first. So block j+1's copy is in flight while block j runs. With two
or fewer streamed blocks everything stays loaded after the first copy. How
a copy is issued and waited for is the copy engine's
(:mod:`dlo_runtime.copy_engine`): CUDA streams and events, or on a CPU
"device" one copy thread playing the copy stream; the schedule here is the
same code for both.

AllGather (``process_group`` of G > 1 ranks, :mod:`dlo_runtime.allgather`):
the same schedule, but each rank holds 1/G of every block (its shard) and a
load is a block-sequence check across the group (exchanged one load ahead)
followed by a gather of every rank's shard into the slot. A lease is only
the shards' source and is closed during setup. A setup that fails after
some blocks were sharded leaves those blocks' tensors as placeholders: the
model must be discarded (the startup transaction does).

Ownership: the backend takes the lease (from a :class:`LeaseCarrier`, once)
before any asynchronous work, and its teardown runs, in order: drain device
work -> drop hooks, staging, buffers and module references -> unregister
every range (the lease's, then the pinned host buffers') -> close the lease.
An unregistration failure keeps the registration and the lease; ``close()``
may be called again to retry.

Example:
    >>> restore_model(model, lease)                                  # doctest: +SKIP
    >>> handle = enable_layerwise_offload(model, list(model.blocks), device="cuda:0", source=LeaseCarrier(lease))
    >>> y = model(x); handle.stats.transport
    'registered'
    >>> handle.close()
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

import dlo_runtime.allgather as ag
from dlo_runtime.copy_engine import CopyEngine, make_copy_engine
from dlo_runtime.cuda_host import HostCapability, default_registrar
from dlo_runtime.host_blocks import (HostBlock, check_mapped, lease_blocks, member_view, pack_block, pack_layout,
                                     set_tensor, shard_block)
from dlo_runtime.offload_stats import BlockStats, OffloadStats
from dlo_runtime.options import OffloadOptions, validate_offload
from dlo_runtime.pin_plan import copy_cuts
from dlo_runtime.pinned import PinnedBuffers
from dlo_runtime.restore import tensor_slots
from dlo_runtime.transports import (
    ORDINARY, STAGING, RegisteredRanges, RegistrationAborted, TransportChoice, broker_for, choose_transport,
)

log = logging.getLogger(__name__)

#: Backends whose registrations could not be removed: they keep their lease
#: (and so the mapping) alive for a retry of close() or process teardown.
_RETAINED: list["OffloadBackend"] = []


def retained() -> list["OffloadBackend"]:
    """Backends holding a lease open because unregistration failed."""
    return list(_RETAINED)


class OffloadBackend:
    """The handle :func:`enable_layerwise_offload` returns.

    Construct, then :meth:`start`; the startup transaction uses the two
    steps to record BACKEND_OWNED (after construction took the lease) and
    BACKEND_READY (after start). Process-local: refuses pickling.

    Args:
        module: the model.
        blocks: the streamable blocks of ``module`` in execution order.
        options: device, transports and registration (default: CPU).
        source: a lease, a LeaseCarrier holding one, or None; see
            :func:`enable_layerwise_offload`.

    Raises:
        InvalidArgument: bad arguments (nothing taken, nothing changed).
    """

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module], options: OffloadOptions | None = None,
                 *, source: Any = None):
        self.options = options = options or OffloadOptions()
        self.device = torch.device(options.device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        blocks = list(blocks)
        validate_offload(module, blocks, options)
        self._module: nn.Module | None = module
        self._all_blocks = blocks
        self._resident = options.resident_blocks
        self._registrar = options.registrar or default_registrar(self.device)
        # Single take, before any asynchronous work: from here on only this
        # backend's abort/close may drain work and close the lease.
        self._lease = source.take() if hasattr(source, "take") else source
        self.trail: list[str] = ["owned"]
        self._choice = TransportChoice(ORDINARY, "not started")
        self._ranges: RegisteredRanges | None = None
        self._blocks: list[HostBlock] = []
        self._hooks: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self._staging: list[torch.Tensor] = []
        self._slot_block: list[int | None] = [None, None]
        self._counts: list[list[int]] = []  # per block: copies, h2d bytes, host copies
        self._meta: list[tuple[str, int]] = []  # per block: name, bytes
        self._cuts: list[tuple[int, ...]] = []  # per block: offsets where its registration ends
        self._unified = False
        self._released = False
        self._closed = False
        self._cuda = self.device.type == "cuda"
        #: Stream/event API and whether copies are asynchronous: torch.cuda
        #: on a CUDA device. A seam: CPU tests swap in a recording fake to
        #: check the event ordering of the asynchronous schedule. Read once,
        #: when start() builds the copy engine.
        self._cu: Any = torch.cuda
        self._async = self._cuda
        #: Whether host buffers the device reads are pinned (a seam too: CPU
        #: tests turn it on against a fake registrar); unregistered at close.
        self._pin_host = self._cuda
        self._pins: list[PinnedBuffers] = []
        self._cap: HostCapability | None = None
        self._engine: CopyEngine | None = None
        #: AllGather: the group (size > 1 only; a group of one is rank-local).
        self._group = options.process_group if ag.group_size(options.process_group) > 1 else None
        self._plans: list[ag.ShardPlan] = []
        self._shards: list[torch.Tensor] = []
        self._shard_store: torch.Tensor | None = None
        self._sequence: ag.SequenceCheck | None = None

    # -- setup ----------------------------------------------------------------

    def start(self) -> "OffloadBackend":
        """Chooses the transport, allocates buffers, installs hooks and
        issues the initial prefetch. On failure tears down (drain first) and
        re-raises; the lease is closed unless registrations are stuck.

        Raises:
            RegistrationAborted: a rollback failed (lease kept for teardown).
            FailedPrecondition: blocks do not match the lease.
        """
        try:
            self._setup()
        except RegistrationAborted as exc:
            # Ranges are still registered: never close the lease under them.
            self._ranges = exc.ranges
            self._drain()
            self._release()
            self._retain(exc)
            raise
        except BaseException:
            self.abort()
            raise
        self.trail.append("ready")
        return self

    def _setup(self) -> None:
        assert self._module is not None
        if self._group is not None:
            return self._setup_allgather()
        # First: from here on teardown drains through the engine.
        self._engine = make_copy_engine(self.device, cu=self._cu, asynchronous=self._async)
        self._cap = cap = self._registrar.capability(self.device)
        self._unified = cap.unified_memory
        streamed = self._all_blocks[self._resident :]
        names = {id(m): n for n, m in self._module.named_modules()}
        walks = [(names[id(b)], b, tensor_slots(b).slots) for b in streamed]
        # Collected before packing repoints the block tensors: everything
        # reachable from a streamed block stays on the host.
        skip = {id(s.tensor) for _, _, slots in walks for s in slots}
        if self._lease is not None:
            self._blocks = lease_blocks(walks, self._lease)
        else:
            outs = self._host_buffers([pack_layout(q, sl)[1] for q, _, sl in walks], "packed blocks")
            self._blocks = [pack_block(qual, b, slots, out=out) for (qual, b, slots), out in zip(walks, outs)]
        self._make_resident(skip | {id(m.host) for b in self._blocks for m in b.members})
        o = self.options
        spans = [(int(b.host_bytes.data_ptr()), b.nbytes) for b in self._blocks]
        self._choice = choose_transport(self._registrar, cap, self._lease, pin_memory=o.pin_memory, spans=spans,
                                        registration_limit_gib=o.registration_limit_gib, chunk_bytes=o.chunk_bytes)
        self._ranges = self._choice.ranges
        if self._ranges is not None:
            # Where blocks share a page a registration may end inside one:
            # its copy goes in pieces, each out of one registration.
            self._cuts = [copy_cuts(a, n, self._ranges.chunks) for a, n in spans]
        self.trail.append(f"transport:{self._choice.kind}")
        size = max((b.nbytes for b in self._blocks), default=0)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        if self._choice.kind == STAGING:
            self._staging = self._host_buffers([size, size], "staging slots")
        self._counts = [[0, 0, 0, 0] for _ in self._blocks]
        self._meta = [(b.name, b.nbytes) for b in self._blocks]  # kept after close for reporting
        self._hook_and_prefetch()

    def _hook_and_prefetch(self) -> None:
        # Each forward starts with the check too: unstreamed tensors may be read from the mapping.
        self._hooks += [self._module.register_forward_pre_hook(lambda m, a: check_mapped(self._lease))] if self._module else []
        for j, b in enumerate(self._blocks):
            self._hooks.append(b.module.register_forward_pre_hook(lambda m, a, j=j: self._pre(j)))
            self._hooks.append(b.module.register_forward_hook(lambda m, a, o, j=j: self._post(j)))
        for j in range(min(2, len(self._blocks))):
            self._load(j, j)  # initial prefetch
        self.trail.append("prefetched")

    def _setup_allgather(self) -> None:
        """The AllGather transport (see :mod:`dlo_runtime.allgather`):
        shards cut from the lease (then closed) or the ordinary tensors."""
        assert self._module is not None and self._group is not None
        group, o = self._group, self.options
        size, rank = group.size(), group.rank()
        # First: from here on teardown drains through the engine.
        self._engine = ag.make_gather_engine(self.device, group, cu=self._cu, timeout_s=o.collective_timeout_s,
                                             asynchronous=self._async)
        self._cap = self._registrar.capability(self.device)
        self._unified = self._cap.unified_memory
        names = {id(m): n for n, m in self._module.named_modules()}
        walks = [(names[id(b)], b, tensor_slots(b).slots) for b in self._all_blocks[self._resident :]]
        skip = {id(s.tensor) for _, _, slots in walks for s in slots}
        leased = lease_blocks(walks, self._lease) if self._lease is not None else [None] * len(walks)
        sizes = [lb.nbytes if lb is not None else pack_layout(q, sl)[1] for (q, _, sl), lb in zip(walks, leased)]
        plans = [ag.ShardPlan.of(n, size, rank) for n in sizes]
        # One private (pinned on CUDA) buffer holds every shard of this rank.
        self._shard_store = store = self._host_buffers([max(1, sum(p.shard for p in plans))], "AllGather shards")[0]
        pos = 0
        for (qual, blk, slots), lb, p in zip(walks, leased, plans):
            out = store[pos : pos + p.shard]
            blk_, plan = shard_block(qual, blk, slots, lb, size, rank, out)
            assert plan == p
            self._blocks.append(blk_)
            self._plans.append(plan)
            self._shards.append(out)
            pos += p.shard
        # Lease views or the ordinary tensors: nothing of the rank's full
        # copy stays referenced once these go.
        del leased, walks
        self.trail.append("shards")
        self._make_resident(skip | {id(m.host) for b in self._blocks for m in b.members})
        if self._lease is not None:
            self._privatize(self._lease.regions())
            lease, self._lease = self._lease, None
            # The mapping was only the shards' source: every rank holds its
            # shards and nothing points into the mapping any more.
            lease.close()
            self.trail.append("close_lease")
        kept = f"({sum(p.shard for p in plans)} of {sum(sizes)} bytes)"
        self._choice = TransportChoice(ag.ALLGATHER, f"rank {rank} of {size} keeps 1/{size} of each block {kept}")
        self.trail.append(f"transport:{ag.ALLGATHER}")
        self._sequence = ag.SequenceCheck(group, self.device, o.collective_timeout_s, [b.name for b in self._blocks],
                                          sizes, stream=self._cu.Stream(self.device) if self._async else None)
        buf = max((p.padded for p in plans), default=0)
        self._buffers = [torch.empty(buf, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._counts = [[0, 0, 0, 0] for _ in self._blocks]
        self._meta = [(b.name, n) for b, n in zip(self._blocks, sizes)]
        self._hook_and_prefetch()

    def _host_buffers(self, sizes: list[int], what: str) -> list[torch.Tensor]:
        """Host buffers the device reads by DMA: exact sizes, pinned under
        the daemon's admission where the policy allows
        (:class:`~dlo_runtime.pinned.PinnedBuffers`), else plain memory."""
        assert self._cap is not None
        o = self.options
        if not (o.pin_memory and self._pin_host and not self._unified):
            return [torch.empty(n, dtype=torch.uint8) for n in sizes]
        pins = PinnedBuffers(self._registrar, self._cap, sizes, pin=True, broker=broker_for(self._lease),
                             label=what, chunk_bytes=o.chunk_bytes)
        self._pins.append(pins)
        self.trail.append(f"pinned:{what}" if pins.pinned else f"pageable:{what}")
        return pins.buffers

    def _privatize(self, regions: Sequence[Any]) -> None:
        """Copies the module's host tensors that still point into the
        mapping (non-streamed tensors on a CPU device) out of it."""
        assert self._module is not None
        for mod in self._module.modules():
            for attr, p in mod._parameters.items():
                if p is not None and ag.in_regions(p.data, regions):
                    p.data = p.data.clone()
            for attr, buf in mod._buffers.items():
                if buf is not None and ag.in_regions(buf, regions):
                    mod._buffers[attr] = buf.clone()

    def _make_resident(self, skip: set[int]) -> None:
        """Moves everything outside the streamed blocks (and streamed blocks'
        non-persistent buffers) to the device once; ``skip`` holds the ids
        of the streamed tensors and their host views."""
        assert self._module is not None
        for mod in self._module.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) not in skip and p.device != self.device:
                    p.data = p.data.to(self.device)
            for attr, buf in mod._buffers.items():
                if buf is not None and id(buf) not in skip and buf.device != self.device:
                    mod._buffers[attr] = buf.to(self.device)

    # -- the schedule ----------------------------------------------------------

    def _slot_of(self, j: int) -> int | None:
        for s in (0, 1):
            if self._slot_block[s] == j:
                return s
        return None

    def _load(self, j: int, slot: int) -> None:
        """One contiguous copy of block j into device buffer ``slot``."""
        assert self._engine is not None
        blk = self._blocks[j]
        c = self._counts[j]
        if self._sequence is not None:
            n = len(self._blocks)
            # The schedule's next load after block j (announced one load
            # ahead; with two or fewer blocks nothing is loaded again).
            predicted = (j + 1) % n if n > 2 else None
            while True:
                # Every rank agrees on this load before its gather is issued.
                g = self._sequence.agree(j, predicted)
                plan, blk_g, c = self._plans[g], self._blocks[g], self._counts[g]
                self._slot_block[slot] = None
                self._engine.label = f"{g} ({blk_g.name!r})"  # type: ignore[attr-defined]
                self._engine.load(slot, self._buffers[slot][: plan.padded], self._shards[g], None)
                self._slot_block[slot] = g
                c[0] += 1
                c[1] += plan.shard
                c[3] += plan.padded - plan.shard
                if g == j:
                    return
                # This rank left the announced sequence: the group agreed on
                # block g, gathered (size-matched) and discarded; the next
                # agree() settles j (or raises on every rank).
        check_mapped(self._lease)  # the bytes about to be copied are still the mapped file's
        staging = self._staging[slot][: blk.nbytes] if self._staging else None
        self._slot_block[slot] = None
        host_copies = self._engine.load(slot, self._buffers[slot][: blk.nbytes], blk.host_bytes, staging,
                                        cuts=self._cuts[j] if self._cuts else ())
        self._slot_block[slot] = j
        c[0] += 1
        c[1] += blk.nbytes
        c[2] += host_copies

    def _pre(self, j: int) -> None:
        slot = self._slot_of(j)
        if slot is None:  # out-of-order call: load on demand into the other slot
            other = self._slot_of((j - 1) % len(self._blocks))
            slot = 0 if other != 0 else 1
            self._load(j, slot)
        assert self._engine is not None
        # Compute must not read the buffer before its copy landed.
        self._engine.before_compute(slot)
        raw = self._buffers[slot]
        for m in self._blocks[j].members:
            set_tensor(m.owner, m.attr, m.is_parameter, member_view(raw, m))

    def _post(self, j: int) -> None:
        slot = self._slot_of(j)
        assert slot is not None and self._engine is not None, f"block {j} ran without being loaded"
        # The next copy into this slot waits for this block's kernels.
        self._engine.after_compute(slot)
        for m in self._blocks[j].members:
            set_tensor(m.owner, m.attr, m.is_parameter, m.host)
        n = len(self._blocks)
        nxt = (j + 2) % n
        if n > 2 and self._slot_of(nxt) is None:
            self._load(nxt, slot)

    # -- teardown --------------------------------------------------------------

    def _drain(self) -> None:
        if self._sequence is not None and not self._sequence.drain():
            # The exchange issued ahead could not complete: the group is
            # broken, so in-flight gathers may never complete either.
            self._engine.clean = False  # type: ignore[union-attr]
        if self._engine is not None:
            # Pending copies read the mapping/staging and compute reads the
            # buffers: both must finish before any of them is released.
            self._engine.drain()
        self.trail.append("drain")

    def _release(self) -> None:
        if self._engine is not None and not getattr(self._engine, "clean", True):
            # A collective could not be drained and may still write them.
            ag.orphan(self._buffers, self._shard_store)
        for h in self._hooks:
            h.remove()
        for b in self._blocks:
            for m in b.members:
                set_tensor(m.owner, m.attr, m.is_parameter, m.host)
        self._hooks, self._buffers, self._staging, self._blocks = [], [], [], []
        self._shards, self._shard_store = [], None
        self._module, self._all_blocks = None, []
        self._released = True
        self.trail.append("release")

    def close(self) -> None:
        """Drain -> release -> unregister -> close the lease. Idempotent;
        after an unregistration failure, call again to retry.

        Raises:
            UnregisterFailed: ranges stay registered and the lease stays open
                (also kept in :func:`retained` so it outlives this handle).
        """
        if self._closed:
            return
        if not self._released:
            self._drain()
            self._release()
        lease_ranges = self._ranges is not None and self._ranges.active
        if not getattr(self._engine, "clean", True):
            ag.orphan(self._pins)  # an undrained collective's H2D may still read them: stay pinned
            self._pins = []
        # After the drain: no copy reads the mapping or these buffers any more.
        for ranges in ([self._ranges] if lease_ranges else []) + [p.ranges for p in reversed(self._pins) if p.pinned]:
            try:
                ranges.unregister()  # type: ignore[union-attr]
            except Exception as exc:
                self._retain(exc)
                raise
        self._pins = []
        if lease_ranges:
            self.trail.append("unregister")
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()
            self.trail.append("close_lease")
        self._closed = True
        if self in _RETAINED:
            _RETAINED.remove(self)

    def abort(self) -> None:
        """close() for a failed setup; never raises. If unregistration fails
        the lease stays open (see :func:`retained`) and close() may retry."""
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - the setup error is the one to report
            log.error("offload backend abort: %s", exc)

    def _retain(self, exc: BaseException) -> None:
        if self not in _RETAINED:
            _RETAINED.append(self)
        self.trail.append("retain_lease")
        log.error("offload backend: registrations could not be removed (%s); lease kept open", exc)

    @property
    def lease(self) -> Any:
        """The lease this backend owns (None once closed or for ordinary)."""
        return self._lease

    # -- reporting ---------------------------------------------------------------

    @property
    def transport(self) -> str:
        """The transport chosen at start (``registered``, ``staging``...)."""
        return self._choice.kind

    @property
    def stats(self) -> OffloadStats:
        """A snapshot of what the backend uses and has done (valid after close)."""
        c = self._choice
        blocks = tuple(BlockStats(name, nbytes, *self._counts[j]) for j, (name, nbytes) in enumerate(self._meta))
        return OffloadStats(
            c.kind, c.reason, str(self.device), self._unified, self._resident,
            int(self._buffers[0].numel()) if self._buffers else 0,
            int(self._staging[0].numel()) if self._staging else 0,
            c.registered_bytes, c.registration_seconds, len(c.calls), blocks,
            ag.group_size(self._group), sum(p.shard for p in self._plans),
            self._sequence.seconds if self._sequence is not None else 0.0,
            float(getattr(self._engine, "wait_seconds", 0.0)),
            float(getattr(self._engine, "staging_seconds", 0.0)),
            sum(p.nbytes for p in self._pins if p.pinned),
        )

    def buffer_ranges(self) -> list[tuple[int, int]]:
        """[start, end) addresses of the two device buffers (for checks)."""
        return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in self._buffers]

    def __reduce__(self):
        raise TypeError("OffloadBackend is process-local (it owns a lease and device buffers) and cannot be pickled")


def enable_layerwise_offload(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    options: OffloadOptions | None = None,
    *,
    source: Any = None,
    **fields: Any,
) -> OffloadBackend:
    """Streams ``blocks`` of ``module`` through two device buffers.

    Args:
        module: the model; everything outside the streamed blocks moves to
            the device once.
        blocks: the streamable blocks in execution order.
        options: an :class:`~dlo_runtime.options.OffloadOptions` (default:
            CPU, no resident blocks, pin policy on, no registration ceiling).
        source: a lease (MappedArtifact API + close()), a LeaseCarrier
            holding one (taken once), or None for ordinary tensors. The
            module must have been restored from it. The backend owns it and
            closes it in :meth:`OffloadBackend.close`.
        process_group: (an option, see below) a ``torch.distributed`` group
            of G > 1 ranks selects the AllGather transport: every rank of
            the group must call this with the same model and blocks, and
            run the same blocks in the same order
            (:mod:`dlo_runtime.allgather`).
        **fields: individual options (``device="cuda:0"``,
            ``resident_blocks=2``...), applied over ``options``; see
            :class:`~dlo_runtime.options.OffloadOptions` for each one's unit
            and default.

    Returns:
        The started backend: ``close()`` and ``stats``.

    Raises:
        TypeError: an unknown option name.
        InvalidArgument: bad arguments (nothing taken, nothing changed).
        FailedPrecondition: blocks do not match the lease.
        RegistrationAborted: rollback failed; startup must abort.
    """
    opts = (options or OffloadOptions()).updated(**fields)
    return OffloadBackend(module, blocks, opts, source=source).start()
