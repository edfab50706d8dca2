"""Source identity on the client: content ids of canonical checkpoint files
and identities built from real checkpoints (DESIGN §3, §6).

:func:`resolve_sources` asks the node daemon (which caches digests and hashes
each file once per node); when the daemon refuses a path (see
:mod:`hwr_server.sources.access`) or does not answer, the file is hashed here with :func:`hash_file`,
the ONE hashing function the daemon also uses, so a content id is the same
whichever side computed it.

:func:`build_identity` turns a checkpoint (a directory, a list of files, or
a ``{name: path}`` mapping) into a validated :class:`~hwr_client.core.identity.Identity`.

Example:
    >>> ident = build_identity(                                  # doctest: +SKIP
    ...     contract={"name": "flux2-klein", "version": 1},
    ...     sources="/models/flux2-klein/transformer",
    ...     layout={"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
    ...     representation={"dtype": "bfloat16"},
    ...     producer={"id": "my-loader", "version": "3"})
    >>> ident.key                                                # doctest: +SKIP
    '5d1c…'
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any, Mapping, Sequence, Union

from hwr_client.channel import RuntimeChannel
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import SourceDigest, absolute_path, content_id_of, hash_file
from hwr_client.core.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from hwr_client.core.identity import Identity

log = logging.getLogger(__name__)

#: File name suffixes of a checkpoint directory that are part of its identity:
#: weight files in every common format, plus JSON (configs and shard indexes
#: change how bytes are interpreted). Everything else (README, licences,
#: images, download metadata) is not byte-relevant.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
CANONICAL_SUFFIXES = WEIGHT_SUFFIXES + (".json",)

#: Paths per ResolveSources call, at most (a quarter of the daemon's default
#: max_resolve_paths, so a daemon configured lower still takes typical calls).
MAX_PATHS_PER_CALL = 1024

SourcesArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Mapping[str, Any]]


# ---------------------------------------------------------------------------
# Resolving through the daemon, with local fallback
# ---------------------------------------------------------------------------


def hash_locally(paths: Sequence[str], *, threads: int | None = None) -> list[SourceDigest]:
    """Hashes ``paths`` in this process, in parallel across files.

    Raises:
        The first error of :func:`hash_file`, in request order.
    """
    if not paths:
        return []
    workers = max(1, min(len(paths), threads or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hwr-hash") as pool:
        results = list(pool.map(hash_file, paths))
    return [SourceDigest(p, content_id_of(h), n, False, "local") for p, (h, n) in zip(paths, results)]


def seen_of(path: str) -> pb.FileIdentity | None:
    """The file at ``path`` as this process sees it (``stat``, links
    followed): the daemon answers only if it resolves that very file (a
    worker in a container may name another file by the same path). None
    when it cannot be stat'ed (the daemon or the local hash says why)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return pb.FileIdentity(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _ask_daemon(client: RuntimeChannel, paths: Sequence[str]) -> list[SourceDigest]:
    out: list[SourceDigest] = []
    # In batches of MAX_PATHS_PER_CALL: the daemon refuses a call of more
    # than its max_resolve_paths (default 4096) paths.
    for start in range(0, len(paths), MAX_PATHS_PER_CALL):
        batch = list(paths[start:start + MAX_PATHS_PER_CALL])
        seen = [seen_of(p) for p in batch]
        known = [v for v in seen if v is not None]
        # All or none: a file this process cannot stat is the daemon's (or
        # the local hash's) to report.
        request = pb.ResolveSourcesRequest(paths=batch, seen=known if len(known) == len(batch) else [])
        # No deadline: a cold 100 GB checkpoint takes minutes to hash, and the
        # call is safe to wait on (the daemon hashes each file once for everyone).
        reply = client.call(client.runtime.ResolveSources, request, timeout=None)
        out += [SourceDigest(p, s.content_id, s.size, s.cached, s.origin) for p, s in zip(batch, reply.sources)]
    return out


def resolve_sources(client: RuntimeChannel | None, paths: Sequence[str | os.PathLike[str]], *,
                    threads: int | None = None) -> list[SourceDigest]:
    """Content ids of canonical files, from the daemon's cache when it can.

    Paths the daemon will not vouch for (PERMISSION_DENIED: not readable by
    this caller's proven uid, outside its source roots when it has some,
    another file than this process sees at that path), and
    every path when the daemon is unreachable (UNAVAILABLE), over its limits
    (RESOURCE_EXHAUSTED) or ``client`` is None, are hashed locally with this
    process's own rights: same content id, no cache.

    Args:
        client: a :class:`hwr_client.Client` (any
            :class:`~hwr_client.channel.RuntimeChannel`), or None for local
            hashing only.
        paths: files (made absolute against this process's cwd).
        threads: local hashing threads; default CPU count.

    Returns:
        One :class:`SourceDigest` per path, in order.

    Raises:
        NotFound, InvalidArgument, PermissionDenied, FailedPrecondition: a
        path that is missing, not a regular file, unreadable here, or changed
        while hashed.
    """
    absolute = [absolute_path(p) for p in paths]
    if client is None or not absolute:
        return hash_locally(absolute, threads=threads)
    try:
        return _ask_daemon(client, absolute)
    except (Unavailable, ResourceExhausted) as exc:
        log.info("source digests: daemon cannot answer now (%s); hashing %d file(s) locally", exc, len(absolute))
        return hash_locally(absolute, threads=threads)
    except PermissionDenied as exc:
        if len(absolute) == 1:
            log.info("source digests: %s; hashing locally", exc)
            return hash_locally(absolute, threads=threads)
        log.info("source digests: %s; asking per file", exc)
    # Some path is outside the source roots: ask per file, hash the refused
    # ones here (in parallel).
    out: dict[int, SourceDigest] = {}
    refused: list[int] = []
    for i, p in enumerate(absolute):
        try:
            out[i] = _ask_daemon(client, [p])[0]
        except (PermissionDenied, Unavailable, ResourceExhausted):
            refused.append(i)
    for i, d in zip(refused, hash_locally([absolute[i] for i in refused], threads=threads)):
        out[i] = d
    return [out[i] for i in range(len(absolute))]


# ---------------------------------------------------------------------------
# Identities from real checkpoints
# ---------------------------------------------------------------------------


def checkpoint_files(directory: str) -> list[tuple[str, str]]:
    """The canonical files of a checkpoint directory: every file (recursively,
    skipping hidden entries; file symlinks followed, directory symlinks not)
    whose name ends in one of :data:`CANONICAL_SUFFIXES`.

    Returns:
        Sorted ``(name, path)``, name relative to ``directory`` with "/".

    Raises:
        NotFound: ``directory`` does not exist.
        InvalidArgument: it holds no weight file.
    """
    if not os.path.isdir(directory):
        raise NotFound(f"checkpoint directory {directory}: no such directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or not name.endswith(CANONICAL_SUFFIXES):
                continue
            path = os.path.join(dirpath, name)
            found.append((os.path.relpath(path, directory).replace(os.sep, "/"), path))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n, _ in found):
        raise InvalidArgument(
            f"checkpoint directory {directory}: no weight file ({', '.join(WEIGHT_SUFFIXES)}); "
            "expected a checkpoint directory or an explicit list of files"
        )
    return sorted(found)


def canonical_sources(sources: SourcesArg) -> list[tuple[str, str]]:
    """``(name, absolute path)`` pairs from a directory, a list of files
    (named relative to their common parent directory) or a ``{name: path}``
    mapping.

    Raises:
        InvalidArgument: an empty list, or an entry of the wrong type.
        NotFound: a directory that does not exist.
    """
    if isinstance(sources, Mapping):
        pairs = [(str(n), absolute_path(p)) for n, p in sources.items()]
    elif isinstance(sources, (str, os.PathLike)):
        path = absolute_path(sources)
        if os.path.isdir(path):
            return checkpoint_files(path)
        pairs = [(os.path.basename(path), path)]
    elif isinstance(sources, (list, tuple)):
        paths = [absolute_path(p) for p in sources]
        if not paths:
            raise InvalidArgument("identity sources: expected at least one file")
        base = os.path.commonpath([os.path.dirname(p) for p in paths])
        pairs = [(os.path.relpath(p, base).replace(os.sep, "/"), p) for p in paths]
    else:
        raise InvalidArgument(
            f"identity sources: expected a directory, a list of files or a name->path mapping, got {type(sources).__name__}"
        )
    if not pairs:
        raise InvalidArgument("identity sources: expected at least one file")
    return sorted(pairs)


def build_identity(
    *,
    contract: Mapping[str, Any],
    sources: SourcesArg,
    layout: Mapping[str, Any],
    representation: Mapping[str, Any],
    producer: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    client: RuntimeChannel | None = None,
    local: bool = False,
) -> Identity:
    """Builds the identity of an artifact produced from a real checkpoint.

    Content ids come from the node daemon (cached, single flight) and fall
    back to local hashing: the key is the same either way.

    Args:
        contract: ``{"name", "version"}`` of the final-layout contract.
        sources: a checkpoint directory (its weight and JSON files, see
            :func:`checkpoint_files`), a list of files (named by their path
            relative to their common parent directory), or ``{name: path}``.
        layout: ``{"tp_rank", "tp_size", "sp_size", "sp_backend"}``.
        representation: ``{"dtype"[, "policy"]}``.
        producer: ``{"id", "version"}``.
        extra: any other byte-relevant canonical JSON; default ``{}``.
        client: a :class:`hwr_client.Client`; None connects to the default
            socket for this call (and hashes locally if no daemon answers).
        local: hash every file in this process and connect to nothing
            (``client`` must be None); the key is the same.

    Returns:
        The validated :class:`Identity`; its key is ``identity.key``.

    Raises:
        InvalidArgument: a malformed field or source list.
        NotFound, PermissionDenied, FailedPrecondition: a source file that is
        missing, unreadable or changed while hashed.

    Example:
        >>> ident = build_identity(contract={"name": "tiny-dit", "version": 1},   # doctest: +SKIP
        ...     sources=["/models/tiny/model.safetensors", "/models/tiny/config.json"],
        ...     layout={"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
        ...     representation={"dtype": "bfloat16"}, producer={"id": "demo", "version": "1"})
    """
    if local and client is not None:
        raise InvalidArgument("build_identity: local=True hashes in this process; expected client=None")
    pairs = canonical_sources(sources)
    paths = [p for _, p in pairs]
    if client is not None or local:
        digests = resolve_sources(client, paths)  # None (local=True): hashed here
    else:
        # Only ResolveSources is called: the runtime channel is all of a
        # client this needs (no session, no admin channel).
        with RuntimeChannel() as channel:
            digests = resolve_sources(channel, paths)
    doc = {
        "contract": dict(contract),
        "sources": [{"name": n, "content_id": d.content_id} for (n, _), d in zip(pairs, digests)],
        "representation": dict(representation),
        "layout": dict(layout),
        "producer": dict(producer),
        "extra": dict(extra or {}),
    }
    return Identity.from_dict(doc)
