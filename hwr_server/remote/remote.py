"""Push and pull of artifacts through an OCI registry (docs/many-nodes.md).

Push (:meth:`Remote.push`): the blobs are read from the store as they are
(no copy, no hashing: a layer's digest is the blob's name); layers the
registry already has (HEAD) are skipped; then the config (manifest.json)
and the OCI manifest (:mod:`hwr_server.remote.oci`), tagged with the key.

Pull (:meth:`Remote.pull`): the OCI manifest and its config are fetched and
checked (:func:`~hwr_server.remote.oci.parse_oci_manifest`,
:func:`~hwr_server.remote.oci.check_config`), and held to the limits a
publication is held to (``plan_limits``: files, tensors, header and
manifest bytes, name lengths, labels) before a byte of payload is fetched.
Each layer whose blob is not in ``blobs/`` is downloaded into staging,
``parallel_layers`` at a time, hashed while it is written (at most 1 MiB at
a time: bounded memory), at ``min_rate_bytes`` or cut, checked against its
digest and size, and fsynced; a connection that breaks mid-layer is retried
``layer_attempts`` times, each resuming with a ``Range`` request from the
bytes already written (the hash state carries over; a registry that ignores
the Range is read from the start). Capacity is a dry run for the bytes to
fetch, then made as they arrive (a registry's claimed sizes evict nothing).
A layer whose blob is present is hard-linked into staging instead, once the
stored bytes hash to their name (a rotted or bad-marked copy is fetched
again and replaces it at the commit), so a concurrent GC unlinking the
stored blob cannot take the bytes away before the commit.
Then the SAME durable commit as a publication
(:func:`hwr_server.store.commit.publish`: the numbered steps and their failpoints).
A failure before the publish point leaves nothing visible: the staging
directory is removed and the blobs the commit moved are unlinked (the
store's claim, as for a publication).

Single flight: one pull per key at a time; a second caller of the same key
waits for the first one's outcome and hears its progress (eight workers
missing one key cause one download). A publication of the key in flight
makes a pull ABORTED (retry). A pull on a miss runs on a thread of its own
and its callers follow it without one; how many may run, per node and per
user, and how long a failure is remembered: :mod:`hwr_server.remote.gate`.

A caller that goes away (its rpc cancelled, or a worker that gave up on
its no-progress bound, ``hwr_client.resolve.PULL_STALL_S``) does not stop
the pull, even when no waiter is left. Decided so because: the bytes
already fetched are the expensive part, and the next miss of the key (the
worker's restart, the other workers of the node) is served by this pull
instead of starting over; a pull commits whole or leaves nothing, so a pull
nobody waits for can never expose a partial artifact; and it is bounded
without a caller: the registry client's ``timeout_s`` per read and
``layer_attempts`` per layer end a dead download with UNAVAILABLE, the
staging removed. ``hwr rm KEY`` removes what it committed, if unwanted.

What a pull checks is what the bytes can prove: every file's SHA-256 (its
blob name) and size, and that the manifest is a valid HWR manifest of the
tag's key. With ``[remote] verify_pull = "full"`` it also re-hashes every
tensor and block against the manifest before the commit; by default those
are checked by ``hwr verify`` / a lease's ``verify="full"``, as for any
stored artifact.

Trust (docs/trust.md; :mod:`hwr_server.remote.signatures`): a push spreads
only artifacts this node trusts (their publisher record) and, with
``[remote] signing_key``, signs the pushed manifest as its referrer; with
``[remote] trusted_keys`` a pull requires a trusted key's signature of the
manifest before any layer is fetched (PERMISSION_DENIED, nothing stored).
A pull's commit records the daemon as the publisher, with the source and
the signing key.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from typing import Any, Callable

from hwr_client.core.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hwr_client.core.identity import check_key
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import PlanLimits, check_manifest_limits
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.access.publisher import UNRECORDED, pulled
from hwr_server.access.trust import TrustPolicy
from hwr_server.config import ServerConfig
from hwr_server.interfaces import RemoteStore
from hwr_server.logtext import untrusted
from hwr_server.publish.limits import plan_limits
from hwr_server.remote.gate import PullGate
from hwr_server.remote.oci import (
    MANIFEST_MEDIA_TYPE, MAX_OCI_MANIFEST_BYTES, OciManifest, build_oci_manifest, check_config, digest_of,
    parse_oci_manifest,
)
from hwr_server.remote.records import Counter, Flight, Progress, ProgressFn, Transfer
from hwr_server.remote.registry import Reference, RegistryClient, client_for, parse_origin, parse_reference
from hwr_server.remote.signatures import sign, signing_key_of, verify_pull
from hwr_server.remote.signing import parse_trusted_keys
from hwr_server.remote.transfer import LayerPolicy, download_layer, link_stored, run_all
from hwr_server.store import commit as durable
from hwr_server.store.recovery import verify_artifact
from hwr_server.store.staging_io import os_error
from hwr_server.remote import companions

log = logging.getLogger(__name__)


class Remote:
    """The daemon's registry component: push, pull, pull on a miss.

    Args:
        config: the daemon's configuration (``remote`` table; the store's
            manifest limit bounds a config blob).
        store: the store artifacts are read from and committed into.
        trust: who this node trusts (a push spreads only their artifacts);
            by default root, the daemon and the configured trusted keys.

    Raises:
        InvalidArgument: an entry of ``[remote] trusted_keys`` is not a key.
    """

    def __init__(self, config: ServerConfig, store: RemoteStore, *, trust: TrustPolicy | None = None):
        self.config = config
        self.store = store
        #: [remote] trusted_keys by key id: a pull needs one's signature.
        self.trusted_keys = parse_trusted_keys(config.remote.trusted_keys)
        self.trust = trust or TrustPolicy(trusted_keys=frozenset(self.trusted_keys))
        rem = config.remote
        for realm in rem.token_realms:  # a typo fails the start, not the first pull
            parse_origin(realm, what="config: [remote] token_realms entry")
        self._lock = threading.Lock()
        self._clients: dict[str, RegistryClient] = {}
        self._flights: dict[str, Flight] = {}
        self._gate = PullGate(max_pulls=rem.max_pulls, max_per_peer=rem.max_pulls_per_peer,
                              miss_cache_s=rem.miss_cache_s)
        self._figures = dict.fromkeys(("pulls", "pulls_failed", "pushes", "pushes_failed", "pull_bytes",
                                       "push_bytes", "pull_joined"), 0)

    # -- plumbing ----------------------------------------------------------------

    def client(self, host: str) -> RegistryClient:
        """The registry client of ``host`` (one per host: its tokens are cached).

        The credentials file is read outside the lock: a file that is slow
        to read (or, were it not refused, a FIFO) never holds up GetStats or
        another host's transfers.

        Raises:
            FailedPrecondition / InvalidArgument: the credentials or CA file.
        """
        with self._lock:
            c = self._clients.get(host)
        if c is not None:
            return c
        rem = self.config.remote
        made = client_for(host, insecure=rem.insecure, ca_file=rem.ca_file, credentials_file=rem.credentials_file,
                          timeout=rem.timeout_s, token_realms=rem.token_realms)
        with self._lock:
            return self._clients.setdefault(host, made)  # a racing thread's client wins; ours is dropped

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._figures[name] += n

    def stats(self) -> dict[str, float]:
        """Figures for GetStats / Prometheus."""
        with self._lock:
            f = dict(self._figures)
        return {f'hwr_remote_transfers_total{{op="pull",outcome="ok"}}': f["pulls"],
                f'hwr_remote_transfers_total{{op="pull",outcome="failed"}}': f["pulls_failed"],
                f'hwr_remote_transfers_total{{op="push",outcome="ok"}}': f["pushes"],
                f'hwr_remote_transfers_total{{op="push",outcome="failed"}}': f["pushes_failed"],
                'hwr_remote_bytes_total{op="pull"}': f["pull_bytes"],
                'hwr_remote_bytes_total{op="push"}': f["push_bytes"],
                "hwr_remote_pulls_joined_total": f["pull_joined"], **self._gate.stats()}

    # -- push --------------------------------------------------------------------

    def push(self, key: str, reference: str, progress: ProgressFn = lambda p: None) -> Transfer:
        """Pushes artifact ``key`` to ``reference`` (``host/repo[:tag]``; the
        tag defaults to the key).

        Raises:
            InvalidArgument: bad key or reference (a digest cannot be pushed to).
            NotFound / FailedPrecondition: the artifact is not published here.
            Unavailable / PermissionDenied: the registry.
        """
        check_key(key)
        ref = parse_reference(reference)
        if ref.digest:
            raise InvalidArgument(f"push {reference}: push to a tag (host/repository[:tag]), not a digest")
        tag = ref.tag or key
        try:
            out = self._push(key, ref, tag, progress)
        except BaseException:
            self._count("pushes_failed")
            raise
        self._count("pushes")
        self._count("push_bytes", out.bytes_transferred)
        # The weights' compile artifacts go with them, as their referrers.
        companions.push_companions(lambda k, r: self.push(k, r), self.store, key, ref)
        return out

    def _push(self, key: str, ref: Reference, tag: str, progress: ProgressFn) -> Transfer:
        t0 = time.monotonic()
        manifest, paths = self.store.get(key)
        self.trust.check_push(key, self.store.publisher(key) or UNRECORDED)
        rem = self.config.remote
        private = signing_key_of(rem.signing_key)  # an unfit key fails the push before any upload
        config = self.store.manifest_json(key).encode("utf-8")
        client = self.client(ref.host)
        repo = ref.repository
        # A compile artifact names its weights' manifest as its subject (a referrer).
        subject = companions.subject_of(self.store, client, repo, manifest)
        notes = companions.annotations_of(manifest)
        oci = build_oci_manifest(manifest, config, subject=subject, extra_annotations=notes)
        layers = list({f.blob: (f, p) for f, p in zip(manifest.files, paths)}.values())
        counter = Counter(sum(f.size for f, _ in layers), len(layers), progress)
        sent = [0, 0]  # bytes, layers

        def one(item: tuple[Any, str]) -> None:
            f, path = item
            digest = "sha256:" + f.blob
            if client.blob_size(repo, digest, push=True) == f.size:
                counter.add(f.size, 1)  # the registry has it: skipped
                return
            try:
                fd, _ = open_stored(path, what=f"blob {f.blob[:12]}")
            except FileNotFoundError:
                raise NotFound(f"push {key[:12]}: blob {f.blob[:12]} vanished (deleted meanwhile); "
                               "publish it again") from None
            except Untrusted as exc:
                raise FailedPrecondition(f"push {key[:12]}: {exc}; run `hwr verify {key[:12]}`") from None
            with os.fdopen(fd, "rb", buffering=0) as src:
                client.upload_blob(repo, digest, src, f.size, chunk_bytes=rem.upload_chunk_bytes,
                                   progress=lambda n: counter.add(n))
            with self._lock:
                sent[0] += f.size
                sent[1] += 1
            counter.add(0, 1)

        run_all(one, layers, rem.parallel_layers)
        config_digest = digest_of(config)
        if client.blob_size(repo, config_digest, push=True) != len(config):
            client.put_bytes_blob(repo, config_digest, config)
        digest = client.put_manifest(repo, tag, oci, MANIFEST_MEDIA_TYPE)
        if digest and digest != digest_of(oci):
            raise FailedPrecondition(f"push {ref.host}/{repo}:{tag}: the registry names the manifest {digest}, "
                                     f"its bytes hash to {digest_of(oci)}")
        if subject is not None:
            companions.index_referrer(client, repo, oci, subject, companions.index_annotations(key, notes))
        signed = sign(client, repo, subject=oci, key=key, private=private) if private else None
        seconds = time.monotonic() - t0
        log.info("pushed %s to %s/%s:%s: %d of %d layers, %d bytes in %.2f s", key[:12], untrusted(ref.host), repo,
                 tag, sent[1], len(layers), sent[0], seconds)
        return Transfer(key, f"{ref.host}/{repo}@{digest_of(oci)}", digest_of(oci), sent[0], sent[1],
                        len(layers) - sent[1], seconds, signature_digest=signed.digest if signed else "",
                        signer=signed.signer if signed else "")

    def push_after_publish(self, key: str) -> None:
        """``[remote] push_after_publish``: pushes a just-committed artifact
        to the configured remote on a background thread; a failure is
        logged (the publication already succeeded, and the next node that
        misses loads canonically, as without a remote)."""
        rem = self.config.remote
        if not (rem.push_after_publish and rem.registry and rem.repository):
            return
        publisher = self.store.publisher(key) or UNRECORDED
        if not self.trust.node_trusts(publisher):
            log.info("push after publish of %s: not pushed, published by %s (only trusted publishers' artifacts "
                     "are pushed)", key[:12], publisher.describe())
            return

        def run() -> None:
            try:
                self.push(key, f"{rem.registry}/{rem.repository}")
            except Exception as exc:  # noqa: BLE001 - background work: logged, never raised
                log.warning("push after publish of %s to %s/%s failed: %s: %s", key[:12], rem.registry,
                            rem.repository, type(exc).__name__, untrusted(exc))

        threading.Thread(target=run, name="hwr-push-after-publish", daemon=True).start()

    # -- pull ----------------------------------------------------------------------

    def pull(self, reference: str, progress: ProgressFn = lambda p: None) -> Transfer:
        """Pulls ``host/repository:tag`` (the tag must be the key) or
        ``host/repository@sha256:…`` into the store.

        Raises:
            InvalidArgument: bad reference.
            NotFound: the registry has no such manifest (or a blob of it).
            FailedPrecondition: not an HWR artifact, key is not the tag,
                layers that are not the manifest's files.
            DataLoss: a layer's bytes do not match its digest or size.
            Unavailable: the registry is unreachable or broke off (retry is
                safe; a retry of an interrupted layer resumes it).
            PermissionDenied: 401/403. ResourceExhausted: capacity, disk.
            Aborted: a publication of the same key is in flight.
        """
        ref = parse_reference(reference)
        if not ref.reference:
            raise InvalidArgument(f"pull {reference}: give a tag (the identity key) or @sha256:<digest>")
        return self._fetch_and_commit(ref, progress, time.monotonic(), "")

    def pull_missing(self, key: str, progress: ProgressFn = lambda p: None, *, owner: str = "") -> Transfer:
        """Pull on a miss, waiting for the outcome (:meth:`start_pull_missing`).

        Raises:
            As :meth:`start_pull_missing`, then as :meth:`pull`.
        """
        flight = self.start_pull_missing(key, owner=owner)
        flight.join(progress)
        flight.done.wait()
        return flight.outcome()

    def start_pull_missing(self, key: str, *, owner: str = "") -> Flight:
        """Pull on a miss: ``key`` from the configured remote, on a thread of
        the pull's own; returns at once with the flight to follow (the
        caller waits on ``done`` without a thread of its own, and may leave).

        Args:
            owner: who asks (``uid N``, or "anonymous"): counted against
                ``[remote] max_pulls_per_peer`` (:mod:`hwr_server.remote.gate`).

        Raises:
            InvalidArgument: bad key.
            NotFound: no remote with pull_on_miss.
            ResourceExhausted: the node's or the owner's pulls in flight.
            The remembered failure of a recent pull of the key.
        """
        check_key(key)
        rem = self.config.remote
        if not (rem.pull_on_miss and rem.registry and rem.repository):
            raise NotFound(f"artifact {key[:12]}: not in the store, and this daemon has no [remote] with "
                           "pull_on_miss")
        self._gate.cached(key)
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                self._figures["pull_joined"] += 1
                return flight
            self._gate.enter(owner or "anonymous", key)
            flight = self._flights[key] = Flight()
        ref = Reference(rem.registry, rem.repository, tag=key)
        threading.Thread(target=self._lead, args=(ref, key, flight, owner or "anonymous"), name="hwr-pull-on-miss",
                         daemon=True).start()
        return flight

    def _lead(self, ref: Reference, key: str, flight: Flight, owner: str) -> None:
        """Runs one pull on a miss to its end, whoever still waits."""
        error: BaseException | None = None
        try:
            flight.result = self._fetch_and_commit(ref, flight.progress, time.monotonic(), key)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            flight.error = error = exc
        finally:
            with self._lock:
                del self._flights[key]
            self._gate.leave(owner, key, error)
            flight.done.set()

    def _flight(self, key: str, progress: ProgressFn, work: Callable[[ProgressFn], Transfer]) -> Transfer:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = Flight(progress)
        assert flight is not None
        if not leader:
            self._count("pull_joined")
            flight.join(progress)
            flight.done.wait()
            return flight.outcome()
        try:
            flight.result = work(flight.progress)
            return flight.result
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()

    def _fetch_and_commit(self, ref: Reference, progress: ProgressFn, t0: float, key: str) -> Transfer:
        what = str(ref)
        client = self.client(ref.host)
        try:
            if key and self.store.contains(key):
                return Transfer(key, what, "", 0, 0, 0, time.monotonic() - t0, already_present=True)
            try:
                raw, ctype = client.get_manifest(ref.repository, ref.reference, limit=MAX_OCI_MANIFEST_BYTES)
            except NotFound:
                raise NotFound(f"{what}: the registry has no such manifest") from None
            oci = parse_oci_manifest(raw, what=what, content_type=ctype, expected_digest=ref.digest)
            limits = plan_limits(self.config)
            _check_descriptors(oci, limits, self.config.max_stored_manifest_bytes, what)
            with client.open_blob(ref.repository, oci.config.digest) as r:
                config = r.read(oci.config.size)
            manifest = check_config(oci, config, what=what, tag=ref.tag)
            # What this node would refuse to publish it does not take from a
            # registry either, checked before a byte of payload is fetched.
            check_manifest_limits(manifest, limits, what=what, manifest_bytes=len(config))
            # The signature rule before any layer is fetched: refused, nothing is stored.
            signer = verify_pull(self.trusted_keys, client, ref.repository, subject_digest=oci.digest,
                                 key=manifest.key, what=what)
            done = (self._flight(manifest.key, progress,
                                 lambda p: self._materialize(ref, client, manifest, oci.digest, p, t0, signer))
                    if not key else self._materialize(ref, client, manifest, oci.digest, progress, t0, signer))
        except BaseException:
            self._count("pulls_failed")
            raise
        if not done.already_present:
            self._count("pulls")
            self._count("pull_bytes", done.bytes_transferred)
        # A weight artifact's compile artifacts for this node's devices come along.
        companions.pull_companions(lambda r: self.pull(r), self.store, client, ref, done.key, done.manifest_digest,
                                   self.config.remote.compile_devices)
        return done

    def _materialize(self, ref: Reference, client: RegistryClient, manifest: Manifest, oci_digest: str,
                     progress: ProgressFn, t0: float, signer: str = "") -> Transfer:
        """Downloads the missing layers into staging and commits, recorded as
        published by the daemon (from ``ref``, verified by ``signer``)."""
        key, store = manifest.key, self.store
        reference = f"{ref.host}/{ref.repository}@{oci_digest}"
        pull_id = "pull-" + uuid.uuid4().hex[:16]
        if store.claim(key, pull_id):  # raises Aborted while a publication of the key runs
            return Transfer(key, reference, oci_digest, 0, 0, 0, time.monotonic() - t0, already_present=True)
        moved: list[str] = []
        staging = ""
        try:
            staging = store.new_staging(pull_id)
            artifact = os.path.join(staging, "artifact")
            os.mkdir(artifact, 0o755)
            paths = [os.path.join(staging, f"{f.index:05d}.safetensors") for f in manifest.files]
            fetched = self._layers(ref, client, manifest, paths, reference, pull_id, progress)
            if self.config.remote.verify_pull == "full":
                # Every tensor and block against the pulled manifest, before
                # anything moves into blobs/ (the files are in the page cache).
                problems, _, _ = verify_artifact(manifest, paths,
                                                 threads=self.config.hash_threads or os.cpu_count() or 2)
                if problems:
                    raise DataLoss(f"{reference}: the pulled artifact fails verification ({'; '.join(problems[:3])}); "
                                   "nothing was published")
            staged = durable.Staged(key, artifact, paths, _synced)
            text = durable.publish(store, staged, manifest, moved,
                                   publisher=pulled(pull_id, source=reference, signer=signer))
        except OSError as exc:
            raise os_error(exc, f"pull {pull_id} of {key[:12]}") from None
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
            store.release_claim(key, pull_id, moved_blobs=tuple(moved))
        if text.encode("utf-8") != _config_text(manifest):
            log.debug("pull %s: stored manifest text re-serialized", key[:12])
        seconds = time.monotonic() - t0
        total = sum(f.size for f in fetched)
        log.info("pulled %s from %s: %d of %d layers, %d bytes in %.2f s", key[:12], untrusted(reference),
                 len(fetched), len(manifest.files), total, seconds)
        return Transfer(key, reference, oci_digest, total, len(fetched), len(manifest.files) - len(fetched), seconds,
                        signer=signer)

    def _layers(self, ref: Reference, client: RegistryClient, manifest: Manifest, paths: list[str],
                reference: str, pull_id: str, progress: ProgressFn) -> list[Any]:
        """Puts every file of ``manifest`` at its path in staging: a stored
        blob whose bytes hash to its name is hard-linked (a corrupt one, or
        one a verify marked bad, is downloaded again), the rest downloaded
        ``parallel_layers`` at a time. Capacity: a dry run for the bytes to
        fetch, then admitted as they arrive, a preallocation step per layer
        at a time (:class:`~hwr_server.remote.transfer.LayerPolicy`).

        Returns:
            The file entries downloaded (one per distinct blob).
        """
        store, rem, who = self.store, self.config.remote, f"pull {pull_id} of {manifest.key[:12]}"
        bad = store.known_bad_blobs()
        first: dict[str, tuple[Any, str, bool]] = {}  # blob -> (file entry, path, try the stored copy)
        for f, path in zip(manifest.files, paths):
            if f.blob not in first:
                first[f.blob] = (f, path, f.blob not in bad and os.path.lexists(store.blob_path(f.blob)))
        to_fetch = sum(f.size for f, _, stored in first.values() if not stored)
        # A dry run: refuses what cannot fit even after collecting, deletes
        # nothing; room is made as the bytes arrive (a registry that claims
        # sizes and sends nothing costs no other artifact).
        store.capacity_hook(to_fetch, evict=False, who=who)

        def admit(nbytes: int) -> None:
            store.capacity_hook(nbytes, evict=True, who=who)

        policy = LayerPolicy(rem.layer_attempts, rem.min_rate_bytes, rem.timeout_s, admit)
        counter = Counter(to_fetch, sum(1 for *_, stored in first.values() if not stored), progress)
        stop = threading.Event()
        fetched: list[Any] = []

        def one(item: tuple[Any, str, bool]) -> None:
            f, path, stored = item
            if stored:
                if link_stored(store.blob_path(f.blob), path, f.size):
                    return
                counter.grow(f.size)  # the stored copy is not its bytes: fetched after all
            download_layer(client, ref.repository, f, path, counter, stop, policy,
                           what=f"{untrusted(reference)} layer {f.index} ({untrusted(f.name)})")
            with self._lock:
                fetched.append(f)

        try:
            run_all(one, list(first.values()), rem.parallel_layers, stop)
        except BaseException:
            stop.set()
            raise
        for f, path in zip(manifest.files, paths):  # duplicates of a file share its bytes
            if not os.path.lexists(path):
                os.link(first[f.blob][1], path)
        return fetched


def _check_descriptors(oci: OciManifest, limits: PlanLimits, stored_limit: int, what: str) -> None:
    """The OCI manifest's own claims against the limits, before the config
    is fetched: its layer count (a file each) and the config's size.

    Raises:
        ResourceExhausted: naming the limit and its ServerConfig field.
    """
    if len(oci.layers) > limits.max_artifact_files:
        raise ResourceExhausted(f"{what}: {len(oci.layers)} layers exceed the limit {limits.max_artifact_files} "
                                "files (ServerConfig.max_artifact_files); not pulled")
    limit = min(stored_limit, limits.max_manifest_bytes)
    if oci.config.size > limit:
        raise ResourceExhausted(f"{what}: config of {oci.config.size} bytes exceeds the limit {limit} "
                                "(ServerConfig.max_manifest_bytes, max_stored_manifest_bytes); not pulled")


def _config_text(manifest: Manifest) -> bytes:
    return manifest.to_json().encode("utf-8")


def _synced() -> None:
    """Commit step 1 for a pull: each downloaded file was fsynced by its
    download thread right after its digest matched (while other layers
    were still flowing), and a hard link of a stored blob shares the blob's
    durable inode; nothing is left to sync."""


__all__ = ["Progress", "Remote", "Transfer"]
