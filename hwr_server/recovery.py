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
   through :func:`hwr_server.commit.quarantine`. The deep check (re-hashing)
   is `hwr verify`, not startup.
4. Blobs that no manifest references (a publication killed between moving
   its payload into blobs/ and renaming its manifest into place, a delete or
   quarantine killed before its blobs went) are removed.
5. The in-memory index is rebuilt from the manifests that passed.

No step fsyncs its removals: a removal that a crash forgets is simply done
again at the next start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from hwr_client.core.errors import HwrError
from hwr_client.core.identity import is_key
from hwr_client.core.layout import parse_header
from hwr_client.core.manifest import Manifest
from hwr_server import failpoints
from hwr_server.hashing import WholeHasher, parts_from_manifest, readback

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery did."""

    artifacts: int  # published after recovery
    quarantined: int  # newly quarantined now
    staging_removed: int
    orphan_blobs_removed: int
    seconds: float
    problems: tuple[str, ...] = ()


def check_artifact(store: Any, key: str) -> tuple[Manifest | None, str, str]:
    """Cheap checks of one artifact directory.

    Returns:
        (manifest or None, reason slug, problem text); reason is "" when ok.
    """
    path = os.path.join(store.artifact_dir(key), "manifest.json")
    what = f"artifact {key[:12]} manifest"
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None, "manifest-missing", f"{what}: missing at {path}"
    try:
        manifest = Manifest.from_json(raw, what=what)
    except HwrError as exc:
        return None, "manifest-invalid", str(exc)
    if manifest.key != key:
        return None, "manifest-invalid", f"{what}: describes key {manifest.key[:12]}, stored under {key[:12]}"
    problem = _check_blocks(manifest)
    if problem:
        return manifest, "manifest-invalid", f"{what}: {problem}"
    for f in manifest.files:
        reason, problem = _check_blob(store, manifest, f)
        if reason:
            return manifest, reason, problem
    return manifest, "", ""


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
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "blob-missing", f"{what}: blob missing at {path}"
    if size != f.size:
        return "blob-size", f"{what}: blob size {size}, expected {f.size}"
    problem = header_problem(manifest, f.index, path, size, what)
    return ("blob-header", problem) if problem else ("", "")


def header_problem(manifest: Manifest, fi: int, path: str, size: int, what: str) -> str:
    """"" when the blob's safetensors header parses and describes exactly the
    manifest's tensors of file ``fi`` at their offsets; else the problem."""
    try:
        with open(path, "rb") as fh:
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
    """Re-hashes one blob: file SHA-256 and xxh3, every tensor's SHA-256,
    every block's xxh3, the header and the zero padding.

    Returns:
        (every problem found, whether the blob itself is corrupt, bytes read).
    """
    f = manifest.files[fi]
    what = f"artifact {manifest.key[:12]} file {fi} (blob {f.blob[:12]})"
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return [f"{what}: blob missing at {path}"], True, 0
    problems = [f"{what}: size {size}, expected {f.size}"] if size != f.size else []
    problem = header_problem(manifest, fi, path, size, what)
    if problem:
        problems.append(problem)
    whole, parts = WholeHasher(), parts_from_manifest(manifest, fi)
    nread = readback(path, whole, parts, f.data_start, size)
    sha, xxh = whole.digests()
    bad = bool(problems) or sha != f.blob
    if sha != f.blob:
        problems.append(f"{what}: sha256 {sha[:12]}…, expected {f.blob[:12]}…")
    if xxh != f.xxh3_128:
        problems.append(f"{what}: xxh3_128 {xxh}, expected {f.xxh3_128}")
    tdig, bdig = parts.tensor_digests(), parts.block_digests()
    for t in manifest.tensors:
        if t.file == fi and tdig.get(t.name) != t.sha256:
            problems.append(f"artifact {manifest.key[:12]} tensor {t.name!r}: sha256 mismatch, expected {t.sha256[:12]}…")
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


def _check_all(store: Any) -> tuple[dict[str, Manifest], list[str]]:
    failpoints.hit("recovery.check_artifacts")
    good: dict[str, Manifest] = {}
    bad: list[tuple[str, Manifest | None, str]] = []
    problems: list[str] = []
    for name in sorted(os.listdir(store.artifacts_dir)):
        if not is_key(name) or not os.path.isdir(store.artifact_dir(name)):
            problems.append(f"artifacts/{name}: not an identity-key directory; quarantined")
            store.quarantine(name, "unknown-entry")
            continue
        manifest, reason, problem = check_artifact(store, name)
        if reason:
            problems.append(problem)
            log.warning("recovery: %s; quarantining", problem)
            bad.append((name, manifest, reason))
        elif manifest is not None:
            good[name] = manifest
    # Quarantine only once the good set is known, so blobs that a quarantined
    # artifact shares with a good one stay in blobs/.
    store.load_index(good)
    for name, manifest, reason in bad:
        corrupt = tuple(f.blob for f in manifest.files if _check_blob(store, manifest, f)[0]) if manifest else ()
        store.quarantine(name, reason, bad_blobs=corrupt, manifest=manifest)
    return good, problems


def _remove_orphans(store: Any, good: dict[str, Manifest]) -> int:
    failpoints.hit("recovery.remove_orphans")
    referenced = {f.blob for m in good.values() for f in m.files}
    removed = 0
    for name in os.listdir(store.blobs_dir):
        if name not in referenced:
            # Nothing references it and nothing is publishing yet: no reader can need it.
            os.unlink(store.blob_path(name))
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
    good, problems = _check_all(store)
    # Corrupt blobs of quarantined artifacts were moved with them; what is left
    # unreferenced is garbage from interrupted publications.
    orphans = _remove_orphans(store, good)
    store.load_index(good)
    report = RecoveryReport(len(good), len(problems), staging, orphans, time.monotonic() - t0, tuple(problems))
    log.info(
        "recovery: %d artifact(s) published, %d quarantined, %d staging removed, %d orphan blob(s) removed in %.3f s",
        report.artifacts, report.quarantined, report.staging_removed, report.orphan_blobs_removed, report.seconds,
    )
    return report
