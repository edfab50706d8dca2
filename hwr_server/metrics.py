"""Prometheus metrics: every component's ``stats()`` turned into metric
families at scrape time.

Components report flat dicts whose keys are Prometheus names with labels
written inline (``hwr_store_bytes{state="published"}``). :meth:`Metrics.gather`
merges them (the one merge: GetStats calls it too) and :func:`families`
parses those keys and groups them into families (``*_total`` are counters,
everything else gauges), so a component adds a figure by adding a key, and
``hwr stats --json`` (GetStats) and Prometheus always show the same numbers.

Exposition, both optional and independent:

- ``metrics_listen = "127.0.0.1:9464"``: an HTTP endpoint on a LOOPBACK
  address only (the daemon has no network listener; a non-loopback address
  is refused at start with a clear error);
- ``metrics_textfile = "/var/lib/node_exporter/textfile/hwr.prom"``: written
  every ``metrics_textfile_interval_s`` atomically (temp file + rename) for
  node_exporter's textfile collector.

The registry is our own ``CollectorRegistry``, never prometheus_client's
global one, so nothing else in the process leaks into the output.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import start_http_server

from hwr_client.core.errors import InvalidArgument
from hwr_server.config import ServerConfig
from hwr_server.interfaces import StatsSource

if TYPE_CHECKING:
    from hwr_server.store.records import StoreFigures

log = logging.getLogger(__name__)

_KEY = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')

#: HELP text of the figures we know; others get a generic one.
HELP = {
    "hwr_store_bytes": "Bytes in the store by state (published, quarantined, staging, deleted_mapped).",
    "hwr_artifacts": "Artifacts by state.",
    "hwr_publications": "Publications by outcome.",
    "hwr_publication_bytes": "Payload bytes received by publications.",
    "hwr_publication_seconds": "Seconds spent in publications.",
    "hwr_verify_failures": "Verifications that found corruption.",
    "hwr_leases_active": "Leases currently held.",
    "hwr_sessions_active": "Client sessions currently open.",
    "hwr_source_cache_hits": "Source-digest requests answered from the cache.",
    "hwr_source_cache_misses": "Source-digest requests that hashed the file.",
    "hwr_gc_runs": "Garbage collections executed.",
    "hwr_gc_bytes_freed": "Bytes unlinked by garbage collection.",
    "hwr_recovery_seconds": "Seconds the last start-up recovery took.",
    "hwr_uptime_seconds": "Seconds since the daemon started.",
    "hwr_scrub_bytes": "Bytes re-hashed by the background scrub.",
    "hwr_registration_budget_bytes": "Node-wide budget of host bytes registered (pinned) for the device.",
    "hwr_registration_admitted_bytes": "Host bytes pinned for registration on the node now, each file byte once.",
    "hwr_registration_requested_bytes": "Sum of the admitted registrations' bytes (pages shared by workers count "
                                        "once per worker).",
    "hwr_registration_worker_bytes": "Host bytes admitted for registration per worker (session, pid).",
    "hwr_registrations_in_flight": "Registrations admitted whose chunks are not all reported yet.",
    "hwr_registration_admissions": "Registration requests by outcome (admitted or the refusal reason).",
    "hwr_registration_chunks": "Registered chunks reported by workers.",
    "hwr_registration_chunk_bytes": "Bytes of the registered chunks reported by workers.",
    "hwr_registration_chunk_seconds": "Seconds the reported registration chunks took.",
    "hwr_registration_last_chunk_gbps": "GB/s of the last reported registration chunk.",
    "hwr_registration_watchdog_stalls": "Chunks that ran past registration_chunk_timeout_s.",
    "hwr_registration_watchdog_stalled": "Chunks running past the limit now (new registrations refused while > 0).",
    "hwr_registration_watchdog_stalled_seconds": "Age of the oldest stalled chunk, seconds.",
    "hwr_registrations_released": "Registrations whose bytes returned to the budget (release or session end).",
}


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    """``'a_b{x="1",y="2"}'`` -> ``('a_b', {'x': '1', 'y': '2'})``.

    Raises:
        InvalidArgument: the key is not a metric name with optional labels.
    """
    m = _KEY.match(key.strip())
    if not m:
        raise InvalidArgument(f"stats key {key!r}: expected name{{label=\"value\",...}}")
    name, body = m.group(1), m.group(2)
    labels: dict[str, str] = {}
    pos = 0
    while body is not None and pos < len(body):
        lm = _LABEL.match(body, pos)
        if not lm or lm.end() == pos:
            raise InvalidArgument(f"stats key {key!r}: malformed labels at {body[pos:]!r}")
        labels[lm.group(1)] = lm.group(2).replace('\\"', '"').replace("\\\\", "\\")
        pos = lm.end()
    return name, labels


def families(stats: Mapping[str, float]) -> list[Metric]:
    """Metric families from a flat stats dict; bad keys/values are skipped
    (and logged) so one component cannot break a scrape.

    Args:
        stats: ``{'hwr_store_bytes{state="published"}': 123.0, ...}``.

    Returns:
        One family per metric name, sorted by name.
    """
    out: dict[str, Metric] = {}
    for key, value in stats.items():
        try:
            name, labels = parse_key(key)
            value = float(value)
        except (InvalidArgument, TypeError, ValueError) as exc:
            log.warning("metrics: skipping stats key %r: %s", key, exc)
            continue
        counter = name.endswith("_total")
        base = name[: -len("_total")] if counter else name
        fam = out.get(base)
        if fam is None:
            fam = out[base] = Metric(base, HELP.get(base, f"HWR figure {base}."), "counter" if counter else "gauge")
        fam.add_sample(name, labels, value)
    return [out[k] for k in sorted(out)]


def store_stats(f: StoreFigures) -> dict[str, float]:
    """The store's figures under their GetStats / Prometheus names."""
    out = {f'hwr_publications_total{{outcome="{o}"}}': float(n) for o, n in f.publications.items()}
    out.update({
        "hwr_publication_bytes_total": float(f.publication_bytes),
        "hwr_publication_seconds_total": float(f.publication_seconds),
        "hwr_verify_failures_total": float(f.verify_failures),
        'hwr_artifacts{state="published"}': float(f.artifacts_published),
        'hwr_artifacts{state="quarantined"}': float(f.artifacts_quarantined),
        'hwr_store_bytes{state="published"}': float(f.bytes_published),
        'hwr_store_bytes{state="quarantined"}': float(f.bytes_quarantined),
        'hwr_store_bytes{state="staging"}': float(f.bytes_staging),
    })
    return out


class StoreStats:
    """The store as a :class:`~hwr_server.interfaces.StatsSource`: the store
    counts (``Store.figures``), this module names.

    Args:
        figures: the store's ``figures`` method.
    """

    def __init__(self, figures: Callable[[], StoreFigures]):
        self._figures = figures

    def stats(self) -> dict[str, float]:
        """The store's figures now, by :func:`store_stats`."""
        return store_stats(self._figures())


def merge_stats(sources: Iterable[tuple[str, StatsSource]]) -> dict[str, float]:
    """Every source's figures in one dict, later sources winning on a clash.

    A source whose ``stats()`` raises is logged and skipped, so one broken
    figure neither hides the others nor fails a scrape.

    Args:
        sources: (name for the log, component) pairs.
    """
    out: dict[str, float] = {}
    for name, component in sources:
        try:
            out.update({str(k): float(v) for k, v in component.stats().items()})
        except Exception:  # noqa: BLE001 - stats are best effort per component
            log.exception("metrics: stats of %s failed", name)
    return out


class _StatsCollector:
    """A prometheus_client custom collector calling ``gather`` per scrape."""

    def __init__(self, gather: Callable[[], Mapping[str, float]]):
        self._gather = gather

    def collect(self) -> Iterable[Metric]:
        return families(self._gather())


def check_loopback(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` / ``"[::1]:9464"`` / ``"localhost:9464"`` -> (host, port).

    Raises:
        InvalidArgument: not host:port, or the host is not a loopback address.
    """
    m = re.match(r"^\[?([^\[\]]*?)\]?:(\d+)$", listen.strip())
    if not m:
        raise InvalidArgument(f"metrics_listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host, port = m.group(1), int(m.group(2))
    addr = "127.0.0.1" if host == "localhost" else host
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidArgument(
            f"metrics_listen {listen!r}: the metrics endpoint is served on a loopback address only "
            f"(127.0.0.1 or ::1); use metrics_textfile or a local scraper/proxy to export further")
    return addr, port


class Metrics:
    """The daemon's figures: GetStats and the exposition (HTTP on loopback
    and/or a textfile).

    Args:
        config: the daemon's ServerConfig (``metrics_*``).
        sources: (name, component) pairs whose ``stats()`` are merged at every
            scrape, in this order; the daemon passes each component and itself.
        started_unix: when the daemon started, for ``hwr_uptime_seconds``
            (default: now).

    Raises:
        InvalidArgument: ``metrics_listen`` is not a loopback address.
    """

    def __init__(self, config: ServerConfig, sources: Sequence[tuple[str, StatsSource]], *,
                 started_unix: float | None = None):
        self.sources = tuple(sources)
        self.listen = check_loopback(config.metrics_listen) if config.metrics_listen else None
        self.textfile = config.metrics_textfile or ""
        self.interval_s = float(config.metrics_textfile_interval_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(self.gather))
        self.started = time.time() if started_unix is None else started_unix
        self.textfile_writes = 0
        self._server: WSGIServer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) the HTTP endpoint is bound to (port 0 resolved)."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        # An AF_INET/AF_INET6 server: the host is always a str.
        return str(host), int(port)

    def gather(self) -> dict[str, float]:
        """Every component's figures and ours in one dict: exactly what
        GetStats (``hwr stats --json``) shows and Prometheus scrapes."""
        return merge_stats([*self.sources, ("metrics", self)])

    def render(self) -> bytes:
        """The Prometheus text exposition of the current figures."""
        return generate_latest(self.registry)

    def write_textfile(self) -> None:
        """Writes the exposition to ``metrics_textfile`` atomically.

        The temp file is in the same directory so the rename is atomic: the
        textfile collector never reads a half-written file. No fsync: after a
        crash a stale or missing metrics file is harmless.
        """
        if not self.textfile:
            return
        d = os.path.dirname(os.path.abspath(self.textfile))
        tmp = os.path.join(d, f".{os.path.basename(self.textfile)}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(self.render())
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.textfile)
        self.textfile_writes += 1

    def _textfile_loop(self) -> None:
        # An event wait, not a sleep: stop() ends the loop at once.
        while not self._stop.wait(self.interval_s):
            try:
                self.write_textfile()
            except OSError as exc:
                log.warning("metrics: writing %s failed: %s", self.textfile, exc)

    def start(self) -> None:
        """Binds the loopback endpoint and starts the textfile writer."""
        if self.listen is not None:
            host, port = self.listen
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics: serving http://%s:%d/metrics", *(self.address or ("?", 0)))
        if self.textfile:
            os.makedirs(os.path.dirname(os.path.abspath(self.textfile)), exist_ok=True)
            self.write_textfile()
            self._thread = threading.Thread(target=self._textfile_loop, name="hwr-metrics", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the endpoint and the writer; writes the textfile one last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.textfile:
            try:
                self.write_textfile()
            except OSError as exc:
                log.warning("metrics: final write of %s failed: %s", self.textfile, exc)

    def stats(self) -> dict[str, float]:
        """The daemon's uptime (emitted here only) and our own counter."""
        return {"hwr_uptime_seconds": time.time() - self.started,
                "hwr_metrics_textfile_writes_total": self.textfile_writes}
