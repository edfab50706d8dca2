from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishRequest(_message.Message):
    __slots__ = ("plan", "chunk", "commit", "written")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    plan: PublishPlan
    chunk: PayloadChunk
    commit: PublishCommit
    written: FileWritten
    def __init__(self, plan: _Optional[_Union[PublishPlan, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ..., commit: _Optional[_Union[PublishCommit, _Mapping]] = ..., written: _Optional[_Union[FileWritten, _Mapping]] = ...) -> None: ...

class PublishPlan(_message.Message):
    __slots__ = ("identity_json", "files", "blocks", "ordered", "declared_content_digest", "annotations_json", "file_handoff", "tensor_sha256")
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    DECLARED_CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    FILE_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    identity_json: str
    files: _containers.RepeatedCompositeFieldContainer[FilePlan]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPlan]
    ordered: bool
    declared_content_digest: str
    annotations_json: str
    file_handoff: bool
    tensor_sha256: bool
    def __init__(self, identity_json: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FilePlan, _Mapping]]] = ..., blocks: _Optional[_Iterable[_Union[BlockPlan, _Mapping]]] = ..., ordered: _Optional[bool] = ..., declared_content_digest: _Optional[str] = ..., annotations_json: _Optional[str] = ..., file_handoff: _Optional[bool] = ..., tensor_sha256: _Optional[bool] = ...) -> None: ...

class FilePlan(_message.Message):
    __slots__ = ("name", "tensors", "declared_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorPlan]
    declared_sha256: str
    def __init__(self, name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorPlan, _Mapping]]] = ..., declared_sha256: _Optional[str] = ...) -> None: ...

class TensorPlan(_message.Message):
    __slots__ = ("name", "dtype", "shape", "declared_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DECLARED_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    declared_sha256: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., declared_sha256: _Optional[str] = ...) -> None: ...

class BlockPlan(_message.Message):
    __slots__ = ("index", "prefix", "tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    prefix: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., prefix: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class FileWritten(_message.Message):
    __slots__ = ("file_index", "data_bytes", "complete")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    data_bytes: int
    complete: bool
    def __init__(self, file_index: _Optional[int] = ..., data_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class PayloadChunk(_message.Message):
    __slots__ = ("file_index", "offset", "data")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    offset: int
    data: bytes
    def __init__(self, file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishEvent(_message.Message):
    __slots__ = ("accepted", "committed")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    accepted: PublishAccepted
    committed: PublishCommitted
    def __init__(self, accepted: _Optional[_Union[PublishAccepted, _Mapping]] = ..., committed: _Optional[_Union[PublishCommitted, _Mapping]] = ...) -> None: ...

class PublishAccepted(_message.Message):
    __slots__ = ("key", "publication_id", "files", "max_chunk_bytes", "already_published", "handoff_token")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TOKEN_FIELD_NUMBER: _ClassVar[int]
    key: str
    publication_id: str
    files: _containers.RepeatedCompositeFieldContainer[FileLayout]
    max_chunk_bytes: int
    already_published: bool
    handoff_token: str
    def __init__(self, key: _Optional[str] = ..., publication_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileLayout, _Mapping]]] = ..., max_chunk_bytes: _Optional[int] = ..., already_published: _Optional[bool] = ..., handoff_token: _Optional[str] = ...) -> None: ...

class FileLayout(_message.Message):
    __slots__ = ("data_size", "tensor_offsets")
    DATA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    data_size: int
    tensor_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data_size: _Optional[int] = ..., tensor_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishCommitted(_message.Message):
    __slots__ = ("key", "manifest_json", "bytes_written", "already_published")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    key: str
    manifest_json: str
    bytes_written: int
    already_published: bool
    def __init__(self, key: _Optional[str] = ..., manifest_json: _Optional[str] = ..., bytes_written: _Optional[int] = ..., already_published: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("manifest_json", "publisher")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    publisher: Publisher
    def __init__(self, manifest_json: _Optional[str] = ..., publisher: _Optional[_Union[Publisher, _Mapping]] = ...) -> None: ...

class Publisher(_message.Message):
    __slots__ = ("via", "uid", "uid_known", "pid", "program", "published_unix", "source", "signer", "text")
    VIA_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    UID_KNOWN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    via: str
    uid: int
    uid_known: bool
    pid: int
    program: str
    published_unix: int
    source: str
    signer: str
    text: str
    def __init__(self, via: _Optional[str] = ..., uid: _Optional[int] = ..., uid_known: _Optional[bool] = ..., pid: _Optional[int] = ..., program: _Optional[str] = ..., published_unix: _Optional[int] = ..., source: _Optional[str] = ..., signer: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "keepalive")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    keepalive: Keepalive
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("pid", "client_name", "reattach_lease_ids")
    PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REATTACH_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    client_name: str
    reattach_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pid: _Optional[int] = ..., client_name: _Optional[str] = ..., reattach_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Keepalive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "keepalive_ack")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_ACK_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    keepalive_ack: KeepaliveAck
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., keepalive_ack: _Optional[_Union[KeepaliveAck, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "keepalive_interval_ms", "keepalive_timeout_ms", "reattached_lease_ids", "lost_lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOST_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keepalive_interval_ms: int
    keepalive_timeout_ms: int
    reattached_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lost_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., keepalive_interval_ms: _Optional[int] = ..., keepalive_timeout_ms: _Optional[int] = ..., reattached_lease_ids: _Optional[_Iterable[str]] = ..., lost_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepaliveAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("session_id", "key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    key: str
    def __init__(self, session_id: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class AcquireLeaseReply(_message.Message):
    __slots__ = ("lease_id", "manifest_json", "blob_paths", "publisher")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOB_PATHS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    manifest_json: str
    blob_paths: _containers.RepeatedScalarFieldContainer[str]
    publisher: Publisher
    def __init__(self, lease_id: _Optional[str] = ..., manifest_json: _Optional[str] = ..., blob_paths: _Optional[_Iterable[str]] = ..., publisher: _Optional[_Union[Publisher, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: str
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ReportCorruptionRequest(_message.Message):
    __slots__ = ("key", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    detail: str
    def __init__(self, key: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportCorruptionReply(_message.Message):
    __slots__ = ("quarantined", "problems")
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    quarantined: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, quarantined: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class AdmitRegistrationRequest(_message.Message):
    __slots__ = ("session_id", "nbytes", "label", "wait_ms", "queue_ticket", "ranges")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TICKET_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nbytes: int
    label: str
    wait_ms: int
    queue_ticket: str
    ranges: _containers.RepeatedCompositeFieldContainer[PinnedRange]
    def __init__(self, session_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., label: _Optional[str] = ..., wait_ms: _Optional[int] = ..., queue_ticket: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[PinnedRange, _Mapping]]] = ...) -> None: ...

class PinnedRange(_message.Message):
    __slots__ = ("key", "offset", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AdmitRegistrationReply(_message.Message):
    __slots__ = ("admitted", "registration_id", "chunk_bytes", "reason", "detail", "queue_ticket", "retry_after_ms", "queue_position")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TICKET_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    registration_id: str
    chunk_bytes: int
    reason: str
    detail: str
    queue_ticket: str
    retry_after_ms: int
    queue_position: int
    def __init__(self, admitted: _Optional[bool] = ..., registration_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., queue_ticket: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., queue_position: _Optional[int] = ...) -> None: ...

class ReportRegistrationChunkRequest(_message.Message):
    __slots__ = ("session_id", "registration_id", "nbytes", "seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    registration_id: str
    nbytes: int
    seconds: float
    def __init__(self, session_id: _Optional[str] = ..., registration_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReportRegistrationChunkReply(_message.Message):
    __slots__ = ("known", "complete")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    complete: bool
    def __init__(self, known: _Optional[bool] = ..., complete: _Optional[bool] = ...) -> None: ...

class ReleaseRegistrationRequest(_message.Message):
    __slots__ = ("session_id", "registration_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    registration_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., registration_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseRegistrationReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ResolveSourcesRequest(_message.Message):
    __slots__ = ("paths", "seen")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    seen: _containers.RepeatedCompositeFieldContainer[FileIdentity]
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., seen: _Optional[_Iterable[_Union[FileIdentity, _Mapping]]] = ...) -> None: ...

class ResolveSourcesReply(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[SourceDigest]
    def __init__(self, sources: _Optional[_Iterable[_Union[SourceDigest, _Mapping]]] = ...) -> None: ...

class SourceDigest(_message.Message):
    __slots__ = ("path", "content_id", "size", "cached", "origin")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    path: str
    content_id: str
    size: int
    cached: bool
    origin: str
    def __init__(self, path: _Optional[str] = ..., content_id: _Optional[str] = ..., size: _Optional[int] = ..., cached: _Optional[bool] = ..., origin: _Optional[str] = ...) -> None: ...

class ArtifactSummary(_message.Message):
    __slots__ = ("key", "state", "contract_name", "contract_version", "producer_id", "producer_version", "size_bytes", "file_count", "tensor_count", "block_count", "created_unix", "lease_count", "last_leased_unix", "reason", "publisher")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_LEASED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    key: str
    state: str
    contract_name: str
    contract_version: int
    producer_id: str
    producer_version: str
    size_bytes: int
    file_count: int
    tensor_count: int
    block_count: int
    created_unix: int
    lease_count: int
    last_leased_unix: int
    reason: str
    publisher: Publisher
    def __init__(self, key: _Optional[str] = ..., state: _Optional[str] = ..., contract_name: _Optional[str] = ..., contract_version: _Optional[int] = ..., producer_id: _Optional[str] = ..., producer_version: _Optional[str] = ..., size_bytes: _Optional[int] = ..., file_count: _Optional[int] = ..., tensor_count: _Optional[int] = ..., block_count: _Optional[int] = ..., created_unix: _Optional[int] = ..., lease_count: _Optional[int] = ..., last_leased_unix: _Optional[int] = ..., reason: _Optional[str] = ..., publisher: _Optional[_Union[Publisher, _Mapping]] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListArtifactsReply(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactSummary]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactSummary, _Mapping]]] = ...) -> None: ...

class InspectArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class InspectArtifactReply(_message.Message):
    __slots__ = ("summary", "manifest_json", "leases")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    summary: ArtifactSummary
    manifest_json: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, summary: _Optional[_Union[ArtifactSummary, _Mapping]] = ..., manifest_json: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class VerifyArtifactRequest(_message.Message):
    __slots__ = ("key", "all")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    key: str
    all: bool
    def __init__(self, key: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("key", "ok", "problems", "quarantined", "bytes_checked")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    key: str
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    quarantined: bool
    bytes_checked: int
    def __init__(self, key: _Optional[str] = ..., ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ..., quarantined: _Optional[bool] = ..., bytes_checked: _Optional[int] = ...) -> None: ...

class VerifyArtifactReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...

class DeleteArtifactRequest(_message.Message):
    __slots__ = ("key", "force")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    force: bool
    def __init__(self, key: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteArtifactReply(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id_prefix", "key", "pid", "client_name", "acquired_unix", "state")
    LEASE_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    lease_id_prefix: str
    key: str
    pid: int
    client_name: str
    acquired_unix: int
    state: str
    def __init__(self, lease_id_prefix: _Optional[str] = ..., key: _Optional[str] = ..., pid: _Optional[int] = ..., client_name: _Optional[str] = ..., acquired_unix: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLeasesReply(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class CollectGarbageRequest(_message.Message):
    __slots__ = ("dry_run", "target_bytes")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    target_bytes: int
    def __init__(self, dry_run: _Optional[bool] = ..., target_bytes: _Optional[int] = ...) -> None: ...

class GcItem(_message.Message):
    __slots__ = ("kind", "name", "bytes", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    bytes: int
    reason: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., bytes: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class CollectGarbageReply(_message.Message):
    __slots__ = ("items", "bytes_freed", "executed", "usage_before", "usage_after", "deferred_reason")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    EXECUTED_FIELD_NUMBER: _ClassVar[int]
    USAGE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    USAGE_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_REASON_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GcItem]
    bytes_freed: int
    executed: bool
    usage_before: int
    usage_after: int
    deferred_reason: str
    def __init__(self, items: _Optional[_Iterable[_Union[GcItem, _Mapping]]] = ..., bytes_freed: _Optional[int] = ..., executed: _Optional[bool] = ..., usage_before: _Optional[int] = ..., usage_after: _Optional[int] = ..., deferred_reason: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsReply(_message.Message):
    __slots__ = ("stats_json",)
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    def __init__(self, stats_json: _Optional[str] = ...) -> None: ...

class SourceRecord(_message.Message):
    __slots__ = ("path", "content_id", "size", "mtime_ns", "recorded_unix")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    RECORDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    path: str
    content_id: str
    size: int
    mtime_ns: int
    recorded_unix: int
    def __init__(self, path: _Optional[str] = ..., content_id: _Optional[str] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., recorded_unix: _Optional[int] = ...) -> None: ...

class ListSourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSourcesReply(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SourceRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[SourceRecord, _Mapping]]] = ...) -> None: ...

class ForgetSourceRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ForgetSourceReply(_message.Message):
    __slots__ = ("forgotten",)
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    forgotten: bool
    def __init__(self, forgotten: _Optional[bool] = ...) -> None: ...

class PullOnMissRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("key", "reference")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    reference: str
    def __init__(self, key: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("reference",)
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    reference: str
    def __init__(self, reference: _Optional[str] = ...) -> None: ...

class TransferEvent(_message.Message):
    __slots__ = ("progress", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: TransferProgress
    done: TransferDone
    def __init__(self, progress: _Optional[_Union[TransferProgress, _Mapping]] = ..., done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "layers_done", "layers_total")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    layers_done: int
    layers_total: int
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., layers_done: _Optional[int] = ..., layers_total: _Optional[int] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("key", "reference", "manifest_digest", "bytes_transferred", "layers_transferred", "layers_skipped", "seconds", "already_present", "signature_digest", "signer")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    key: str
    reference: str
    manifest_digest: str
    bytes_transferred: int
    layers_transferred: int
    layers_skipped: int
    seconds: float
    already_present: bool
    signature_digest: str
    signer: str
    def __init__(self, key: _Optional[str] = ..., reference: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., bytes_transferred: _Optional[int] = ..., layers_transferred: _Optional[int] = ..., layers_skipped: _Optional[int] = ..., seconds: _Optional[float] = ..., already_present: _Optional[bool] = ..., signature_digest: _Optional[str] = ..., signer: _Optional[str] = ...) -> None: ...

class ResolveLeaseRequest(_message.Message):
    __slots__ = ("session_id", "identity_json", "sources", "wait")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    identity_json: str
    sources: _containers.RepeatedCompositeFieldContainer[NamedSource]
    wait: bool
    def __init__(self, session_id: _Optional[str] = ..., identity_json: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[NamedSource, _Mapping]]] = ..., wait: _Optional[bool] = ...) -> None: ...

class NamedSource(_message.Message):
    __slots__ = ("name", "path", "content_id", "seen")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    content_id: str
    seen: FileIdentity
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., content_id: _Optional[str] = ..., seen: _Optional[_Union[FileIdentity, _Mapping]] = ...) -> None: ...

class ResolveLeaseReply(_message.Message):
    __slots__ = ("state", "sources", "refused", "key", "reason", "candidates", "lease_id", "manifest_json", "blob_paths", "publisher")
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOB_PATHS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    state: str
    sources: _containers.RepeatedCompositeFieldContainer[SourceDigest]
    refused: _containers.RepeatedScalarFieldContainer[str]
    key: str
    reason: str
    candidates: bool
    lease_id: str
    manifest_json: str
    blob_paths: _containers.RepeatedScalarFieldContainer[str]
    publisher: Publisher
    def __init__(self, state: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[SourceDigest, _Mapping]]] = ..., refused: _Optional[_Iterable[str]] = ..., key: _Optional[str] = ..., reason: _Optional[str] = ..., candidates: _Optional[bool] = ..., lease_id: _Optional[str] = ..., manifest_json: _Optional[str] = ..., blob_paths: _Optional[_Iterable[str]] = ..., publisher: _Optional[_Union[Publisher, _Mapping]] = ...) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("dev", "ino", "size", "mtime_ns")
    DEV_FIELD_NUMBER: _ClassVar[int]
    INO_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    dev: int
    ino: int
    size: int
    mtime_ns: int
    def __init__(self, dev: _Optional[int] = ..., ino: _Optional[int] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ...) -> None: ...
