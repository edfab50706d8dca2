"""Background scrub: low-rate deep verification of unleased artifacts.

Bit rot and stray writes are found when a worker maps corrupt weights, unless
someone looks first. With ``scrub_bytes_per_s > 0`` a thread walks the
published artifacts (least recently scrubbed first), skips leased ones,
re-hashes each with ``store.verify`` and quarantines any that fail, so the
next worker gets a clean miss (and republishes) instead of wrong numbers.

The rate is an average: after verifying an artifact of N bytes the thread
waits N / rate seconds before the next one, so the scrub takes at most that
share of the disk's bandwidth over time. A full pass is followed by a pause of
at least ``MIN_PASS_INTERVAL_S``.

Deep verification on demand is paced too: :class:`ReportedVerify` runs the
verification a worker's ReportCorruption asks for at most once at a time per
key, shares it among concurrent reports, and reuses its result for
``report_verify_interval_s`` (any runtime client may call it, and a full
re-hash costs the node's disk and CPU what the artifact weighs).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Protocol

from hwr_client.core.errors import DataLoss, FailedPrecondition, NotFound
from hwr_server.config import ServerConfig
from hwr_server.interfaces import Pins, ScrubStore, VerifyOutcome

log = logging.getLogger(__name__)

#: Seconds between the start of two full passes (at least).
MIN_PASS_INTERVAL_S = 3600.0


class Scrubber:
    """The background scrub component.

    Args:
        config: ServerConfig (``scrub_bytes_per_s``; 0 = off).
        store: what the scrub needs of the store (``keys``, ``verify``,
            ``quarantine``).
        leases: which keys are leased (``pinned_keys``): never scrubbed.
        pass_interval_s: seconds between the starts of two full passes.
    """

    def __init__(self, config: ServerConfig, store: ScrubStore, leases: Pins, *,
                 pass_interval_s: float = MIN_PASS_INTERVAL_S):
        self.rate = int(config.scrub_bytes_per_s or 0)
        self.store = store
        self.leases = leases
        self.pass_interval_s = pass_interval_s
        self._last: dict[str, float] = {}  # key -> monotonic time of its last scrub
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_total = 0
        self.artifacts_total = 0
        self.corrupt_total = 0
        self.passes_total = 0
        self.skipped_leased_total = 0

    @property
    def enabled(self) -> bool:
        """True when ``scrub_bytes_per_s`` > 0."""
        return self.rate > 0

    def _pinned(self) -> set[str]:
        return set(self.leases.pinned_keys())

    def scrub_one(self, key: str) -> int:
        """Verifies one artifact unless leased; quarantines it if corrupt.

        Returns:
            Bytes re-hashed (0 when skipped).
        """
        if key in self._pinned():
            self.skipped_leased_total += 1
            return 0
        problems: list[str]
        bad: tuple[str, ...] = ()
        try:
            result = self.store.verify(key)
            ok, problems, nbytes = bool(result.ok), list(result.problems), int(result.bytes_checked)
            bad = tuple(result.bad_blobs)
        except DataLoss as exc:
            ok, problems, nbytes = False, [str(exc)], 0
        except (NotFound, FailedPrecondition):
            return 0  # deleted or already quarantined meanwhile
        self._last[key] = time.monotonic()
        self.artifacts_total += 1
        self.bytes_total += nbytes
        if not ok:
            self.corrupt_total += 1
            log.error("scrub: artifact %s is corrupt: %s", key[:16], "; ".join(problems[:5]))
            self._quarantine(key, problems, bad)
        return nbytes

    def _quarantine(self, key: str, problems: list[str], bad: tuple[str, ...]) -> None:
        if key not in set(self.store.keys()):
            return  # someone else quarantined or deleted it meanwhile
        reason = "scrub: " + (problems[0] if problems else "verification failed")
        try:
            self.store.quarantine(key, reason, bad_blobs=bad)
        except (NotFound, FailedPrecondition) as exc:
            log.info("scrub: quarantine of %s not needed: %s", key[:16], exc)

    def run_pass(self) -> int:
        """One pass over the published artifacts, paced at ``rate``.

        Returns:
            Artifacts verified in this pass.
        """
        keys = sorted(self.store.keys(), key=lambda k: (self._last.get(k, 0.0), k))
        done = 0
        for key in keys:
            if self._stop.is_set():
                break
            try:
                nbytes = self.scrub_one(key)
            except Exception:  # noqa: BLE001 - one bad artifact must not end the scrub
                log.exception("scrub: verifying %s failed", key[:16])
                continue
            done += nbytes > 0
            # Pace: an event wait (stop() is prompt) of the time these bytes
            # "cost" at the configured rate.
            if nbytes and self._stop.wait(nbytes / self.rate):
                break
        self.passes_total += 1
        live = set(keys)
        for k in [k for k in self._last if k not in live]:
            del self._last[k]
        return done

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run_pass()
            except Exception:  # noqa: BLE001 - keep scrubbing later
                log.exception("scrub: pass failed")
            self._stop.wait(max(1.0, self.pass_interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Starts the scrub thread if ``scrub_bytes_per_s`` > 0."""
        if self.enabled and self._thread is None:
            log.info("scrub: verifying unleased artifacts at %d bytes/s", self.rate)
            self._thread = threading.Thread(target=self._loop, name="hwr-scrub", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the scrub thread; an artifact being verified finishes first."""
        # Also cuts the pacing wait short: the thread checks _stop there.
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stats(self) -> dict[str, float]:
        """Scrub counters and the configured rate."""
        return {
            "hwr_scrub_bytes_total": self.bytes_total,
            "hwr_scrub_artifacts_total": self.artifacts_total,
            "hwr_scrub_corrupt_total": self.corrupt_total,
            "hwr_scrub_passes_total": self.passes_total,
            "hwr_scrub_rate_bytes_per_second": self.rate,
        }


# -- verification on a worker's report -------------------------------------------------


class ReportStore(Protocol):
    """What :class:`ReportedVerify` needs of the store."""

    def get(self, key: str) -> tuple[Any, list[str]]: ...
    def verify(self, key: str) -> VerifyOutcome: ...
    def quarantine(self, key: str, reason: str, *, bad_blobs: tuple[str, ...] = ()) -> str: ...
    def quarantined(self, key: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ReportOutcome:
    """What a verification on report found: whether it quarantined the
    artifact, every problem, and whether this caller shared a verification
    another report started (or one that ended less than the interval ago)."""

    quarantined: bool
    problems: tuple[str, ...]
    shared: bool = False


class _Flight:
    """One verification in progress; its reports wait on ``done``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.outcome: ReportOutcome | None = None
        self.error: BaseException | None = None


class ReportedVerify:
    """ReportCorruption's deep verification, throttled per key: at most one
    in flight (concurrent reports wait for it and share its result), and
    after one ends its result answers reports of the same published artifact
    for ``interval_s`` seconds instead of a new re-hash.

    Args:
        store: the store (``get``, ``verify``, ``quarantine``).
        interval_s: ``ServerConfig.report_verify_interval_s``; 0 re-verifies
            on every report that is not concurrent with another.
        clock: monotonic seconds (a seam for tests).
    """

    def __init__(self, store: ReportStore, interval_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.interval_s = float(interval_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        #: key -> (manifest object verified, when it ended, outcome): a
        #: republished artifact is a new manifest object and is verified anew.
        self._recent: dict[str, tuple[object, float, ReportOutcome]] = {}
        self.verifications_total = 0
        self.shared_total = 0

    def report(self, key: str) -> ReportOutcome:
        """Verifies ``key`` (or shares a verification of it) and quarantines
        it if it is corrupt.

        A report of an artifact that is quarantined already (by a report
        whose verification just ended, by scrub or by ``hwr verify``) answers
        "quarantined" without a re-hash: what the reporter asked for is done.
        Without this, a report arriving just after a shared verification
        quarantined the artifact would get FAILED_PRECONDITION while the
        reports before it heard "quarantined".

        Raises:
            NotFound: not published and not quarantined.
        """
        try:
            manifest, _ = self.store.get(key)
        except FailedPrecondition:
            entry = self.store.quarantined(key)
            if entry is None:
                raise
            with self._lock:
                self.shared_total += 1
            return ReportOutcome(True, (f"quarantined already ({entry.reason}) in quarantine/{entry.entry}",), shared=True)
        with self._lock:
            recent = self._recent.get(key)
            if recent is not None and recent[0] is manifest and self.clock() - recent[1] < self.interval_s:
                self.shared_total += 1
                return dataclasses.replace(recent[2], shared=True)
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            # Waits for the verification another report started: one re-hash
            # answers every report that arrives while it runs.
            flight.done.wait()
            with self._lock:
                self.shared_total += 1
            if flight.error is not None:
                raise flight.error
            assert flight.outcome is not None
            return dataclasses.replace(flight.outcome, shared=True)
        try:
            flight.outcome = self._verify(key)
            return flight.outcome
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
                now = self.clock()
                self._recent = {k: v for k, v in self._recent.items() if now - v[1] < self.interval_s}
                if flight.outcome is not None and self.interval_s > 0:
                    self._recent[key] = (manifest, now, flight.outcome)
            # Only after the result is recorded: a waiter woken earlier could
            # find neither the flight nor the result and verify again.
            flight.done.set()

    def _verify(self, key: str) -> ReportOutcome:
        with self._lock:
            self.verifications_total += 1
        result = self.store.verify(key)
        if result.ok:
            log.info("report: artifact %s verified intact (%d bytes re-hashed)", key[:12], result.bytes_checked)
            return ReportOutcome(False, ())
        self.store.quarantine(key, "reported-corrupt", bad_blobs=tuple(result.bad_blobs))
        return ReportOutcome(True, tuple(result.problems))
