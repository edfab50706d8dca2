"""How an HWR artifact is laid out in an OCI registry (docs/many-nodes.md).

One OCI image manifest per artifact::

    {"schemaVersion": 2,
     "mediaType": "application/vnd.oci.image.manifest.v1+json",
     "artifactType": "application/vnd.hwr.artifact.v1",
     "config": {"mediaType": "application/vnd.hwr.manifest.v1+json",
                "digest": "sha256:<sha256 of manifest.json>", "size": N},
     "layers": [{"mediaType": "application/vnd.cncf.model.weight.v1.raw",
                 "digest": "sha256:<FileEntry.blob>", "size": FileEntry.size,
                 "annotations": {"org.cncf.model.filepath": "<FileEntry.name>",
                                 "org.opencontainers.image.title": "<file name, see file_titles>",
                                 "org.hwr.file.index": "<i>"}}, ...],
     "annotations": {"org.hwr.key": ..., "org.hwr.contract": "name@version",
                     "org.hwr.layout": "tp<r>of<n>-sp<s>-<backend>",
                     "org.hwr.producer": "id@version",
                     "org.hwr.content_digest": "sha256:...",
                     "org.opencontainers.image.created": RFC 3339,
                     "org.opencontainers.image.title": "<contract name>",
                     "org.opencontainers.image.version": "<contract version>"}}

The config blob is the artifact's ``manifest.json`` byte for byte; the layers
are the payload files in the manifest's file order, uncompressed, so each
layer's digest is the blob's own name in ``blobs/sha256/`` (a push never
hashes). The tag is the identity key.

Two annotations name each layer's file, for two kinds of reader: ModelPack's
``org.cncf.model.filepath`` and ``org.opencontainers.image.title``, from
which ORAS (and CRI-O's image volumes) name a pulled file and without which
``oras pull`` skips the layer. The title is the file's relative name when it
is a safe, unique file name (:func:`safe_title`), else ``<index>.safetensors``;
a pull refuses a title that is not safe (a registry must not hand an ORAS
user a path such as ``../../x``).

Why the artifact keeps its own ``artifactType`` and config media type rather
than ModelPack's (``application/vnd.cncf.model.manifest.v1+json`` and a
``…model.config.v1+json`` config): the config must be the HWR manifest (the
pull commits from it), and the payload files are a runtime layout (cast,
packed, padded), not a checkpoint a ModelPack runtime could serve; a
ModelPack artifact type would invite serving stacks to mount and load them.

:func:`check_remote` validates what a registry answered against all of it;
this module is pure (no I/O, no torch), so another tool can use it as the
reference reader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Mapping

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.manifest import Manifest

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
#: Names HWR and the format's version; a reader refuses another.
ARTIFACT_TYPE = "application/vnd.hwr.artifact.v1"
#: The config blob: the HWR manifest.json (hwr_client.core.manifest).
CONFIG_MEDIA_TYPE = "application/vnd.hwr.manifest.v1+json"
#: ModelPack's media type of an unarchived, uncompressed weight file: each
#: layer is one safetensors file, so a ModelPack-aware tool sees weights.
LAYER_MEDIA_TYPE = "application/vnd.cncf.model.weight.v1.raw"
#: ModelPack's layer annotation for the file's name.
FILEPATH_ANNOTATION = "org.cncf.model.filepath"
#: The OCI annotation ORAS names a pulled file by.
TITLE_ANNOTATION = "org.opencontainers.image.title"
#: Longest title, UTF-8 bytes (a file name on Linux).
MAX_TITLE_BYTES = 255
KEY_ANNOTATION = "org.hwr.key"
#: The largest OCI manifest read from a registry, bytes (one descriptor is
#: ~300 bytes; an artifact has at most a few hundred files).
MAX_OCI_MANIFEST_BYTES = 4 * 1024 * 1024


def digest_of(data: bytes) -> str:
    """The OCI digest (``sha256:<hex>``) of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layout(doc: Mapping[str, Any]) -> str:
    lay = doc["layout"]
    return f"tp{lay['tp_rank']}of{lay['tp_size']}-sp{lay['sp_size']}-{lay['sp_backend']}"


def safe_title(name: str) -> bool:
    """Whether ``name`` is usable as a pulled file's name: one path
    component, printable (no control characters: titles reach logs and
    terminals), not ``.`` or ``..``, at most :data:`MAX_TITLE_BYTES`."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
            and name.isprintable() and len(name.encode("utf-8")) <= MAX_TITLE_BYTES)


def file_titles(manifest: Manifest) -> list[str]:
    """Each file's title: its name when every name is a safe title and no
    two are equal, else ``<index:05d>.safetensors`` for all (one rule for
    the whole artifact, so a reader can tell which was used)."""
    names = [f.name for f in manifest.files]
    if all(safe_title(n) for n in names) and len(set(names)) == len(names):
        return names
    return [f"{f.index:05d}.safetensors" for f in manifest.files]


def build_oci_manifest(manifest: Manifest, config: bytes, *, subject: Mapping[str, Any] | None = None,
                       extra_annotations: Mapping[str, str] | None = None) -> bytes:
    """The OCI image manifest of an artifact (module docstring), as the
    bytes that are pushed; their SHA-256 is the manifest digest.

    Args:
        manifest: the artifact's manifest.
        config: its manifest.json bytes as stored (the config blob).
        subject: the descriptor of the manifest this one refers to (a
            compile artifact's weights: hwr_server.remote.companions).
        extra_annotations: added to the manifest's annotations.
    """
    doc = manifest.identity.document
    annotations = {
        KEY_ANNOTATION: manifest.key,
        "org.hwr.contract": f"{doc['contract']['name']}@{doc['contract']['version']}",
        "org.hwr.layout": _layout(doc),
        "org.hwr.producer": f"{doc['producer']['id']}@{doc['producer']['version']}",
        "org.hwr.content_digest": manifest.content_digest,
        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(manifest.created_unix)),
        "org.opencontainers.image.title": str(doc["contract"]["name"]),
        "org.opencontainers.image.version": str(doc["contract"]["version"]),
    }
    oci = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": digest_of(config), "size": len(config)},
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPE, "digest": "sha256:" + f.blob, "size": f.size,
             "annotations": {FILEPATH_ANNOTATION: f.name, TITLE_ANNOTATION: title, "org.hwr.file.index": str(f.index)}}
            for f, title in zip(manifest.files, file_titles(manifest))
        ],
        "annotations": {**annotations, **(extra_annotations or {})},
    }
    if subject is not None:
        oci["subject"] = dict(subject)
    return json.dumps(oci, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor, checked: media type, ``sha256:`` digest, size."""

    media_type: str
    digest: str
    size: int

    @property
    def hex(self) -> str:
        return self.digest[len("sha256:"):]


@dataclasses.dataclass(frozen=True)
class OciManifest:
    """A parsed and checked OCI manifest of an HWR artifact (before its
    config was fetched)."""

    digest: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: dict[str, str]


def _descriptor(value: Any, what: str, media_type: str) -> Descriptor:
    if not isinstance(value, dict):
        raise FailedPrecondition(f"{what}: expected a descriptor object, got {type(value).__name__}")
    mt, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if mt != media_type:
        raise FailedPrecondition(f"{what}: media type {mt!r}, expected {media_type!r}")
    if not (isinstance(digest, str) and digest.startswith("sha256:") and len(digest) == 71
            and all(c in "0123456789abcdef" for c in digest[7:])):
        raise FailedPrecondition(f"{what}: digest {digest!r}, expected sha256:<64 lowercase hex>")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise FailedPrecondition(f"{what}: size {size!r}, expected a non-negative integer")
    return Descriptor(mt, digest, size)


def _check_title(annotations: Any, what: str) -> None:
    """A layer's title, when it has one, must be a safe file name: ORAS
    writes the layer to that name (a ``../`` in it is a path out of the
    user's directory)."""
    title = annotations.get(TITLE_ANNOTATION) if isinstance(annotations, dict) else None
    if title is not None and not (isinstance(title, str) and safe_title(title)):
        raise FailedPrecondition(f"{what}: title {str(title)[:80]!r} is not a safe file name (one printable path "
                                 "component, not '.' or '..')")


def parse_oci_manifest(raw: bytes, *, what: str, content_type: str = "",
                       expected_digest: str = "") -> OciManifest:
    """Checks an OCI manifest a registry answered.

    Args:
        raw: the body.
        what: names it in errors (``registry/repo:tag``).
        content_type: the response's Content-Type ("" when not known).
        expected_digest: the digest it was pulled by, or "" (by tag).

    Raises:
        FailedPrecondition: not an OCI image manifest of an HWR artifact
            (wrong media type, artifactType, config type, malformed).
        DataLoss is never raised here: a digest mismatch of the manifest
            itself is FailedPrecondition too (nothing was stored).
    """
    if len(raw) > MAX_OCI_MANIFEST_BYTES:
        raise FailedPrecondition(f"{what}: manifest of {len(raw)} bytes exceeds {MAX_OCI_MANIFEST_BYTES}")
    digest = digest_of(raw)
    if expected_digest and digest != expected_digest:
        raise FailedPrecondition(f"{what}: manifest bytes hash to {digest}, expected {expected_digest}")
    if content_type and content_type.split(";")[0].strip() != MANIFEST_MEDIA_TYPE:
        raise FailedPrecondition(f"{what}: Content-Type {content_type!r}, expected {MANIFEST_MEDIA_TYPE!r} "
                                 "(not an HWR artifact)")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FailedPrecondition(f"{what}: manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FailedPrecondition(f"{what}: manifest is not a JSON object")
    if doc.get("schemaVersion") != 2 or doc.get("mediaType") != MANIFEST_MEDIA_TYPE:
        raise FailedPrecondition(f"{what}: expected schemaVersion 2 and mediaType {MANIFEST_MEDIA_TYPE!r}")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise FailedPrecondition(f"{what}: artifactType {doc.get('artifactType')!r}, expected {ARTIFACT_TYPE!r} "
                                 "(not an HWR artifact, or another format version)")
    config = _descriptor(doc.get("config"), f"{what} config", CONFIG_MEDIA_TYPE)
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise FailedPrecondition(f"{what}: expected a non-empty list of layers")
    descs = tuple(_descriptor(lay, f"{what} layer {i}", LAYER_MEDIA_TYPE) for i, lay in enumerate(layers))
    for i, lay in enumerate(layers):
        _check_title(lay.get("annotations"), f"{what} layer {i}")
    annotations = doc.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
        raise FailedPrecondition(f"{what}: annotations must map strings to strings")
    return OciManifest(digest, config, descs, dict(annotations))


def check_config(oci: OciManifest, config: bytes, *, what: str, tag: str = "") -> Manifest:
    """Checks the config blob against its descriptor and the layers against
    the HWR manifest it holds.

    Args:
        oci: the checked OCI manifest.
        config: the config blob's bytes.
        tag: the tag it was pulled by ("" by digest): must equal the key.

    Returns:
        The HWR manifest.

    Raises:
        FailedPrecondition: config bytes that do not hash to their digest,
            not an HWR manifest, a key that is not the tag or the annotation,
            layers that are not the manifest's files (digest, size, order).
    """
    if len(config) != oci.config.size or digest_of(config) != oci.config.digest:
        raise FailedPrecondition(f"{what}: config blob of {len(config)} bytes hashing to {digest_of(config)}, "
                                 f"expected {oci.config.size} bytes {oci.config.digest}")
    try:
        manifest = Manifest.from_json(config, what=f"{what} config")
    except InvalidArgument as exc:
        raise FailedPrecondition(f"{what}: the config is not an HWR manifest ({exc})") from None
    if tag and manifest.key != tag:
        raise FailedPrecondition(f"{what}: the artifact's identity key is {manifest.key}, expected the tag {tag}")
    if oci.annotations.get(KEY_ANNOTATION, manifest.key) != manifest.key:
        raise FailedPrecondition(f"{what}: annotation {KEY_ANNOTATION} {oci.annotations[KEY_ANNOTATION]!r}, "
                                 f"expected the config's key {manifest.key}")
    if len(oci.layers) != len(manifest.files):
        raise FailedPrecondition(f"{what}: {len(oci.layers)} layers, the manifest lists {len(manifest.files)} files")
    for lay, f in zip(oci.layers, manifest.files):
        if lay.hex != f.blob or lay.size != f.size:
            raise FailedPrecondition(f"{what}: layer {f.index} is {lay.size} bytes {lay.digest}, the manifest's "
                                     f"file {f.index} ({f.name}) is {f.size} bytes sha256:{f.blob}")
    return manifest


__all__ = [
    "ARTIFACT_TYPE", "CONFIG_MEDIA_TYPE", "Descriptor", "LAYER_MEDIA_TYPE", "MANIFEST_MEDIA_TYPE", "OciManifest",
    "TITLE_ANNOTATION", "build_oci_manifest", "check_config", "digest_of", "file_titles", "parse_oci_manifest",
    "safe_title",
]
