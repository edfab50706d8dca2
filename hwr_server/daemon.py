"""The daemon process: lock, bind, recover, serve, shut down.

Start-up order (each step's reason in a comment at the step):
 1. lock the root, then the socket paths — before any bind;
 2. build components (store, leases, sources, gc, scrub, metrics);
 3. bind both sockets with restrictive modes, health NOT_SERVING, rpcs
    answer UNAVAILABLE;
 4. recovery (store.recover) and component start();
 5. health SERVING, sd_notify READY=1.
Shutdown (SIGTERM/SIGINT): health NOT_SERVING, sd_notify STOPPING=1, stop
accepting, let in-flight calls finish within ``shutdown_grace_s``, stop
components in reverse order, release locks, exit 0.
"""

from __future__ import annotations

import concurrent.futures
import grp
import importlib
import logging
import os
import signal
import socket as pysocket
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hwr_client.core.defaults import MESSAGE_OPTIONS
from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_server import servicer
from hwr_server.config import ServerConfig
from hwr_server.hashing import tune_allocator
from hwr_server.lock import InstanceLock

log = logging.getLogger(__name__)

#: (attribute, module, class, constructor args by attribute name), in
#: construction order; stop() runs in reverse.
COMPONENTS = (
    ("store", "hwr_server.store", "Store", ("config",)),
    ("leases", "hwr_server.leases", "LeaseManager", ("config", "store")),
    ("sources", "hwr_server.sources", "SourceCache", ("config",)),
    ("gc", "hwr_server.gc", "Collector", ("config", "store", "leases")),
    ("scrub", "hwr_server.scrub", "Scrubber", ("config", "store", "leases")),
    ("metrics", "hwr_server.metrics", "Metrics", ("daemon",)),
)
_SERVICES = ("", "hwr.v1.Runtime", "hwr.v1.Admin")


def _optional_module(name: str) -> Any:
    """The module, or None while it does not exist yet (other import
    errors propagate: a broken component must not be silently skipped)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


class Daemon:
    """One running ``hwr serve``. Components are attributes (None when their
    module is absent); handlers receive this object."""

    def __init__(self, config: ServerConfig):
        self.config = config.resolved().validate()
        self.root = self.config.root
        self.ready = False
        self.started_unix = time.time()
        self.recovery_seconds = 0.0
        self.store = self.leases = self.sources = self.gc = self.scrub = self.metrics = None
        self._locks: list[InstanceLock] = []
        self._servers: list[grpc.Server] = []
        self._bound: list[str] = []
        self._health: list[health.HealthServicer] = []
        self._stop = threading.Event()
        self._notifier: Any = None

    # -- start ---------------------------------------------------------------

    def start(self, environ: dict[str, str] | None = None) -> None:
        """Runs start-up steps 1–5; raises on any failure (nothing bound)."""
        cfg = self.config
        os.makedirs(cfg.root, mode=0o755, exist_ok=True)
        # 1. Locks before binding: a second daemon must fail here, before
        #    grpcio would silently steal the first one's socket path.
        self._locks.append(InstanceLock(os.path.join(cfg.root, "hwr.lock"), f"store root {cfg.root}").acquire())
        for path in (cfg.socket, cfg.admin_socket):
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
            self._locks.append(InstanceLock(path + ".lock", f"socket {path}").acquire())
        # 2. Components.
        self._build_components()
        sdnotify = _optional_module("hwr_server.sdnotify")
        if sdnotify is not None:
            self._notifier = sdnotify.Notifier.from_environ(environ if environ is not None else {})
        # 3. Bind; rpcs answer UNAVAILABLE and health NOT_SERVING until ready.
        self._bind(cfg.socket, admin=False, mode=0o660, group=cfg.socket_group)
        self._bind(cfg.admin_socket, admin=True, mode=0o600, group="")
        # 4. Recovery: the index must reflect the disk before any call is served.
        t0 = time.monotonic()
        if self.store is not None:
            report = self.store.recover()
            log.info("recovery: %s", report)
        for name in self._component_names():
            comp = getattr(self, name)
            if hasattr(comp, "start"):
                comp.start()
        self.recovery_seconds = time.monotonic() - t0
        # 5. Ready.
        self.ready = True
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self._notifier is not None:
            self._notifier.ready()
        log.info("serving %s on %s (admin %s) after %.3f s recovery", cfg.root, cfg.socket, cfg.admin_socket,
                 self.recovery_seconds)

    def _component_names(self) -> list[str]:
        return [attr for attr, *_ in COMPONENTS if getattr(self, attr) is not None]

    def _build_components(self) -> None:
        for attr, module_name, cls_name, arg_names in COMPONENTS:
            module = _optional_module(module_name)
            if module is None:
                log.debug("component %s: module %s not present", attr, module_name)
                continue
            args = [self if a == "daemon" else getattr(self, a, None) for a in arg_names]
            setattr(self, attr, getattr(module, cls_name)(*args))

    def _bind(self, path: str, *, admin: bool, mode: int, group: str) -> None:
        _refuse_live_socket(path)
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=self.config.grpc_threads,
                                                  thread_name_prefix="hwr-admin" if admin else "hwr-rpc"),
            options=[*MESSAGE_OPTIONS,
                     # One listener per path; never share a live path.
                     ("grpc.so_reuseport", 0)],
        )
        servicer.add_to_server(server, self, admin=admin)
        hs = health.HealthServicer()
        # grpc's HealthServicer answers SERVING for "" until told otherwise;
        # say NOT_SERVING before the first connection can be accepted, or a
        # client could see SERVING while rpcs still answer UNAVAILABLE.
        for service in _SERVICES:
            hs.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        # umask 0177 while binding: the socket file is created 0600, never
        # briefly wider than intended; we widen the runtime socket below.
        old = os.umask(0o177)
        try:
            port = server.add_insecure_port(f"unix:{path}")
            server.start()
        finally:
            os.umask(old)
        if port == 0:
            raise FailedPrecondition(f"socket {path}: could not bind")
        if group:
            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except KeyError:
                raise InvalidArgument(f"socket_group {group!r}: no such group") from None
        os.chmod(path, mode)
        self._servers.append(server)
        self._bound.append(path)
        self._health.append(hs)

    def _set_health(self, status: int) -> None:
        for hs in self._health:
            for service in _SERVICES:
                hs.set(service, status)

    # -- run / stop ------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return {"hwr_recovery_seconds": self.recovery_seconds, "hwr_uptime_seconds": time.time() - self.started_unix}

    def request_stop(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        """Blocks until request_stop() (the signal handler calls it)."""
        while not self._stop.wait(1.0):
            pass

    def shutdown(self) -> None:
        """Shutdown steps; safe to call after a partial start."""
        self.ready = False
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._notifier is not None:
            self._notifier.stopping()
        # Long-lived session streams would otherwise hold the grace period
        # open; components that own such streams end them here.
        for name in self._component_names():
            comp = getattr(self, name)
            if hasattr(comp, "begin_shutdown"):
                comp.begin_shutdown()
        # Stop accepting; in-flight calls get the grace period to finish.
        events = [s.stop(self.config.shutdown_grace_s) for s in self._servers]
        for e in events:
            e.wait()
        for name in reversed(self._component_names()):
            comp = getattr(self, name)
            if hasattr(comp, "stop"):
                try:
                    comp.stop()
                except Exception:  # noqa: BLE001 - keep shutting the others down
                    log.exception("component %s failed to stop", name)
        # Only the paths WE bound: a daemon that failed its lock must never
        # remove the socket of the daemon that holds it.
        for path in self._bound:
            _unlink_quietly(path)
        for lock in reversed(self._locks):
            lock.release()
        if self._notifier is not None and hasattr(self._notifier, "close"):
            self._notifier.close()
        if self._bound:
            log.info("stopped")


def _refuse_live_socket(path: str) -> None:
    """A path that accepts connections belongs to a live server: refuse.
    A stale file (nobody listening) from a crashed daemon is removed."""
    if not os.path.exists(path):
        return
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        _unlink_quietly(path)
        return
    except OSError:
        pass
    else:
        raise FailedPrecondition(f"socket {path}: another server is listening on it")
    finally:
        probe.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def serve(config: ServerConfig, environ: dict[str, str]) -> int:
    """Runs a daemon until SIGTERM/SIGINT; returns the exit code."""
    # Process-wide malloc settings for payload buffers (see tune_allocator):
    # applied by the daemon process only, never by a library user of Store.
    tune_allocator()
    daemon = Daemon(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    try:
        daemon.start(environ)
    except Exception:
        daemon.shutdown()
        raise
    daemon.wait()
    daemon.shutdown()
    return 0
