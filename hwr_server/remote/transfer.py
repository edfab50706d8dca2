"""Moving one artifact's layers: the parallel runner of a transfer, one
layer's resumable, hashed download into staging, and the hard link of a
blob the store already holds (:class:`hwr_server.remote.remote.Remote`
drives them; the commit is the store's).
"""

from __future__ import annotations

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
from hwr_server.remote.registry import IO_BYTES, RegistryClient
from hwr_server.store.staging_io import pwrite_all

log = logging.getLogger(__name__)


class Counts(Protocol):
    """Progress shared by the layer threads of one transfer."""

    def add(self, nbytes: int = 0, layers: int = 0) -> None: ...


def link_stored(blob: str, path: str, size: int) -> bool:
    """Hard-links the stored blob of the right size into staging; False
    when it is missing, a link, or another size (then it is downloaded)."""
    try:
        fd, st = open_stored(blob, what=f"blob {os.path.basename(blob)[:12]}")
    except (FileNotFoundError, Untrusted):
        return False
    try:
        if st.st_size != size:
            return False
        os.link(blob, path, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False  # collected meanwhile
    finally:
        os.close(fd)


def download_layer(client: RegistryClient, repository: str, f: Any, path: str, counter: Counts,
              stop: threading.Event, attempts: int, *, what: str) -> None:
    """Streams one layer into ``path`` while hashing it; resumes with a
    Range request after a broken connection; checks size and digest; fsyncs.

    Raises:
        DataLoss: more or other bytes than the digest names.
        Unavailable: still broken after ``attempts`` tries.
        OSError: writing (ENOSPC: the caller's os_error makes it RESOURCE_EXHAUSTED).
    """
    digest = "sha256:" + f.blob
    h = hashlib.sha256()
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if f.size:
            os.posix_fallocate(fd, 0, f.size)
        attempt = 0
        while written < f.size or (f.size == 0 and attempt == 0):
            attempt += 1
            if stop.is_set():
                raise Stopped(f"{what}: stopped, another layer failed")
            try:
                with client.open_blob(repository, digest, offset=written) as r:
                    if written and r.status == 200:
                        h, written = hashlib.sha256(), 0  # the registry ignored the Range: start over
                    while True:
                        chunk = r.resp.read(IO_BYTES)
                        if not chunk:
                            break
                        if written + len(chunk) > f.size:
                            raise DataLoss(f"{what}: the registry sent more than its {f.size} bytes; nothing "
                                           "was published")
                        pwrite_all(fd, chunk, written)
                        h.update(chunk)
                        written += len(chunk)
                        counter.add(len(chunk))
                        if stop.is_set():
                            raise Stopped(f"{what}: stopped, another layer failed")
            except NotFound:
                raise NotFound(f"{what}: the registry has no blob {digest}") from None
            except (Unavailable, OSError, http.client.HTTPException) as exc:
                if isinstance(exc, OSError) and not is_network(exc):
                    raise
                if attempt >= attempts:
                    raise Unavailable(f"{what}: download broke off after {written} of {f.size} bytes "
                                      f"({attempt} attempts: {exc}); nothing was published, retry is safe") from None
                log.warning("%s: broke off after %d of %d bytes (%s); resuming with a Range request", what,
                            written, f.size, exc)
                time.sleep(min(2.0, 0.2 * attempt))
                continue
            if written < f.size:
                if attempt >= attempts:
                    raise Unavailable(f"{what}: truncated download, {written} of {f.size} bytes after {attempt} "
                                      "attempts; nothing was published, retry is safe")
                log.warning("%s: response ended after %d of %d bytes; resuming", what, written, f.size)
        if h.hexdigest() != f.blob:
            raise DataLoss(f"{what}: the downloaded bytes hash to sha256:{h.hexdigest()}, expected {digest} "
                           "(corrupt in the registry or on the way); nothing was published")
        # Durable before the commit's blobs/ rename can expose it (commit step 1, done here).
        os.fsync(fd)
    finally:
        os.close(fd)
    counter.add(0, 1)


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
