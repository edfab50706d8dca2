"""Moving one artifact's layers: the parallel runner of a transfer, one
layer's resumable, hashed download into staging, and the hard link of a
blob the store already holds (:class:`hwr_server.remote.remote.Remote`
drives them; the commit is the store's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from hwr_client.core.errors import Aborted, DataLoss, NotFound, Unavailable
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.logtext import untrusted
from hwr_server.remote.httpio import RateGuard
from hwr_server.remote.registry import IO_BYTES, RegistryClient
from hwr_server.store.staging_io import pwrite_all

log = logging.getLogger(__name__)


class Counts(Protocol):
    """Progress shared by the layer threads of one transfer."""

    def add(self, nbytes: int = 0, layers: int = 0) -> None: ...


#: Disk space admitted (capacity) and preallocated ahead of a download's
#: bytes, in steps of this many bytes per layer (never the registry's
#: claimed size at once).
PREALLOCATE_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """How one pull downloads its layers.

    Attributes:
        attempts: tries per layer; each retry resumes with a Range request.
        min_rate: bytes per second a layer must keep up over each window
            (``[remote] min_rate_bytes``; 0 = no minimum).
        window_s: that window, seconds (``[remote] timeout_s``).
        admit: called with each step of bytes about to be preallocated,
            before it is (the store's capacity hook, collecting if it must).
    """

    attempts: int
    min_rate: int
    window_s: float
    admit: Callable[[int], None]


def link_stored(blob: str, path: str, size: int) -> bool:
    """Hard-links the stored blob into staging once its bytes are proved:
    a regular file of ours of the right size whose SHA-256 is its name,
    read through the descriptor that was checked, and the link made to that
    same inode. False when it is missing, a link, another size, or its bytes
    differ (rotted, rewritten): then the layer is downloaded, and the commit
    replaces the stored copy (``Store.install_blob``)."""
    name = os.path.basename(blob)
    try:
        fd, st = open_stored(blob, what=f"blob {name[:12]}")
    except (FileNotFoundError, Untrusted):
        return False
    try:
        if st.st_size != size or not _hashes_to(fd, size, name):
            log.warning("blob %s: the stored copy does not hash to its name; downloading it again", name[:12])
            return False
        os.link(blob, path, follow_symlinks=False)
        linked = os.lstat(path)
        if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
            os.unlink(path)  # renamed over since it was hashed: not the bytes proved
            return False
        return True
    except FileNotFoundError:
        return False  # collected meanwhile
    finally:
        os.close(fd)


def _hashes_to(fd: int, size: int, hexdigest: str) -> bool:
    h = hashlib.sha256()
    done = 0
    while done < size:
        block = os.pread(fd, min(IO_BYTES, size - done), done)
        if not block:
            return False  # shorter than its fstat said
        h.update(block)
        done += len(block)
    return h.hexdigest() == hexdigest


class _Layer:
    """One layer's file in staging: what was written and allocated."""

    def __init__(self, fd: int, size: int, policy: LayerPolicy):
        self.fd, self.size, self.policy = fd, size, policy
        self.written = 0
        self.allocated = 0  # admitted and preallocated; a restart keeps it (nothing admitted twice)
        self.h = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        end = self.written + len(chunk)
        if end > self.allocated:
            # A step at a time, as bytes arrive: room is made (capacity, and
            # collection if it must) for bytes that came, then preallocated,
            # so a full disk still fails early in its step, and a registry
            # that claims 900 MiB and trickles holds one step, not the claim.
            # Admitted exactly what is preallocated: the store counts the
            # allocated staging bytes, and counting them twice would evict
            # for bytes that never need room.
            n = min(max(PREALLOCATE_BYTES, end - self.allocated), self.size - self.allocated)
            self.policy.admit(n)
            os.posix_fallocate(self.fd, self.allocated, n)
            self.allocated += n
        pwrite_all(self.fd, chunk, self.written)
        self.h.update(chunk)
        self.written = end

    def restart(self) -> int:
        """The registry ignored the Range: start over; returns the bytes dropped."""
        dropped, self.written, self.h = self.written, 0, hashlib.sha256()
        return dropped


def download_layer(client: RegistryClient, repository: str, f: Any, path: str, counter: Counts,
                   stop: threading.Event, policy: LayerPolicy, *, what: str) -> None:
    """Streams one layer into ``path`` while hashing it, at ``policy``'s
    minimum rate; resumes with a Range request after a broken connection
    (from the start when the registry ignores the Range); checks size and
    digest; fsyncs.

    Raises:
        DataLoss: more or other bytes than the digest names.
        Unavailable: still broken after ``policy.attempts`` tries.
        ResourceExhausted: the capacity admission refused the bytes.
        OSError: writing (ENOSPC: the caller's os_error makes it RESOURCE_EXHAUSTED).
    """
    digest = "sha256:" + f.blob
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    layer = _Layer(fd, f.size, policy)
    try:
        attempt = 0
        while layer.written < f.size or (f.size == 0 and attempt == 0):
            attempt += 1
            try:
                _one_attempt(client, repository, digest, layer, counter, stop, what)
            except NotFound:
                raise NotFound(f"{what}: the registry has no blob {digest}") from None
            except (Unavailable, OSError, http.client.HTTPException) as exc:
                if isinstance(exc, OSError) and not is_network(exc):
                    raise
                if attempt >= policy.attempts:
                    raise Unavailable(f"{what}: download broke off after {layer.written} of {f.size} bytes "
                                      f"({attempt} attempts: {exc}); nothing was published, retry is safe") from None
                log.warning("%s: broke off after %d of %d bytes (%s); resuming with a Range request", what,
                            layer.written, f.size, untrusted(exc))
                time.sleep(min(2.0, 0.2 * attempt))
                continue
            if layer.written < f.size:
                if attempt >= policy.attempts:
                    raise Unavailable(f"{what}: truncated download, {layer.written} of {f.size} bytes after "
                                      f"{attempt} attempts; nothing was published, retry is safe")
                log.warning("%s: response ended after %d of %d bytes; resuming", what, layer.written, f.size)
        if layer.h.hexdigest() != f.blob:
            raise DataLoss(f"{what}: the downloaded bytes hash to sha256:{layer.h.hexdigest()}, expected {digest} "
                           "(corrupt in the registry or on the way); nothing was published")
        # Durable before the commit's blobs/ rename can expose it (commit step 1, done here).
        os.fsync(fd)
    finally:
        os.close(fd)
    counter.add(0, 1)


def _one_attempt(client: RegistryClient, repository: str, digest: str, layer: _Layer, counter: Counts,
                 stop: threading.Event, what: str) -> None:
    """One GET of the layer from where it stands, streamed at the policy's rate."""
    if stop.is_set():
        raise Stopped(f"{what}: stopped, another layer failed")
    guard = RateGuard(layer.policy.min_rate, layer.policy.window_s, what=what)
    with client.open_blob(repository, digest, offset=layer.written) as r:
        if layer.written and r.status == 200:
            # The registry ignored the Range (RFC 9110 allows it): the body is
            # the whole blob, so the file and the hash start over with it.
            log.warning("%s: the registry ignored the Range request (answered 200); reading from the start",
                        what)
            counter.add(-layer.restart())
        body = r.stream()
        while True:
            # read1: whatever one recv brings (at most 1 MiB), so a trickle
            # is measured per arrival, not after a full block that never comes.
            chunk = body.read1(IO_BYTES)
            if not chunk:
                break
            if layer.written + len(chunk) > layer.size:
                raise DataLoss(f"{what}: the registry sent more than its {layer.size} bytes; nothing "
                               "was published")
            layer.write(chunk)
            counter.add(len(chunk))
            guard.add(len(chunk))
            if stop.is_set():
                raise Stopped(f"{what}: stopped, another layer failed")


class Stopped(Aborted):
    """A layer stopped because another one failed (never the error reported)."""


def is_network(exc: OSError) -> bool:
    """A socket-level failure (retry), not a local write error (raise)."""
    import errno

    return isinstance(exc, (ConnectionError, TimeoutError)) or exc.errno in (
        errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH, None)


def run_all(fn: Callable[[Any], None], items: list[Any], threads: int, stop: threading.Event | None = None) -> None:
    """Runs ``fn`` on every item, ``threads`` at once; raises the first
    error after the others stopped (they check ``stop``)."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items))), thread_name_prefix="hwr-remote") as pool:
        futures = [pool.submit(fn, it) for it in items]
        first: BaseException | None = None
        for fut in futures:
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - the first real error wins, the rest are its echoes
                if first is None or isinstance(first, Stopped):
                    first = exc
                    if stop is not None:
                        stop.set()
    if first is not None:
        raise first
