"""Signatures of pushed artifacts in the registry, as Notation and cosign
store theirs (docs/trust.md): an OCI artifact whose ``subject`` is the
signed manifest, found through the referrers API (OCI distribution spec
1.1, ``GET /v2/<name>/referrers/<digest>``) or, on a registry without it
(the CNCF distribution 2.x that Debian ships), through the referrers tag
schema: an image index tagged ``sha256-<hex of the manifest digest>``.

One signature is::

    {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
     "artifactType": "application/vnd.hwr.signature.v1",
     "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": <of "{}">, "size": 2},
     "layers": [{"mediaType": "application/vnd.hwr.signature.payload.v1+json",
                 "digest": <of the payload>, "size": N,
                 "annotations": {"org.hwr.signature": <base64 Ed25519 signature of the payload>,
                                 "org.hwr.signature.key": "SHA256:<key fingerprint>"}}],
     "subject": {<descriptor of the artifact's manifest>},
     "annotations": {"org.hwr.signature.key": ..., "org.opencontainers.image.created": ...}}

The payload (:func:`hwr_server.remote.signing.payload`) names the manifest
digest and the identity key. ``oras discover`` and any referrers-aware tool
list it; a registry, a mirror or a peer can withhold or delete it (the pull
is then refused) but cannot forge it.

Reading is bounded like every registry read: at most
:data:`MAX_SIGNATURES` signatures examined per pull, an index of at most
:data:`MAX_INDEX_BYTES`, a signature manifest of :data:`MAX_SIGNATURE_BYTES`
and a payload of :data:`MAX_PAYLOAD_BYTES`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from hwr_client.core.errors import FailedPrecondition, NotFound, PermissionDenied
from hwr_server.remote.oci import MANIFEST_MEDIA_TYPE, digest_of
from hwr_server.remote.registry import RegistryClient
from hwr_server.remote.signing import PublicKey, check_payload, load_private_key, payload, public_of

log = logging.getLogger(__name__)

SIGNATURE_ARTIFACT_TYPE = "application/vnd.hwr.signature.v1"
PAYLOAD_MEDIA_TYPE = "application/vnd.hwr.signature.payload.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
SIGNATURE_ANNOTATION = "org.hwr.signature"
SIGNER_ANNOTATION = "org.hwr.signature.key"
#: Signatures examined per pull, trusted signers first.
MAX_SIGNATURES = 16
MAX_INDEX_BYTES = 1 << 20
MAX_SIGNATURE_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Signed:
    """A signature pushed: its manifest's digest and the signing key's id."""

    digest: str
    signer: str


def fallback_tag(digest: str) -> str:
    """The referrers tag schema's tag of ``digest`` (``sha256-<hex>``)."""
    return digest.replace(":", "-", 1)


def signature_manifest(subject_digest: str, subject_size: int, payload_bytes: bytes, signature: bytes,
                       signer: str) -> bytes:
    """The bytes of one signature artifact's manifest (module docstring)."""
    doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": SIGNATURE_ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": digest_of(EMPTY), "size": len(EMPTY)},
        "layers": [{"mediaType": PAYLOAD_MEDIA_TYPE, "digest": digest_of(payload_bytes), "size": len(payload_bytes),
                    "annotations": {SIGNATURE_ANNOTATION: base64.b64encode(signature).decode("ascii"),
                                    SIGNER_ANNOTATION: signer}}],
        "subject": {"mediaType": MANIFEST_MEDIA_TYPE, "digest": subject_digest, "size": subject_size},
        "annotations": {SIGNER_ANNOTATION: signer,
                        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign(client: RegistryClient, repository: str, *, subject: bytes, key: str,
         private: Ed25519PrivateKey) -> Signed:
    """Signs the manifest ``subject`` (its bytes as pushed) of artifact
    ``key`` and pushes the signature as its referrer.

    Steps: 1. the payload signed; 2. the empty config and the payload
    uploaded (skipped when present); 3. the signature manifest put by its
    digest; 4. when the registry did not index it (no ``OCI-Subject``
    answer: no referrers API), the fallback index ``sha256-<hex>`` read,
    extended and put back. Two nodes updating one fallback index at the
    same moment can lose one entry (the registry has no compare-and-swap);
    pushing again restores it.

    Raises:
        Unavailable / PermissionDenied / FailedPrecondition: the registry.
    """
    subject_digest = digest_of(subject)
    public = public_of(private.public_key())
    data = payload(subject_digest, key, int(time.time()))
    sig = private.sign(data)
    for blob in (EMPTY, data):
        if client.blob_size(repository, digest_of(blob), push=True) != len(blob):
            client.put_bytes_blob(repository, digest_of(blob), blob)
    manifest = signature_manifest(subject_digest, len(subject), data, sig, public.id)
    indexed = client.put_referrer(repository, manifest, MANIFEST_MEDIA_TYPE)
    if not indexed:
        index_in_fallback(client, repository, subject_digest, {
            "mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of(manifest), "size": len(manifest),
            "artifactType": SIGNATURE_ARTIFACT_TYPE, "annotations": {SIGNER_ANNOTATION: public.id}})
    log.info("signed %s (%s) in %s/%s with %s: %s", key[:12], subject_digest[:19], client.host, repository,
             public.id, "referrers API" if indexed else f"fallback tag {fallback_tag(subject_digest)[:19]}")
    return Signed(digest_of(manifest), public.id)


def index_in_fallback(client: RegistryClient, repository: str, subject_digest: str, entry: dict[str, Any]) -> None:
    """Adds the descriptor ``entry`` of a referrer of ``subject_digest`` to
    its fallback index (the referrers tag schema), creating the index."""
    tag = fallback_tag(subject_digest)
    raw = client.get_index(repository, tag, limit=MAX_INDEX_BYTES)
    index = _index_doc(raw, what=f"{client.host}/{repository}:{tag}") if raw is not None else None
    if index is None:
        index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": []}
    if any(isinstance(d, dict) and d.get("digest") == entry["digest"] for d in index["manifests"]):
        return
    index["manifests"].append(entry)
    body = json.dumps(index, sort_keys=True, separators=(",", ":")).encode("utf-8")
    client.put_manifest(repository, tag, body, INDEX_MEDIA_TYPE)


def _index_doc(raw: bytes, *, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("manifests"), list):
        raise FailedPrecondition(f"{what}: not an OCI image index")
    return doc


def find(client: RegistryClient, repository: str, subject_digest: str) -> list[dict[str, Any]]:
    """The descriptors of HWR signatures whose subject is ``subject_digest``:
    from the referrers API, else from the fallback tag; [] when neither has any."""
    what = f"referrers of {client.host}/{repository}@{subject_digest[:19]}"
    raw = client.referrers(repository, subject_digest, artifact_type=SIGNATURE_ARTIFACT_TYPE, limit=MAX_INDEX_BYTES)
    if raw is None:
        raw = client.get_index(repository, fallback_tag(subject_digest), limit=MAX_INDEX_BYTES)
    if raw is None:
        return []
    return [d for d in _index_doc(raw, what=what)["manifests"]
            if isinstance(d, dict) and d.get("artifactType") == SIGNATURE_ARTIFACT_TYPE
            and isinstance(d.get("digest"), str)]


def verify(client: RegistryClient, repository: str, *, subject_digest: str, key: str,
           trusted: dict[str, PublicKey], what: str) -> str:
    """The id of a trusted key whose signature of ``subject_digest`` (the
    manifest of ``key``) is in the registry.

    Raises:
        PermissionDenied: none verifies; names what each signature examined lacked.
        Unavailable: the registry could not be read (a retry is safe).
    """
    found = find(client, repository, subject_digest)
    # Signatures that name a trusted signer first: the bound on how many are
    # examined must not let a registry hide the good one behind junk.
    found.sort(key=lambda d: _named_signer(d) not in trusted)
    reasons = []
    for desc in found[:MAX_SIGNATURES]:
        try:
            signer, why = _check_one(client, repository, desc, subject_digest, key, trusted)
        except (NotFound, FailedPrecondition) as exc:
            signer, why = "", f"unreadable ({exc})"
        if signer:
            return signer
        reasons.append(f"{str(desc['digest'])[:19]}: {why}")
    detail = "; ".join(reasons[:4]) if reasons else "the registry lists none"
    raise PermissionDenied(f"{what}: no valid signature by a key of [remote] trusted_keys ({len(found)} "
                           f"signature(s) found; {detail}); nothing was pulled")


def _named_signer(desc: dict[str, Any]) -> str:
    notes = desc.get("annotations")
    signer = notes.get(SIGNER_ANNOTATION) if isinstance(notes, dict) else None
    return signer if isinstance(signer, str) else ""


def _check_one(client: RegistryClient, repository: str, desc: dict[str, Any], subject_digest: str, key: str,
               trusted: dict[str, PublicKey]) -> tuple[str, str]:
    """(signer id, "") when ``desc`` is a valid trusted signature, else ("", why)."""
    digest = str(desc["digest"])
    raw, _ = client.get_manifest(repository, digest, limit=MAX_SIGNATURE_BYTES)
    if digest_of(raw) != digest:
        return "", f"the registry served bytes hashing to {digest_of(raw)[:19]}"
    try:
        doc = json.loads(raw)
        layer, = doc["layers"]
        notes = layer["annotations"]
        signer, sig_text = notes[SIGNER_ANNOTATION], notes[SIGNATURE_ANNOTATION]
        sub_ok = doc["subject"]["digest"] == subject_digest and doc.get("artifactType") == SIGNATURE_ARTIFACT_TYPE
        size, layer_digest = layer["size"], layer["digest"]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return "", "not an HWR signature manifest"
    if not sub_ok or layer.get("mediaType") != PAYLOAD_MEDIA_TYPE:
        return "", "not a signature of this manifest"
    if not isinstance(signer, str) or signer not in trusted:
        return "", f"signed by {str(signer)[:60]}, not a trusted key"
    if type(size) is not int or not 0 < size <= MAX_PAYLOAD_BYTES:
        return "", f"payload of {size!r} bytes, expected 1..{MAX_PAYLOAD_BYTES}"
    with client.open_blob(repository, str(layer_digest)) as r:
        data = r.read(MAX_PAYLOAD_BYTES)
    if digest_of(data) != layer_digest:
        return "", "its payload does not hash to its digest"
    try:
        signature = base64.b64decode(str(sig_text), validate=True)
    except (ValueError, binascii.Error):
        return "", "its signature is not base64"
    if not trusted[signer].verify(signature, data):
        return "", f"the signature does not verify with {signer}"
    why = check_payload(data, manifest_digest=subject_digest, key=key)
    return ("", why) if why else (signer, "")


def signing_key_of(path: str) -> Ed25519PrivateKey | None:
    """``[remote] signing_key``, read now (a rotated key applies at the next
    push, and an unfit one fails the push before anything is uploaded);
    None when none is configured (pushes are unsigned).

    Raises:
        FailedPrecondition: the key file is unfit (see ``load_private_key``).
    """
    return load_private_key(path, what="[remote] signing_key") if path else None


def verify_pull(trusted: dict[str, PublicKey], client: RegistryClient, repository: str, *, subject_digest: str,
                key: str, what: str) -> str:
    """The signature rule of a pull: with ``[remote] trusted_keys``, the id
    of the trusted key that signed ``subject_digest``; without, "" (the
    registry is trusted).

    Raises:
        PermissionDenied: trusted keys are configured and none signed it.
    """
    if not trusted:
        return ""
    return verify(client, repository, subject_digest=subject_digest, key=key, trusted=trusted, what=what)


__all__ = ["INDEX_MEDIA_TYPE", "MAX_SIGNATURES", "PAYLOAD_MEDIA_TYPE", "SIGNATURE_ARTIFACT_TYPE", "Signed",
           "fallback_tag", "find", "index_in_fallback", "sign", "signature_manifest", "signing_key_of", "verify",
           "verify_pull"]
