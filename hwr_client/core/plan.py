"""Publication plans: which tensors go into which payload file, in what order,
and which tensors form each streamable block.

The client builds a plan from tensors (:func:`hwr_client.tensors.build_plan`,
the torch half), the daemon receives it over the wire (:func:`from_proto`)
and both check it with ONE function (:func:`check_plan`), which also computes
the aligned file layouts and the block byte ranges that end up in the
manifest. This module is torch-free: the daemon imports it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Mapping, Sequence

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.annotations import (
    MAX_ANNOTATIONS_BYTES,
    annotations_json,
    check_annotations,
    parse_annotations,
)
from hwr_client.core.digests import check_label_text
from hwr_client.core.errors import InvalidArgument, ResourceExhausted
from hwr_client.core.identity import Identity
from hwr_client.core.layout import MAX_HEADER_BYTES, FileLayout, TensorSpec, layout_file
# manifest imports this module only for type annotations: no import cycle.
from hwr_client.core.manifest import (
    FORMAT_VERSION,
    BlockEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    content_digest,
)

#: Default size at which block files are split: blocks are packed into files
#: of about this size (a block is never split across files).
FILE_TARGET_BYTES = 512 * 1024 * 1024
# \Z, not $: "$" also matches before a trailing newline.
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_CONTENT_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
# `blocks.3.`, `layers.3.`, `transformer_blocks.3.`, `single_transformer_blocks.3.`,
# optionally under a module path (`model.layers.3.`).
_BLOCK_NAME = re.compile(r"^((?:.*\.)?(?:blocks|layers|transformer_blocks|single_transformer_blocks|h)\.)(\d+)\.")


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One payload file as planned: a label, its tensors in layout order,
    and optionally the SHA-256 hex the client expects for the whole file
    (empty when not declared; checked at commit when given)."""

    name: str
    tensors: tuple[TensorSpec, ...]
    declared_sha256: str = ""


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """One streamable block as planned: its position in execution order,
    the name prefix its tensors share (``blocks.3.``) and their names, which
    must be adjacent and in order in one file."""

    index: int
    prefix: str
    tensors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """A publication plan: which tensors go into which file, in what order,
    and which form each block. Unchecked; :func:`check_plan` checks it.

    ``ordered``: the payload arrives strictly in file and offset order, so
    the daemon hashes while writing (otherwise it hashes by read-back).
    ``declared_content_digest``: the ``sha256:<hex>`` content digest the
    client expects, checked at commit; empty if none.
    ``annotations``: an opaque object the daemon stores unchanged in the
    manifest (:mod:`hwr_client.core.annotations`); None for none.
    ``tensor_sha256``: the manifest records each tensor's SHA-256 (format 1)
    instead of its xxh3-128 (format 2): for a consumer whose own format
    needs one (vLLM-Omni); the daemon then hashes the tensors with SHA-256
    a second time.
    """

    identity: Identity
    files: tuple[FileSpec, ...]
    blocks: tuple[BlockSpec, ...]
    ordered: bool = True
    declared_content_digest: str = ""
    annotations: Mapping[str, Any] | None = None
    tensor_sha256: bool = False


@dataclasses.dataclass(frozen=True)
class CheckedBlock:
    """A block of a checked plan with its byte range: ``[begin, end)`` are
    ABSOLUTE offsets in file ``file`` (header included), from the first
    tensor's first byte to the last tensor's last."""

    index: int
    prefix: str
    file: int
    begin: int
    end: int
    tensors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CheckedPlan:
    """A plan that passed :func:`check_plan`, with one aligned layout per
    file (same order as ``plan.files``) and the blocks' byte ranges."""

    plan: PlanSpec
    layouts: tuple[FileLayout, ...]
    blocks: tuple[CheckedBlock, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all payload files together, headers included."""
        return sum(lay.file_size for lay in self.layouts)


def derive_blocks(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Groups tensor names into blocks by their ``<stack>.<N>.`` prefix.

    Stacks keep the order in which they first appear; within a stack blocks
    are ordered by N numerically. Names that match no stack are not in a block.
    """
    stacks: dict[str, dict[int, list[str]]] = {}
    for name in names:
        m = _BLOCK_NAME.match(name)
        if m:
            stacks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(name)
    return [(f"{stack}{n}.", group[n]) for stack, group in stacks.items() for n in sorted(group)]


def check_plan(plan: PlanSpec) -> CheckedPlan:
    """Validates a plan and computes its layouts and block ranges.

    Raises:
        InvalidArgument: naming the file, tensor or block at fault.
    """
    if not plan.files:
        raise InvalidArgument("publication plan: expected at least one file, got none")
    where: dict[str, tuple[int, int]] = {}
    layouts = []
    for fi, f in enumerate(plan.files):
        if not f.tensors:
            raise InvalidArgument(f"publication plan: file {fi} ({f.name!r}) has zero tensors")
        if f.declared_sha256 and not _HEX64.match(f.declared_sha256):
            raise InvalidArgument(f"publication plan: file {fi} declared_sha256 must be 64 lowercase hex")
        for ti, t in enumerate(f.tensors):
            if t.name in where:
                raise InvalidArgument(f"publication plan: duplicate tensor name {t.name!r}")
            where[t.name] = (fi, ti)
        layouts.append(layout_file(f.tensors))
    if plan.declared_content_digest and not _CONTENT_DIGEST.match(plan.declared_content_digest):
        raise InvalidArgument("publication plan: declared_content_digest must be 'sha256:<64 hex>'")
    if plan.annotations is not None:
        check_annotations(plan.annotations, what="publication plan: annotations")
    checked: list[CheckedBlock] = []
    owner: dict[str, int] = {}  # tensor name -> the block that holds it
    for bi, b in enumerate(plan.blocks):
        if b.index != bi:
            raise InvalidArgument(f"publication plan: block {bi} has index {b.index}, expected {bi}")
        if not b.tensors:
            raise InvalidArgument(f"publication plan: block {bi} ({b.prefix!r}) names no tensors")
        for n in b.tensors:
            if n not in where:
                raise InvalidArgument(f"publication plan: block {bi} names unknown tensor {n!r}")
            if n in owner:
                raise InvalidArgument(f"publication plan: tensor {n!r} is in blocks {owner[n]} and {bi}")
            owner[n] = bi
        fi, t0 = where[b.tensors[0]]
        for k, n in enumerate(b.tensors):
            if where[n] != (fi, t0 + k):
                raise InvalidArgument(
                    f"publication plan: block {bi} ({b.prefix!r}) tensors must be adjacent and in order in one file; "
                    f"{n!r} is not"
                )
        lay = layouts[fi]
        last = lay.tensors[t0 + len(b.tensors) - 1]
        begin = lay.data_start + lay.tensor_offsets[t0]
        end = lay.data_start + lay.tensor_offsets[t0 + len(b.tensors) - 1] + last.nbytes
        checked.append(CheckedBlock(bi, b.prefix, fi, begin, end, tuple(b.tensors)))
    return CheckedPlan(plan, tuple(layouts), tuple(checked))


# -- limits ---------------------------------------------------------------------

#: The smallest header entry a tensor adds to its file's safetensors header:
#: ``"<name>":{"dtype":"U8","shape":[],"data_offsets":[0,1]},`` without the
#: name is 50 bytes. A lower bound, so the plan-time estimate never refuses a
#: header the exact check would accept.
_MIN_HEADER_ENTRY = 50


@dataclasses.dataclass(frozen=True)
class PlanLimits:
    """What one publication plan may ask of the daemon (DESIGN §16): each
    field is a ``ServerConfig`` field of the same name, whose documentation
    gives its unit and default; ``field`` names it in every refusal.

    The counts are checked on the wire message by :func:`check_plan_message`
    BEFORE any object is built from it, so the memory a plan costs is bounded
    by these numbers, not by the 64 MiB message limit; the exact sizes
    (headers, manifest) once the plan is checked (:func:`check_plan_sizes`).
    """

    max_artifact_tensors: int = 65536
    max_artifact_files: int = 1024
    max_tensor_name_bytes: int = 1024
    max_tensor_dims: int = 8
    max_header_bytes: int = 16 * 1024 * 1024
    max_manifest_bytes: int = 32 * 1024 * 1024


def _exhausted(what: str, value: int, limit: int, field: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"publication plan: {what} {value} exceeds the limit {limit} (ServerConfig.{field}); "
        "split the artifact or raise the limit in the daemon's config"
    )


def check_plan_message(msg: pb.PublishPlan, limits: PlanLimits) -> None:
    """Checks the counts of a wire plan against ``limits`` before anything is
    built from it: files, tensors, block entries, identity size, then per
    tensor its name length and dimensions, and per file a lower bound of its
    header size. Costs O(files) until the counts pass, O(tensors) after.

    Raises:
        ResourceExhausted: too many files, tensors or block entries, or a
            header or identity too large (a limit of capacity).
        InvalidArgument: a tensor name too long or too many dimensions (a
            malformed tensor).
    """
    if len(msg.files) > limits.max_artifact_files:
        raise _exhausted("files", len(msg.files), limits.max_artifact_files, "max_artifact_files")
    tensors = sum(len(f.tensors) for f in msg.files)
    if tensors > limits.max_artifact_tensors:
        raise _exhausted("tensors", tensors, limits.max_artifact_tensors, "max_artifact_tensors")
    # Blocks repeat tensor names: bounded by the same count (each tensor is in
    # at most one block, which check_plan enforces once the objects exist).
    if len(msg.blocks) > limits.max_artifact_tensors:
        raise _exhausted("blocks", len(msg.blocks), limits.max_artifact_tensors, "max_artifact_tensors")
    in_blocks = sum(len(b.tensors) for b in msg.blocks)
    if in_blocks > limits.max_artifact_tensors:
        raise _exhausted("tensor names in blocks", in_blocks, limits.max_artifact_tensors, "max_artifact_tensors")
    # The identity is stored in the manifest: one that cannot fit it never could be served.
    if len(msg.identity_json) > limits.max_manifest_bytes:
        raise _exhausted("identity bytes", len(msg.identity_json), limits.max_manifest_bytes, "max_manifest_bytes")
    # Annotations have their own fixed limit: a str of n characters holds at
    # least n UTF-8 bytes, so a longer one is refused before from_proto
    # parses it (the exact canonical size is checked there).
    if len(msg.annotations_json) > MAX_ANNOTATIONS_BYTES:
        raise InvalidArgument(f"publication plan: annotations of {len(msg.annotations_json)} characters exceed the "
                              f"limit {MAX_ANNOTATIONS_BYTES} bytes (MAX_ANNOTATIONS_BYTES)")
    for fi, f in enumerate(msg.files):
        check_label_text(f.name, f"publication plan: files[{fi}].name")
        header = 0
        for t in f.tensors:
            _check_name_bytes(t.name, f"file {fi} tensor", limits)
            if len(t.shape) > limits.max_tensor_dims:
                raise InvalidArgument(
                    f"publication plan: tensor {t.name!r} has {len(t.shape)} dimensions; at most "
                    f"{limits.max_tensor_dims} (ServerConfig.max_tensor_dims)"
                )
            header += len(t.name) + _MIN_HEADER_ENTRY
        if header > limits.max_header_bytes:
            raise _exhausted(f"file {fi} header bytes (at least)", header, limits.max_header_bytes,
                             "max_header_bytes")
    for bi, b in enumerate(msg.blocks):
        check_label_text(b.prefix, f"publication plan: blocks[{bi}].prefix")
        _check_name_bytes(b.prefix, "block prefix", limits)


def _check_name_bytes(name: str, what: str, limits: PlanLimits) -> None:
    # A str of n characters has n to 4n UTF-8 bytes: encode only when that decides.
    n = len(name)
    if n > limits.max_tensor_name_bytes or (4 * n > limits.max_tensor_name_bytes
                                            and len(name.encode("utf-8")) > limits.max_tensor_name_bytes):
        raise InvalidArgument(
            f"publication plan: {what} name {name[:64]!r}... is longer than {limits.max_tensor_name_bytes} UTF-8 "
            "bytes (ServerConfig.max_tensor_name_bytes)"
        )


def check_plan_sizes(checked: CheckedPlan, limits: PlanLimits) -> None:
    """Checks the exact header size of every file and the size the manifest
    will have, before anything is staged: a header the safetensors parser
    would refuse, or a manifest that cannot be sent in one gRPC message
    (Lookup, AcquireLease), must never be published.

    Raises:
        ResourceExhausted: naming the file or the manifest, its size and the limit.
    """
    header_limit = min(limits.max_header_bytes, MAX_HEADER_BYTES)
    for fi, lay in enumerate(checked.layouts):
        if len(lay.header) > header_limit:
            raise _exhausted(f"file {fi} header bytes", len(lay.header), header_limit, "max_header_bytes")
    size = planned_manifest_bytes(checked)
    if size > limits.max_manifest_bytes:
        raise _exhausted("manifest bytes", size, limits.max_manifest_bytes, "max_manifest_bytes")


def check_manifest_limits(manifest: Manifest, limits: PlanLimits, *, what: str, manifest_bytes: int) -> None:
    """The plan limits and label checks applied to a manifest that did not
    come through a plan (a pull): an artifact this node could not have
    published is not taken from a registry either (it could not be served:
    a Lookup of its manifest, a header the parser refuses).

    Args:
        manifest: the parsed manifest.
        limits: the daemon's plan limits.
        what: names it in errors (``registry/repo:tag``).
        manifest_bytes: the size of its JSON as received.

    Raises:
        ResourceExhausted: files, tensors, blocks, a header or the manifest
            over their limits (naming the ServerConfig field).
        InvalidArgument: a NUL in a file label or block prefix, a tensor name
            or prefix too long, too many dimensions.
    """
    def over(thing: str, value: int, limit: int, field: str) -> ResourceExhausted:
        return ResourceExhausted(f"{what}: {thing} {value} exceeds the limit {limit} (ServerConfig.{field}); "
                                 "this node would not publish it, so it does not pull it either")

    counts = (("files", len(manifest.files), limits.max_artifact_files, "max_artifact_files"),
              ("tensors", len(manifest.tensors), limits.max_artifact_tensors, "max_artifact_tensors"),
              ("blocks", len(manifest.blocks), limits.max_artifact_tensors, "max_artifact_tensors"),
              ("manifest bytes", manifest_bytes, limits.max_manifest_bytes, "max_manifest_bytes"))
    for thing, value, limit, field in counts:
        if value > limit:
            raise over(thing, value, limit, field)
    header_limit = min(limits.max_header_bytes, MAX_HEADER_BYTES)
    for f in manifest.files:
        check_label_text(f.name, f"{what}: files[{f.index}].name")
        if f.data_start - 8 > header_limit:  # 8: the header's length prefix
            raise over(f"file {f.index} header bytes", f.data_start - 8, header_limit, "max_header_bytes")
    for t in manifest.tensors:
        _check_name_bytes(t.name, f"{what}: tensor", limits)
        if len(t.shape) > limits.max_tensor_dims:
            raise InvalidArgument(f"{what}: tensor {t.name!r} has {len(t.shape)} dimensions; at most "
                                  f"{limits.max_tensor_dims} (ServerConfig.max_tensor_dims)")
    for b in manifest.blocks:
        check_label_text(b.prefix, f"{what}: blocks[{b.index}].prefix")
        _check_name_bytes(b.prefix, f"{what}: block prefix", limits)


def to_proto(plan: PlanSpec) -> pb.PublishPlan:
    """The wire form of ``plan`` (:func:`from_proto` reads it back)."""
    return pb.PublishPlan(
        identity_json=plan.identity.to_json(),
        files=[
            pb.FilePlan(
                name=f.name,
                declared_sha256=f.declared_sha256,
                tensors=[pb.TensorPlan(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in f.tensors],
            )
            for f in plan.files
        ],
        blocks=[pb.BlockPlan(index=b.index, prefix=b.prefix, tensors=list(b.tensors)) for b in plan.blocks],
        ordered=plan.ordered,
        declared_content_digest=plan.declared_content_digest,
        annotations_json=annotations_json(dict(plan.annotations)) if plan.annotations is not None else "",
        tensor_sha256=plan.tensor_sha256,
    )


def from_proto(msg: pb.PublishPlan) -> PlanSpec:
    """Converts a wire plan; identity and names are validated here, the rest
    by :func:`check_plan`.

    Raises:
        InvalidArgument: bad identity JSON or field.
    """
    identity = Identity.from_json(msg.identity_json)
    files = tuple(
        FileSpec(f.name, tuple(TensorSpec(t.name, t.dtype, tuple(int(d) for d in t.shape)) for t in f.tensors),
                 f.declared_sha256)
        for f in msg.files
    )
    blocks = tuple(BlockSpec(b.index, b.prefix, tuple(b.tensors)) for b in msg.blocks)
    annotations = parse_annotations(msg.annotations_json, what="publication plan: annotations")
    return PlanSpec(identity, files, blocks, msg.ordered, msg.declared_content_digest, annotations,
                    tensor_sha256=msg.tensor_sha256)


def build_manifest(
    checked: CheckedPlan,
    file_digests: Sequence[tuple[str, str]],
    tensor_digests: Mapping[str, str],
    block_xxh: Sequence[str],
    *,
    created_unix: int | None = None,
) -> Manifest:
    """Assembles the manifest from a checked plan and the computed digests:
    the one builder the daemon's publication and the reference writer share.
    It lives with the plan (the plan imports the manifest, never the reverse).

    Args:
        file_digests: per file (sha256 hex, xxh3_128 hex).
        tensor_digests: tensor name -> xxh3_128 hex (the manifest format
            :data:`~hwr_client.core.manifest.FORMAT_VERSION` 2 digest), or
            sha256 hex where the plan asks for ``tensor_sha256`` (format 1).
        block_xxh: per block xxh3_128 hex.
    """
    plan = checked.plan
    sha = plan.tensor_sha256
    files = tuple(
        FileEntry(i, f.name, file_digests[i][0], lay.file_size, file_digests[i][1], lay.data_start)
        for i, (f, lay) in enumerate(zip(plan.files, checked.layouts))
    )
    tensors = tuple(
        TensorEntry(spec.name, fi, spec.dtype, spec.shape, lay.data_start + off, spec.nbytes,
                    tensor_digests[spec.name] if sha else "", "" if sha else tensor_digests[spec.name])
        for fi, lay in enumerate(checked.layouts)
        for spec, off in zip(lay.tensors, lay.tensor_offsets)
    )
    blocks = tuple(BlockEntry(b.index, b.prefix, b.file, b.begin, b.end, block_xxh[b.index], b.tensors) for b in checked.blocks)
    digest = content_digest((t.name, t.dtype, t.shape, t.digest) for t in tensors)
    created = int(time.time()) if created_unix is None else created_unix
    annotations = dict(plan.annotations) if plan.annotations is not None else None
    return Manifest(plan.identity.key, plan.identity, digest, created, files, tensors, blocks, annotations,
                    format_version=1 if sha else FORMAT_VERSION)


def planned_manifest_bytes(checked: CheckedPlan) -> int:
    """The UTF-8 size of the manifest a publication of ``checked`` will
    store: the manifest built with placeholder digests of the real lengths,
    so the figure is exact (``created_unix`` has the same digits until 2286).
    Costs one manifest build, O(tensors)."""
    sha, xxh = "0" * 64, "0" * 32
    tensors = {spec.name: sha if checked.plan.tensor_sha256 else xxh for lay in checked.layouts for spec in lay.tensors}
    manifest = build_manifest(checked, [(sha, xxh)] * len(checked.layouts), tensors, [xxh] * len(checked.blocks))
    return len(manifest.to_json().encode("utf-8"))
