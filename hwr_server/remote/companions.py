"""Compile artifacts travel with their weight artifact (DESIGN §18): an
OCI referrer of the weights' manifest.

A compile artifact is pushed like any artifact (its own tag, the identity
key; the same layers, config and signature), with two additions to its OCI
manifest: ``subject``, the descriptor of its weight artifact's manifest,
and the annotations :data:`DEVICE_ANNOTATION` (``cpu:avx512``,
``cuda:9.0``) and :data:`WEIGHTS_ANNOTATION`. A registry with the
referrers API indexes it itself (OCI distribution 1.1); on one without
(CNCF distribution 2.x), it is added to the referrers tag schema's index
``sha256-<hex of the weights' manifest digest>``, where signatures go
too (:mod:`hwr_server.remote.signatures`); ``oras discover`` lists both.

- **Push** of a weight artifact pushes every compile artifact of the store
  that belongs to it (:func:`push_companions`); a compile artifact pushed
  on its own (``push_after_publish`` after a worker published it) names
  its subject too (:func:`subject_of`: computed from the weights' manifest
  in the store, which is byte for byte what its push sends, else read from
  the registry's tag).
- **Pull** of a weight artifact (``hwr pull``, or a worker's pull on a
  miss) then pulls its compile artifacts for this node's devices,
  ``[remote] compile_devices`` (:func:`pull_companions`), each through the
  ordinary pull (digests, signature rule, durable commit). At most
  :data:`MAX_COMPANIONS` are examined; a failure is logged and never fails
  the weights' transfer (the worker then compiles, as without a remote).

Which artifact is which comes from the identity (the key covers it:
:mod:`hwr_client.core.compile_link`); the OCI annotations only pick what
to fetch, and a pulled manifest is checked like every other.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping, Protocol, Sequence

from hwr_client.core.compile_link import COMPILE_CONTRACT, COMPILE_CONTRACT_VERSION, device_matches, target_of
from hwr_client.core.errors import HwrError, NotFound
from hwr_client.core.identity import is_key
from hwr_client.core.manifest import Manifest
from hwr_server.remote.oci import ARTIFACT_TYPE, KEY_ANNOTATION, MANIFEST_MEDIA_TYPE, MAX_OCI_MANIFEST_BYTES, \
    build_oci_manifest, digest_of
from hwr_server.remote.registry import Reference, RegistryClient
from hwr_server.remote.signatures import MAX_INDEX_BYTES, fallback_tag, index_in_fallback

log = logging.getLogger(__name__)

DEVICE_ANNOTATION = "org.hwr.compile.device"
WEIGHTS_ANNOTATION = "org.hwr.compile.weights"
CONTRACT_ANNOTATION = "org.hwr.contract"
#: The contract annotation every compile artifact's OCI manifest carries.
COMPILE_TAG = f"{COMPILE_CONTRACT}@{COMPILE_CONTRACT_VERSION}"
#: Compile referrers examined per pulled weight artifact.
MAX_COMPANIONS = 16


class CompanionStore(Protocol):
    """What this module reads of the store: published keys and manifests."""

    def keys(self) -> list[str]: ...

    def indexed(self, key: str) -> Manifest | None: ...

    def contains(self, key: str) -> bool: ...

    def manifest_json(self, key: str) -> str: ...


def annotations_of(manifest: Manifest) -> dict[str, str]:
    """The OCI annotations a compile artifact adds ({} for any other)."""
    target = target_of(manifest.identity)
    if target is None:
        return {}
    return {DEVICE_ANNOTATION: target.device, WEIGHTS_ANNOTATION: target.weights_key}


def subject_of(store: CompanionStore, client: RegistryClient, repository: str,
               manifest: Manifest) -> dict[str, Any] | None:
    """The ``subject`` descriptor of a compile artifact's OCI manifest: its
    weight artifact's manifest, as the store would push it (the same bytes,
    so the same digest), else as the registry holds it under its key's tag;
    None for any other artifact, or weights found in neither."""
    target = target_of(manifest.identity)
    if target is None or not target.weights_key:
        return None
    weights = store.indexed(target.weights_key)
    if weights is not None:
        data = build_oci_manifest(weights, store.manifest_json(weights.key).encode("utf-8"))
    else:
        try:
            data, _ = client.get_manifest(repository, target.weights_key, limit=MAX_OCI_MANIFEST_BYTES)
        except NotFound:
            return None
    return {"mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of(data), "size": len(data)}


def index_annotations(key: str, notes: Mapping[str, str]) -> dict[str, str]:
    """What a fallback index entry of compile artifact ``key`` carries:
    ``notes`` (:func:`annotations_of`), its key and contract (what
    :func:`find` selects by; the referrers API copies the manifest's own)."""
    return {**notes, KEY_ANNOTATION: key, CONTRACT_ANNOTATION: COMPILE_TAG}


def index_referrer(client: RegistryClient, repository: str, oci: bytes, subject: Mapping[str, Any],
                   annotations: Mapping[str, str]) -> str:
    """Makes the pushed manifest ``oci`` findable from its subject: the
    referrers API when the registry indexed it (``OCI-Subject``), else the
    fallback index. Returns which."""
    if client.put_referrer(repository, oci, MANIFEST_MEDIA_TYPE):
        return "referrers API"
    index_in_fallback(client, repository, str(subject["digest"]), {
        "mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of(oci), "size": len(oci), "artifactType": ARTIFACT_TYPE,
        "annotations": dict(annotations)})
    return f"fallback tag {fallback_tag(str(subject['digest']))[:19]}"


def companions_of(store: CompanionStore, weights_key: str) -> list[str]:
    """Keys of the store's compile artifacts that belong to ``weights_key``."""
    out = []
    for key in store.keys():
        manifest = store.indexed(key)
        target = target_of(manifest.identity) if manifest is not None else None
        if target is not None and target.weights_key == weights_key:
            out.append(key)
    return sorted(out)


def push_companions(push: Callable[[str, str], Any], store: CompanionStore, weights_key: str,
                    ref: Reference) -> list[str]:
    """Pushes the compile artifacts of ``weights_key`` to ``ref``'s
    repository (each under its own key); returns the keys pushed. A failure
    is logged: the weights are pushed, and a node missing the kernels
    compiles them."""
    pushed = []
    for key in companions_of(store, weights_key):
        try:
            push(key, f"{ref.host}/{ref.repository}")
            pushed.append(key)
        except HwrError as exc:
            log.warning("push of %s: its compile artifact %s was not pushed: %s: %s", weights_key[:12], key[:12],
                        type(exc).__name__, exc)
    return pushed


def find(client: RegistryClient, repository: str, subject_digest: str,
         devices: Sequence[str]) -> list[tuple[str, str]]:
    """(key, manifest digest) of the compile artifacts whose subject is
    ``subject_digest`` and whose device ``devices`` selects, at most
    :data:`MAX_COMPANIONS`; [] when the registry lists none."""
    raw = client.referrers(repository, subject_digest, artifact_type=ARTIFACT_TYPE, limit=MAX_INDEX_BYTES)
    if raw is None:
        raw = client.get_index(repository, fallback_tag(subject_digest), limit=MAX_INDEX_BYTES)
    if raw is None:
        return []
    try:
        entries = json.loads(raw).get("manifests")
    except (ValueError, UnicodeDecodeError, AttributeError):
        entries = None
    if not isinstance(entries, list):
        log.warning("referrers of %s/%s@%s: not an image index; no compile artifacts pulled", client.host,
                    repository, subject_digest[:19])
        return []
    out = []
    for d in entries:
        notes = d.get("annotations") if isinstance(d, dict) else None
        if not isinstance(notes, dict) or d.get("artifactType") != ARTIFACT_TYPE:
            continue
        key, device, digest = notes.get(KEY_ANNOTATION), notes.get(DEVICE_ANNOTATION), d.get("digest")
        if notes.get(CONTRACT_ANNOTATION) != COMPILE_TAG or not is_key(key) or not isinstance(digest, str):
            continue
        if isinstance(device, str) and device_matches(device, devices):
            out.append((str(key), digest))
        if len(out) >= MAX_COMPANIONS:
            break
    return out


def pull_companions(pull: Callable[[str], Any], store: CompanionStore, client: RegistryClient, ref: Reference,
                    weights_key: str, subject_digest: str, devices: Sequence[str]) -> list[str]:
    """After a weight artifact's pull: pulls its compile artifacts for
    ``devices`` by manifest digest (the ordinary pull); returns the keys
    now in the store. Failures are logged, never raised."""
    manifest = store.indexed(weights_key)
    if not devices or not subject_digest or manifest is None or target_of(manifest.identity) is not None:
        return []  # nothing asked for, or the pulled artifact is itself a compile artifact
    try:
        found = find(client, ref.repository, subject_digest, devices)
    except HwrError as exc:
        log.warning("pull of %s: its compile artifacts could not be listed: %s: %s", weights_key[:12],
                    type(exc).__name__, exc)
        return []
    got = []
    for key, digest in found:
        if store.contains(key):
            got.append(key)
            continue
        try:
            pull(f"{ref.host}/{ref.repository}@{digest}")
            got.append(key)
        except HwrError as exc:
            log.warning("pull of %s: its compile artifact %s was not pulled: %s: %s", weights_key[:12], key[:12],
                        type(exc).__name__, exc)
    if got:
        log.info("pull of %s: %d compile artifact(s) for %s: %s", weights_key[:12], len(got), list(devices),
                 [k[:12] for k in got])
    return got


__all__ = ["COMPILE_TAG", "CompanionStore", "DEVICE_ANNOTATION", "MAX_COMPANIONS", "WEIGHTS_ANNOTATION",
           "annotations_of", "companions_of", "find", "index_annotations", "index_referrer", "pull_companions", "push_companions",
           "subject_of"]
