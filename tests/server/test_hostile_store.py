"""Trust in the filesystem: the runtime directory, startup
recovery, the store's bytes. Every test runs the real daemon; the
permission cases run it (or the attacker) as uid nobody in a child process.

Each test plants what an attacker or a damaged disk would leave, starts
``hwr serve`` and checks that it refuses the planted thing with a reason,
or serves the rest, and never writes through a planted link.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import types
import uuid

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import FailedPrecondition, NotFound
from hwr_client.tensors import build_plan
from hwr_server.rpc import store as rpc_store
from hwr_server.leases.manager import LeaseManager
from tests.conftest import identity, sample_tensors
from tests.support.daemon import make_daemon, wait_serving
from tests.support.privdrop import nobody, popen_python_as, run_python_as
from tests.support.gc import publish
from tests.support.store import make_store, publish_inproc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting files of other users needs root")

#: A uid that is neither root nor nobody: the "other user" of a two-user attack.
OTHER_UID = 1


def _exit_log(d, timeout: float = 30.0) -> tuple[int, str]:
    """Waits for a daemon expected to refuse to start; (exit code, log)."""
    assert d.proc is not None
    try:
        rc = d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"daemon did not refuse to start; log:\n{d.log()[-2000:]}")
    return rc, d.log()


@pytest.fixture
def victim_file(tmp_path):
    """A file of the daemon's user that a planted link points at."""
    path = tmp_path / "precious.txt"
    path.write_text("precious\n")
    return path


# -- the runtime directory ------------------------------------------------


def test_socket_dir_made_by_another_user_writable_by_all_is_refused(tmp_path, victim_file):
    """nobody pre-creates the daemon's socket directory 0777 and plants
    ``hwr.sock.lock`` as a link to a file of the victim (root). The daemon
    must refuse the directory and leave the file alone."""
    user = nobody()
    sockdir = f"/tmp/hwr-victim-{uuid.uuid4().hex[:8]}"
    os.chmod(tmp_path, 0o755)  # let nobody reach the victim's file by name
    plant = (f"import os; os.mkdir({sockdir!r}); os.chmod({sockdir!r}, 0o777); "
             f"os.symlink({str(victim_file)!r}, {sockdir + '/hwr.sock.lock'!r})")
    out = run_python_as(user.pw_uid, user.pw_gid, plant)
    assert out.returncode == 0, out.stderr
    try:
        d = make_daemon(tmp_path)
        d.socket, d.admin_socket = f"{sockdir}/hwr.sock", f"{sockdir}/admin.sock"
        d.start(wait=False)
        rc, log = _exit_log(d)
        assert rc != 0
        assert f"directory {sockdir} is owned by uid {user.pw_uid}, expected root or uid 0" in log
        assert victim_file.read_text() == "precious\n"
        assert not os.path.exists(d.socket)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_lock_file_planted_as_a_link_is_never_written_through(tmp_path, victim_file):
    """Even in a directory of our own, ``<socket>.lock`` that is a link is
    refused (O_NOFOLLOW), with the reason."""
    d = make_daemon(tmp_path)
    os.symlink(victim_file, d.socket + ".lock")
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0
    assert f"lock file {d.socket}.lock of socket {d.socket} is a symbolic link" in log
    assert victim_file.read_text() == "precious\n"


def test_store_lock_planted_as_a_link_is_refused(tmp_path, victim_file):
    d = make_daemon(tmp_path)
    os.makedirs(d.root)
    os.symlink(victim_file, os.path.join(d.root, "hwr.lock"))
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0 and "is a symbolic link" in log
    assert victim_file.read_text() == "precious\n"


def test_socket_path_that_is_a_link_is_refused(tmp_path, victim_file):
    """A link at the socket path itself is not bound through or unlinked."""
    d = make_daemon(tmp_path)
    os.symlink(victim_file, d.socket)
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0 and f"socket {d.socket}: exists and is not a Unix socket" in log
    assert os.path.islink(d.socket) and victim_file.read_text() == "precious\n"


@pytest.fixture
def nobody_env():
    """uid nobody's environment without XDG_RUNTIME_DIR (so the predictable
    /tmp/hwr-<uid>-run default is used), with a HOME of its own; the default
    runtime directory is removed before and after."""
    user = nobody()
    run = f"/tmp/hwr-{user.pw_uid}-run"
    shutil.rmtree(run, ignore_errors=True)
    home = tempfile.mkdtemp(prefix="hwr-home-", dir="/tmp")
    os.chown(home, user.pw_uid, user.pw_gid)
    env = {"HOME": home, "PATH": os.environ["PATH"]}
    yield user, run, env
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)


def test_default_runtime_dir_is_created_private_and_serves(nobody_env):
    user, run, env = nobody_env
    proc = popen_python_as(user.pw_uid, user.pw_gid, ["-m", "hwr_client.cli", "serve"], env=env, cwd=env["HOME"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_serving(os.path.join(run, "hwr", "hwr.sock"), proc=proc)
        for d in (run, os.path.join(run, "hwr")):
            st = os.stat(d)
            assert (st.st_uid, st.st_mode & 0o777) == (user.pw_uid, 0o700), d
        # The client's default choice accepts a directory of its own user.
        out = run_python_as(user.pw_uid, user.pw_gid,
                            "from hwr_client.channel import default_socket; print(default_socket())", env=env)
        assert out.returncode == 0 and out.stdout.strip() == os.path.join(run, "hwr", "hwr.sock"), out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def _plant_other_users_runtime_dir(run: str, victim: str) -> None:
    """What another user (uid 1) leaves for nobody: the predictable runtime
    directory, 0777, with a lock link to nobody's file."""
    os.makedirs(os.path.join(run, "hwr"))
    for d in (run, os.path.join(run, "hwr")):
        os.chown(d, OTHER_UID, OTHER_UID)
        os.chmod(d, 0o777)
    os.symlink(victim, os.path.join(run, "hwr", "hwr.sock.lock"))


def test_default_runtime_dir_of_another_user_is_refused_by_daemon_and_client(nobody_env):
    """uid 1 pre-created /tmp/hwr-<nobody>-run: nobody's daemon refuses to
    start there (and writes nothing through the planted lock link), and
    nobody's client refuses the default socket in it, naming the directory."""
    user, run, env = nobody_env
    victim = os.path.join(env["HOME"], "precious.txt")
    with open(victim, "w") as f:
        f.write("precious\n")
    os.chown(victim, user.pw_uid, user.pw_gid)
    _plant_other_users_runtime_dir(run, victim)
    proc = popen_python_as(user.pw_uid, user.pw_gid, ["-m", "hwr_client.cli", "serve"], env=env, cwd=env["HOME"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0, out
    assert f"directory {run}/hwr: directory {run} on its way is owned by uid {OTHER_UID}, expected root or uid {user.pw_uid}" in out
    assert open(victim).read() == "precious\n"
    client = run_python_as(user.pw_uid, user.pw_gid, (
        "from hwr_client.channel import RuntimeChannel\n"
        "from hwr_client.core.errors import FailedPrecondition\n"
        "try:\n    RuntimeChannel()\nexcept FailedPrecondition as e:\n    print('refused:', e)\n"
    ), env=env)
    assert client.returncode == 0, client.stderr
    assert client.stdout.startswith("refused:") and f"{run} on its way is owned by uid {OTHER_UID}" in client.stdout


# -- startup recovery of a store nobody vouches for ---------------


def _publish(d, *tags: str, seed: int = 0) -> dict[str, object]:
    """Publishes one small artifact per tag (one file per block, so each
    has blobs of its own); returns tag -> manifest."""
    out = {}
    with d.client() as c:
        for i, tag in enumerate(tags):
            out[tag] = c.publish(identity(t=tag), sample_tensors(blocks=2, seed=seed + i), file_target_bytes=1).manifest
    return out


def _states(d) -> dict[str, tuple[str, str]]:
    """key -> (state, reason) as ListArtifacts reports it."""
    with d.client() as c:
        reply = c.call(c.reader.ListArtifacts, pb.ListArtifactsRequest())
    return {a.key: (a.state, a.reason) for a in reply.artifacts}


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _replace(path: str, plant) -> None:
    """Replaces a (read-only) stored file by what ``plant(path)`` creates."""
    os.unlink(path)
    plant(path)


def _plant_fifo(tmp_path):
    fifo = str(tmp_path / "fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    return lambda p: os.symlink(fifo, p)


def _plant_sparse(tmp_path):
    def plant(p: str) -> None:
        with open(p, "wb") as f:
            f.truncate(1 << 30)  # 1 GiB of holes: costs no disk, would cost 1 GiB of RAM to read
    return plant


def _plant_outside(tmp_path):
    def plant(p: str) -> None:
        outside = str(tmp_path / "outside-manifest.json")
        os.symlink(outside, p)
    return plant


PLANTS = {
    "manifest-fifo-link": _plant_fifo,
    "manifest-dev-zero-link": lambda tmp_path: (lambda p: os.symlink("/dev/zero", p)),
    "manifest-sparse-1GiB": _plant_sparse,
    "manifest-link-outside-root": _plant_outside,
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_recovery_never_follows_or_reads_unbounded_a_planted_manifest(tmp_path, make_daemon_fixture, plant):
    """manifest.json as a link to a FIFO (the daemon used to hang, deaf to
    SIGTERM), to /dev/zero (9 GB of RSS), a 1 GiB sparse file (read whole),
    a link to a valid manifest outside the root (published): each is
    quarantined, the daemon reaches SERVING, serves the other artifact, keeps
    its peak RSS far under the planted size, and exits 0 on SIGTERM."""
    d = make_daemon_fixture()
    m = _publish(d, "good", "planted")
    d.stop()
    good, bad = m["good"].key, m["planted"].key
    mpath = os.path.join(d.root, "artifacts", bad, "manifest.json")
    shutil.copy(mpath, tmp_path / "outside-manifest.json")
    _replace(mpath, PLANTS[plant](tmp_path))
    d.start(wait=False)
    wait_serving(d.socket, timeout=20, proc=d.proc)
    states = _states(d)
    assert states[good] == ("published", "")
    assert states[bad][0] == "quarantined"
    with d.client() as c:
        assert c.lookup(good).key == good
        with pytest.raises(FailedPrecondition, match="quarantined"):
            c.lookup(bad)
    assert _peak_rss_bytes(d.proc.pid) < 512 * 2**20
    assert d.stop(signal.SIGTERM) == 0


def test_recovery_quarantines_an_artifact_directory_linked_outside_the_root(tmp_path, make_daemon_fixture):
    """artifacts/<key> as a link to a valid artifact directory elsewhere is
    not published (it used to be): quarantined as a link, the target untouched."""
    d = make_daemon_fixture()
    m = _publish(d, "good", "linked")
    d.stop()
    good, bad = m["good"].key, m["linked"].key
    art = os.path.join(d.root, "artifacts", bad)
    outside = str(tmp_path / "outside-artifact")
    shutil.copytree(art, outside)
    shutil.rmtree(art)
    os.symlink(outside, art)
    d.start()
    states = _states(d)
    assert states[good] == ("published", "") and states[bad] == ("quarantined", "artifact-link")
    assert sorted(os.listdir(outside)) == ["manifest.json", "publisher.json"]  # as copied: untouched


def test_unparseable_manifest_is_quarantined_with_its_blobs(make_daemon_fixture):
    """A manifest that does not parse (two bytes cut off its end): the blobs
    it names that no other artifact uses go into its quarantine entry; they
    used to be unlinked as unreferenced. Shared blobs stay in blobs/."""
    d = make_daemon_fixture()
    m = _publish(d, "good", "broken")
    d.stop()
    good, bad = m["good"], m["broken"]
    mpath = os.path.join(d.root, "artifacts", bad.key, "manifest.json")
    with open(mpath, "rb") as f:
        raw = f.read()
    os.unlink(mpath)
    with open(mpath, "wb") as f:
        f.write(raw[:-2])
    shared = {f.blob for f in good.files}
    own = {f.blob for f in bad.files} - shared
    assert own, "the test needs blobs only the broken artifact uses"
    d.start()
    assert _states(d)[bad.key] == ("quarantined", "manifest-invalid")
    entry, = [e for e in os.listdir(os.path.join(d.root, "quarantine")) if e.startswith(bad.key)]
    assert set(os.listdir(os.path.join(d.root, "quarantine", entry, "blobs"))) == own
    assert set(os.listdir(os.path.join(d.root, "blobs", "sha256"))) == shared


def _nobody_store(make_daemon_fixture, tags):
    """A store published by root, then handed to uid nobody (chown -R), in a
    directory nobody can reach; returns (daemon as root stopped, manifests,
    the base directory)."""
    user = nobody()
    base = tempfile.mkdtemp(prefix="hwr-nobody-", dir="/tmp")
    d = make_daemon_fixture(root=os.path.join(base, "root"))
    m = _publish(d, *tags)
    d.stop()
    for dirpath, dirs, files in os.walk(base):
        for n in [dirpath, *(os.path.join(dirpath, x) for x in dirs + files)]:
            os.lchown(n, user.pw_uid, user.pw_gid)
    return d, m, base


def test_recovery_under_a_non_root_daemon_skips_what_it_cannot_read(make_daemon_fixture):
    """Under a daemon running as nobody: a stray directory in blobs/sha256
    (IsADirectoryError), a root-owned 0600 manifest and a root-owned 0600
    blob (PermissionError) used to make `hwr serve` exit 1. Now the daemon
    serves the good artifact, quarantines the two with their reasons, and
    skips (not served, blobs kept) an artifact directory of root's it may
    not even move."""
    user = nobody()
    d, m, base = _nobody_store(make_daemon_fixture, ["good", "manifest", "blob", "rootdir"])
    try:
        blobs = os.path.join(d.root, "blobs", "sha256")
        os.mkdir(os.path.join(blobs, "stray-directory"))
        mpath = os.path.join(d.root, "artifacts", m["manifest"].key, "manifest.json")
        own_blob = [f.blob for f in m["blob"].files if all(f.blob != g.blob for g in m["good"].files)][-1]
        for path in (mpath, os.path.join(blobs, own_blob)):
            os.chown(path, 0, 0)
            os.chmod(path, 0o600)
        rootdir = os.path.join(d.root, "artifacts", m["rootdir"].key)
        os.chown(rootdir, 0, 0)
        os.chmod(rootdir, 0o755)
        sockdir = os.path.join(base, "run")
        os.mkdir(sockdir, 0o700)
        os.chown(sockdir, user.pw_uid, user.pw_gid)
        sock = os.path.join(sockdir, "hwr.sock")
        proc = popen_python_as(user.pw_uid, user.pw_gid, [
            "-m", "hwr_client.cli", "serve", "--root", d.root, "--socket", sock,
            "--admin-socket", os.path.join(sockdir, "admin.sock")],
            env={"HOME": base, "PATH": os.environ["PATH"]}, cwd=base,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_serving(sock, timeout=20, proc=proc)
            d.socket, d.admin_socket = sock, os.path.join(sockdir, "admin.sock")
            states = _states(d)
            with d.client() as c:
                assert c.lookup(m["good"].key).key == m["good"].key
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, out
        assert states[m["good"].key] == ("published", "")
        assert states[m["manifest"].key] == ("quarantined", "manifest-unreadable")
        assert states[m["blob"].key][0] == "quarantined" and states[m["blob"].key][1].startswith("blob-")
        assert m["rootdir"].key not in states  # neither served nor movable
        assert os.path.isdir(rootdir) and all(os.path.exists(os.path.join(blobs, f.blob)) for f in m["rootdir"].files)
        assert os.path.isdir(os.path.join(blobs, "stray-directory"))
        assert "stray-directory is d" in out and "could not quarantine it" in out
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- a lease granted between DeleteArtifact's lease check and its delete ---


def test_lease_granted_in_the_gap_of_a_non_force_delete_never_lands_on_a_deleted_artifact(tmp_path, monkeypatch):
    """In process, at the seam between the holder check and the delete: a
    grant started there must either be seen by the check (delete refused) or
    wait for the delete and fail; it used to complete in the gap, so the
    delete went on and the worker held a lease on a deleted artifact."""
    store = make_store(tmp_path)
    tensors = sample_tensors()
    key = publish_inproc(store, build_plan(identity(t="gap"), tensors), tensors).key
    leases = LeaseManager(store.config, store)
    session = leases.open_session(pid=4242, client_name="gap").session_id
    outcome: dict[str, object] = {}

    def grant() -> None:
        try:
            outcome["grant"] = leases.acquire(session, key)
        except NotFound as exc:
            outcome["grant"] = exc

    real_delete = store.delete

    def delete_with_a_grant_in_the_gap(k: str) -> int:
        t = threading.Thread(target=grant)
        t.start()
        # Gives the grant every chance to complete now, inside the gap; it
        # cannot while the delete holds the store's lock (then it waits).
        t.join(timeout=2.0)
        outcome["granted_in_gap"] = not t.is_alive()
        try:
            return real_delete(k)
        finally:
            outcome["thread"] = t

    monkeypatch.setattr(store, "delete", delete_with_a_grant_in_the_gap)
    c = types.SimpleNamespace(store=store, leases=leases)
    try:
        rpc_store.delete(c, pb.DeleteArtifactRequest(key=key), None)  # type: ignore[arg-type]
        deleted = True
    except FailedPrecondition:
        deleted = False
    t = outcome["thread"]
    assert isinstance(t, threading.Thread)
    t.join(timeout=10)
    granted = not isinstance(outcome["grant"], Exception)
    assert not (deleted and granted), "a lease was granted on an artifact the delete then removed"
    assert outcome["granted_in_gap"] is False
    assert deleted and isinstance(outcome["grant"], NotFound)
    assert leases.holders(key) == []


# -- dedup must not trust a stored blob by its name and size ---------------


def _flip_byte(path: str, offset: int = -100) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    os.chmod(path, 0o444)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_publication_replaces_a_rotted_blob_with_the_bytes_it_just_hashed(daemon):
    """X's blob loses one byte (size unchanged); Y publishes the same bytes.
    Y used to commit pointing at the rotted blob (and a lease without
    verification read wrong data). Now the fresh copy replaces it: Y and X
    both verify, and a reader of the old inode keeps its bytes."""
    tensors = sample_tensors(blocks=2, seed=5)
    with daemon.client() as c:
        x = c.publish(identity(t="x"), tensors, file_target_bytes=1).manifest
        blob = x.files[-1].blob
        path = os.path.join(daemon.root, "blobs", "sha256", blob)
        _flip_byte(path)
        with open(path, "rb") as old_reader:
            y = c.publish(identity(t="y"), tensors, file_target_bytes=1).manifest
            assert blob in {f.blob for f in y.files}
            assert _sha256(path) == blob  # the stored blob is the bytes just hashed
            assert hashlib.sha256(old_reader.read()).hexdigest() != blob  # the old inode keeps its bytes
        for key in (y.key, x.key):
            reply = c.call(c.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=key))
            assert reply.results[0].ok, reply
    assert "the stored copy differs from the bytes just published" in daemon.log()


def test_publication_reuses_an_intact_blob_without_a_second_copy(daemon):
    """The other side of the comparison: an intact stored blob is kept (same
    inode: mappers of X and Y share one copy in the page cache)."""
    tensors = sample_tensors(blocks=2, seed=6)
    with daemon.client() as c:
        x = c.publish(identity(t="x2"), tensors, file_target_bytes=1).manifest
        inodes = {f.blob: os.stat(os.path.join(daemon.root, "blobs", "sha256", f.blob)).st_ino for f in x.files}
        c.publish(identity(t="y2"), tensors, file_target_bytes=1)
    assert inodes == {b: os.stat(os.path.join(daemon.root, "blobs", "sha256", b)).st_ino for b in inodes}


# -- ReportCorruption re-hashes at most once per key at a time ---


def _bytes_read(pid: int) -> int:
    """Bytes the process has read (page cache included) since it started."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _report_all(d, key: str, n: int) -> list:
    with d.client() as c:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: c.call(c.runtime.ReportCorruption,
                                                  pb.ReportCorruptionRequest(key=key, detail="test"), timeout=120),
                                 range(n)))


def test_concurrent_corruption_reports_share_one_verification(make_daemon_fixture):
    """16 concurrent reports on an intact 32 MiB artifact used to re-hash it
    16 times (16 x 32 MiB read); now one verification answers them all, and
    reports within report_verify_interval_s after it re-hash nothing."""
    d = make_daemon_fixture()
    with d.client() as c:
        report = publish(c, "reported", 32)
    size = report.manifest.size_bytes
    before = _bytes_read(d.proc.pid)
    replies = _report_all(d, report.key, 16)
    during = _bytes_read(d.proc.pid) - before
    assert all(not r.quarantined and not r.problems for r in replies)
    assert size <= during < 3 * size, (during, size)
    before = _bytes_read(d.proc.pid)
    _report_all(d, report.key, 4)
    assert _bytes_read(d.proc.pid) - before < size // 4  # the interval: nothing re-hashed


def test_reports_of_a_corrupt_artifact_quarantine_it_once_and_all_hear_so(make_daemon_fixture, tmp_path):
    conf = tmp_path / "hwr.toml"
    conf.write_text("report_verify_interval_s = 0.0\n")
    d = make_daemon_fixture("--config", str(conf))
    with d.client() as c:
        report = publish(c, "rotten", 8)
    _flip_byte(os.path.join(d.root, "blobs", "sha256", report.manifest.files[-1].blob))
    replies = _report_all(d, report.key, 8)
    assert all(r.quarantined and r.problems for r in replies)
    assert len([e for e in os.listdir(os.path.join(d.root, "quarantine")) if e.startswith(report.key)]) == 1
