"""Host-side transports of the DLO backend and the registration policy.

Best first:

``registered``
    The lease's mapped files are registered with ``cudaHostRegister``
    (read-only + portable flags, whole pages per file, chunks of at most
    :data:`MAX_CHUNK_BYTES` or the daemon's chunk size cut only between
    blocks (:mod:`dlo_runtime.pin_plan`), all pre-faulted first so the
    driver pins resident pages instead of reading them from disk under its
    locks), so each block copies straight from the mapping into its device
    buffer. No staging memory is allocated. While registered, the ranges hold
    the lease and its mappings (:func:`mapping_keepalive`).
``staging``
    Two bounded staging slots sized to the largest streamed block, pinned
    (exact sizes, under the daemon's admission: :mod:`dlo_runtime.pinned`)
    when the pin policy allows: mapping -> slot (host memcpy) -> device.

GPUs without read-only registration (``cudaDevAttrHostRegisterReadOnlySupported``
= 0: x86 discrete GPUs) decline registration of the lease's ``PROT_READ``
mappings: the driver pins without the read-only flag for WRITE
(``os_lock_user_pages`` -> ``FOLL_WRITE``), which a read-only mapping refuses
(vllm-omni #6240: error 801 with the flag, error 1 without, on a B300). They
stage. ``bench/gpu/probe.py`` measures exactly this matrix on the machine at
hand and its ``decision`` says whether the rule holds there
(:func:`probe_decision`).
``ordinary``
    No lease: each block's tensors are packed once at setup into a host
    buffer with the artifact's aligned layout (one extra host copy of the
    model, made block by block; the original tensors are released), and each
    block moves from there in one copy.
``unified``
    Host and device share one memory pool (an integrated GPU): registration
    and staging gain nothing there and are skipped; blocks copy straight from
    the mapping. The backend reports it so an operator can run resident.

Admission: a lease bound to a daemon session registers only what
the node daemon admits (:mod:`hwr_client.registration`): pre-fault, then
``request(total)``, then one ``chunk_done`` per registered chunk, and
``release`` once every chunk is unregistered (or rolled back). A source
without a daemon session (a local artifact, a test lease) registers without
admission, as before: nothing on the node accounts for it.

Registration outcomes follow the seed exactly:

- pin policy disabled, platform without support, over
  ``registration_limit_gib``, not admitted by the daemon (over its budget,
  watchdog, busy, unreachable) or a failed call that was rolled back
  completely -> ``staging`` (with the reason);
- a failed call whose rollback also failed -> :class:`RegistrationAborted`:
  startup aborts and the lease must stay open (closing it would unmap memory
  the driver still holds);
- an unregistration failure -> :class:`UnregisterFailed`; the remaining ranges
  stay registered and the lease stays open, so a later retry can finish.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

from hwr_client.core.errors import Internal
from hwr_client.mapping import PAGE_SIZE, Region
from hwr_client.registration import RegistrationBroker, RegistrationGrant, broker_for

from dlo_runtime.cuda_host import (
    HOST_REGISTER_DEFAULT, HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, HostCapability, Registrar, prefault,
)
from dlo_runtime.pin_plan import (  # noqa: F401 - Chunk and plan_chunks are part of this module's API
    Chunk, PinRegion, PinSource, admission_extents, pin_regions, plan_chunks, report_pieces,
)

#: (address, nbytes) -> how the range was faulted in; see cuda_host.prefault.
Prefault = Callable[[int, int], str]


def default_prefault(address: int, nbytes: int) -> str:
    """The default pre-fault: :func:`dlo_runtime.cuda_host.prefault`, looked
    up at call time (a test seam)."""
    return prefault(address, nbytes)

log = logging.getLogger(__name__)

#: Largest range one cudaHostRegister call gets (64 GiB).
MAX_CHUNK_BYTES = 64 * 1024**3
GIB = 1024**3

REGISTERED = "registered"
STAGING = "staging"
ORDINARY = "ordinary"
UNIFIED = "unified"


class RegistrationAborted(Internal):
    """A registration failed and its rollback failed too: some ranges are
    still registered. The lease must stay open; startup must abort."""

    def __init__(self, message: str, ranges: "RegisteredRanges"):
        super().__init__(message)
        self.ranges = ranges


class UnregisterFailed(Internal):
    """cudaHostUnregister failed: the remaining ranges are still registered,
    so the lease must stay open until a retry succeeds."""


@dataclasses.dataclass(frozen=True)
class RegistrationCall:
    """One runtime call, as logged: op, start address, bytes, result, time."""

    op: str  # "register" | "unregister"
    address: int
    nbytes: int
    code: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A registration the node daemon admitted: the broker to report to and
    its grant."""

    broker: RegistrationBroker
    grant: RegistrationGrant

    def release(self, reason: str) -> bool:
        """Returns the grant's bytes to the node's budget; never raises."""
        return self.broker.release(self.grant, reason=reason)


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The transport the backend will use, why, and what was registered.

    ``grant`` is the daemon's answer when it was asked (None: no daemon
    session behind the source, or registration declined before asking).
    """

    kind: str
    reason: str
    ranges: "RegisteredRanges | None" = None
    calls: tuple[RegistrationCall, ...] = ()
    grant: RegistrationGrant | None = None

    @property
    def registered_bytes(self) -> int:
        """Bytes registered now (0 unless the transport is registered)."""
        return self.ranges.nbytes if self.ranges is not None else 0

    @property
    def registration_seconds(self) -> float:
        """Seconds spent in cudaHostRegister calls."""
        return sum(c.seconds for c in self.calls if c.op == "register")


def _timed(registrar: Registrar, op: str, chunk: Chunk, flags: int) -> RegistrationCall:
    t0 = time.perf_counter()
    try:
        code = registrar.register(chunk.address, chunk.nbytes, flags) if op == "register" \
            else registrar.unregister(chunk.address)
    except Exception as exc:  # a broken binding is a failed call, not a crash mid-rollback
        log.error("cudaHost%s %#x (%d bytes) raised %r", op.capitalize(), chunk.address, chunk.nbytes, exc)
        code = -1
    call = RegistrationCall(op, chunk.address, chunk.nbytes, int(code), time.perf_counter() - t0)
    log.info("cudaHost%s %#x %d bytes (%s): code %d in %.3f ms", op.capitalize(), chunk.address, chunk.nbytes,
             chunk.path, call.code, call.seconds * 1e3)
    if call.code != 0:
        # Reset the per-thread error a failed call leaves, so the next
        # unrelated CUDA check in torch does not raise it.
        registrar.clear_error()
    return call


def mapping_keepalive(source: Any) -> tuple:
    """What must stay referenced while ``source``'s ranges are registered:
    the source itself and the mappings (the whole-file views, each holding
    its mmap object), so the memory cannot be unmapped under the driver even
    if the source releases its own references first."""
    file_bytes = getattr(source, "file_bytes", None)
    if file_bytes is None or not hasattr(source, "regions"):
        return (source,)
    return (source, tuple(file_bytes(i) for i in range(len(source.regions()))))


class RegisteredRanges:
    """Chunks currently registered, plus references that keep their memory
    mapped (the lease and its mappings) until every chunk is unregistered,
    and the daemon's admission, released once they all are."""

    def __init__(self, registrar: Registrar, chunks: Sequence[Chunk], keepalive: Any,
                 admitted: Admitted | None = None):
        self._registrar = registrar
        self._chunks = list(chunks)
        self._keepalive = keepalive
        self._admitted = admitted
        self.calls: list[RegistrationCall] = []
        self.prefaults: list[tuple[Chunk, str, float]] = []

    @property
    def holds(self) -> Any:
        """The keep-alive (None once everything is unregistered)."""
        return self._keepalive

    @property
    def active(self) -> bool:
        """Whether any chunk is still registered."""
        return bool(self._chunks)

    @property
    def nbytes(self) -> int:
        """Bytes still registered."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The chunks still registered, in registration order."""
        return tuple(self._chunks)

    @property
    def admitted(self) -> Admitted | None:
        """The daemon's admission, until it is released (None without one)."""
        return self._admitted

    def unregister(self, *, reason: str = "unregistered") -> None:
        """Unregisters every remaining chunk, last first, then returns the
        admitted bytes to the node's budget (``reason`` is logged by the
        daemon). Retryable.

        Raises:
            UnregisterFailed: a call failed; that chunk and the ones before it
                stay registered (and the mapping stays referenced). The
                admission is NOT released: those bytes are still pinned, so
                the node's budget must keep counting them (the daemon frees
                them with the session, when this process ends and the driver
                unpins everything anyway).
        """
        while self._chunks:
            chunk = self._chunks[-1]
            call = _timed(self._registrar, "unregister", chunk, 0)
            self.calls.append(call)
            if call.code != 0:
                raise UnregisterFailed(
                    f"cudaHostUnregister {chunk.address:#x} ({chunk.nbytes} bytes of {chunk.path}): error {call.code}; "
                    f"{len(self._chunks)} range(s) stay registered and the lease stays open; retry close()"
                )
            self._chunks.pop()
        self._keepalive = None
        admitted, self._admitted = self._admitted, None
        if admitted is not None:
            admitted.release(reason)


def registration_decline_reason(capability: HostCapability, *, pin_memory: bool = True, total: int = 0,
                                limit_bytes: int = 0, writable: bool = False) -> str:
    """Why registration must not be attempted ("" = go ahead).

    The one decision rule: the backend's transport choice and the CUDA tests'
    skip rule both call it, so a platform the code declines is one the tests
    skip. ``writable``: the memory is the process's own writable memory
    (pinned staging slots, shards), which needs no read-only support.
    """
    if not pin_memory:
        return "pin_memory=False: the pin policy is disabled"
    if capability.unified_memory:
        return "unified memory: registration gains nothing"
    if not capability.host_register_supported:
        return f"host registration unsupported on {capability.platform}: {capability.reason or 'no capability'}"
    if not writable and not (capability.read_only_supported or capability.uses_host_page_tables):
        return ("read-only host registration unsupported (cudaDevAttrHostRegisterReadOnlySupported is 0): the "
                "driver would pin the read-only mapping for write, which it refuses")
    if limit_bytes and total > limit_bytes:
        return f"mapping needs {total} registered bytes, over the {limit_bytes}-byte registration limit"
    return ""


def registration_flags(capability: HostCapability, *, writable: bool = False) -> int:
    """The cudaHostRegister flags: read-only where the device supports it
    (never for writable memory: the CPU writes staging slots), always
    portable, so every CUDA context of the process sees the range as
    pinned (a registration is otherwise tied to the context current at the
    call, and a copy issued under another device's context would not be a
    pinned copy)."""
    read_only = capability.read_only_supported and not writable
    return (HOST_REGISTER_READ_ONLY if read_only else HOST_REGISTER_DEFAULT) | HOST_REGISTER_PORTABLE


def probe_decision(rows: Sequence[dict]) -> dict:
    """The transport for lease mappings that the probe matrix
    (``bench/gpu/probe.py``) supports on the machine it ran on.

    ``rows``: one per (mapping, flag, state) with ``mapping`` in
    ``file_ro`` / ``tmpfs_rw`` / ``anon``, ``flag`` in ``read_only`` /
    ``default``, and ``code`` (0 = registered). A lease maps its blobs
    ``PROT_READ`` (``file_ro``): registered with the read-only flag if that
    worked, else with the default flag if that worked, else staging
    through pinned slots (``anon`` + default: anonymous memory, what the
    staging arena registers).
    """
    def ok(mapping: str, flag: str) -> bool:
        return any(r["mapping"] == mapping and r["flag"] == flag and r["code"] == 0 for r in rows)

    if ok("file_ro", "read_only"):
        return {"transport": REGISTERED, "flags": "read_only", "why": "read-only registration of a PROT_READ file "
                "mapping succeeded"}
    if ok("file_ro", "default"):
        return {"transport": REGISTERED, "flags": "default", "why": "the default flag pinned a PROT_READ file "
                "mapping (the driver did not ask for write access)"}
    pinned = ok("anon", "default")
    return {"transport": STAGING, "flags": "", "why": "no flag registers a PROT_READ file mapping; staging slots "
            + ("are pinned (anonymous memory registers)" if pinned else "stay pageable (anonymous memory does not "
                                                                       "register either)")}


def register_regions(
    registrar: Registrar,
    capability: HostCapability,
    regions: Sequence[Region | PinRegion],
    *,
    keepalive: Any,
    pin_memory: bool = True,
    limit_bytes: int = 0,
    chunk_bytes: int = MAX_CHUNK_BYTES,
    prefault_fn: Prefault | None = default_prefault,
    broker: RegistrationBroker | None = None,
    label: str = "",
    spans: Sequence[tuple[int, int]] = (),
    writable: bool = False,
) -> TransportChoice:
    """Registers all regions, or none: THE registration entry point.

    Order: decline rule -> pre-fault every chunk (``prefault_fn``, None =
    cold) -> ask the daemon (``broker``) -> register chunk by chunk, each
    reported. Pre-faulting comes before the request so that the node's
    in-flight slot and the daemon's chunk clock (its watchdog) cover only
    the pinning, not this worker's disk reads; the driver then pins resident
    pages instead of reading them from disk under its locks. (A refused
    request has warmed the page cache for nothing but the staging copies,
    which read the same pages.)

    Args:
        registrar: the runtime seam.
        capability: the probed platform capability (probed before any call).
        regions: the lease's mapped files, or :class:`PinRegion` s naming
            their file extents (what the daemon counts once per node).
        keepalive: the lease; the ranges hold it and its mappings
            (:func:`mapping_keepalive`) until every chunk is unregistered.
        pin_memory: the pin policy; False selects staging without a call.
        limit_bytes: ceiling on page-aligned registered bytes; 0 = none.
        chunk_bytes: largest range per call (the daemon's chunk size lowers
            it when smaller), unless one block alone is larger.
        broker: the node daemon's admission for the lease's session; None
            registers without asking (no daemon session behind the source).
        label: what the daemon logs for this registration.
        spans: ``(address, nbytes)`` of each streamed block: no chunk
            boundary falls inside one (:func:`~dlo_runtime.pin_plan.plan_chunks`).
        writable: the process's own writable memory (staging slots):
            default flag, no read-only requirement.

    Returns:
        ``registered`` with the ranges, or ``staging`` with the reason
        (including a refusal by the daemon: never an error).

    Raises:
        RegistrationAborted: a call failed and rollback failed; the returned
            ranges in the exception are still registered.
    """
    chunks = plan_chunks(regions, chunk_bytes, spans)
    total = sum(c.nbytes for c in chunks)
    reason = registration_decline_reason(capability, pin_memory=pin_memory, total=total, limit_bytes=limit_bytes,
                                         writable=writable)
    if reason:
        log.info("host registration skipped (%s); using %s", reason, STAGING)
        return TransportChoice(STAGING, reason)
    flags = registration_flags(capability, writable=writable)
    keep = mapping_keepalive(keepalive)
    faults = _prefault_all(chunks, prefault_fn)
    admitted: Admitted | None = None
    if broker is not None:
        extents = admission_extents(pin_regions(regions), chunks)
        grant = broker.request(total, label=label, ranges=[(e.key, e.offset, e.length) for e in extents])
        if not grant.admitted:
            reason = f"host registration not admitted by the node daemon ({grant.reason}): {grant.detail}"
            log.info("%s; using %s", reason, STAGING)
            return TransportChoice(STAGING, reason, grant=grant)
        admitted = Admitted(broker, grant)
        # The daemon's chunk size bounds each call: its chunk clock (the
        # watchdog) and its progress figures count one chunk per report.
        step = grant.chunk_bytes // PAGE_SIZE * PAGE_SIZE if grant.chunk_bytes > 0 else chunk_bytes
        if step <= 0:
            reason = (f"the node daemon's registration_chunk_bytes ({grant.chunk_bytes}) is below one page "
                      f"({PAGE_SIZE} bytes)")
            admitted.release(reason)
            log.warning("%s; using %s", reason, STAGING)
            return TransportChoice(STAGING, reason, grant=grant)
        if step < chunk_bytes:
            chunks = plan_chunks(regions, step, spans)
    done: list[Chunk] = []
    calls: list[RegistrationCall] = []
    for k, chunk in enumerate(chunks):
        call = _timed(registrar, "register", chunk, flags)
        calls.append(call)
        if call.code != 0:
            return _roll_back(registrar, done, calls, keep, k, chunk, call.code, admitted)
        done.append(chunk)
        if admitted is not None:
            _report(admitted, chunk, call.seconds, k, label)
    ranges = RegisteredRanges(registrar, done, keep, admitted)
    ranges.calls.extend(calls)
    ranges.prefaults.extend(faults)
    how = "admitted by the node daemon" if admitted is not None else "no daemon session: not admission-controlled"
    what = "writable" if writable else ("read-only" if flags & HOST_REGISTER_READ_ONLY else "default-flag")
    return TransportChoice(REGISTERED, f"{len(done)} range(s), {total} bytes registered {what} ({how})", ranges,
                           tuple(calls), admitted.grant if admitted is not None else None)


def _report(admitted: Admitted, chunk: Chunk, seconds: float, k: int, label: str) -> None:
    """Reports one registered chunk, in pieces of at most the daemon's chunk
    size (a chunk holding one block larger than that is still one call)."""
    for nbytes, share in report_pieces(chunk.nbytes, seconds, admitted.grant.chunk_bytes):
        if not admitted.broker.chunk_done(admitted.grant, nbytes, share):
            # The daemon forgot the registration (it restarted, or our session
            # ended) or could not be told: the pins are real either way, so
            # carry on; only the node's accounting of them is lost.
            log.warning("registration %s: the daemon did not record chunk %d; continuing", label or "(unlabelled)", k)
            return
def _prefault_all(chunks: Sequence[Chunk], prefault_fn: Prefault | None) -> list[tuple[Chunk, str, float]]:
    """Pre-faults every chunk (None = cold: nothing); returns (chunk, how,
    seconds) per chunk."""
    faults: list[tuple[Chunk, str, float]] = []
    if prefault_fn is None:
        return faults
    for chunk in chunks:
        t0 = time.perf_counter()
        how = prefault_fn(chunk.address, chunk.nbytes)
        faults.append((chunk, how, time.perf_counter() - t0))
        log.info("prefault %#x %d bytes (%s): %s in %.3f ms", chunk.address, chunk.nbytes, chunk.path, how,
                 faults[-1][2] * 1e3)
    return faults


def _roll_back(registrar: Registrar, done: list[Chunk], calls: list[RegistrationCall], keepalive: Any,
               k: int, failed: Chunk, code: int, admitted: Admitted | None) -> TransportChoice:
    """Unregisters ``done`` after range ``k`` failed; staging if clean.

    A clean rollback returns the admitted bytes to the node's budget. A
    failed one keeps them admitted (the ranges carry the admission, released
    when a later retry of ``unregister()`` succeeds): those bytes are still
    pinned, and releasing them would let other workers pin past the budget.
    """
    ranges = RegisteredRanges(registrar, done, keepalive, admitted)
    why = f"cudaHostRegister failed at range {k} ({failed.path}, error {code})"
    try:
        ranges.unregister(reason=f"{why}; rolled back")
    except UnregisterFailed as exc:
        calls.extend(ranges.calls)
        raise RegistrationAborted(
            f"cudaHostRegister failed at range {k} ({failed.path} @ {failed.address:#x}, error {code}) and rollback "
            f"failed ({exc}); {ranges.nbytes} bytes stay registered, so the lease stays open: startup aborted",
            ranges,
        ) from None
    calls.extend(ranges.calls)
    reason = f"{why}; {len(done)} range(s) rolled back"
    log.warning("%s; using %s", reason, STAGING)
    return TransportChoice(STAGING, reason, None, tuple(calls), admitted.grant if admitted is not None else None)


def choose_transport(
    registrar: Registrar,
    capability: HostCapability,
    source: Any,
    *,
    pin_memory: bool,
    registration_limit_gib: float,
    chunk_bytes: int = MAX_CHUNK_BYTES,
    prefault_fn: Prefault | None = default_prefault,
    spans: Sequence[tuple[int, int]] = (),
) -> TransportChoice:
    """Picks the transport for a backend.

    Args:
        source: the lease (MappedArtifact API) or None for ordinary tensors.
            A lease bound to a daemon session (``source.session``) registers
            through that daemon's admission (:func:`broker_for`). A
            :class:`~dlo_runtime.pin_plan.PinSource` (the checkpoint
            mapping) names its own ranges; a lease registers its files whole.
        spans: ``(address, nbytes)`` of each streamed block (chunks are
            cut between blocks).

    Raises:
        RegistrationAborted: see :func:`register_regions`.
    """
    if source is None:
        return TransportChoice(ORDINARY, "no lease: blocks packed once into host buffers")
    if capability.unified_memory:
        log.warning("device shares one memory pool with the host (unified memory): offload frees nothing; "
                    "staging and registration skipped")
        return TransportChoice(UNIFIED, "unified memory: staging and registration skipped")
    limit = int(registration_limit_gib * GIB)
    key = getattr(source, "key", "")
    regions = source.registration_regions() if isinstance(source, PinSource) else source.regions()
    return register_regions(registrar, capability, regions, keepalive=source, pin_memory=pin_memory,
                            limit_bytes=limit, chunk_bytes=chunk_bytes, prefault_fn=prefault_fn,
                            broker=broker_for(source), label=f"lease {key[:12]}" if key else "checkpoint mapping",
                            spans=spans)
