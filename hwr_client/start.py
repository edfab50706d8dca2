"""A worker's start in one round trip: resolve the identity of a checkpoint
and lease its artifact with ONE ResolveLease call (DESIGN §6-§8).

The daemon vouches for the source files (:mod:`hwr_server.sources.access`:
any file the caller's proven uid may read, unless source roots restrict
it), builds the identity with the client's own code and, on a hit, leases
the artifact for this process's session. A warm start hashes nothing here.

=================================  =========================================
the daemon answers                 the worker
=================================  =========================================
hit                                maps the lease: LOCAL_HIT
miss, unusable                     the mode's rule (:mod:`hwr_client.resolve`),
                                   a pull on a miss
a source it does not vouch for     hashes it here with its own rights; the
                                   report's notes say why and what would
                                   make it fast
a source new to it (pending)       the daemon hashes it, on its threads
no daemon, or a full one           hashes here (preferred), FAILED (required)
=================================  =========================================

While a content id is still missing (refused or pending) the daemon also
says whether any artifact could match (one in the store with the same
template and source names, or a registry to pull from). When none can, the
start is certainly a miss: in preferred mode the worker loads canonically at
once and the identity is completed meanwhile (the worker's hashes and the
daemon's run while the canonical load does; the identity is only needed to
publish): :attr:`Resolution.deferred`. When one can, the hashes are waited
for, as the start may be a hit.

Example:
    >>> res = resolve_start(client, template, [("config.json", "/m/config.json"),   # doctest: +SKIP
    ...                                        ("model.safetensors", "/m/model.safetensors")])
    >>> res.outcome, res.key                                                           # doctest: +SKIP
    (<Outcome.LOCAL_HIT: 'LOCAL_HIT'>, '5d1c…')
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
from typing import Any, Callable, Mapping, Sequence

import grpc
# grpc imports these on its first channel, which a worker opens under its
# start clock; imported with this module instead (as the worker's other
# imports are), they cost ~8 ms of every fresh worker's start otherwise.
import grpc._channel  # noqa: F401
import grpc._interceptor  # noqa: F401

from hwr_client.channel import DEFAULT_TIMEOUT_S, peer_token
from hwr_client.client import connect
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import absolute_path
from hwr_client.core.errors import (FailedPrecondition, HwrError, InvalidArgument, NotFound, ResourceExhausted,
                                    Unavailable, UntrustedPublisher)
from hwr_client.core.identity import Identity
from hwr_client.resolve import (Mode, Outcome, Resolution, failed, lease_or_miss, missed, parse_mode,
                                resolve as resolve_key)
from hwr_client.lease import lease_from_grant
from hwr_client.sources import MAX_PATHS_PER_CALL, hash_locally, resolve_sources, seen_of

log = logging.getLogger(__name__)

#: A placeholder content id: validates a template before any file is hashed.
_PLACEHOLDER = "sha256:" + "0" * 64


def resolve_start(client: Any, template: Mapping[str, Any], sources: Sequence[tuple[str, str]], *,
                  mode: Mode | str = Mode.PREFERRED, verify: str = "none") -> Resolution:
    """Resolves the identity ``template`` + ``sources`` and leases its
    artifact, in one ResolveLease round trip when the daemon vouches for
    the files (see the module doc).

    Args:
        client: a :class:`hwr_client.Client`.
        template: the identity document without ``sources`` (contract,
            representation, layout, producer, extra).
        sources: ``(name, path)`` of each canonical file.
        mode: ``"preferred"`` or ``"required"`` (``"disabled"`` touches
            nothing).
        verify: lease-time verification: ``"none"``, ``"fast"``, ``"full"``.

    Returns:
        A :class:`~hwr_client.resolve.Resolution` with ``identity`` (or
        ``deferred``) and ``notes``; never raises for a miss, an unusable
        artifact or an unreachable daemon (FAILED carries the error).

    Raises:
        InvalidArgument: ``mode`` is not a mode.
    """
    mode = parse_mode(mode)
    if mode is Mode.DISABLED:
        return Resolution(Outcome.CANONICAL_FALLBACK, mode, reason="HWR disabled")
    try:
        if "sources" in template:
            raise InvalidArgument("identity template: expected the document without \"sources\" (they are "
                                  "given as (name, path) pairs)")
        named = [(str(n), absolute_path(p)) for n, p in sources]
        # Validated here first, so that a bad template is FAILED without a call.
        _identity(template, named, [_PLACEHOLDER] * len(named))
        template_json = json.dumps(dict(template), sort_keys=True, separators=(",", ":"))
    except HwrError as exc:
        return failed(mode, "", f"invalid identity: {exc}", exc)
    if len(named) > MAX_PATHS_PER_CALL:
        return _legacy(client, template, named, mode, verify, "more sources than one call takes")
    try:
        session = client.session()
        reply = session.granting(lambda sid: _ask(client, session, sid, template_json, named, {}, wait=False),
                                 what="ResolveLease")
    except (Unavailable, ResourceExhausted) as exc:
        return _without_daemon(client, template, named, mode, exc)
    except HwrError as exc:
        if _unimplemented(exc):
            return _legacy(client, template, named, mode, verify, "the daemon predates ResolveLease")
        return failed(mode, "", f"{type(exc).__name__}: {exc}", exc)
    notes = []
    if reply.state == "incomplete":
        notes += _hash_notes(client, named, reply)
        if not reply.candidates and mode is Mode.PREFERRED:
            reason = (f"no stored artifact has this identity but for the content ids ({reply.reason}): certainly "
                      "a miss; loading canonically while the sources are hashed")
            log.info("HWR resolve: %s", reason)
            later = _background(lambda: _complete(client, template_json, template, named, reply))
            return Resolution(Outcome.CANONICAL_FALLBACK, mode, reason=reason, deferred=later, notes=tuple(notes))
        try:
            given = _hash_refused(named, reply)
            reply = session.granting(lambda sid: _ask(client, session, sid, template_json, named, given, wait=True),
                                     what="ResolveLease")
        except (Unavailable, ResourceExhausted) as exc:
            return _without_daemon(client, template, named, mode, exc, notes)
        except HwrError as exc:
            return failed(mode, "", f"{type(exc).__name__}: {exc}", exc)
    return _decide(client, session, template, named, reply, mode, verify, tuple(notes))


def _ask(client: Any, session: Any, session_id: str, template_json: str, named: Sequence[tuple[str, str]],
         given: Mapping[int, str], *, wait: bool) -> pb.ResolveLeaseReply:
    """One ResolveLease call: each source by its content id when ``given``,
    else by path. With a ``session``, on the session's own channel, as
    AcquireLease is (its stream has connected it; the client's channel
    would connect now, on the start's clock)."""
    request = pb.ResolveLeaseRequest(
        session_id=session_id, identity_json=template_json, wait=wait,
        sources=[pb.NamedSource(name=n, content_id=given[i]) if i in given
                 else pb.NamedSource(name=n, path=p, seen=seen_of(p)) for i, (n, p) in enumerate(named)])
    # Waiting for hashes has no deadline (a cold 100 GB checkpoint takes
    # minutes; the daemon hashes each file once for everyone); otherwise
    # the daemon only checks the files and answers.
    stub = session.runtime if session is not None else client.runtime
    return client.call(stub.ResolveLease, request, timeout=None if wait else DEFAULT_TIMEOUT_S)


def _identity(template: Mapping[str, Any], named: Sequence[tuple[str, str]], content_ids: Sequence[str]) -> Identity:
    return Identity.from_dict({**template, "sources": [{"name": n, "content_id": c}
                                                       for (n, _), c in zip(named, content_ids)]})


def _decide(client: Any, session: Any, template: Mapping[str, Any], named: Sequence[tuple[str, str]],
            reply: pb.ResolveLeaseReply, mode: Mode, verify: str, notes: tuple[str, ...]) -> Resolution:
    """A complete reply (hit, miss, unusable) as the mode's Resolution."""
    identity = _identity(template, named, [d.content_id for d in reply.sources])
    key = identity.key
    if key != reply.key:
        # One implementation builds both keys: a difference is a bug, never a miss.
        if reply.lease_id:
            session.release(reply.lease_id)
        return failed(mode, key, f"the daemon's key {reply.key[:12]} differs from ours {key[:12]}",
                      FailedPrecondition(f"ResolveLease: the daemon built key {reply.key}, the client {key}"))
    if reply.state == "hit":
        try:
            lease = lease_from_grant(client, session, key, reply, verify=verify)
        except FailedPrecondition as exc:
            out = missed(mode, key, f"artifact {key[:12]} unusable: {exc}", exc)
        except HwrError as exc:
            out = failed(mode, key, f"{type(exc).__name__}: {exc}", exc)
        else:
            log.info("HWR resolve %s: LOCAL_HIT (lease %s…, published by %s) in one call", key[:12],
                     lease.lease_id[:8], lease.publisher or "?")
            out = Resolution(Outcome.LOCAL_HIT, mode, lease=lease, key=key, reason="exact artifact in the store",
                             publisher=lease.publisher)
    elif reply.state == "untrusted":
        out = missed(mode, key, reply.reason, UntrustedPublisher(reply.reason))
    elif reply.state == "unusable":
        out = missed(mode, key, f"artifact {key[:12]} unusable: {reply.reason}", FailedPrecondition(reply.reason))
    elif reply.state == "miss":
        out = lease_or_miss(client, key, mode=mode, verify=verify, known_miss=NotFound(reply.reason))
    else:
        error = FailedPrecondition(f"ResolveLease: unexpected state {reply.state!r} for {key[:12]}")
        out = failed(mode, key, str(error), error)
    return dataclasses.replace(out, identity=identity, deferred=None, notes=notes)


def _hash_refused(named: Sequence[tuple[str, str]], reply: pb.ResolveLeaseReply) -> dict[int, str]:
    """Content ids of the sources the daemon refused, hashed here (in
    parallel), by index; with what the daemon did answer."""
    given = {i: d.content_id for i, d in enumerate(reply.sources) if d.content_id}
    refused = [i for i, why in enumerate(reply.refused) if why]
    for i, digest in zip(refused, hash_locally([named[i][1] for i in refused])):
        given[i] = digest.content_id
    return given


def _complete(client: Any, template_json: str, template: Mapping[str, Any], named: Sequence[tuple[str, str]],
              reply: pb.ResolveLeaseReply) -> Identity:
    """The deferred identity: refused sources hashed here, then the daemon's
    pending hashes joined (a resolve-only call: nothing is leased)."""
    given = _hash_refused(named, reply)
    if len(given) < len(named):
        # On a connection of its own: the start's client may be closed (its
        # model closed) while the daemon still hashes, and the background
        # publication waiting for this identity must still get it.
        with connect(client.socket) as own:
            reply = _ask(own, None, "", template_json, named, given, wait=True)
        given = {i: d.content_id for i, d in enumerate(reply.sources)}
    return _identity(template, named, [given[i] for i in range(len(named))])


def _local_identity(template: Mapping[str, Any], named: Sequence[tuple[str, str]]) -> Identity:
    return _identity(template, named, [d.content_id for d in hash_locally([p for _, p in named])])


def _without_daemon(client: Any, template: Mapping[str, Any], named: Sequence[tuple[str, str]], mode: Mode,
                    exc: HwrError, notes: Sequence[str] = ()) -> Resolution:
    """No daemon, or one that cannot take this worker now: FAILED in
    required mode; in preferred mode a canonical load while the sources are
    hashed here (the identity is needed only to publish)."""
    reason = (f"HWR daemon unreachable: {exc}" if isinstance(exc, Unavailable)
              else f"HWR daemon cannot take this worker now: {exc}")
    if mode is not Mode.PREFERRED:
        return missed(mode, "", reason, exc)
    note = (f"source identity: the {len(named)} source file(s) are hashed in this worker because the daemon did "
            f"not answer ({reason}); with `hwr serve` running on {client.socket} a warm start hashes nothing here")
    log.info("HWR resolve: %s; falling back to the canonical load", reason)
    later = _background(lambda: _local_identity(template, named))
    return Resolution(Outcome.CANONICAL_FALLBACK, mode, reason=reason, error=exc, deferred=later,
                      notes=(*notes, note))


def _legacy(client: Any, template: Mapping[str, Any], named: Sequence[tuple[str, str]], mode: Mode, verify: str,
            why: str) -> Resolution:
    """ResolveSources (batched, local hashing where refused) then
    AcquireLease: for a daemon without ResolveLease, or too many sources."""
    log.info("HWR resolve: %s; resolving the sources, then leasing", why)
    try:
        digests = resolve_sources(client, [p for _, p in named])
        identity = _identity(template, named, [d.content_id for d in digests])
    except HwrError as exc:
        return failed(mode, "", f"{type(exc).__name__}: {exc}", exc)
    out = resolve_key(client, identity, mode=mode, verify=verify)
    local = sum(1 for d in digests if d.origin == "local")
    notes = (f"source identity: {local} source file(s) hashed in this worker ({why})",) if local else ()
    return dataclasses.replace(out, identity=identity, deferred=None, notes=notes)


def _hash_notes(client: Any, named: Sequence[tuple[str, str]], reply: pb.ResolveLeaseReply) -> list[str]:
    """What the report says when the worker hashes sources itself: how
    many, why the daemon did not vouch for them, and what would make the
    start fast."""
    refused = [(named[i][0], why) for i, why in enumerate(reply.refused) if why]
    if not refused:
        return []
    if peer_token(client.socket) is None:
        fix = (f"this process did not prove its uid to the daemon (no token from its credentials socket "
               f"{client.socket}.cred: a daemon too old to offer it, or a socket this user may not connect to); "
               "a worker whose uid the daemon knows gets its sources vouched for and hashes nothing")
    else:
        fix = ("make the files readable by this worker's uid (and their directories searchable), give the worker "
               "the daemon's view of them (the same files at the same paths: a bind mount, not a copy, for a "
               "container), or, where the daemon's source roots restrict it, add the checkpoint's directory with "
               "--source-root")
    return [f"source identity: {len(refused)} of {len(named)} source file(s) hashed in this worker: the daemon "
            f"did not vouch for {refused[0][0]!r} ({refused[0][1]}); {fix}"]


def _unimplemented(exc: HwrError) -> bool:
    code = getattr(exc.__cause__, "code", None)
    return callable(code) and code() == grpc.StatusCode.UNIMPLEMENTED


def _background(work: Callable[[], Identity]) -> concurrent.futures.Future[Identity]:
    """Runs ``work`` on a daemon thread (an interpreter exit never waits for
    a hash nobody needs any more); its Future."""
    future: concurrent.futures.Future[Identity] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the identity
            future.set_exception(exc)

    threading.Thread(target=run, name="hwr-identity", daemon=True).start()
    return future
