"""How a vLLM-Omni artifact is written down in HWR's records, and read back.

Identity. vLLM-Omni's ``WeightArtifactIdentity`` travels opaquely: its
canonical JSON and its key sit in the HWR identity's ``extra``, next to the
storage domain it was resolved in (see :func:`hwr_identity`). The HWR key is
the SHA-256 of a document that contains those bytes, so two vLLM-Omni
identities never share an HWR key, and every lookup checks that the
manifest's ``extra`` holds exactly the requested identity
(:func:`check_identity`). The other HWR fields (contract, sources,
representation, layout, producer) are derived from it so that ``hwr ls``
and ``hwr inspect`` show what the artifact is.

Annotations. What vLLM-Omni's manifest holds and HWR's does not (each
tensor's kind and role, the producer and restorer schemas, the format
metadata) is kept in the manifest's opaque annotations
(:mod:`hwr_client.core.annotations`) under ``data["vllm_omni"]``, version
:data:`RECORD_VERSION`. The format metadata travels as its canonical JSON
text: vLLM-Omni allows floats there, HWR's annotations do not.

Manifest. :func:`vllm_manifest` rebuilds vLLM-Omni's ``WeightManifest`` from
the HWR manifest and the annotations: the same tensor entries, the same
content digest (vLLM-Omni's, over its tensors' semantic records) that its
filesystem store computes for the same bytes; files are HWR's payload
blobs under the producer's file names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Mapping

import torch
from vllm_omni.host_weight_runtime import (
    CanonicalJson,
    FileManifestEntry,
    ProductionMetadata,
    TensorKind,
    TensorManifestEntry,
    WeightArtifactIdentity,
    WeightManifest,
)
from vllm_omni.host_weight_runtime.identity import canonical_json as vllm_canonical_json

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.identity import REPRESENTATION_DTYPES, Identity
from hwr_client.core.manifest import Manifest

class IncompatibleArtifact(FailedPrecondition):
    """An HWR artifact that is not exactly the requested vLLM-Omni artifact:
    another identity or domain in its ``extra``, or a missing or malformed
    vLLM-Omni record (not written by this adapter)."""


#: Version of the ``data["vllm_omni"]`` annotation record and of the identity
#: mapping (a change of either must not read old records as new ones).
RECORD_VERSION = 1
#: The kind and role most tensors have: only the others are listed.
_DEFAULT_CLASS = (TensorKind.PARAMETER.value, "weight")


@dataclasses.dataclass(frozen=True)
class Domain:
    """The vLLM-Omni storage domain a store serves: the resolved root, its
    scope and domain id. Part of every HWR identity the store writes, so
    workers configured with different roots keep separate artifacts, as
    vLLM-Omni's own stores do; identical payload files are still stored
    once, because HWR names blobs by their content."""

    root: str
    scope: str
    domain_id: str

    def document(self) -> dict[str, str]:
        return {"root": self.root, "scope": self.scope, "domain_id": self.domain_id}


def hwr_identity(identity: WeightArtifactIdentity, domain: Domain) -> Identity:
    """The HWR identity of a vLLM-Omni artifact identity in ``domain``.

    Raises:
        InvalidArgument: the representation dtype has no HWR name (HWR
            records one runtime dtype per artifact, torch spelling).
    """
    dtype = identity.representation.dtype.removeprefix("torch.")
    if dtype not in REPRESENTATION_DTYPES:
        raise InvalidArgument(f"vLLM-Omni representation dtype {identity.representation.dtype!r}: HWR knows "
                              f"{sorted(REPRESENTATION_DTYPES)} (torch spelling, optionally 'torch.'-prefixed)")
    layout, producer = identity.layout, identity.producer
    source = identity.source.to_dict()
    return Identity.from_dict({
        "contract": {"name": f"vllm-omni:{identity.representation.name}", "version": identity.schema_version},
        # The source identity as one content id: vLLM-Omni's fingerprint is
        # already a digest of its files; HWR only needs a stable name for it.
        "sources": [{"name": f"vllm-omni:{identity.source.model_id}",
                     "content_id": "sha256:" + hashlib.sha256(vllm_canonical_json(source)).hexdigest()}],
        "representation": {"dtype": dtype, "policy": identity.representation.name},
        "layout": {"tp_rank": layout.tensor_parallel_rank, "tp_size": layout.tensor_parallel_size,
                   "sp_size": layout.sequence_parallel_size, "sp_backend": layout.sequence_parallel_backend},
        "producer": {"id": producer.producer_id, "version": producer.version},
        "extra": {"vllm_omni": {"version": RECORD_VERSION, "identity": identity.canonical_bytes.decode("ascii"),
                                "key": identity.key, "domain": domain.document()}},
    })


def check_identity(manifest: Manifest, identity: WeightArtifactIdentity, domain: Domain) -> None:
    """Proves that ``manifest`` is the artifact of exactly ``identity`` in
    ``domain``: its ``extra`` holds the same canonical bytes and key.

    Raises:
        IncompatibleArtifact: naming what differs.
    """
    extra = manifest.identity.document.get("extra", {}).get("vllm_omni")
    what = f"HWR artifact {manifest.key[:12]}"
    if not isinstance(extra, dict) or extra.get("version") != RECORD_VERSION:
        raise IncompatibleArtifact(f"{what}: its identity carries no vLLM-Omni record of version {RECORD_VERSION}")
    if extra.get("identity") != identity.canonical_bytes.decode("ascii") or extra.get("key") != identity.key:
        raise IncompatibleArtifact(f"{what}: its vLLM-Omni identity {str(extra.get('key'))[:12]} differs from the "
                                 f"requested {identity.key[:12]}")
    if extra.get("domain") != domain.document():
        raise IncompatibleArtifact(f"{what}: published for storage domain {extra.get('domain')}, "
                                 f"expected {domain.document()}")


# -- annotations -------------------------------------------------------------


def annotations(metadata: ProductionMetadata, classes: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """The HWR annotations object for a produced artifact.

    Args:
        metadata: what the producer returned.
        classes: tensor name -> (kind, role).
    """
    others = {name: list(c) for name, c in sorted(classes.items()) if c != _DEFAULT_CLASS}
    record = {
        "version": RECORD_VERSION,
        "producer_schema": metadata.producer_schema,
        "restorer_schema": metadata.restorer_schema,
        # Text, not a nested object: vLLM-Omni's canonical JSON may hold floats.
        "format_metadata": metadata.format_metadata.encoded.decode("ascii"),
        "default_class": list(_DEFAULT_CLASS),
        "tensor_classes": others,
    }
    return {"schema_version": 1, "data": {"vllm_omni": record}}


@dataclasses.dataclass(frozen=True)
class Record:
    """The vLLM-Omni record read back from a manifest's annotations."""

    producer_schema: str
    restorer_schema: str
    format_metadata: CanonicalJson
    classes: dict[str, tuple[TensorKind, str]]


def read_record(manifest: Manifest) -> Record:
    """The vLLM-Omni record of ``manifest``, checked field by field.

    Raises:
        IncompatibleArtifact: no record, another version, or a malformed field
            (the artifact was not written by this adapter).
    """
    what = f"HWR artifact {manifest.key[:12]}: annotations"
    doc = (manifest.annotations or {}).get("data", {}).get("vllm_omni")
    expected = {"version", "producer_schema", "restorer_schema", "format_metadata", "default_class", "tensor_classes"}
    if not isinstance(doc, dict) or set(doc) != expected or doc["version"] != RECORD_VERSION:
        raise IncompatibleArtifact(f"{what}: expected a vLLM-Omni record of version {RECORD_VERSION} with fields "
                                 f"{sorted(expected)}")
    names = {t.name for t in manifest.tensors}
    try:
        default = _tensor_class(doc["default_class"])
        classes = {name: default for name in names}
        for name, c in doc["tensor_classes"].items():
            if name not in names:
                raise ValueError(f"class of unknown tensor {name!r}")
            classes[name] = _tensor_class(c)
        format_metadata = CanonicalJson(doc["format_metadata"].encode("ascii"))
        if not all(isinstance(doc[k], str) and doc[k] for k in ("producer_schema", "restorer_schema")):
            raise ValueError("schemas must be non-empty strings")
    except (ValueError, TypeError, AttributeError, UnicodeError) as exc:
        raise IncompatibleArtifact(f"{what}: malformed vLLM-Omni record ({exc})") from None
    return Record(doc["producer_schema"], doc["restorer_schema"], format_metadata, classes)


def _tensor_class(value: Any) -> tuple[TensorKind, str]:
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str) or not value[1]:
        raise ValueError(f"tensor class {value!r}: expected [kind, role]")
    return TensorKind(value[0]), value[1]


# -- manifest --------------------------------------------------------------------


def contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    """The stride torch gives a contiguous tensor of ``shape`` (what
    vLLM-Omni's writer records)."""
    return tuple(torch.empty(tuple(shape), device="meta").stride())


def vllm_manifest(manifest: Manifest, identity: WeightArtifactIdentity, record: Record,
                  torch_dtypes: Mapping[str, torch.dtype]) -> WeightManifest:
    """vLLM-Omni's manifest of an HWR artifact (see the module doc).

    Raises:
        IncompatibleArtifact: the result breaks vLLM-Omni's manifest rules
            (duplicate file names, ...), naming the rule.
    """
    files = manifest.files
    if manifest.format_version != 1:
        # The adapter publishes with PlanSpec.tensor_sha256 (build.staged_plan);
        # a manifest of xxh3-128 tensor digests cannot fill vLLM-Omni's.
        raise IncompatibleArtifact(f"HWR artifact {manifest.key[:12]}: manifest format {manifest.format_version} "
                                   "records no per-tensor SHA-256, which vLLM-Omni's manifest needs (publish "
                                   "with tensor_sha256)")
    tensors = []
    for t in sorted(manifest.tensors, key=lambda t: t.name):
        kind, role = record.classes[t.name]
        tensors.append(TensorManifestEntry(
            name=t.name, kind=kind, role=role, file_name=files[t.file].name, storage_key=t.name,
            shape=tuple(t.shape), dtype=str(torch_dtypes[t.dtype]), stride=contiguous_stride(t.shape),
            nbytes=t.nbytes, sha256=t.sha256,
        ))
    try:
        return WeightManifest(
            schema_version=1, artifact_key=identity.key, identity=identity,
            producer_schema=record.producer_schema, restorer_schema=record.restorer_schema,
            tensors=tuple(tensors),
            files=tuple(FileManifestEntry(file_name=f.name, size=f.size, sha256=f.blob)
                        for f in sorted(files, key=lambda f: f.name)),
            artifact_content_sha256=content_sha256(tensors),
            format_metadata=record.format_metadata,
        )
    except ValueError as exc:  # ManifestValidationError is a ValueError
        raise IncompatibleArtifact(f"HWR artifact {manifest.key[:12]}: not a valid vLLM-Omni manifest ({exc})") from None


def content_sha256(entries: Iterable[TensorManifestEntry]) -> str:
    """vLLM-Omni's artifact content digest: SHA-256 over the canonical JSON
    of each tensor's semantic record, in name order (independent of files)."""
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.name):
        digest.update(vllm_canonical_json(entry.semantic_dict()))
    return digest.hexdigest()


__all__ = ["Domain", "IncompatibleArtifact", "RECORD_VERSION", "Record", "annotations", "check_identity", "content_sha256",
           "hwr_identity", "read_record", "vllm_manifest"]
