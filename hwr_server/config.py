"""Daemon configuration: one dataclass, every field with unit and default.

Read from a TOML file (``--config``) and overridden by CLI flags; both only in
the CLI code (``hwr_server.cli``). Library code never reads the environment.
Unknown keys are rejected so a typo cannot silently keep a default.

Each field's ``#:`` comment is its documentation, and a ``# -- title --``
line starts a group (plain ``#`` lines right after it explain the group):
``python -m hwr_server.config_example`` writes every key, its default and
that text into ``deploy/hwr.toml.example`` (tests/server/test_config_example.py
fails when the two disagree). A new field needs a ``#:`` comment with its
unit; then regenerate the example.

A short ``/etc/hwr/hwr.toml``::

    root = "/var/lib/hwr"
    socket = "/run/hwr/hwr.sock"
    admin_socket = "/run/hwr/admin.sock"
    socket_group = "hwr"
    capacity = "2TiB"
    source_roots = ["/models", "/var/cache/huggingface/hub"]   # optional restriction

    [remote]                       # an OCI registry (hwr push / hwr pull)
    registry = "registry.example:5000"
    repository = "hwr/artifacts"
    pull_on_miss = true
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Any

from hwr_client.core.defaults import default_paths, parse_size
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.plan import PlanLimits

# The plan limits' defaults are PlanLimits' own: one place for the numbers.
_PLAN_DEFAULTS = PlanLimits()


def is_size_key(key: str) -> bool:
    """Whether a config key holds bytes (or bytes per second), so that it
    takes a size like "64MiB" (:func:`hwr_client.core.defaults.parse_size`)."""
    return key == "capacity" or key.endswith("_bytes") or key.endswith("_bytes_per_s")


@dataclasses.dataclass
class RemoteConfig:
    """The ``[remote]`` table: the OCI registry this node pulls from and
    pushes to (hwr_server.remote.remote; docs/many-nodes.md)."""

    #: ``host[:port]`` of the registry (e.g. "registry.example:5000"); "" =
    #: no remote. Needed, with repository, by pull_on_miss and
    #: push_after_publish.
    registry: str = ""
    #: Repository artifacts live in (e.g. "hwr/artifacts"); the tag is the
    #: identity key.
    repository: str = ""
    #: A worker's resolve that misses locally asks the daemon to pull the key.
    pull_on_miss: bool = False
    #: After a publication commits, push it to the remote (in the background).
    push_after_publish: bool = False
    #: PEM file that verifies the registry's TLS certificate ("" = system store).
    ca_file: str = ""
    #: Plain HTTP instead of HTTPS (a loopback or lab registry only).
    insecure: bool = False
    #: Docker-style ``config.json`` whose ``auths`` hold the credentials
    #: (e.g. "/etc/hwr/registry.json"; mode 0600/0640, owner root or the
    #: daemon's user); "" = anonymous.
    credentials_file: str = ""
    #: Layers downloaded (or uploaded) at once. Count.
    parallel_layers: int = 4
    #: Upload in PATCH chunks of this many bytes; 0 = one monolithic PUT.
    upload_chunk_bytes: int = 0
    #: Attempts per layer download; each retry resumes with a Range request. Count.
    layer_attempts: int = 3
    #: Seconds a registry connect, a read, a response head or a small
    #: answer may take.
    timeout_s: float = 30.0
    #: What a pull checks before its commit: "file" (every file's SHA-256
    #: and size, while it downloads) or "full" (also re-hashes every tensor
    #: and block against the pulled manifest, as `hwr verify` does).
    verify_pull: str = "file"
    #: Devices whose compile artifacts a pull of a weight artifact brings
    #: along (its OCI referrers; hwr_server.remote.companions): "*" every
    #: device, a kind ("cpu", "cuda": every capability) or an exact
    #: "kind:capability" ("cuda:9.0", "cpu:avx512"); [] = none. Default ["*"]:
    #: they are small next to weights. A worker's own miss of a compile
    #: artifact still pulls it by its key.
    compile_devices: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    #: Ed25519 private key (PEM, a file of the daemon's user, mode 0600;
    #: `hwr keys generate /etc/hwr/signing.key` as that user) that signs
    #: every push; "" = pushes are unsigned. Read at each push, so `hwr keys
    #: rotate` needs no restart.
    signing_key: str = ""
    #: Public keys (`ssh-ed25519 AAAA...` lines, as `hwr keys show` prints)
    #: whose signature a pull requires: with any set, a pull or pull on a
    #: miss of an artifact no listed key signed is PERMISSION_DENIED and
    #: stores nothing. Empty (default): pulls are not checked for
    #: signatures; the configured registry is trusted (docs/trust.md).
    trusted_keys: list[str] = dataclasses.field(default_factory=list)
    #: Pulls on a miss in flight on the node at once (distinct keys; callers
    #: of a key in flight join it). More: RESOURCE_EXHAUSTED at once. Count.
    max_pulls: int = 4
    #: Pulls on a miss one user (uid; all callers without a peer token
    #: together) may have started and still in flight. Count.
    max_pulls_per_peer: int = 2
    #: A pull on a miss that failed (not found, refused, unreachable) is
    #: answered from memory for this long instead of asking the registry
    #: again. Seconds; 0 = never cached.
    miss_cache_s: float = 30.0
    #: A layer download must keep up this many bytes per second over each
    #: ``timeout_s`` window, or it is cut (UNAVAILABLE; a retry resumes).
    #: Bytes per second; 0 = no minimum.
    min_rate_bytes: int = 64 * 1024
    #: Origins (``https://auth.example[:port]``) besides the registry itself
    #: whose Bearer realm may issue its tokens (Docker Hub:
    #: ``https://auth.docker.io``). A realm elsewhere is refused: the daemon
    #: never fetches a URL a registry names, nor sends credentials there.
    token_realms: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_mapping(cls, doc: Any, *, what: str) -> "RemoteConfig":
        if not isinstance(doc, dict):
            raise InvalidArgument(f"{what}: [remote] must be a table")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - fields
        if unknown:
            raise InvalidArgument(f"{what}: unknown key(s) {sorted(unknown)} in [remote]; expected some of "
                                  f"{sorted(fields)}")
        values: dict[str, Any] = {}
        defaults = cls()
        for k, v in doc.items():
            if is_size_key(k):
                values[k] = parse_size(v)
                continue
            default = getattr(defaults, k)
            ok = (type(v) is bool if isinstance(default, bool) else type(v) is int if isinstance(default, int)
                  else type(v) in (int, float) if isinstance(default, float)
                  else isinstance(v, list) and all(isinstance(x, str) for x in v) if isinstance(default, list)
                  else isinstance(v, str))
            if not ok:
                raise InvalidArgument(f"{what}: remote.{k} = {v!r} has the wrong type; expected "
                                      f"{type(default).__name__}")
            values[k] = float(v) if isinstance(default, float) else v
        return cls(**values)


@dataclasses.dataclass
class ServerConfig:
    """Everything ``hwr serve`` can be told."""

    # -- paths and sockets --
    #: Store root directory (one filesystem; one daemon per root). Empty:
    #: /var/lib/hwr as root, else $XDG_DATA_HOME/hwr (~/.local/share/hwr).
    #: The systemd unit's StateDirectory creates /var/lib/hwr.
    root: str = ""
    #: Runtime socket, for workers: mode 0660, group ``socket_group``. Empty:
    #: /run/hwr/hwr.sock as root, else $XDG_RUNTIME_DIR/hwr/hwr.sock.
    socket: str = ""
    #: Admin socket, for operators (rm, gc, verify): mode 0600. Empty:
    #: /run/hwr/admin.sock as root, else $XDG_RUNTIME_DIR/hwr/admin.sock.
    admin_socket: str = ""
    #: Group that owns the runtime socket: workers must be in it (``usermod
    #: -aG GROUP USER``); anyone else is refused at connect. Empty: the
    #: daemon's own group (``hwr`` under the systemd unit).
    socket_group: str = ""
    # -- capacity and garbage collection --
    # GC deletes unleased artifacts, least recently leased first.
    #: Byte budget of the root, e.g. "2TiB"; 0 = unlimited (only the disk's
    #: free space). Sizes take B, KB/MB/GB/TB or KiB/MiB/GiB/TiB.
    capacity: int = 0
    #: GC starts above this fraction of capacity ...
    gc_high_watermark: float = 0.90
    #: ... and collects down to this fraction.
    gc_low_watermark: float = 0.80
    #: Seconds between automatic capacity checks.
    gc_interval_s: float = 30.0
    # -- canonical checkpoints --
    #: Optional restriction of the files the daemon vouches for (hashes and
    #: caches content ids of). Empty (the default): any regular file that a
    #: caller whose uid the credentials handshake proved may read, at a path
    #: where the caller sees the same file as the daemon. Set: only files
    #: under these absolute directories, then also for callers of unknown
    #: uid (files anyone may read). See hwr_server.sources.access.
    source_roots: list[str] = dataclasses.field(default_factory=list)
    # -- sessions, leases and shutdown --
    #: Client keepalive period, milliseconds.
    keepalive_interval_ms: int = 5000
    #: A session without a keepalive for this long loses its leases, ms.
    keepalive_timeout_ms: int = 30000
    #: After a restart, persisted leases wait this long for their clients to
    #: re-attach; GC does not run before it ends. Seconds.
    lease_grace_s: float = 60.0
    #: SIGTERM: in-flight calls get this long to finish. Seconds.
    shutdown_grace_s: float = 10.0
    # -- publications --
    #: Largest payload chunk accepted, bytes.
    max_chunk_bytes: int = 4 * 1024 * 1024
    #: Publications running at once; more wait at plan. Count.
    max_publications: int = 4
    #: Threads hashing source files / verifying. Count; 0 = automatic: 2 x CPU
    #: count for source files (a thread waiting on the disk leaves its core to
    #: another), CPU count for read-back and verification.
    hash_threads: int = 0
    # -- metrics and scrub --
    #: Prometheus endpoint, loopback only: "127.0.0.1:9464" serves /metrics;
    #: "" for none.
    metrics_listen: str = ""
    #: Prometheus textfile-collector path (node_exporter) written
    #: periodically, "" for none.
    metrics_textfile: str = ""
    #: Seconds between textfile writes.
    metrics_textfile_interval_s: float = 15.0
    #: Background scrub: re-hash unleased artifacts at this rate, bytes/s
    #: (e.g. "50MiB"); 0 disables scrubbing.
    scrub_bytes_per_s: int = 0
    # -- source digests (ResolveSources) --
    #: Paths in one ResolveSources call; more is RESOURCE_EXHAUSTED before any
    #: file is looked at. Count. Default 4096: a real checkpoint has at most a
    #: few hundred files, and the client sends at most 1024 per call.
    max_resolve_paths: int = 4096
    # -- trust in the filesystem (runtime directory, recovery, the store's bytes) --
    #: Largest manifest.json the daemon reads back from the store (startup
    #: recovery, the quarantine listing, Lookup), bytes. A larger one is
    #: quarantined at startup without being read. Default 64 MiB, the gRPC
    #: message limit (a larger manifest could not be served anyway); a
    #: 10k-tensor checkpoint's manifest is a few MiB.
    max_stored_manifest_bytes: int = 64 * 1024 * 1024
    #: ReportCorruption: reports of one key share one deep verification in
    #: flight, and within this many seconds after it ended they get its
    #: result instead of re-hashing the artifact. Seconds; default 60.
    report_verify_interval_s: float = 60.0
    # -- publication limits and idle publications --
    # Checked at plan, before anything is built or staged; a refusal names the
    # limit, the value and the field. RESOURCE_EXHAUSTED unless noted.
    #: Tensors of one artifact (padding not counted). Count. Real FLUX, Wan
    #: and LLM checkpoints have at most ~10k; one tensor costs the daemon
    #: about 2 KiB while its publication runs.
    max_artifact_tensors: int = _PLAN_DEFAULTS.max_artifact_tensors
    #: Payload files of one artifact. Count. Real checkpoints have <= ~200.
    max_artifact_files: int = _PLAN_DEFAULTS.max_artifact_files
    #: Longest tensor name or block prefix, UTF-8 bytes; INVALID_ARGUMENT.
    #: At most 1024 (the format's own rule; a larger value means 1024).
    max_tensor_name_bytes: int = _PLAN_DEFAULTS.max_tensor_name_bytes
    #: Dimensions of one tensor. Count; INVALID_ARGUMENT. Real weights have <= 5.
    max_tensor_dims: int = _PLAN_DEFAULTS.max_tensor_dims
    #: safetensors header of one payload file, bytes (~60 bytes + the name
    #: per tensor: 10k tensors take ~1.5 MB). At most 100 MB, the parser's limit.
    max_header_bytes: int = _PLAN_DEFAULTS.max_header_bytes
    #: Manifest JSON of one artifact, bytes (~300 bytes + the name per
    #: tensor). At most 48 MiB, so Lookup and AcquireLease can always send it
    #: in one 64 MiB gRPC message.
    max_manifest_bytes: int = _PLAN_DEFAULTS.max_manifest_bytes
    #: A publication that receives no message for this long ends ABORTED: its
    #: staging removed, its slot and reservation freed. Seconds; 0 = never.
    publication_idle_s: float = 60.0
    #: Publications one peer runs at once; its next waits for one of its own
    #: to end, holding no global slot. Count (at most max_publications).
    max_publications_per_peer: int = 2
    #: Bytes a peer's publications may reserve together once it has one in
    #: flight (its first may be as large as capacity allows). Bytes; 0 = half
    #: of ``capacity``, or half of the disk without one.
    peer_reserved_bytes: int = 0
    #: Nice increment of the threads that hash and fsync a handed-over
    #: publication's files, and of those hashing a certain miss's source
    #: files that no caller waits for (0..19; 0 = the daemon's own priority).
    #: Both are for the next start: on a busy node the serving workers' and
    #: the loading worker's threads come first. Default 10.
    publication_nice: int = 10
    #: Publications the processes of one uid run at once, together; the next
    #: waits for one of that uid's own, holding no global slot. Root and the
    #: daemon's own uid are not capped by it (the node's operator). Count;
    #: 0 = half of max_publications (at least 1), so other users always
    #: find a slot.
    max_publications_per_uid: int = 0
    #: Payload bytes a publication must bring per second of the time the
    #: daemon spends waiting for its next message, measured over each
    #: publication_idle_s of such waiting; a slower one ends ABORTED (its
    #: slot freed): a client trickling a byte at a time cannot hold a slot.
    #: The daemon's own time (writing, hashing, collecting) is not counted.
    #: Bytes/s; 0 = no floor. Default 64 KiB/s.
    publication_min_bytes_per_s: int = 64 * 1024

    # -- threads, streams, sessions and peers (hwr_server.access.admission, .peers, .leases) --
    #: gRPC worker threads per socket. Count.
    grpc_threads: int = 64
    #: Client streams (Session, Publish) one process, as proven by the peer
    #: credentials handshake, may hold at once on one socket; more answer
    #: RESOURCE_EXHAUSTED before taking a thread. Count. Default 8 (a worker
    #: holds one session and at most a publication or two).
    max_streams_per_peer: int = 8
    #: The same cap for every caller without a peer token together (old
    #: clients, raw gRPC); 0 refuses their streams. Count. Default 8.
    max_streams_anonymous: int = 8
    #: Client streams the processes of one uid (as proven by the handshake)
    #: may hold together on one socket; more answer RESOURCE_EXHAUSTED. Root
    #: and the daemon's own uid are not capped by it. Count; 0 = half of the
    #: socket's stream capacity (24 with the default grpc_threads), so one
    #: user forking processes cannot take every stream. A node that runs
    #: all its workers as one non-root uid raises it.
    max_streams_per_uid: int = 0
    #: A client stream that sends no first message (SessionOpen, the plan)
    #: within this long is cancelled and its thread freed. Seconds. Default 10.
    stream_first_message_timeout_s: float = 10.0
    #: rpcs in flight on one socket, running or queued for a thread; beyond
    #: it gRPC answers RESOURCE_EXHAUSTED without taking a thread (the
    #: backstop of the stream caps). Count, at least grpc_threads. Default 1024.
    max_concurrent_rpcs: int = 1024
    #: Leases one session may hold at once; more answer RESOURCE_EXHAUSTED.
    #: Count. Default 1024 (a worker holds one per artifact it maps).
    max_leases_per_session: int = 1024

    # -- trust in publishers (hwr_server.access.trust; docs/trust.md) --
    #: Publishers whose artifacts every worker takes, besides its own uid,
    #: root and the daemon's uid: user names or uids, and groups as
    #: "group:NAME" or "group:GID" (members and users of that primary
    #: group). Resolved when the daemon starts; an unknown name refuses to
    #: start. Default: none.
    trusted_publishers: list[str] = dataclasses.field(default_factory=list)
    #: Artifacts with no publisher record (published before the daemon kept
    #: them) count as the daemon's. Default false: nobody takes them until
    #: they are published again (or this is set, after checking the store).
    trust_unrecorded_publishers: bool = False

    # -- host registration admission (hwr_server.registration.admission) --
    #: Bytes of host memory all workers of the node may have registered
    #: (pinned for the device) at once; more is refused "budget" and the
    #: worker stages. Bytes; 0 = registration_budget_fraction of MemTotal.
    registration_budget_bytes: int = 0
    #: The budget as a fraction of the node's MemTotal when
    #: registration_budget_bytes is 0. In (0, 1]; default 0.5: pinned pages
    #: cannot be reclaimed, and the page cache and the workers need the rest.
    registration_budget_fraction: float = 0.5
    #: Registrations in flight on the node at once; more are queued (up to
    #: registration_max_wait_s, asking again with a ticket; no daemon thread
    #: waits), then refused "busy". Count. Default 1: pinning serializes on
    #: driver-global locks anyway.
    max_registrations_in_flight: int = 1
    #: Largest range a worker registers in one call, bytes; each chunk is
    #: logged and counted. Default 1 GiB.
    registration_chunk_bytes: int = 1024 ** 3
    #: A chunk not reported within this long is a stall: logged, counted,
    #: shown in `hwr stats`; its in-flight slot goes to the next request and
    #: the stalled session's new requests are refused "watchdog" until it
    #: completes (other workers are not). Seconds. Default 60 (1 GiB of cold
    #: pages from a slow disk takes well under that).
    registration_chunk_timeout_s: float = 60.0
    #: Longest a request stays queued for an in-flight slot. Seconds. Default 300.
    registration_max_wait_s: float = 300.0
    #: Fraction of the budget the registrations of one uid may hold together;
    #: more is refused "budget". Root and the daemon's own uid are not capped
    #: by it. In (0, 1]; default 0.5: one user cannot pin the whole budget.
    registration_uid_share: float = 0.5
    #: Requests of one uid queued for the in-flight slot at once; more are
    #: refused "busy" at once. Count; default 4.
    max_registration_waiters_per_uid: int = 4

    # -- many nodes: the OCI registry (hwr_server.remote.remote) --
    #: The ``[remote]`` table (RemoteConfig): an OCI registry for `hwr push`
    #: / `hwr pull` and pull on a miss (docs/many-nodes.md).
    remote: RemoteConfig = dataclasses.field(default_factory=RemoteConfig)

    def resolved(self) -> "ServerConfig":
        """A copy with empty paths filled from :func:`default_paths`."""
        root, sock, admin = default_paths()
        return dataclasses.replace(
            self, root=self.root or root, socket=self.socket or sock, admin_socket=self.admin_socket or admin
        )

    def validate(self) -> "ServerConfig":
        """Returns self when the fields agree with each other.

        Raises:
            InvalidArgument: watermarks out of order, a keepalive timeout
                under two intervals, or a relative source root.
        """
        if not (0 < self.gc_low_watermark < self.gc_high_watermark <= 1.0):
            raise InvalidArgument(
                f"config: expected 0 < gc_low_watermark ({self.gc_low_watermark}) < gc_high_watermark "
                f"({self.gc_high_watermark}) <= 1"
            )
        if not 0 <= self.publication_nice <= 19:
            raise InvalidArgument(f"config: publication_nice {self.publication_nice}: expected 0..19")
        if self.keepalive_timeout_ms < 2 * self.keepalive_interval_ms:
            raise InvalidArgument(
                f"config: keepalive_timeout_ms ({self.keepalive_timeout_ms}) must be at least twice "
                f"keepalive_interval_ms ({self.keepalive_interval_ms})"
            )
        for r in self.source_roots:
            if not os.path.isabs(r):
                raise InvalidArgument(f"config: source root {r!r} must be an absolute path")
        rem = self.remote
        if (rem.pull_on_miss or rem.push_after_publish) and not (rem.registry and rem.repository):
            raise InvalidArgument("config: [remote] pull_on_miss / push_after_publish need registry and repository")
        if rem.verify_pull not in ("file", "full"):
            raise InvalidArgument(f"config: [remote] verify_pull {rem.verify_pull!r}: expected 'file' or 'full'")
        if rem.parallel_layers < 1 or rem.layer_attempts < 1:
            raise InvalidArgument("config: [remote] parallel_layers and layer_attempts must be at least 1")
        if rem.max_pulls < 1 or rem.max_pulls_per_peer < 1:
            raise InvalidArgument("config: [remote] max_pulls and max_pulls_per_peer must be at least 1")
        if rem.miss_cache_s < 0 or rem.min_rate_bytes < 0:
            raise InvalidArgument("config: [remote] miss_cache_s and min_rate_bytes must not be negative")
        return self

    @classmethod
    def from_mapping(cls, doc: dict[str, Any], *, what: str = "config") -> "ServerConfig":
        """Builds a config from a parsed TOML/JSON mapping.

        Raises:
            InvalidArgument: unknown key or a value of the wrong type.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(doc) - set(fields)
        if unknown:
            raise InvalidArgument(f"{what}: unknown key(s) {sorted(unknown)}; expected some of {sorted(fields)}")
        values: dict[str, Any] = {}
        defaults = cls()
        for k, v in doc.items():
            if k == "remote":
                values[k] = RemoteConfig.from_mapping(v, what=what)
                continue
            if is_size_key(k):
                values[k] = parse_size(v)
                continue
            # k is one of our own field names (checked above): the default's
            # type is what the value must have.
            default = getattr(defaults, k)
            if isinstance(default, bool):
                ok = type(v) is bool
            elif type(default) is int:
                ok = type(v) is int
            elif isinstance(default, float):
                ok = type(v) in (int, float)
            elif isinstance(default, list):
                ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
            else:
                ok = isinstance(v, str)
            if not ok:
                raise InvalidArgument(f"{what}: {k} = {v!r} has the wrong type; expected {type(default).__name__}")
            values[k] = float(v) if isinstance(default, float) else v
        return cls(**values)

    @classmethod
    def from_file(cls, path: str) -> "ServerConfig":
        """Reads a TOML config file (see :meth:`from_mapping`).

        Raises:
            InvalidArgument: unreadable, not TOML, or a bad key or value.
        """
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as exc:
            raise InvalidArgument(f"config {path}: cannot read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config {path}: not valid TOML ({exc})") from None
        return cls.from_mapping(doc, what=f"config {path}")
