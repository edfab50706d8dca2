"""An HWR lease as vLLM-Omni's ``HostWeightLease``.

The lease is the real class (vLLM-Omni checks every tensor against the
manifest in its constructor). Its tensors are the HWR mapping's zero-copy
views with ONE storage per tensor (``tensors(storage="per-tensor")``): its
restorer treats two tensors with one storage as aliases and refuses them.
Its ``mapped_regions`` are the HWR lease's regions (one per payload file,
page-aligned, what a CUDA registrar registers); its
``release_artifact_lock`` closes the HWR lease, so the daemon unpins the
artifact when vLLM-Omni's transport tears the lease down, and the session
does it anyway if the process dies.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from vllm_omni.host_weight_runtime import (
    HostWeightLease,
    LeaseProvenance,
    MappedHostRegion,
    ValidationLevel,
    WeightArtifactIdentity,
)

from dlo_runtime.integrations.vllm_omni.records import Domain, check_identity, read_record, vllm_manifest
from hwr_client.client import Client
from hwr_client.lease import Lease
from hwr_client.tensors import TORCH_DTYPES

#: vLLM-Omni's validation level -> the HWR lease-time verification.
#: MANIFEST_AND_METADATA: the manifest is validated and every file's size
#: checked when it is mapped; FULL_CHECKSUM: SHA-256 of every file and
#: tensor before the lease is handed out.
VERIFY = {ValidationLevel.MANIFEST_AND_METADATA: "none", ValidationLevel.FULL_CHECKSUM: "full"}


def open_lease(client: Client, key: str, identity: WeightArtifactIdentity, domain: Domain,
               validation: ValidationLevel, *, domain_uuid: str) -> HostWeightLease:
    """Acquires HWR artifact ``key`` and wraps it for vLLM-Omni.

    Args:
        client: the process's HWR client.
        key: the HWR identity key of ``identity`` in ``domain``.
        identity: the exact vLLM-Omni identity requested.
        domain: the store's storage domain.
        validation: MANIFEST_AND_METADATA or FULL_CHECKSUM (see :data:`VERIFY`).
        domain_uuid: the provenance's domain id.

    Raises:
        HwrError: from the daemon (NotFound, FailedPrecondition, ...).
        FailedPrecondition: the artifact is not exactly ``identity``'s, or
            its vLLM-Omni record is missing or malformed. The HWR lease is
            closed before any error leaves.
    """
    hwr_lease = client.acquire(key, verify=VERIFY[validation])
    try:
        manifest = hwr_lease.manifest
        check_identity(manifest, identity, domain)
        wmanifest = vllm_manifest(manifest, identity, read_record(manifest), TORCH_DTYPES)
        return HostWeightLease(
            identity=identity,
            manifest=wmanifest,
            tensors=hwr_lease.tensors(storage="per-tensor"),
            mapped_regions=_regions(hwr_lease),
            provenance=LeaseProvenance(
                resolution_id=uuid.uuid4().hex,
                identity_digest=identity.key,
                artifact_content_sha256=wmanifest.artifact_content_sha256,
                domain_uuid=domain_uuid,
                publication_id=f"hwr:{key}@{manifest.created_unix}",
                resolution_source="local",
                artifact_origin="hwr",
                producer_id=identity.producer.producer_id,
                provider_id=None,
                validation_level=validation.value,
                backing_fingerprint=_backing_fingerprint(hwr_lease),
            ),
            resource_closers=(),
            release_artifact_lock=hwr_lease.close,
        )
    except BaseException:
        hwr_lease.close()
        raise


def _regions(lease: Lease) -> tuple[MappedHostRegion, ...]:
    """The HWR lease's mapped regions under the producer's file names."""
    names = [f.name for f in lease.manifest.files]
    return tuple(MappedHostRegion(file_name=names[i], address=r.address, length=r.length, read_only=True)
                 for i, r in enumerate(lease.regions()))


def _backing_fingerprint(lease: Lease) -> str:
    """What the mapped bytes are: each blob's digest, device, inode and size
    (a blob replaced under the same name gets another fingerprint)."""
    digest = hashlib.sha256(lease.key.encode("ascii"))
    for entry, path in zip(lease.manifest.files, lease.paths):
        st = os.stat(path)
        digest.update(f"{entry.blob}:{st.st_dev}:{st.st_ino}:{st.st_size};".encode("ascii"))
    return digest.hexdigest()
