"""Integrity checks of stored artifacts: startup recovery (cheap checks) and
deep verification (re-hashing every byte).

Startup recovery (DESIGN §4) runs before the daemon serves; each step is a
failpoint (``recovery.*``, :mod:`hwr_server.failpoints`) and each is safe to
run again after a crash in the middle of it:

1. Staging leftovers are removed: nothing in staging/ was ever visible, so an
   interrupted publication (crash, SIGKILL, power loss) simply disappears,
   and so does the directory of an interrupted delete.
2. Empty quarantine entries are removed: a quarantine interrupted between
   creating its entry and renaming the artifact into it (the artifact is
   still in artifacts/ and gets step 3 like any other).
3. Every artifacts/<key>/ gets the cheap checks: manifest present and valid,
   key matches the directory, each blob present with the manifest's size and
   a safetensors header that parses and describes the manifest's tensors.
   An artifact that fails is quarantined (its bytes are kept for inspection)
   through :func:`hwr_server.store.commit.quarantine`. The deep check (re-hashing)
   is `hwr verify`, not startup.
4. Blobs that no manifest references (a publication killed between moving
   its payload into blobs/ and renaming its manifest into place, a delete or
   quarantine killed before its blobs went) are removed.
5. The in-memory index is rebuilt from the manifests that passed.

No step fsyncs its removals: a removal that a crash forgets is simply done
again at the next start.

Nothing under the root is trusted (a damaged disk, an operator's mistake or
someone with write access to the store may have left anything there), and
no single entry may stop the daemon from serving the rest:

- every file is opened by :func:`~hwr_server.access.files.open_stored`: ``O_NOFOLLOW`` (a link is
  refused, never followed out of the root), ``O_NONBLOCK`` (a FIFO cannot
  block the open; SIGTERM stays honoured), then fstat: a regular file owned
  by the daemon's user; every read is bounded (a manifest by
  ``ServerConfig.max_stored_manifest_bytes``, a header by the safetensors
  parser's own limit);
- an artifact directory must be a real directory of the daemon's user;
- what fails is quarantined with the reason; what cannot even be
  quarantined (no permission to move it) is skipped with a logged reason,
  not served, and its blobs are kept; an entry of blobs/ that is not a
  regular file is skipped with a logged reason, never unlinked as a blob;
- a manifest that does not parse still names its blobs (64-hex strings in
  its bytes that are blobs here): they go into the quarantine entry with it,
  so "quarantine keeps the bytes" holds for it too. An empty, unreadable or
  oversized manifest names none; its blobs are then unreferenced and go in
  step 4.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from hwr_client.core.errors import HwrError
from hwr_client.core.identity import is_key
from hwr_client.core.layout import parse_header
from hwr_client.core.manifest import Manifest
from hwr_server import failpoints
from hwr_server.access.files import Untrusted, open_stored, read_stored
from hwr_server.store.hashing import WholeHasher, parts_from_manifest, readback

log = logging.getLogger(__name__)


#: A digest as it appears in a manifest (blob names are SHA-256 hex).
_DIGEST = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


def salvage_blob_names(raw: bytes, blobs_dir: str) -> tuple[str, ...]:
    """Blob names a manifest that does not parse may still reference: the
    64-hex strings in its bytes that name a file in ``blobs_dir``."""
    names = dict.fromkeys(m.group().decode() for m in _DIGEST.finditer(raw))
    return tuple(n for n in names if os.path.lexists(os.path.join(blobs_dir, n)))


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the cheap checks found for one artifact directory.

    Attributes:
        manifest: the parsed manifest, or None.
        reason: a slug for the quarantine entry; "" when the artifact is ok.
        problem: the problem in words.
        salvaged: blob names found in a manifest that did not parse.
    """

    manifest: Manifest | None
    reason: str = ""
    problem: str = ""
    salvaged: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery did."""

    artifacts: int  # published after recovery
    quarantined: int  # newly quarantined now
    staging_removed: int
    orphan_blobs_removed: int
    seconds: float
    problems: tuple[str, ...] = ()


def check_artifact(store: Any, key: str) -> Checked:
    """Cheap checks of one artifact directory (the directory itself was
    checked by the caller: a real directory of the daemon's user).

    Returns:
        What was found; ``reason`` is "" when the artifact is ok.
    """
    path = os.path.join(store.artifact_dir(key), "manifest.json")
    what = f"artifact {key[:12]} manifest"
    try:
        raw = read_stored(path, what=what, limit=store.config.max_stored_manifest_bytes)
    except FileNotFoundError:
        return Checked(None, "manifest-missing", f"{what}: missing at {path}")
    except Untrusted as exc:
        return Checked(None, f"manifest-{exc.slug}", str(exc))
    try:
        manifest = Manifest.from_json(raw, what=what)
    except HwrError as exc:
        return Checked(None, "manifest-invalid", str(exc), salvage_blob_names(raw, store.blobs_dir))
    if manifest.key != key:
        return Checked(None, "manifest-invalid", f"{what}: describes key {manifest.key[:12]}, stored under {key[:12]}",
                       tuple(dict.fromkeys(f.blob for f in manifest.files)))
    problem = _check_blocks(manifest)
    if problem:
        return Checked(manifest, "manifest-invalid", f"{what}: {problem}")
    for f in manifest.files:
        reason, problem = _check_blob(store, manifest, f)
        if reason:
            return Checked(manifest, reason, problem)
    return Checked(manifest)


def _check_blocks(manifest: Manifest) -> str:
    """Each block must span exactly its tensors, adjacent in one file."""
    by_name = {t.name: t for t in manifest.tensors}
    for b in manifest.blocks:
        ts = [by_name[n] for n in b.tensors]
        if {t.file for t in ts} != {b.file} or b.begin != ts[0].offset or b.end != ts[-1].offset + ts[-1].nbytes:
            return f"block {b.index} ({b.prefix!r}) range [{b.begin}, {b.end}) does not match its tensors"
    return ""


def _check_blob(store: Any, manifest: Manifest, f: Any) -> tuple[str, str]:
    what = f"artifact {manifest.key[:12]} file {f.index} (blob {f.blob[:12]})"
    path = store.blob_path(f.blob)
    try:
        fd, st = open_stored(path, what=what)
    except FileNotFoundError:
        return "blob-missing", f"{what}: blob missing at {path}"
    except Untrusted as exc:
        return f"blob-{exc.slug}", str(exc)
    with os.fdopen(fd, "rb") as fh:
        if st.st_size != f.size:
            return "blob-size", f"{what}: blob size {st.st_size}, expected {f.size}"
        problem = _header_problem_of(fh, manifest, f.index, st.st_size, what)
    return ("blob-header", problem) if problem else ("", "")


def _header_problem_of(fh: Any, manifest: Manifest, fi: int, size: int, what: str) -> str:
    try:
        # The parser bounds its own read (MAX_HEADER_BYTES) and the file size.
        header = parse_header(fh, size, what=what)
    except HwrError as exc:
        return str(exc)
    expect = sorted((t.name, t.dtype, tuple(t.shape), t.offset) for t in manifest.tensors if t.file == fi)
    got = sorted((e.name, e.dtype, tuple(e.shape), header.data_start + e.begin) for e in header.tensors())
    if header.data_start != manifest.files[fi].data_start or got != expect:
        return f"{what}: safetensors header does not describe the manifest's tensors"
    return ""


# -- deep verification (`hwr verify`, scrub, ReportCorruption) -----------------


def verify_file(manifest: Manifest, fi: int, path: str) -> tuple[list[str], bool, int]:
    """Re-hashes one blob: file SHA-256 and xxh3, every tensor's digest (the
    manifest format's: xxh3-128, or SHA-256 for format 1), every block's
    xxh3, the header and the zero padding. The file's SHA-256 proves every
    byte; the rest names what is damaged.

    Returns:
        (every problem found, whether the blob itself is corrupt, bytes read).
    """
    f = manifest.files[fi]
    what = f"artifact {manifest.key[:12]} file {fi} (blob {f.blob[:12]})"
    try:
        fd, st = open_stored(path, what=what)
    except FileNotFoundError:
        return [f"{what}: blob missing at {path}"], True, 0
    except Untrusted as exc:
        # A link or FIFO where a blob should be is never read (it could
        # block, or never end: /dev/zero).
        return [str(exc)], True, 0
    # Every read below goes through this one checked fd: re-opening the
    # path would read whatever the name points to by then (a link swapped
    # in after the check).
    try:
        size = st.st_size
        problems = [f"{what}: size {size}, expected {f.size}"] if size != f.size else []
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as fh:
            problem = _header_problem_of(fh, manifest, fi, size, what)
        if problem:
            problems.append(problem)
        whole, parts = WholeHasher(), parts_from_manifest(manifest, fi)
        nread = readback(fd, whole, parts, f.data_start, size)
    finally:
        os.close(fd)
    sha, xxh = whole.digests()
    bad = bool(problems) or sha != f.blob
    if sha != f.blob:
        problems.append(f"{what}: sha256 {sha[:12]}…, expected {f.blob[:12]}…")
    if xxh != f.xxh3_128:
        problems.append(f"{what}: xxh3_128 {xxh}, expected {f.xxh3_128}")
    tdig, bdig = parts.tensor_digests(), parts.block_digests()
    for t in manifest.tensors:
        if t.file == fi and tdig.get(t.name) != t.digest:
            problems.append(f"artifact {manifest.key[:12]} tensor {t.name!r}: {t.digest_algorithm} mismatch, "
                            f"expected {t.digest[:12]}…")
    for b in manifest.blocks:
        if b.file == fi and bdig.get(b.index) != b.xxh3_128:
            problems.append(f"artifact {manifest.key[:12]} block {b.index} ({b.prefix!r}): xxh3_128 mismatch")
    return problems + parts.problems, bad, nread


def verify_artifact(manifest: Manifest, paths: Sequence[str], *, threads: int = 2) -> tuple[list[str], list[str], int]:
    """Deep verification of every file (files in parallel, two hashing
    threads each).

    Returns:
        (every problem, digests of corrupt blobs, bytes read).
    """
    with ThreadPoolExecutor(max_workers=max(1, threads // 2)) as pool:
        results = list(pool.map(lambda i: verify_file(manifest, i, paths[i]), range(len(paths))))
    problems = [p for r in results for p in r[0]]
    bad = [manifest.files[i].blob for i, r in enumerate(results) if r[1]]
    return problems, bad, sum(r[2] for r in results)


# -- startup -------------------------------------------------------------------


def _remove_staging(store: Any) -> int:
    failpoints.hit("recovery.remove_staging")
    names = os.listdir(store.staging_dir)
    for name in names:
        path = os.path.join(store.staging_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    if names:
        log.info("recovery: removed %d staging leftover(s)", len(names))
    return len(names)


def _remove_partial_quarantine(store: Any) -> int:
    """Removes empty quarantine entries (a quarantine killed before its
    rename); rmdir refuses any entry that holds something."""
    failpoints.hit("recovery.remove_partial_quarantine")
    removed = 0
    for name in os.listdir(store.quarantine_dir):
        try:
            os.rmdir(os.path.join(store.quarantine_dir, name))
        except OSError:
            continue  # not empty (a real entry) or not a directory
        removed += 1
    if removed:
        log.info("recovery: removed %d empty quarantine entr%s", removed, "y" if removed == 1 else "ies")
    return removed


def _check_all(store: Any) -> tuple[dict[str, Manifest], list[str], set[str]]:
    """Step 3. Returns (good manifests, problems, blobs to keep although no
    good manifest references them: those of artifacts that could not be
    quarantined)."""
    failpoints.hit("recovery.check_artifacts")
    good: dict[str, Manifest] = {}
    bad: list[tuple[str, Checked]] = []
    problems: list[str] = []
    for name in sorted(os.listdir(store.artifacts_dir)):
        checked = _check_entry(store, name)
        if checked is None:
            continue
        if checked.reason:
            problems.append(checked.problem)
            log.warning("recovery: %s; quarantining", checked.problem)
            bad.append((name, checked))
        elif checked.manifest is not None:
            good[name] = checked.manifest
    # Quarantine only once the good set is known, so blobs that a quarantined
    # artifact shares with a good one stay in blobs/.
    store.load_index(good)
    keep: set[str] = set()
    for name, checked in bad:
        manifest = checked.manifest
        corrupt = tuple(f.blob for f in manifest.files if _check_blob(store, manifest, f)[0]) if manifest else ()
        try:
            store.quarantine(name, checked.reason, bad_blobs=corrupt, manifest=manifest, blobs=checked.salvaged)
        except OSError as exc:
            # E.g. a directory of another user that we may not move. Not
            # served (it is not in the index), left where it is, and its
            # blobs are kept: one entry must not stop the daemon.
            log.error("recovery: artifacts/%s: could not quarantine it (%s); skipped, not served", name, exc)
            keep.update(checked.salvaged)
            if manifest is not None:
                keep.update(f.blob for f in manifest.files)
    return good, problems, keep


def _check_entry(store: Any, name: str) -> Checked | None:
    """artifacts/<name> must be a real directory (never a link: it could
    publish a directory outside the root) of the daemon's user, named by an
    identity key; then :func:`check_artifact`. None when it is gone."""
    try:
        st = os.lstat(store.artifact_dir(name))
    except FileNotFoundError:
        return None  # gone since listdir (nothing else runs during recovery)
    if not is_key(name) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return Checked(None, "unknown-entry", f"artifacts/{name}: not an identity-key directory")
    if stat.S_ISLNK(st.st_mode):
        return Checked(None, "artifact-link", f"artifacts/{name}: a symbolic link, expected a directory")
    checked = check_artifact(store, name)
    if st.st_uid != os.geteuid():
        # Another user's directory: what its manifest names moves with it,
        # or is kept if we may not move it.
        return dataclasses.replace(checked, reason="artifact-owner", problem=(
            f"artifacts/{name}: owned by uid {st.st_uid}, expected uid {os.geteuid()} (the daemon's user)"))
    return checked


def _remove_orphans(store: Any, good: dict[str, Manifest], keep: set[str]) -> int:
    """Step 4: unlinks the blobs no good manifest references (except
    ``keep``). An entry that is not a regular file or a link (a directory)
    is skipped with a logged reason: it is no blob of ours to unlink."""
    failpoints.hit("recovery.remove_orphans")
    referenced = {f.blob for m in good.values() for f in m.files} | keep
    removed = 0
    for name in os.listdir(store.blobs_dir):
        if name in referenced:
            continue
        path = store.blob_path(name)
        try:
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                log.warning("recovery: blobs/sha256/%s is %s, not a blob; skipped (remove it by hand)",
                            name, stat.filemode(st.st_mode))
                continue
            # Nothing references it and nothing is publishing yet: no reader
            # can need it. unlink removes a link itself, never its target.
            os.unlink(path)
        except OSError as exc:
            log.warning("recovery: unreferenced blobs/sha256/%s not removed: %s", name, exc)
            continue
        removed += 1
    if removed:
        log.info("recovery: removed %d unreferenced blob(s)", removed)
    return removed


def recover(store: Any) -> RecoveryReport:
    """Runs startup recovery on ``store`` and installs the rebuilt index.

    Returns:
        A RecoveryReport with the counts.
    """
    t0 = time.monotonic()
    staging = _remove_staging(store)
    _remove_partial_quarantine(store)
    good, problems, keep = _check_all(store)
    # Corrupt blobs of quarantined artifacts were moved with them; what is left
    # unreferenced is garbage from interrupted publications.
    orphans = _remove_orphans(store, good, keep)
    store.load_index(good)
    report = RecoveryReport(len(good), len(problems), staging, orphans, time.monotonic() - t0, tuple(problems))
    log.info(
        "recovery: %d artifact(s) published, %d quarantined, %d staging removed, %d orphan blob(s) removed in %.3f s",
        report.artifacts, report.quarantined, report.staging_removed, report.orphan_blobs_removed, report.seconds,
    )
    return report
