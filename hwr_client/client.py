"""The client a worker (or the CLI) uses to talk to the node daemon.

``connect()`` opens the runtime channel; admin calls open the admin channel
lazily. Each verb is implemented in the module of its concept
(``publish``, ``lease``, ``resolve``, ``sources``); this class holds the
channels and the process's session, and failed calls become
:mod:`hwr_client.core.errors` classes in :mod:`hwr_client.channel`.

Layers (no cycle): ``channel`` at the bottom; ``session`` on it; ``lease``,
``publish``, ``sources`` and ``resolve`` on those; this module on top. None
of them imports this one.

Example:
    >>> import hwr_client                                    # doctest: +SKIP
    >>> client = hwr_client.connect()                        # doctest: +SKIP
    >>> report = client.publish(identity, {"blocks.0.w": w}) # doctest: +SKIP
    >>> with client.acquire(report.key) as lease:            # doctest: +SKIP
    ...     weights = lease.tensors()
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Self, Sequence

import grpc

from hwr_client.channel import DEFAULT_TIMEOUT_S, RuntimeChannel, default_socket, open_channel
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.digests import SourceDigest
from hwr_client.core.errors import Internal, Unavailable, from_rpc_error
from hwr_client.core.identity import Identity
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import FILE_TARGET_BYTES
from hwr_client.resolve import Mode, PublishAfterLoadReport, Resolution
from hwr_client.resolve import publish_after_load as _publish_after_load
from hwr_client.resolve import resolve as _resolve
from hwr_client.session import Session
from hwr_client.sources import resolve_sources as _resolve_sources

if TYPE_CHECKING:  # torch-heavy modules: imported by the verbs that need them
    import torch

    from hwr_client.lease import Lease
    from hwr_client.publish import PublishReport

__all__ = ["Client", "connect"]

_session_lock = threading.Lock()


def _reinit_after_fork() -> None:
    # A lock copied into the child while another parent thread held it would
    # stay locked forever; the child starts with a fresh one.
    global _session_lock
    _session_lock = threading.Lock()


os.register_at_fork(after_in_child=_reinit_after_fork)


class Client(RuntimeChannel):
    """A connection to one node daemon. Thread-safe; one per process is
    enough (leases share its session).

    Args:
        socket: runtime socket path; default ``HWR_SOCKET`` or the daemon's
            default path.
        admin_socket: admin socket path; default ``HWR_ADMIN_SOCKET`` or
            the daemon's default, opened on the first admin call.
    """

    def __init__(self, socket: str | None = None, *, admin_socket: str | None = None):
        super().__init__(socket)
        self._admin_socket = admin_socket
        self._admin: pb_grpc.AdminStub | None = None
        self._admin_channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        # The process's session, opened by the first acquire (see session()).
        self._session: Session | None = None

    # -- plumbing -----------------------------------------------------------

    @property
    def admin(self) -> pb_grpc.AdminStub:
        """Admin stub on the admin socket (read-only admin calls also work on
        the runtime socket: see :attr:`reader`)."""
        # Two threads making their first admin call must share one channel.
        with self._lock:
            if self._admin is None:
                self._admin_channel = open_channel(self._admin_socket or default_socket(admin=True))
                self._admin = pb_grpc.AdminStub(self._admin_channel)
            return self._admin

    @property
    def reader(self) -> pb_grpc.AdminStub:
        """Admin stub on the runtime socket, for read-only calls (list,
        inspect, leases, stats, sources) that need no admin rights."""
        return pb_grpc.AdminStub(self.channel)

    def session(self) -> Session:
        """This client's session for THIS process, opened on first use.

        A session inherited through fork (another pid) is abandoned, never
        used or closed: its stream belongs to the parent; the child opens
        its own.

        Raises:
            Unavailable: the daemon did not answer the session open in time.
        """
        session = self._session
        if session is not None and session.usable:
            return session
        # One session per client: two threads acquiring at once must not
        # both open a stream (the loser's leases would sit on a session
        # nobody tracks).
        with _session_lock:
            session = self._session
            if session is None or not session.usable:
                session = Session(self.socket)
                self._session = session
            return session

    def close(self) -> None:
        """Ends the session (releasing its leases) and closes the channels."""
        session, self._session = self._session, None
        if session is not None:
            session.close()
        super().close()
        if self._admin_channel is not None:
            self._admin_channel.close()

    def __enter__(self) -> Self:
        return self

    # -- verbs ---------------------------------------------------------------

    def lookup(self, key: str) -> Manifest:
        """The manifest of a published artifact.

        Raises:
            NotFound: no artifact with that key.
            FailedPrecondition: the artifact is quarantined.
        """
        reply = self.call(self.runtime.Lookup, pb.LookupRequest(key=key))
        return Manifest.from_json(reply.manifest_json, what=f"artifact {key[:12]} manifest")

    def publish(
        self,
        identity: Identity | Mapping[str, Any] | str,
        tensors: Mapping[str, torch.Tensor],
        *,
        blocks: Sequence[Sequence[str]] | None = None,
        ordered: bool = True,
        file_target_bytes: int = FILE_TARGET_BYTES,
        progress: Callable[[int, int], None] | None = None,
        seed: int | None = None,
        handoff: bool = True,
        before_commit: Callable[[], None] | None = None,
        cancel: threading.Event | None = None,
        annotations: Mapping[str, Any] | None = None,
    ) -> PublishReport:
        """Publishes CPU tensors as a final-layout artifact; see
        :func:`hwr_client.publish.publish` for the options (``handoff``,
        ``before_commit``, ``cancel`` among them) and errors."""
        # hwr_client.publish imports torch: imported on use, so importing the
        # client (the CLI, admin tools) does not load torch.
        from hwr_client.publish import publish

        return publish(self, identity, tensors, blocks=blocks, ordered=ordered,
                       file_target_bytes=file_target_bytes, progress=progress, seed=seed, handoff=handoff,
                       before_commit=before_commit, cancel=cancel, annotations=annotations)

    def acquire(self, key: str, *, verify: str = "none") -> Lease:
        """Takes a lease on a published artifact and maps it; see
        :func:`hwr_client.lease.acquire` for the verify modes and errors."""
        # hwr_client.lease imports torch (views): imported on use, as above.
        from hwr_client.lease import acquire

        return acquire(self, key, verify=verify)

    def resolve(self, identity: Identity | Mapping[str, Any] | str, *, mode: Mode | str = Mode.PREFERRED,
                verify: str = "none") -> Resolution:
        """Resolves an identity to a lease or a fallback decision; see
        :func:`hwr_client.resolve.resolve`."""
        return _resolve(self, identity, mode=mode, verify=verify)

    def publish_after_load(
        self,
        identity: Identity | Mapping[str, Any] | str,
        tensors: Mapping[str, torch.Tensor],
        *,
        blocks: Sequence[Sequence[str]] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> PublishAfterLoadReport:
        """Publishes after a canonical load without ever raising; see
        :func:`hwr_client.resolve.publish_after_load`."""
        return _publish_after_load(self, identity, tensors, blocks=blocks, progress=progress)

    def transfer(self, method: Callable[..., Any], request: Any, *,
                 progress: Callable[[pb.TransferProgress], None] | None = None,
                 stall_s: float | None = None) -> pb.TransferDone:
        """Runs a transfer rpc (Push, Pull, PullOnMiss) to its end, handing
        each progress event to ``progress``. No deadline on the whole call
        (a large pull legitimately takes minutes; the daemon streams
        progress while bytes flow); ``stall_s`` bounds the time without any
        event instead: past it the call is cancelled (the daemon's transfer
        goes on and commits whole or not at all).

        Raises:
            HwrError: the daemon's error class (NotFound, DataLoss, Unavailable, ...).
            Unavailable: no event for ``stall_s`` seconds, naming the stall.
        """
        call = method(request, timeout=None)
        heard = threading.Event()
        over = threading.Event()
        stalled = [False]

        def watch() -> None:
            # One wait per event: an event resets the bound.
            while heard.wait(stall_s):
                heard.clear()
                if over.is_set():
                    return
            if not over.is_set():
                stalled[0] = True
                call.cancel()

        if stall_s is not None:
            threading.Thread(target=watch, name="hwr-transfer-watch", daemon=True).start()
        try:
            for ev in call:
                heard.set()
                if ev.WhichOneof("kind") == "done":
                    return ev.done
                if progress is not None:
                    progress(ev.progress)
        except grpc.RpcError as err:
            if stalled[0]:
                raise Unavailable(f"{type(request).__name__.removesuffix('Request')}: no progress from the daemon "
                                  f"for {stall_s:g} s (the registry or the daemon stalled); the caller gave up, the "
                                  "daemon's transfer goes on and commits whole or not at all") from None
            raise from_rpc_error(err) from None
        finally:
            over.set()
            heard.set()  # wakes the watcher so that it ends now
        raise Internal("transfer: the daemon ended the stream without a result")

    def pull_on_miss(self, key: str, *, progress: Callable[[pb.TransferProgress], None] | None = None,
                     stall_s: float | None = DEFAULT_TIMEOUT_S) -> pb.TransferDone:
        """Asks the daemon to pull ``key`` from its configured remote (the
        PullOnMiss rpc) and waits while progress flows: ``stall_s`` seconds
        without progress (default: the deadline of every unary call) end
        the wait with Unavailable; see :meth:`transfer` for the other errors
        (NotFound: no remote, or the registry lacks it)."""
        return self.transfer(self.runtime.PullOnMiss, pb.PullOnMissRequest(key=key), progress=progress,
                             stall_s=stall_s)

    def resolve_sources(self, paths: Sequence[str | os.PathLike[str]], *,
                        threads: int | None = None) -> list[SourceDigest]:
        """Content ids of canonical files, from the daemon's cache when it
        can; see :func:`hwr_client.sources.resolve_sources`."""
        return _resolve_sources(self, paths, threads=threads)


def connect(socket: str | None = None, *, admin_socket: str | None = None) -> Client:
    """Connects to the node daemon (lazily: the first call dials).

    Args:
        socket: runtime socket path; default ``HWR_SOCKET`` or the daemon's
            default path.
        admin_socket: admin socket path for admin calls.

    Example:
        >>> client = connect("/run/hwr/hwr.sock")  # doctest: +SKIP
    """
    return Client(socket, admin_socket=admin_socket)
