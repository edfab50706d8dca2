"""The crash matrix: for EVERY failpoint in hwr_server.failpoints.POINTS the
real daemon (``hwr serve``) runs with ``HWR_FAILPOINT`` set, is driven to the
operation the point belongs to, dies by SIGKILL there, and is restarted on the
same root without the failpoint. Then: each artifact is absent or complete
and passes verification, staging/ is empty, no blob is unreferenced, and the
operation retried succeeds.

The tests are parametrized from the registry, so a new failpoint is covered
without a new test. Artifacts are tiny; each test starts the daemon 2–4
times (about 0.4 s each).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import DataLoss, FailedPrecondition, NotFound
from hwr_client.core.identity import Identity
from hwr_server import failpoints
from tests.conftest import identity, sample_tensors
from tests.support.daemon import Daemon, cleanup, make_daemon

SHARED = sample_tensors(blocks=2, seed=7)
#: Same base file as SHARED (embedding and final norm), its own block files.
OWN = {**SHARED, **{k: v + 1 for k, v in SHARED.items() if k.startswith("blocks.")}}


def key_of(tag: str) -> str:
    return Identity.from_dict(identity(t=tag)).key


# -- the daemon, with and without the failpoint ----------------------------------


@pytest.fixture
def daemon(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HWR_FAILPOINT"}
    d = make_daemon(tmp_path, env=env)
    d.env.pop("HWR_FAILPOINT", None)
    yield d
    cleanup(d)


def start(d: Daemon, point: str | None = None, *, wait: bool = True) -> Daemon:
    """(Re)starts the daemon on its root, armed with ``point`` or clean."""
    d.env.pop("HWR_FAILPOINT", None)
    if point:
        d.env["HWR_FAILPOINT"] = point
    return d.start(wait=wait)


def died_at(d: Daemon, point: str) -> None:
    """The daemon died by SIGKILL, and the failpoint says it was there."""
    assert d.proc is not None
    try:
        code = d.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"daemon armed with {point} did not die; log:\n{d.log()[-3000:]}")
    assert code == -signal.SIGKILL, f"exit {code}, expected SIGKILL at {point}; log:\n{d.log()[-3000:]}"
    # Other threads may log in the instant before the signal lands.
    assert f"hwr: failpoint {point} reached: SIGKILL" in d.log().splitlines()[-5:], d.log()[-3000:]


def expect_death(d: Daemon, point: str, call) -> None:
    """Runs ``call`` (which the failpoint interrupts) and checks the death."""
    with pytest.raises(Exception):  # the stream breaks: Unavailable, or the rpc's own error
        call()
    died_at(d, point)


# -- the checks after a restart ----------------------------------------------------


def published(d: Daemon) -> dict[str, dict]:
    """Manifests under artifacts/, read from disk."""
    out = {}
    art = os.path.join(d.root, "artifacts")
    for key in os.listdir(art):
        with open(os.path.join(art, key, "manifest.json"), encoding="utf-8") as f:
            out[key] = json.load(f)
    return out


def assert_consistent(d: Daemon, *, corrupt: str = "") -> set[str]:
    """staging/ empty, no unreferenced blob, every published artifact (except
    the one this test corrupted on purpose) passes verification; no empty
    quarantine entry. Returns the published keys."""
    root = d.root
    # A publication removes its staging directory just after its reply.
    deadline = time.monotonic() + 10
    while os.listdir(os.path.join(root, "staging")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(os.path.join(root, "staging")) == []
    manifests = published(d)
    referenced = {f["blob"] for m in manifests.values() for f in m["files"]}
    assert set(os.listdir(os.path.join(root, "blobs", "sha256"))) == referenced
    for entry in os.listdir(os.path.join(root, "quarantine")):
        assert os.path.exists(os.path.join(root, "quarantine", entry, "artifact")), entry
    with d.client() as c:
        for key in manifests:
            assert c.lookup(key).key == key
            if key != corrupt:
                reply = c.call(c.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=key))
                assert reply.results[0].ok, reply
    return set(manifests)


def index_of(point: str, step: str) -> int:
    names = [p.name for p in failpoints.POINTS if p.sequence == point.split(".")[0]]
    return names.index(point) - names.index(step)


# -- drivers, one per sequence ---------------------------------------------------------


def crash_commit(d: Daemon, point: str) -> None:
    """An ordered and an unordered publication, each killed at ``point``."""
    visible = index_of(point, "commit.rename_artifact") > 0  # past the publish point
    for ordered in (True, False):
        tag = f"commit-{point}-{ordered}"
        start(d, point)
        with d.client() as c:
            expect_death(d, point, lambda: c.publish(identity(t=tag), SHARED, ordered=ordered, file_target_bytes=1))
        start(d)
        keys = assert_consistent(d)
        assert (key_of(tag) in keys) == visible
        with d.client() as c:  # the retry
            report = c.publish(identity(t=tag), SHARED, ordered=ordered, file_target_bytes=1)
            assert report.key == key_of(tag)
        assert key_of(tag) in assert_consistent(d)
        d.stop()


def crash_delete(d: Daemon, point: str) -> None:
    """A DeleteArtifact, then a GC run, each killed at ``point`` (GC deletes
    through the same sequence)."""
    gone = index_of(point, "delete.rename_to_trash") > 0  # past the unpublish point
    own, shared = key_of("own"), key_of("shared")
    start(d, point)
    with d.client() as c:
        c.publish(identity(t="own"), OWN)
        c.publish(identity(t="shared"), SHARED)
        expect_death(d, point, lambda: c.call(c.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=own)))
    start(d)
    keys = assert_consistent(d)
    assert (own not in keys) == gone and shared in keys  # the shared base blob survived
    with d.client() as c:
        if not gone:
            c.call(c.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=own))
        with pytest.raises(NotFound):
            c.lookup(own)
    assert assert_consistent(d) == {shared}
    d.stop()
    start(d, point)
    with d.client() as c:
        gc = pb.CollectGarbageRequest(target_bytes=1)
        expect_death(d, point, lambda: c.call(c.admin.CollectGarbage, gc))
    start(d)
    assert (shared in assert_consistent(d)) == (not gone)
    with d.client() as c:
        c.call(c.admin.CollectGarbage, gc)
        assert assert_consistent(d) == set()
        assert c.publish(identity(t="shared"), SHARED).key == shared
    d.stop()


def _corrupt(d: Daemon, key: str) -> None:
    """Flips one byte of a block tensor (in a blob only ``key`` uses)."""
    with d.client() as c:
        manifest = c.lookup(key)
    t = manifest.tensor("blocks.1.norm.weight")
    path = os.path.join(d.root, "blobs", "sha256", manifest.files[t.file].blob)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(t.offset)
        byte = f.read(1)
        f.seek(t.offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def crash_quarantine(d: Daemon, point: str) -> None:
    """ReportCorruption of a corrupt artifact (the daemon re-verifies and
    quarantines), killed at ``point``."""
    gone = index_of(point, "quarantine.rename_artifact") > 0
    own, shared = key_of("own"), key_of("shared")
    start(d, point)
    with d.client() as c:
        c.publish(identity(t="own"), OWN)
        c.publish(identity(t="shared"), SHARED)
        _corrupt(d, own)
        report = pb.ReportCorruptionRequest(key=own, detail="crash matrix")
        expect_death(d, point, lambda: c.call(c.runtime.ReportCorruption, report))
    start(d)
    keys = assert_consistent(d, corrupt=own)
    assert (own not in keys) == gone and shared in keys
    with d.client() as c:
        if not gone:  # the retry: verification quarantines it this time
            with pytest.raises(DataLoss):
                c.call(c.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=own))
        with pytest.raises(FailedPrecondition, match="quarantined"):
            c.lookup(own)
        assert c.publish(identity(t="own"), OWN).key == own  # republished clean
    assert assert_consistent(d) == {own, shared}
    d.stop()


def crash_recovery(d: Daemon, point: str) -> None:
    """Startup recovery of a store with work for every step, killed at
    ``point``; the next start finishes it."""
    good, bad = key_of("good"), key_of("bad")
    start(d)
    with d.client() as c:
        c.publish(identity(t="good"), SHARED)
        c.publish(identity(t="bad"), OWN)
    d.stop()
    root = d.root
    os.makedirs(os.path.join(root, "staging", "leftover"))
    open(os.path.join(root, "staging", "leftover", "00000.safetensors"), "wb").close()
    open(os.path.join(root, "blobs", "sha256", "ab" * 32), "wb").close()  # an orphan
    os.mkdir(os.path.join(root, "quarantine", f"{bad}.interrupted.1"))
    manifest = os.path.join(root, "artifacts", bad, "manifest.json")
    os.chmod(manifest, 0o644)
    open(manifest, "w").close()  # truncated: quarantined at the check step
    start(d, point, wait=False)
    died_at(d, point)
    start(d)
    assert assert_consistent(d) == {good}
    with d.client() as c:
        with pytest.raises(FailedPrecondition, match="quarantined"):
            c.lookup(bad)
        assert c.publish(identity(t="bad"), OWN).key == bad
    assert assert_consistent(d) == {good, bad}
    d.stop()


DRIVERS = {"commit": crash_commit, "delete": crash_delete, "quarantine": crash_quarantine,
           "recovery": crash_recovery}


def test_every_sequence_has_a_driver():
    assert {p.sequence for p in failpoints.POINTS} <= set(DRIVERS)


@pytest.mark.parametrize("point", [p.name for p in failpoints.POINTS])
def test_crash_at_failpoint_recovers(daemon, point):
    DRIVERS[failpoints.get(point).sequence](daemon, point)


# -- a pull commits through the same sequence ----------------------------------------------


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A real registry holding SHARED and OWN, pushed by a daemon that is
    gone again: (registry host, {tag: key})."""
    from tests.support.oci_registry import make_registry, remote_config

    tmp = tmp_path_factory.mktemp("pull-matrix")
    reg = make_registry(str(tmp / "registry"))
    src = make_daemon(tmp, "--config", remote_config(str(tmp / "src.toml")))
    src.start()
    try:
        with src.client() as c:
            for tag, tensors in (("shared", SHARED), ("own", OWN)):
                key = c.publish(identity(t=tag), tensors, file_target_bytes=1).key
                c.transfer(c.admin.Push, pb.PushRequest(key=key, reference=f"{reg.host}/hwr/matrix"))
    finally:
        cleanup(src)
    yield reg.host
    reg.stop()


@pytest.mark.parametrize("point", [p.name for p in failpoints.POINTS if p.sequence == "commit"])
def test_pull_crash_at_commit_failpoint_recovers(daemon, pushed, tmp_path, point):
    """A pull killed at each step of the commit it shares with publication.
    The node holds SHARED first, so OWN's base blob is reused (linked), and
    only its block files are downloaded."""
    from tests.support.oci_registry import remote_config

    daemon.extra_args += ["--config", remote_config(str(tmp_path / "node.toml"))]
    own = key_of("own")
    pull = pb.PullRequest(reference=f"{pushed}/hwr/matrix:{own}")
    visible = index_of(point, "commit.rename_artifact") > 0
    start(daemon)
    with daemon.client() as c:
        c.publish(identity(t="shared"), SHARED, file_target_bytes=1)
    daemon.stop()
    start(daemon, point)
    with daemon.client() as c:
        expect_death(daemon, point, lambda: c.transfer(c.admin.Pull, pull))
    start(daemon)
    keys = assert_consistent(daemon)
    assert key_of("shared") in keys and (own in keys) == visible
    with daemon.client() as c:  # the retry
        done = c.transfer(c.admin.Pull, pull)
        assert done.key == own and done.already_present == visible
    assert assert_consistent(daemon) == {own, key_of("shared")}
    daemon.stop()


# -- the switch itself -------------------------------------------------------------------


def test_failpoint_names_are_listed_one_per_line():
    out = subprocess.run([sys.executable, "-m", "hwr_server.failpoints"], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.splitlines() == failpoints.names() and len(set(failpoints.names())) > 20


def test_unknown_failpoint_makes_serve_exit_2(daemon):
    start(daemon, "commit.no_such_step", wait=False)
    assert daemon.proc.wait(30) == 2
    assert "HWR_FAILPOINT" in daemon.log() and "commit.no_such_step" in daemon.log()
    assert not os.path.exists(daemon.socket)


def test_unarmed_hit_is_a_no_op():
    assert failpoints.armed() is None
    for name in failpoints.names():
        failpoints.hit(name)  # still alive
