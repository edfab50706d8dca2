"""The copy engine of the DLO backend: how one block's bytes reach a device
buffer slot, and the waits that keep the two slots safe to reuse.

The backend's schedule (which block goes into which slot, and when) is the
same on every device; only the mechanics differ, and they live here:

- :class:`StreamCopyEngine` (CUDA): copies are queued on a dedicated copy
  stream and ordered against the compute stream with events, so the copy of
  block j+1 runs while block j computes.
- :class:`ThreadCopyEngine` (a CPU "device"): one thread plays the copy
  stream. Copies run in issue order beside the compute; a block waits for
  its own copy on the host; compute, being synchronous there, needs no
  event.

Both follow the same three rules, per slot:

1. a copy into a slot starts only after the compute that last read that
   slot finished (buffer reuse);
2. a block's compute starts only after its copy landed;
3. with staging, a staging slot is overwritten only after the previous
   transfer out of it finished.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Protocol, Sequence

import torch


class CopyEngine(Protocol):
    """The seam between the backend's schedule and a device's copy
    mechanics. ``slot`` is 0 or 1, the device buffer a block lives in."""

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None, *,
             cuts: Sequence[int] = ()) -> int:
        """Issues the copy of ``src`` (host bytes) into ``dst`` (the slot's
        device buffer), through ``staging`` (the slot's host staging buffer)
        when given. ``cuts``: byte offsets where ``src`` crosses from one
        host registration into the next; a direct copy is issued in pieces
        split there (each piece a pinned copy). Returns the host copies it
        made (1 through staging)."""
        ...

    def before_compute(self, slot: int) -> None:
        """Called before a block reads ``slot``: waits for its copy."""
        ...

    def after_compute(self, slot: int) -> None:
        """Called after a block's forward issued its work on ``slot``."""
        ...

    def drain(self) -> None:
        """Waits for every copy and compute issued; the engine is done."""
        ...


def pieces(nbytes: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``[0, nbytes)`` split at ``cuts`` (offsets strictly inside)."""
    bounds = [0, *sorted(c for c in cuts if 0 < c < nbytes), nbytes]
    return list(zip(bounds, bounds[1:]))


class StreamCopyEngine:
    """CUDA: copies on a copy stream, ordered by events.

    Args:
        device: the CUDA device.
        cu: the stream/event API (``torch.cuda``; CPU tests pass a recording
            fake to check the ordering).
    """

    def __init__(self, device: torch.device, cu: Any):
        self.device, self.cu = device, cu
        self.copy_stream = cu.Stream(device)
        self.copy_done = [cu.Event(), cu.Event()]
        self.compute_done = [cu.Event(), cu.Event()]
        self.staging_free = [cu.Event(), cu.Event()]
        #: Host seconds spent on staging (slot wait + memcpy) on the calling
        #: thread, which is the one running the forward hooks.
        self.staging_seconds = 0.0

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None, *,
             cuts: Sequence[int] = ()) -> int:
        """Queues the copy on the copy stream; see :class:`CopyEngine`."""
        host_copies = 0
        with self.cu.stream(self.copy_stream):
            # Buffer reuse: the block that last ran from this slot must
            # finish before its bytes are overwritten.
            self.copy_stream.wait_event(self.compute_done[slot])
            if staging is not None:
                t0 = time.perf_counter()
                # Host wait: the previous DMA out of this staging slot
                # must finish before the memcpy overwrites its bytes.
                self.staging_free[slot].synchronize()
                src, host_copies = staging.copy_(src), 1
                self.staging_seconds += time.perf_counter() - t0
                cuts = ()  # one staging slot is one registration
            for lo, hi in pieces(src.numel(), cuts):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            if staging is not None:
                self.staging_free[slot].record(self.copy_stream)
            self.copy_done[slot].record(self.copy_stream)
        return host_copies

    def before_compute(self, slot: int) -> None:
        """Makes the compute stream wait for the slot's copy."""
        # Compute must not read the buffer before its H2D copy landed.
        self.cu.current_stream(self.device).wait_event(self.copy_done[slot])

    def after_compute(self, slot: int) -> None:
        """Records "compute done" on the slot for its next copy to wait on."""
        # The next copy into this slot waits for this block's kernels.
        self.compute_done[slot].record(self.cu.current_stream(self.device))

    def drain(self) -> None:
        """Synchronizes the device."""
        # Pending H2D copies read the mapping/staging and kernels read the
        # buffers: both must finish before any of them is released.
        self.cu.synchronize(self.device)


class _CopyThread:
    """The copy stream of a CPU "device": one thread that runs block copies
    in the order they were issued, so the copy of block j+1 overlaps the
    compute of block j the way an H2D copy on a CUDA copy stream does
    (torch releases the GIL inside ``copy_``). Started on first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.ident: int | None = None  # the copying thread (tests check copies ran there)

    def submit(self, dst: torch.Tensor, src: torch.Tensor,
               parts: Sequence[tuple[int, int]] | None = None) -> concurrent.futures.Future:
        """Queues ``dst[lo:hi].copy_(src[lo:hi])`` per part (default: one
        whole copy); the future completes when they ran."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlo-copy", daemon=True)
            self._thread.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((done, dst, src, parts if parts and len(parts) > 1 else None))
        return done

    def _run(self) -> None:
        self.ident = threading.get_ident()
        while (item := self._queue.get()) is not None:
            done, dst, src, parts = item
            try:
                if parts is None:
                    dst.copy_(src)
                for lo, hi in parts or ():
                    dst[lo:hi].copy_(src[lo:hi])
            except BaseException as exc:  # raised where the copy is waited for
                done.set_exception(exc)
            else:
                done.set_result(None)

    def close(self) -> None:
        """Stops the thread after the copies already issued."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            # Join: the thread must not outlive the buffers it copies into.
            thread.join()


class ThreadCopyEngine:
    """A CPU "device": copies on one copy thread, waited for on the host."""

    def __init__(self) -> None:
        self._copier = _CopyThread()
        #: Per slot, its last copy in flight.
        self._pending: list[concurrent.futures.Future | None] = [None, None]
        self.staging_seconds = 0.0  # host seconds in staging memcpys, on the calling thread

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor, staging: torch.Tensor | None, *,
             cuts: Sequence[int] = ()) -> int:
        """Submits the copy to the copy thread; see :class:`CopyEngine`."""
        # The slot's previous copy reads its staging slot and writes its
        # buffer: it must finish before either is reused. (Its block's
        # compute already finished: CPU compute is synchronous.)
        self._wait(slot)
        host_copies = 0
        if staging is not None:
            t0 = time.perf_counter()
            src, host_copies = staging.copy_(src), 1
            self.staging_seconds += time.perf_counter() - t0
            cuts = ()
        parts = pieces(src.numel(), cuts)
        self._pending[slot] = self._copier.submit(dst, src, parts) if len(parts) > 1 else self._copier.submit(dst, src)
        return host_copies

    def before_compute(self, slot: int) -> None:
        """Waits on the host for the slot's copy; re-raises its error."""
        self._wait(slot)  # compute must not read the buffer before its copy landed

    def after_compute(self, slot: int) -> None:
        """Nothing: CPU compute is synchronous, it is done on return."""

    def drain(self) -> None:
        """Waits for the copies in flight, then stops the copy thread."""
        # Pending copies read the mapping/staging and write the buffers: they
        # must finish before any of them is released. A copy's error was (or
        # would have been) raised where its block waited; teardown must not
        # stop on it.
        concurrent.futures.wait([p for p in self._pending if p is not None])
        self._pending = [None, None]
        self._copier.close()

    def _wait(self, slot: int) -> None:
        pending, self._pending[slot] = self._pending[slot], None
        if pending is not None:
            pending.result()


def make_copy_engine(device: torch.device, *, cu: Any = torch.cuda, asynchronous: bool | None = None) -> CopyEngine:
    """The copy engine for ``device``.

    Args:
        device: the backend's compute device.
        cu: the stream/event API for the asynchronous engine.
        asynchronous: stream engine (True) or copy thread (False); None
            picks by device (CUDA: streams).
    """
    if asynchronous is None:
        asynchronous = device.type == "cuda"
    return StreamCopyEngine(device, cu) if asynchronous else ThreadCopyEngine()
