"""The daemon process: lock, bind, recover, serve, shut down.

Start-up order (each step's reason in a comment at the step):
 1. lock the root, then the socket paths — before any bind;
 2. build components (store, leases, sources, gc, scrub, metrics);
 3. bind both sockets with restrictive modes, health NOT_SERVING, rpcs
    answer UNAVAILABLE; then the peer credentials socket next to the
    runtime socket (hwr_server.access.peers);
 4. recovery (store.recover) and component start();
 5. health SERVING, sd_notify READY=1.
Threads: each socket's pool has ``grpc_threads`` threads, of which client
streams may hold at most ``admission.stream_capacity`` (the rest stay for
unary calls); gRPC's ``maximum_concurrent_rpcs`` bounds what may queue
(hwr_server.access.admission).

Shutdown (SIGTERM/SIGINT): health NOT_SERVING, sd_notify STOPPING=1, stop
accepting, let in-flight calls finish within ``shutdown_grace_s``, stop
components in reverse order, release locks, exit 0.
"""

from __future__ import annotations

import concurrent.futures
import errno
import grp
import logging
import os
import pwd
import signal
import socket as pysocket
import threading
import time
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hwr_client.core.defaults import HANDOFF_SOCKET_SUFFIX, MESSAGE_OPTIONS, PEER_SOCKET_SUFFIX
from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_server.access import peers, runtime_dir
from hwr_server.access.admission import Deadlines, StreamAdmission
from hwr_server.access.lock import InstanceLock
from hwr_server.access.trust import TrustPolicy, resolve_publishers
from hwr_server.components import Components
from hwr_server.config import ServerConfig
from hwr_server.gc.collector import Collector
from hwr_server.interfaces import Lifecycle, StatsSource
from hwr_server.leases.manager import LeaseManager
from hwr_server.metrics import Metrics, StoreStats
from hwr_server.publish.handed import leases_work
from hwr_server.publish.handoff import HandoffListener
from hwr_server.registration.admission import RegistrationAdmission
from hwr_server.remote.remote import Remote
from hwr_server.remote.signing import parse_trusted_keys
from hwr_server.rpc import servicer
from hwr_server.sdnotify import Notifier
from hwr_server.sources.cache import SourceCache
from hwr_server.store.hashing import tune_allocator
from hwr_server.store.scrub import Scrubber
from hwr_server.store.store import Store

log = logging.getLogger(__name__)

_SERVICES = ("", "hwr.v1.Runtime", "hwr.v1.Admin")
_C = TypeVar("_C", bound=Lifecycle)


class Daemon:
    """One running ``hwr serve``.

    Args:
        config: the daemon's configuration; empty paths are filled from the
            defaults and the whole is validated here.

    Raises:
        InvalidArgument: the configuration is inconsistent.
    """

    def __init__(self, config: ServerConfig):
        self.config = config.resolved().validate()
        self.root = self.config.root
        self.ready = False
        self.started_unix = time.time()
        self.recovery_seconds = 0.0
        #: Set by start() step 2; None until then (and after a failed build).
        self.components: Components | None = None
        #: Components with background work, in start order, as they are
        #: built: shutdown stops exactly these, even after a partial start.
        self._lifecycle: list[tuple[str, Lifecycle]] = []
        self._locks: list[InstanceLock] = []
        self._servers: list[grpc.Server] = []
        self._bound: list[str] = []
        self._health: list[health.HealthServicer] = []
        #: Stream caps per socket (runtime: False, admin: True); built with
        #: the components, one per socket because each has its own pool.
        self._admission: dict[bool, StreamAdmission] = {}
        self._peer_listener: peers.PeerListener | None = None
        self._stop = threading.Event()
        self._notifier: Notifier | None = None

    # -- start ---------------------------------------------------------------

    def start(self, environ: dict[str, str] | None = None) -> None:
        """Runs start-up steps 1–5; raises on any failure (nothing bound)."""
        cfg = self.config
        # 1. Locks before binding: a second daemon must fail here, before
        #    grpcio would silently steal the first one's socket path.
        self._locks.append(_lock_root(cfg.root))
        for path in (cfg.socket, cfg.admin_socket):
            runtime_dir.prepare_socket_dir(path)  # created private; refused if another user can change it
            self._locks.append(InstanceLock(path + ".lock", f"socket {path}").acquire())
        # 2. Components, after the locks: the store and the lease database
        #    are touched only by the daemon that holds the root.
        components = self.components = self._build_components()
        # The MAC key lives in the root, which only the lock holder touches.
        authority = peers.PeerAuthority(peers.load_key(cfg.root))
        peers.install(authority)
        self._notifier = Notifier.from_environ(environ if environ is not None else {})
        # 3. Bind; rpcs answer UNAVAILABLE and health NOT_SERVING until ready.
        self._bind(cfg.socket, components, admin=False, mode=0o660, group=cfg.socket_group)
        self._bind(cfg.admin_socket, components, admin=True, mode=0o600, group="")
        self._bind_peer_socket(cfg.socket + PEER_SOCKET_SUFFIX, authority, mode=0o660, group=cfg.socket_group)
        self._bind_handoff_socket(components, mode=0o660, group=cfg.socket_group)
        # 4. Recovery: the index must reflect the disk before any call is served.
        t0 = time.monotonic()
        report = components.store.recover()
        log.info("recovery: %s", report)
        for _name, comp in self._lifecycle:
            comp.start()
        self.recovery_seconds = time.monotonic() - t0
        # 5. Ready.
        self.ready = True
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._notifier.ready()
        log.info("serving %s on %s (admin %s) after %.3f s recovery", cfg.root, cfg.socket, cfg.admin_socket,
                 self.recovery_seconds)

    def _build_components(self) -> Components:
        """Builds every component and hands each the narrow interface it
        uses (hwr_server.interfaces); the one place they are wired."""
        cfg = self.config
        store = Store(cfg)
        leases = self._built("leases", LeaseManager(cfg, store))
        sources = self._built("sources", SourceCache(cfg))
        gc = self._built("gc", Collector(cfg, store, leases, fallback_hook=store.default_capacity_hook))
        # The store exists before the collector that keeps it within
        # capacity; it gets the collector's hook here, once, before recovery
        # or any publication can call it.
        store.capacity_hook = gc.capacity_hook
        scrub = self._built("scrub", Scrubber(cfg, store, leases))
        # The node's registration budget; a session's admitted bytes return
        # to it on every session end, so the hook is set here, before any
        # session can open. Liveness is LeaseManager.keepalive (a call on
        # the session proves it alive, as AcquireLease does).
        registration = self._built("registration", RegistrationAdmission(cfg, leases.keepalive))
        leases.on_session_end = registration.end_session
        # One timer thread for the first-message deadlines of both sockets.
        deadlines = self._built("deadlines", Deadlines())
        self._admission = {
            False: StreamAdmission(cfg, socket_name="runtime socket", deadlines=deadlines),
            True: StreamAdmission(cfg, socket_name="admin socket", deadlines=deadlines, per_peer=False),
        }
        # Who may take whose artifacts: trusted_publishers resolved now (an
        # unknown name refuses to start), the [remote] trusted_keys parsed.
        trust = TrustPolicy(trusted_uids=resolve_publishers(cfg.trusted_publishers),
                            trusted_keys=frozenset(parse_trusted_keys(cfg.remote.trusted_keys)),
                            trust_unrecorded=cfg.trust_unrecorded_publishers)
        if cfg.remote.registry and not cfg.remote.trusted_keys:
            log.warning("[remote] %s: no trusted_keys; pulled artifacts are trusted without a signature "
                        "(docs/trust.md)", cfg.remote.registry)
        # Push and pull read and commit through the store; no background work.
        remote = Remote(cfg, store, trust=trust)
        figures: list[tuple[str, StatsSource]] = [
            ("store", StoreStats(store.figures)), ("leases", leases), ("sources", sources), ("gc", gc),
            ("scrub", scrub), ("streams", self._admission[False]), ("registration", registration), ("remote", remote), ("daemon", self)]
        metrics = self._built("metrics", Metrics(cfg, figures, started_unix=self.started_unix))
        handoff = HandoffListener(cfg.socket + HANDOFF_SOCKET_SUFFIX)
        return Components(store, leases, sources, gc, scrub, metrics, registration, remote, trust, handoff)

    def _built(self, name: str, component: _C) -> _C:
        """Records a component with background work for start() and shutdown()."""
        self._lifecycle.append((name, component))
        return component

    def _bind(self, path: str, components: Components, *, admin: bool, mode: int, group: str) -> None:
        _refuse_live_socket(path)
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=self.config.grpc_threads,
                                                  thread_name_prefix="hwr-admin" if admin else "hwr-rpc"),
            options=[*MESSAGE_OPTIONS,
                     # One listener per path; never share a live path.
                     ("grpc.so_reuseport", 0)],
            # The backstop behind the stream caps: beyond this many rpcs in
            # flight (running or queued for a thread) gRPC answers
            # RESOURCE_EXHAUSTED without taking a thread or queueing more.
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs,
        )
        servicer.add_to_server(server, components, ready=lambda: self.ready, admin=admin,
                               admission=self._admission[admin])
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
            os.chown(path, -1, _group_id(group))
        os.chmod(path, mode)
        self._servers.append(server)
        self._bound.append(path)
        self._health.append(hs)

    def _bind_peer_socket(self, path: str, authority: peers.PeerAuthority, *, mode: int, group: str) -> None:
        """The credentials handshake socket (hwr_server.access.peers), with the
        runtime socket's mode and group: whoever may call may prove who it
        is. Its path is covered by the runtime socket's lock. A path that
        cannot be bound (e.g. over the 108-byte limit) is logged: clients
        then count as the anonymous peer, and everything else works."""
        _refuse_live_socket(path)
        listener = peers.PeerListener(path, authority)
        try:
            listener.bind(mode=mode, gid=_group_id(group) if group else -1)
        except OSError as exc:
            log.warning("peer credentials socket %s: cannot bind (%s); every client counts as the anonymous "
                        "peer (max_streams_anonymous)", path, exc.strerror or exc)
            return
        self._peer_listener = listener

    def _bind_handoff_socket(self, components: Components, *, mode: int, group: str) -> None:
        """The publications' handoff socket (hwr_server.publish.handoff), with
        the runtime socket's mode and group; its path is covered by the
        runtime socket's lock. Where it cannot serve (file leases unavailable
        on the store's filesystem, a path that cannot be bound) it is
        logged, and publications take the message transport."""
        listener = components.handoff
        assert listener is not None
        why = leases_work(components.store.staging_dir)
        if why:
            log.warning("handoff socket %s: not offered: %s; publications send their payload in messages",
                        listener.path, why)
            return
        _refuse_live_socket(listener.path)
        try:
            listener.bind(mode=mode, gid=_group_id(group) if group else -1)
        except OSError as exc:
            log.warning("handoff socket %s: cannot bind (%s); publications send their payload in messages",
                        listener.path, exc.strerror or exc)

    def _set_health(self, status: int) -> None:
        for hs in self._health:
            for service in _SERVICES:
                hs.set(service, status)

    # -- run / stop ------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The daemon's own figure; uptime is the metrics component's."""
        return {"hwr_recovery_seconds": self.recovery_seconds}

    def request_stop(self) -> None:
        """Asks wait() to return (safe from a signal handler: one Event.set)."""
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
        # open; the lease manager owns them and ends them here.
        if self.components is not None:
            self.components.leases.begin_shutdown()
        # Stop accepting; in-flight calls get the grace period to finish.
        events = [s.stop(self.config.shutdown_grace_s) for s in self._servers]
        for e in events:
            e.wait()
        if self._peer_listener is not None:
            self._peer_listener.close()  # removes only the path it bound
        if self.components is not None and self.components.handoff is not None and self.components.handoff.serving:
            self.components.handoff.close()  # removes only the path it bound
        for name, comp in reversed(self._lifecycle):
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
        if self._notifier is not None:
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


def _lock_root(root: str) -> InstanceLock:
    """Creates the store root if needed and takes its instance lock.

    Raises:
        InvalidArgument: the root cannot be created or written by this user
            (a file there, a read-only or foreign directory): one line naming
            the path, the reason and the fix, instead of a traceback.
        FailedPrecondition: another daemon holds the root.
    """
    try:
        os.makedirs(root, mode=0o755, exist_ok=True)
        # The lock file alone may be writable in a directory that is not
        # (left from an earlier owner): ask for the directory itself.
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), root)
        return InstanceLock(os.path.join(root, "hwr.lock"), f"store root {root}").acquire()
    except OSError as exc:
        elsewhere = "pass another directory (`hwr serve --root DIR`, or `root = \"DIR\"` in the config file)"
        if isinstance(exc, FileExistsError) or exc.errno == errno.ENOTDIR:
            raise InvalidArgument(f"store root {root}: it, or a path above it, is a file, not a directory; "
                                  f"{elsewhere}") from None
        user = _user_name()
        raise InvalidArgument(f"store root {root}: user {user} cannot create or write it "
                              f"({exc.strerror or exc}); {elsewhere}, or give the directory to this user "
                              f"(`chown -R {user} {root}`)") from None


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _group_id(group: str) -> int:
    """The gid of ``group``.

    Raises:
        InvalidArgument: no such group.
    """
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgument(f"socket_group {group!r}: no such group") from None


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
