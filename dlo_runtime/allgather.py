"""The AllGather transport of the DLO backend: each rank of a process group
keeps 1/G of every streamed block, and the whole block is rebuilt in a
device buffer slot by one all-gather (seed: "AllGather path").

Shards. A streamed block is one contiguous byte range (the artifact's
aligned layout). Its ``N`` bytes are padded to ``P = G * S`` where ``S``,
the shard, is a multiple of the 64-byte alignment; rank ``r`` keeps bytes
``[r*S, (r+1)*S)`` (zeros past ``N``) in one private host buffer, pinned on
CUDA. The gather writes all ``P`` bytes into a slot, but tensor views cover
only ``[0, N)``: the padding never reaches a tensor.

Sources. With a lease, each rank cuts its shards from the mapped artifact
(every rank of a node maps the same pages), copies the few non-streamed
tensors still on the host out of the mapping, and closes the lease: the
mapping is only the source of the shards (seed: "the checkpoint mappings are
only the source used to prepare each rank's persistent shard"). Without a
lease, the shards are cut from the ordinary tensors, which the backend then
drops. Either way, between uses a streamed tensor is a zero-stride
placeholder (NaN for floating dtypes): no rank holds the whole block.

Per block (the backend's schedule is unchanged, see :mod:`dlo_runtime.backend`):

1. :meth:`SequenceCheck.agree` compares every rank's (load number, block
   index, bytes) record for this load, exchanged one load ahead. A rank
   that streams another block (one skipped, one called out of order) makes
   EVERY rank raise :class:`BlockSequenceMismatch` before any data
   collective of mismatched size is issued, instead of hanging or gathering
   the wrong shards. Cost: one 32-byte-per-rank asynchronous collective per
   block load, issued one load ahead, so in the steady state no rank waits
   for it (no per-block rendezvous).
2. The engine puts the shard into the slot's slice ``[r*S, (r+1)*S)`` and
   issues ``all_gather_single`` (``all_gather_into_tensor``'s name from
   torch 2.13 on) of that slice into the whole slot, asynchronously.
3. Before the block runs, the engine waits for that gather (with the
   group's timeout): a dead or stuck peer raises :class:`CollectiveFailed`
   naming the collective.

Engines: :class:`ThreadGatherEngine` (CPU "device", gloo: ``async_op=True``
work handles, gloo's own threads run the gather while the block computes)
and :class:`StreamGatherEngine` (CUDA, NCCL: shard H2D on a communication
stream ordered by events; written against the PyTorch docs, untested: no
multi-GPU machine was available).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
from typing import Any, Sequence

import torch

from hwr_client.core.errors import FailedPrecondition, Internal, InvalidArgument
from hwr_client.core.layout import ALIGN

log = logging.getLogger(__name__)

ALLGATHER = "allgather"

#: Buffers a collective may still write into because draining it failed
#: (timed out): kept referenced until process exit so the backend never
#: frees memory that gloo/NCCL could still write.
_ORPHANED: list[Any] = []


class CollectiveFailed(Internal):
    """A collective of the AllGather transport failed or timed out (a peer
    died, hung, or left): the group is unusable and the forward fails."""


class BlockSequenceMismatch(FailedPrecondition):
    """The ranks of an AllGather group do not stream the same blocks in the
    same order; raised on every rank."""


def _gather_op() -> Any:
    """``all_gather_single`` (torch >= 2.13, same operation) or
    ``all_gather_into_tensor`` (older torch)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Any) -> int:
    """The size of a process group (1 for None).

    Raises:
        InvalidArgument: an object that is not a process group.
    """
    if group is None:
        return 1
    if not (callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None))):
        raise InvalidArgument(f"process_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return int(group.size())


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one block is split: ``nbytes`` real bytes padded to ``padded`` =
    ``group_size * shard``; this rank keeps ``[begin, begin + shard)``."""

    nbytes: int
    shard: int
    padded: int
    begin: int

    @classmethod
    def of(cls, nbytes: int, size: int, rank: int) -> "ShardPlan":
        """The plan of an ``nbytes`` block for ``rank`` of ``size``."""
        unit = size * ALIGN
        padded = max(unit, (nbytes + unit - 1) // unit * unit)
        shard = padded // size
        return cls(nbytes, shard, padded, rank * shard)

    def overlap(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        """The part of ``[offset, offset + nbytes)`` inside this rank's shard,
        as (start in the range, length), or None."""
        lo, hi = max(offset, self.begin), min(offset + nbytes, self.begin + self.shard)
        return (lo - offset, hi - lo) if hi > lo else None


def placeholder(dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A zero-stride host tensor of ``shape`` over one element: what a
    streamed tensor is between uses on an AllGather rank (NaN for floating
    dtypes, so an accidental read outside the block's forward is loud)."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, dtype=dtype).expand(tuple(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` looks like a :func:`placeholder`: more than one element
    over a single stored one (every stride 0), NaN for floating dtypes."""
    if t.numel() <= 1 or any(s != 0 for s in t.stride()):
        return False
    return not (t.dtype.is_floating_point or t.dtype.is_complex) or bool(torch.isnan(t.reshape(-1)[0]).item())


def in_regions(t: torch.Tensor, regions: Sequence[Any]) -> bool:
    """Whether a CPU tensor's bytes start inside one of ``regions``."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    ptr = t.data_ptr()
    return any(r.address <= ptr < r.address + r.length for r in regions)


def _wait(work: Any, timeout_s: float, what: str, rank: int, size: int) -> None:
    try:
        if timeout_s > 0:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            work.wait()
    except Exception as exc:
        raise CollectiveFailed(f"{what} failed on rank {rank} of {size} (timeout {timeout_s:g}s): {exc}") from exc


class SequenceCheck:
    """The block-sequence check (see the module docstring, step 1).

    Every gather ``g`` is preceded by one exchange ``E_g`` of a fixed
    32-byte record per rank: (load number, block index, bytes, flag). The
    exchange is issued one load AHEAD, with the block the schedule predicts
    (:meth:`agree`'s ``predicted``), right before gather ``g - 1``, so by
    the time load ``g`` is issued it has had a whole block's compute to
    complete and waiting for it costs nothing in the steady state (the
    former design exchanged and waited at every load: a per-block blocking
    rendezvous).

    Guarantees, unchanged: no rank issues a gather before every rank's
    record for it was seen equal (so gathers of mismatched sizes are never
    issued), and a rank that streams another block than the group makes
    every rank raise :class:`BlockSequenceMismatch`:

    - records that differ in ``E_g``: every rank raises at load ``g``;
    - the group agreed on block ``b`` for load ``g`` (everyone predicted
      it) but this rank needs ``j != b`` (a block skipped or called out of
      order): it announces ``(g, j, bytes, REVISED)`` in ``E_{g+1}``,
      issues the agreed gather ``g`` of ``b`` anyway (size-matched, so the
      others' gather completes and teardown can drain it) and then waits
      for ``E_{g+1}`` at once. The others announced their prediction there:
      the records differ and every rank raises, the others at their next
      load. If EVERY rank revised to the same block (a consistent
      out-of-order call, e.g. the same skipped layer on every rank of a
      synchronized wave) the records agree and the group gathers ``j`` next.

    A load without an exchange ahead (the first one, or after a revision)
    exchanges and waits at once, as before.
    """

    REVISED = 1

    def __init__(self, group: Any, device: torch.device, timeout_s: float, names: Sequence[str],
                 sizes: Sequence[int], *, stream: Any = None):
        self.group, self.device, self.timeout_s = group, device, timeout_s
        #: CUDA: a side stream the check is issued on, so NCCL's stream
        #: waits for nothing queued on the compute stream (a check issued
        #: from the compute stream would make the host wait for the block
        #: that is running). None: the current stream / CPU.
        self.stream = stream
        self.size, self.rank = group.size(), group.rank()
        self.names, self.sizes = list(names), list(sizes)
        self.loads = 0  # block loads (gathers) issued by this rank so far
        self.seconds = 0.0  # host time in agree(): issuing and waiting for exchanges
        self.exchanges = 0  # exchanges issued
        self.blocking = 0  # exchanges issued and waited at once (no exchange ahead)
        self.revisions = 0  # loads where this rank left the announced sequence
        #: The exchange for load ``self.loads``, issued ahead: (work, output,
        #: this rank's record, what).
        self._ahead: tuple[Any, torch.Tensor, list[int], str] | None = None

    def _stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _issue(self, record: list[int]) -> tuple[Any, torch.Tensor, list[int], str]:
        blk = record[1]
        name = self.names[blk] if 0 <= blk < len(self.names) else f"#{blk}"
        what = f"all_gather_single (block-sequence check of load {record[0]}, block {name!r})"
        # Everything on the side stream on CUDA (see ``stream``): the tag's
        # H2D, the gather, the wait and the read-back are ordered there only.
        with self._stream():
            mine = torch.tensor(record, dtype=torch.int64, device=self.device)
            out = torch.empty(4 * self.size, dtype=torch.int64, device=self.device)
            work = _gather_op()(out, mine, group=self.group, async_op=True)
        self.exchanges += 1
        return work, out, record, what

    def _rows(self, pending: tuple[Any, torch.Tensor, list[int], str]) -> list[list[int]]:
        work, out, _, what = pending
        with self._stream():
            try:
                _wait(work, self.timeout_s, what, self.rank, self.size)
            except CollectiveFailed:
                # A timed-out exchange may still be written into later.
                _ORPHANED.append(pending)
                raise
            return out.view(self.size, 4).cpu().tolist()

    def _record(self, j: int) -> list[int]:
        return [self.loads, j, self.sizes[j], 0]

    def agree(self, j: int, predicted: int | None) -> int:
        """Makes the group agree on this rank's next load (block ``j``) and
        returns the block to gather now: ``j``, or (once, after this rank
        left the predicted sequence) the block the group agreed on, to be
        gathered and discarded before calling again.

        Args:
            j: the block this rank loads next.
            predicted: the block the schedule loads after ``j`` (announced
                ahead); None when no further load is expected.

        Raises:
            BlockSequenceMismatch: the ranks' records differ.
            CollectiveFailed: an exchange failed or timed out.
        """
        t0 = time.perf_counter()
        try:
            pending, self._ahead = self._ahead, None
            if pending is None:
                # No exchange ahead: exchange now and wait (before any gather).
                self.blocking += 1
                pending = self._issue(self._record(j))
            # Blocking: a gather is issued only once every rank's record for
            # it was seen equal, so diverging ranks never pair collectives of
            # different sizes (which hangs or corrupts instead of failing).
            rows = self._rows(pending)
            if any(row != rows[0] for row in rows):
                raise self._mismatch(rows)
            agreed = rows[0][1]
            if agreed != j:
                # This rank left the sequence it announced: say so in the
                # next exchange, then gather what the group agreed on.
                self.revisions += 1
                self._ahead = self._issue([self.loads, j, self.sizes[j], self.REVISED])
            elif predicted is not None:
                self._ahead = self._issue([self.loads + 1, predicted, self.sizes[predicted], 0])
            self.loads += 1
            return agreed
        finally:
            self.seconds += time.perf_counter() - t0

    def drain(self) -> bool:
        """Waits for the exchange issued ahead (every rank issued it: it
        completes unless a peer is gone). Returns False if it could not
        complete (its buffers must then outlive the check)."""
        pending, self._ahead = self._ahead, None
        if pending is None:
            return True
        try:
            self._rows(pending)
            return True
        except CollectiveFailed as exc:
            log.warning("AllGather drain: %s", exc)
            return "timed out" not in str(exc.__cause__ or "").lower()

    def _mismatch(self, rows: list[list[int]]) -> BlockSequenceMismatch:
        parts = []
        for r, (seq, blk, nbytes, flag) in enumerate(rows):
            name = self.names[blk] if 0 <= blk < len(self.names) else f"#{blk}"
            part = f"rank {r}: load {seq} of block {blk} ({name!r}, {nbytes} bytes"
            parts.append(part + (", not the block the group agreed on)" if flag == self.REVISED else ")"))
        return BlockSequenceMismatch(
            "AllGather block sequence differs across ranks: " + "; ".join(parts)
            + ". Every rank of the group must run the same blocks in the same order (same request path)")


class ThreadGatherEngine:
    """A CPU "device" with gloo: the gather runs on gloo's threads while the
    current block computes; its work handle is waited for on the host.

    The shard is handed to gloo as the gather's input directly: on a CPU
    device the "copy into the slot's slice" is gloo's own write of rank r's
    chunk, so no extra memcpy is made (the NCCL engine copies the shard
    into the slice and gathers in place).
    """

    def __init__(self, group: Any, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.size, self.rank = group.size(), group.rank()
        self._pending: list[tuple[Any, str] | None] = [None, None]
        self.label = ""
        self.wait_seconds = 0.0  # host time blocked on gathers (exposed collective time)
        self.clean = True  # False once a drain could not complete: buffers must outlive us

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None) -> int:
        """Issues the gather of ``src`` (this rank's shard) into ``dst`` (the
        slot's first ``G * S`` bytes); see :class:`~dlo_runtime.copy_engine.CopyEngine`."""
        # The slot's previous gather writes dst: it must have finished
        # before the slot is gathered into again. (Its block's compute has
        # finished too: CPU compute is synchronous.)
        self._wait(slot)
        what = f"all_gather_single of block {self.label} ({dst.numel()} bytes over {self.size} ranks)"
        self._pending[slot] = (_gather_op()(dst, src, group=self.group, async_op=True), what)
        return 0

    def before_compute(self, slot: int) -> None:
        """Waits for the slot's gather; a dead or stuck peer raises
        :class:`CollectiveFailed` within the timeout."""
        t0 = time.perf_counter()
        self._wait(slot)  # the block must not read the slot before every shard landed
        self.wait_seconds += time.perf_counter() - t0

    def after_compute(self, slot: int) -> None:
        """Nothing: CPU compute is synchronous, it is done on return."""

    def drain(self) -> None:
        """Waits for every gather in flight (errors logged, not raised:
        teardown must go on). A gather that cannot be drained keeps the
        engine unclean, so the backend keeps its buffers referenced."""
        # In-flight gathers write the slots: they must finish before the
        # backend frees them.
        for slot in (0, 1):
            try:
                self._wait(slot)
            except CollectiveFailed as exc:
                self.clean = self.clean and "timed out" not in str(exc.__cause__ or "").lower()
                log.warning("AllGather drain: %s", exc)

    def _wait(self, slot: int) -> None:
        pending, self._pending[slot] = self._pending[slot], None
        if pending is not None:
            _wait(pending[0], self.timeout_s, pending[1], self.rank, self.size)


class StreamGatherEngine:
    """CUDA with NCCL (written against the PyTorch/NCCL docs; untested here).

    Per load, on a dedicated communication stream: wait for the compute
    that last read the slot, copy the pinned shard into the slot's slice
    (async H2D), then the in-place gather (NCCL's in-place rule: input ==
    output + rank * count). ProcessGroupNCCL runs the collective on its own
    stream, which waits for the current stream (the communication stream)
    when the op is issued; ``work.wait()`` makes the *current* stream wait
    for the collective without blocking the host. The group's timeout is
    the NCCL watchdog's (``init_process_group(timeout=...)``).

    Args:
        device: the CUDA device.
        group: the NCCL process group.
        cu: the stream/event API (``torch.cuda``).
    """

    def __init__(self, device: torch.device, group: Any, cu: Any, timeout_s: float):
        self.device, self.group, self.cu, self.timeout_s = device, group, cu, timeout_s
        self.size, self.rank = group.size(), group.rank()
        self.comm_stream = cu.Stream(device)
        self.compute_done = [cu.Event(), cu.Event()]
        self._pending: list[tuple[Any, str] | None] = [None, None]
        self.label = ""
        self.wait_seconds = 0.0
        self.clean = True

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None) -> int:
        """Queues the shard H2D and the gather; see :class:`ThreadGatherEngine`."""
        n = src.numel()
        mine = dst[self.rank * n : (self.rank + 1) * n]
        what = f"all_gather_single of block {self.label} ({dst.numel()} bytes over {self.size} ranks)"
        with self.cu.stream(self.comm_stream):
            # Buffer reuse: the block that last ran from this slot must
            # finish before its bytes are overwritten by the H2D or gather.
            self.comm_stream.wait_event(self.compute_done[slot])
            mine.copy_(src, non_blocking=True)  # pinned shard: asynchronous H2D
            # Issued with the communication stream current: NCCL's stream
            # waits for it, so the gather starts after this shard landed.
            work = _gather_op()(dst, mine, group=self.group, async_op=True)
        self._pending[slot] = (work, what)
        return 0

    def before_compute(self, slot: int) -> None:
        """Makes the compute stream wait for the slot's gather."""
        pending, self._pending[slot] = self._pending[slot], None
        if pending is not None:
            # Compute must not read the slot before the gather landed; on
            # NCCL wait() orders the current stream, the host goes on.
            _wait(pending[0], 0, pending[1], self.rank, self.size)

    def after_compute(self, slot: int) -> None:
        """Records "compute done" on the slot for its next load to wait on."""
        # The next H2D/gather into this slot waits for this block's kernels.
        self.compute_done[slot].record(self.cu.current_stream(self.device))

    def drain(self) -> None:
        """Waits for gathers in flight, then synchronizes the device."""
        for slot in (0, 1):
            pending, self._pending[slot] = self._pending[slot], None
            if pending is not None:
                try:
                    _wait(pending[0], 0, pending[1], self.rank, self.size)
                except CollectiveFailed as exc:
                    log.warning("AllGather drain: %s", exc)
        # Pending H2D copies read the shards and the gathers write the
        # slots: both must finish before any of them is freed.
        self.cu.synchronize(self.device)


def make_gather_engine(device: torch.device, group: Any, *, cu: Any, timeout_s: float,
                       asynchronous: bool) -> Any:
    """The gather engine for ``device`` (CUDA streams or gloo work handles)."""
    if asynchronous:
        return StreamGatherEngine(device, group, cu, timeout_s)
    return ThreadGatherEngine(group, timeout_s)


def orphan(*objs: Any) -> None:
    """Keeps ``objs`` (buffers a collective may still write) alive."""
    _ORPHANED.append(objs)
