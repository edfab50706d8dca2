"""The durable sequences of the store (DESIGN §4): the commit of a
publication and its two siblings, delete and quarantine. Every rename that
changes what is visible under the store root happens here, as numbered steps;
each step is a named failpoint (:mod:`hwr_server.failpoints`), hit just
before the step runs.

The commit (:func:`publish`), in the durability order:
  1. fsync every payload file (the publication's background fsyncs finish);
  2. move the payloads into blobs/ (or drop those whose intact blob exists),
     fsync blobs/;
  3. write and fsync manifest.json and publisher.json (who published it,
     :mod:`hwr_server.access.publisher`), fsync their directory;
  4. rename the artifact directory into artifacts/ (the publish point);
  5. fsync artifacts/;
  6. add the artifact to the index;
  7. return, and only then the caller replies.
A failure before 4 raises and leaves nothing visible (the publication removes
its staging directory and the blobs it moved). From 4 on nothing raises and
nothing is undone: a visible artifact whose blobs were unlinked again would be
a manifest without its payload.

Delete (:func:`delete`) and quarantine (:func:`quarantine`) run the mirror
image: one rename out of artifacts/ is their unpublish point; after it,
failures are logged and the sequence goes on, for the same reason.

A crash (SIGKILL, power loss) at any step leaves a state that startup
recovery (:mod:`hwr_server.store.recovery`) turns into "the artifact whole, or not
at all": staging/ is removed, blobs no manifest references are unlinked.

Temp names are unique per attempt (staging/<publication id>/,
staging/delete-<key>-<random>/, a fresh quarantine entry), so correctness
never rests on a lock between processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
import uuid
from typing import Callable, Sequence

from hwr_client.core.errors import NotFound, ResourceExhausted
from hwr_client.core.manifest import Manifest
from hwr_server import failpoints
from hwr_server.access.publisher import PUBLISHER_FILE, Publisher
from hwr_server.interfaces import SequenceStore

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_REASON = re.compile(r"[^a-z0-9-]+")


def fsync_dir(path: str) -> None:
    """fsyncs a directory, so the creations, renames and removals of its
    entries survive a crash (the file's own fsync does not cover them)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: str) -> int:
    """Sum of file sizes under ``path`` (0 when it vanished meanwhile)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


# -- the commit ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Staged:
    """A publication's staged artifact, every digest computed and checked.

    Attributes:
        key: the identity key it is published under.
        directory: staging/<publication id>/artifact/; becomes artifacts/<key>/.
        payload: the payload file paths, in the manifest's file order.
        sync: makes every payload file durable (step 1); the publication
            started most of these fsyncs while the bytes were still flowing.
    """

    key: str
    directory: str
    payload: Sequence[str]
    sync: Callable[[], None]


def publish(store: SequenceStore, staged: Staged, manifest: Manifest, moved: list[str], *,
            publisher: Publisher) -> str:
    """The commit: makes a staged artifact durable, then visible (steps in the
    module docstring).

    Args:
        store: the store it is published into.
        staged: the staged artifact.
        manifest: its manifest, built from the digests just computed.
        moved: receives each blob this commit moved into blobs/, as it moves
            it, so that a failure before the publish point can unlink them.
        publisher: who publishes it (the daemon's record, stored next to
            the manifest and indexed with it).

    Returns:
        The manifest.json text as stored.

    Raises:
        OSError: a step before the publish point failed; nothing is visible.
    """
    key = staged.key
    # 1. Payload durable before blobs/ or any manifest refers to it.
    failpoints.hit("commit.sync_payload")
    staged.sync()
    # 2. Payloads into blobs/; blobs/ fsynced so the renames are durable before
    #    a manifest refers to them (a crash must not keep the manifest and lose a blob).
    failpoints.hit("commit.install_blobs")
    for path, f in zip(staged.payload, manifest.files):
        if store.install_blob(key, path, f.blob, f.size):
            moved.append(f.blob)
    fsync_dir(store.blobs_dir)
    # 3. Manifest and publisher record written and fsynced before the rename
    #    publishes them together (an artifact never appears without its
    #    publisher); then their directory, whose entries must survive the rename.
    failpoints.hit("commit.write_manifest")
    text = manifest.to_json()
    _write_new(os.path.join(staged.directory, MANIFEST), text.encode("utf-8"))
    _write_new(os.path.join(staged.directory, PUBLISHER_FILE), publisher.to_json())
    fsync_dir(staged.directory)
    # Under the store's lock: no quarantine or delete can see artifacts/<key>
    # before the index says it is published.
    with store.visibility_lock:
        # 4. The publish point: rename is atomic, the artifact appears whole or not at all.
        failpoints.hit("commit.rename_artifact")
        os.rename(staged.directory, store.artifact_dir(key))
        # From here on the artifact is visible and complete: nothing raises and
        # nothing is undone, or the publication's cleanup would unlink the blobs
        # of a visible manifest.
        # 5. Without this fsync a crash could forget the rename after we replied.
        failpoints.hit("commit.sync_artifacts")
        try:
            fsync_dir(store.artifacts_dir)
        except OSError as exc:
            log.error("artifact %s: published, but fsync of artifacts/ failed (%s); a power loss before the "
                      "next sync may lose it, which a restart then reports as absent", key, exc)
        # 6. The index: lookups and leases see it from now on.
        failpoints.hit("commit.update_index")
        store.index_published(key, manifest, publisher)
    # 7. The caller replies only after this returns.
    failpoints.hit("commit.reply")
    return text


def _write_new(path: str, data: bytes) -> None:
    """Writes a new read-only file and fsyncs it (O_EXCL: never an old one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


# -- delete ----------------------------------------------------------------------


def delete(store: SequenceStore, key: str) -> int:
    """Unpublishes an artifact and unlinks its blobs no other artifact uses.
    Never truncates: a process that maps a blob keeps valid bytes.

    Steps (failpoints ``delete.*``):
      1. rename artifacts/<key> to staging/delete-<key>-<random>/ (the unpublish point);
      2. fsync artifacts/;
      3. drop it from the index;
      4. unlink its blobs no other artifact (or in-flight commit) references;
      5. remove the renamed directory.
    A crash after 1 leaves the artifact gone; recovery removes the directory
    in staging/ and the unreferenced blobs.

    Returns:
        Bytes freed.

    Raises:
        NotFound: the key is not published.
    """
    with store.visibility_lock:
        manifest = store.indexed(key)
        if manifest is None:
            raise NotFound(f"artifact {key[:12]}: not published; `hwr ls` lists the keys")
        # A name unique per attempt: two deletes never share a directory.
        trash = os.path.join(store.staging_dir, f"delete-{key[:16]}-{uuid.uuid4().hex[:8]}")
        # 1. rename first: the artifact disappears atomically, then its files go.
        failpoints.hit("delete.rename_to_trash")
        os.rename(store.artifact_dir(key), trash)
        # From here on the artifact is gone: failures are logged, not raised,
        # so the index never lists a directory that is no longer there.
        # 2. The unpublish survives a crash (else a restart would show it again
        #    while its blobs may already be unlinked).
        failpoints.hit("delete.sync_artifacts")
        _logged(fsync_dir, store.artifacts_dir, f"artifact {key}: deleted, fsync of artifacts/")
        failpoints.hit("delete.update_index")
        store.index_unpublished(key)
        # 4. No fsync of blobs/: an unlink a crash forgets leaves an
        #    unreferenced blob, which recovery removes.
        failpoints.hit("delete.unlink_blobs")
        refs = store.blob_refs()
        freed = dir_bytes(trash)
        for f in manifest.files:
            if f.blob not in refs:
                try:
                    freed += os.lstat(store.blob_path(f.blob)).st_size
                    os.unlink(store.blob_path(f.blob))
                except FileNotFoundError:
                    pass  # a blob listed twice in the manifest, already unlinked
                except OSError as exc:
                    log.error("artifact %s: deleted, but unlinking blob %s failed: %s", key, f.blob, exc)
    # 5. Outside the lock (it may be slow); what a crash leaves here, recovery removes.
    failpoints.hit("delete.remove_trash")
    shutil.rmtree(trash, ignore_errors=True)
    log.info("artifact %s deleted, %d bytes freed", key[:12], freed)
    return freed


# -- quarantine ------------------------------------------------------------------


def quarantine(store: SequenceStore, name: str, reason: str, *, bad_blobs: Sequence[str] = (),
               manifest: Manifest | None = None, blobs: Sequence[str] = ()) -> str:
    """Moves artifacts/<name> to quarantine/<name>.<reason>.<ts>/artifact,
    together with its corrupt blobs and the blobs no other artifact uses.

    Steps (failpoints ``quarantine.*``):
      1. create the entry directory (a name no other entry has);
      2. rename the artifact into it (the unpublish point);
      3. move the corrupt and exclusive blobs into its blobs/;
      4. fsync the entry, quarantine/, artifacts/ and blobs/;
      5. drop the artifact from the index, list it as quarantined.
    A crash after 1 and before 2 leaves an empty entry, which recovery
    removes; after 2, blobs not yet moved are unreferenced and recovery
    removes them.

    Args:
        name: the identity key, or (recovery only) any entry of artifacts/.
        reason: free text; its slug goes into the entry name.
        bad_blobs: digests a verification found corrupt; they move along
            even when another artifact references them.
        manifest: the artifact's manifest when it is not in the index
            (recovery), so its exclusive blobs move along.
        blobs: without a manifest (recovery, one that did not parse): the
            blobs it may reference; those no other artifact uses move along,
            so the quarantine keeps the artifact's bytes.

    Returns:
        The quarantine entry name.

    Raises:
        NotFound: nothing is published under ``name``.
    """
    slug = _REASON.sub("-", reason.lower()).strip("-")[:40] or "unknown"
    with store.visibility_lock:
        manifest = store.indexed(name) or manifest
        src = store.artifact_dir(name)
        if manifest is None and not os.path.lexists(src):
            raise NotFound(f"artifact {name[:12]}: not published, nothing to quarantine")
        # 1. A fresh entry: no earlier quarantine of the same key is overwritten.
        failpoints.hit("quarantine.make_entry")
        entry, dest = _new_entry(store.quarantine_dir, name.replace(".", "_"), slug)
        # 2. rename first: the artifact stops being visible atomically.
        failpoints.hit("quarantine.rename_artifact")
        try:
            os.rename(src, os.path.join(dest, "artifact"))
        except OSError:
            os.rmdir(dest)  # nothing was unpublished: leave no empty entry behind
            raise
        # From here on the artifact is gone: failures are logged, not raised, so
        # the index never lists an artifact that is no longer in artifacts/.
        failpoints.hit("quarantine.move_blobs")
        digests = [f.blob for f in manifest.files] if manifest is not None else list(blobs)
        if digests:
            _move_blobs(store, digests, name, dest, set(bad_blobs) | store.known_bad_blobs())
        # 4. The unpublish and the moves survive a crash: the entry's own
        #    entries, its creation in quarantine/, the removals from artifacts/
        #    and blobs/ (else a restart could show a corrupt artifact again).
        failpoints.hit("quarantine.sync_dirs")
        dirs = [dest, store.quarantine_dir, store.artifacts_dir, store.blobs_dir]
        if digests:
            dirs.insert(0, os.path.join(dest, "blobs"))
        for d in dirs:
            _logged(fsync_dir, d, f"artifact {name}: quarantined, fsync of {d}")
        failpoints.hit("quarantine.update_index")
        store.index_unpublished(name, quarantine_entry=entry, reason=slug, manifest=manifest)
    log.warning("artifact %s quarantined: %s (quarantine/%s)", name[:12], reason, entry)
    return entry


def _new_entry(parent: str, prefix: str, slug: str) -> tuple[str, str]:
    """Creates parent/<prefix>.<slug>.<ts>[-n]; returns (name, path)."""
    ts = int(time.time())
    for n in range(1000):
        name = f"{prefix}.{slug}.{ts}" + (f"-{n}" if n else "")
        path = os.path.join(parent, name)
        try:
            os.mkdir(path, 0o700)  # atomic: exactly one caller gets each name
        except FileExistsError:
            continue
        return name, path
    raise ResourceExhausted(f"quarantine: too many entries for {prefix[:12]} at {ts}; run `hwr gc`")


def _move_blobs(store: SequenceStore, digests: Sequence[str], key: str, dest: str, bad: set[str]) -> None:
    """Moves the artifact's corrupt blobs and those nothing else references."""
    others = {blob for blob, keys in store.blob_refs().items() if keys - {key}}
    os.makedirs(os.path.join(dest, "blobs"), exist_ok=True)
    for blob in digests:
        if blob in bad or blob not in others:
            try:
                # rename: a reader that still maps the blob keeps valid bytes.
                os.rename(store.blob_path(blob), os.path.join(dest, "blobs", blob))
            except FileNotFoundError:
                pass  # missing (the reason for the quarantine) or listed twice
            except OSError as exc:
                log.error("artifact %s: quarantined, but moving blob %s failed: %s", key, blob, exc)


def _logged(fn: Callable[[str], None], path: str, what: str) -> None:
    """Runs fn(path); an OSError is logged (after an unpublish point)."""
    try:
        fn(path)
    except OSError as exc:
        log.error("%s failed: %s", what, exc)


__all__ = ["Staged", "delete", "dir_bytes", "fsync_dir", "publish", "quarantine"]
