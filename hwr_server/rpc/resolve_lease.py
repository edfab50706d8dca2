"""gRPC handler of ResolveLease (runtime): a worker's start in one round
trip.

1. validate the request (every field, before a file is looked at);
2. resolve the sources named by path for the calling peer
   (:meth:`hwr_server.sources.cache.SourceCache.resolve_each`: a source the
   daemon will not vouch for is a per-source refusal, not an error);
3. with every content id known, build the identity
   (:class:`hwr_client.core.identity.Identity`, the one implementation the
   client uses too) and its key;
4. lease the artifact for the session (AcquireLease's own handler: the
   same lease under the same rules, the publisher trusted), or, without a
   session, only look it up under the same trust rule.

A miss, a quarantined artifact and an incomplete identity are states of the
reply, not errors: the worker needs the key (or the refusals) to go on.
Hashing blocks this gRPC worker thread (never an event loop) when
``wait`` is set.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import SourceDigest, check_label_text, check_path_text
from hwr_client.core.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                                    ResourceExhausted, UntrustedPublisher)
from hwr_client.core.identity import Identity, canonical_json
from hwr_server.access.peers import peer_of
from hwr_server.rpc import leases as rpc_leases
from hwr_server.rpc.sources import seen_of

if TYPE_CHECKING:
    from hwr_server.components import Components

#: A content id that only stands in while a template is validated.
_PLACEHOLDER = "sha256:" + "0" * 64
#: Where a session error from LeaseManager.acquire starts (the client
#: re-opens its session and asks again).
_SESSION_PREFIX = "session:"


def resolve_lease(c: Components, request: pb.ResolveLeaseRequest,
                  context: grpc.ServicerContext) -> pb.ResolveLeaseReply:
    """ResolveLease: see the module doc and the proto.

    Raises:
        InvalidArgument: no sources; a source without exactly one of path
            and content id; a bad name, path or content id (naming its
            index); an identity document that is not a JSON object without
            "sources", or not a valid identity once the sources are added.
        ResourceExhausted: more sources than ``max_resolve_paths``; the
            session's lease cap.
        NotFound, FailedPrecondition: a missing or changing source file (as
            ResolveSources); ``session: ...`` when the session is not open.
    """
    sources = list(request.sources)
    template = _checked(c, request, sources)
    by_path = [s for s in sources if s.path]
    answers = iter(c.sources.resolve_each([s.path for s in by_path], peer=peer_of(context), wait=request.wait,
                                          seen=[seen_of(s.seen) if s.HasField("seen") else None for s in by_path]))
    digests: list[pb.SourceDigest] = []
    refused: list[str] = []
    for s in sources:
        answer = next(answers) if s.path else SourceDigest(s.path, s.content_id, 0, True, "given")
        digests.append(_digest_pb(s, answer))
        refused.append(str(answer) if isinstance(answer, PermissionDenied) else "")
    reply = pb.ResolveLeaseReply(sources=digests, refused=refused)
    if any(not d.content_id for d in digests):
        reply.state = "incomplete"
        reply.candidates = _candidates(c, template, [s.name for s in sources])
        n_refused, n_pending = sum(1 for r in refused if r), sum(1 for d in digests if d.origin == "pending")
        reply.reason = f"{n_refused} source(s) refused, {n_pending} being hashed by the daemon"
        return reply
    identity = Identity.from_dict({**template, "sources": [{"name": s.name, "content_id": d.content_id}
                                                           for s, d in zip(sources, digests)]})
    reply.key = identity.key
    _lease_into(c, request.session_id, identity.key, reply, context)
    return reply


def _checked(c: Components, request: pb.ResolveLeaseRequest, sources: Sequence[pb.NamedSource]) -> dict[str, Any]:
    """Step 1: every field; returns the identity template (no sources)."""
    if not sources:
        raise InvalidArgument("ResolveLease: expected at least one source")
    limit = c.sources.config.max_resolve_paths
    if len(sources) > limit:
        raise ResourceExhausted(
            f"ResolveLease: {len(sources)} sources in one call; the limit is {limit} (max_resolve_paths in the "
            "daemon config)")
    for i, s in enumerate(sources):
        what = f"ResolveLease: sources[{i}]"
        check_label_text(s.name, f"{what}.name")
        if bool(s.path) == bool(s.content_id):
            raise InvalidArgument(f"{what} ({s.name!r}): expected exactly one of path and content_id")
        if s.path:
            check_path_text(s.path, f"{what}.path")
    try:
        template = json.loads(request.identity_json, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"ResolveLease: identity_json is not valid JSON ({exc})") from None
    if not isinstance(template, dict) or "sources" in template:
        raise InvalidArgument("ResolveLease: identity_json must be a JSON object without \"sources\" (contract, "
                              "representation, layout, producer, extra); the sources travel in `sources`")
    # The whole document is validated now, whatever the sources turn out
    # to be: a placeholder content id per name (names and content ids given
    # are checked here too, naming their index).
    Identity.from_dict({**template, "sources": [{"name": s.name, "content_id": s.content_id or _PLACEHOLDER}
                                                for s in sources]})
    return template


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _digest_pb(source: pb.NamedSource, answer: SourceDigest | PermissionDenied | None) -> pb.SourceDigest:
    if isinstance(answer, SourceDigest):
        return pb.SourceDigest(path=source.path, content_id=answer.content_id, size=answer.size,
                               cached=answer.cached, origin=answer.origin)
    return pb.SourceDigest(path=source.path, origin="refused" if answer is not None else "pending")


def _lease_into(c: Components, session_id: str, key: str, reply: pb.ResolveLeaseReply,
                context: grpc.ServicerContext) -> None:
    """Step 4: lease (with a session) or look up ``key``; sets the state.

    The lease is AcquireLease's own handler (:func:`hwr_server.rpc.leases.acquire`):
    one place decides who may lease what, so both rpcs grant the same lease
    under the same rules."""
    try:
        if session_id:
            grant = rpc_leases.acquire(c, pb.AcquireLeaseRequest(session_id=session_id, key=key), context)
            reply.lease_id, reply.manifest_json = grant.lease_id, grant.manifest_json
            reply.blob_paths.extend(grant.blob_paths)
            reply.publisher.CopyFrom(grant.publisher)
        else:
            # A lookup answers as a lease would: an artifact the caller
            # does not trust is no hit for it either.
            reply.publisher.CopyFrom(rpc_leases.trusted_publisher(c, key, context).to_proto())
    except NotFound as exc:
        reply.state, reply.reason = "miss", str(exc)
        return
    except UntrustedPublisher as exc:
        reply.state, reply.reason = "untrusted", str(exc)
        return
    except FailedPrecondition as exc:
        if str(exc).startswith(_SESSION_PREFIX):
            raise  # the client re-opens its session and asks again
        reply.state, reply.reason = "unusable", str(exc)
        return
    reply.state, reply.reason = "hit", "exact artifact in the store"


def _candidates(c: Components, template: dict[str, Any], names: list[str]) -> bool:
    """Whether an artifact could have this identity once its content ids
    are known: one in the store has the same template and source names, or
    the configured registry may hold it (a pull on a miss needs the key)."""
    if c.sources.config.remote.pull_on_miss:
        return True
    want = _template_key(template, sorted(names))
    for key in c.store.keys():
        manifest = c.store.indexed(key)
        if manifest is not None and _stored_template_key(key, manifest.identity.canonical) == want:
            return True
    return False


def _template_key(template: dict[str, Any], names: list[str]) -> str:
    doc = {**template, "sources": [{"name": n} for n in names]}
    return hashlib.sha256(canonical_json(doc)).hexdigest()


@functools.lru_cache(maxsize=4096)
def _stored_template_key(key: str, canonical: bytes) -> str:
    # Keyed by the artifact key: its identity never changes, so a cached
    # answer is never stale.
    doc = json.loads(canonical)
    template = {k: v for k, v in doc.items() if k != "sources"}
    return _template_key(template, sorted(s["name"] for s in doc["sources"]))
