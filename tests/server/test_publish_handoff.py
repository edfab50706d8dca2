"""The handoff transport: a local client writes the staging files through
descriptors the daemon hands it; the daemon seals each file (no writable
descriptor left anywhere), hashes what it holds (one SHA-256 pass per byte)
and fsyncs it. A client is never trusted: whatever it does to a file, the
daemon publishes what the file holds, or nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import shutil
import subprocess
import tempfile
import threading

import grpc
import pytest
import torch
import xxhash

from hwr_client.core.errors import Aborted, FailedPrecondition, NotFound
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.handoff import HandoffUnavailable, receive_descriptor, write_file
from hwr_client.tensors import build_plan, iter_payload
from hwr_server.publish.handoff import HandoffListener
from hwr_server.publish.publication import Publication
from hwr_server.store import hashing
from tests.conftest import identity, sample_tensors
from tests.server.test_hostile_publications import assert_nothing_left, key_of
from tests.support.handoff import RawHandoff, wait_until
from tests.support.privdrop import nobody, run_python_as
from tests.support.store import chunks_of, make_store

StatusCode = grpc.StatusCode


def big_tensors(mib: int = 8, blocks: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    per = mib * 2**20 // blocks // 4
    out = {"embed.weight": torch.randn(64, generator=g)}
    for i in range(blocks):
        out[f"blocks.{i}.w"] = torch.randn(per, generator=g)
    return out


def daemon_rchar(daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# -- the default path ---------------------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
def test_a_local_publication_takes_the_handoff_and_no_payload_crosses_the_socket(daemon, ordered):
    tensors = big_tensors()
    payload = sum(t.nbytes for t in tensors.values())
    before = daemon_rchar(daemon)
    with daemon.client() as client:
        report = client.publish(identity(t=f"default-{ordered}"), tensors, ordered=ordered, file_target_bytes=2 << 20)
        mapped = client.acquire(report.key, verify="full")
        with mapped:
            for name, t in tensors.items():
                assert torch.equal(mapped.tensors()[name], t)
    assert report.transport == "handoff" and report.bytes_written >= payload
    # No payload through read(2) at all: not from the socket, not read back
    # (the daemon hashes through mappings of the sealed files).
    assert daemon_rchar(daemon) - before < payload // 20
    assert report.manifest.format_version == 2
    for t in report.manifest.tensors:
        assert t.sha256 == "" and t.xxh3_128 == xxhash.xxh3_128(tensors[t.name].numpy().tobytes()).hexdigest()


def test_without_the_handoff_socket_the_payload_goes_in_messages(daemon):
    os.unlink(daemon.socket + ".pub")  # e.g. a client in another mount namespace: it cannot reach it
    with daemon.client() as client:
        report = client.publish(identity(t="fallback"), sample_tensors())
        assert report.transport == "messages"
        assert client.publish(identity(t="fallback2"), sample_tensors(), handoff=False).transport == "messages"


# -- one SHA-256 pass per byte --------------------------------------------------------


class _CountingHashlib:
    """Stands in for ``hashlib`` inside hwr_server.store.hashing: counts
    the bytes every SHA-256 it makes is fed."""

    def __init__(self):
        self.sha256_bytes = 0

    def sha256(self, data: bytes = b""):
        outer, inner = self, hashlib.sha256()

        class Counting:
            def update(self, piece) -> None:
                outer.sha256_bytes += memoryview(piece).nbytes
                inner.update(piece)

            def hexdigest(self) -> str:
                return inner.hexdigest()

        h = Counting()
        h.update(data)
        return h


@pytest.fixture
def inproc(tmp_path, monkeypatch):
    """A store, a bound handoff socket (short path) and the SHA-256 counter."""
    counter = _CountingHashlib()
    monkeypatch.setattr(hashing, "hashlib", counter)
    sockdir = tempfile.mkdtemp(prefix="hwr-h-", dir="/tmp")
    listener = HandoffListener(os.path.join(sockdir, "s.pub"))
    listener.bind(mode=0o600, gid=-1)
    yield make_store(tmp_path), listener, os.path.join(sockdir, "s"), counter
    listener.close()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.mark.parametrize("transport", ["handoff", "messages"])
def test_every_payload_byte_is_sha256_hashed_exactly_once(inproc, transport):
    store, listener, socket, counter = inproc
    tensors = big_tensors(4)
    plan = build_plan(identity(t=f"once-{transport}"), tensors, file_target_bytes=1 << 20)
    checked = check_plan(plan)
    msg = to_proto(plan)
    msg.file_handoff = transport == "handoff"
    pub = Publication.begin(store, msg, handoff=listener)
    try:
        if transport == "handoff":
            assert pub.handoff_token
            for i, lay in enumerate(checked.layouts):
                fd = receive_descriptor(socket, pub.handoff_token, i)
                write_file(fd, lay, tensors)
                os.close(fd)
                pub.written(i, lay.data_size, True)
        else:
            for fi, off, data in chunks_of(plan, tensors, 1 << 20):
                pub.write(fi, off, data)
        done = pub.commit()
    finally:
        pub.close()
    files = sum(lay.file_size for lay in checked.layouts)
    assert counter.sha256_bytes == files  # each file once (its blob name), no tensor a second time
    manifest = Manifest.from_json(done.manifest_json)
    for f, path in zip(manifest.files, (store.blob_path(f.blob) for f in manifest.files)):
        with open(path, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == f.blob


def test_a_declared_tensor_digest_is_checked_with_sha256(inproc):
    store, listener, socket, counter = inproc
    tensors = big_tensors(1)
    plan = build_plan(identity(t="declared"), tensors, file_target_bytes=1 << 20)
    msg = to_proto(plan)
    msg.file_handoff = True
    declared = next(t for f in msg.files for t in f.tensors if t.name == "blocks.1.w")
    name = declared.name
    declared.declared_sha256 = hashlib.sha256(tensors[name].numpy().tobytes()).hexdigest()
    pub = Publication.begin(store, msg, handoff=listener)
    try:
        for i, lay in enumerate(check_plan(plan).layouts):
            fd = receive_descriptor(socket, pub.handoff_token, i)
            write_file(fd, lay, tensors)
            os.close(fd)
            pub.written(i, lay.data_size, True)
        pub.commit()
    finally:
        pub.close()
    files = sum(lay.file_size for lay in check_plan(plan).layouts)
    assert counter.sha256_bytes == files + tensors[name].nbytes  # only the declared tensor twice


@pytest.mark.parametrize("transport", ["handoff", "messages"])
def test_a_plan_asking_for_tensor_sha256_gets_a_format_1_manifest(inproc, transport):
    """vLLM-Omni's manifest needs a SHA-256 per tensor: such a plan pays a
    second SHA-256 pass over the tensors, and its manifest (format 1) holds
    them, with its annotations."""
    store, listener, socket, counter = inproc
    tensors = big_tensors(1)
    plan = dataclasses.replace(build_plan(identity(t=f"sha-{transport}"), tensors, file_target_bytes=1 << 20),
                               tensor_sha256=True, annotations={"schema_version": 1, "data": {"k": 1}})
    checked = check_plan(plan)
    msg = to_proto(plan)
    msg.file_handoff = transport == "handoff"
    pub = Publication.begin(store, msg, handoff=listener)
    try:
        for i, lay in enumerate(checked.layouts):
            if transport == "handoff":
                fd = receive_descriptor(socket, pub.handoff_token, i)
                write_file(fd, lay, tensors)
                os.close(fd)
                pub.written(i, lay.data_size, True)
        for fi, off, data in chunks_of(plan, tensors, 1 << 20) if transport == "messages" else ():
            pub.write(fi, off, data)
        manifest = Manifest.from_json(pub.commit().manifest_json)
    finally:
        pub.close()
    files = sum(lay.file_size for lay in checked.layouts)
    assert counter.sha256_bytes == files + sum(t.nbytes for t in tensors.values())
    assert manifest.format_version == 1 and manifest.annotations == {"schema_version": 1, "data": {"k": 1}}
    assert {t.name: t.sha256 for t in manifest.tensors} == {
        n: hashlib.sha256(t.numpy().tobytes()).hexdigest() for n, t in tensors.items()}


# -- a client is never trusted ------------------------------------------------------------


@pytest.mark.parametrize("how", ["kept open", "duplicated", "held by a child process"])
def test_a_file_still_writable_anywhere_is_refused_at_its_seal(daemon, how):
    tensors = sample_tensors()
    child = None
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t=f"writer-{how}"), tensors)
        fd = raw.write(0, close=False)
        keep = []
        if how == "duplicated":
            keep.append(os.dup(fd))
            os.close(fd)
        elif how == "held by a child process":
            child = subprocess.Popen(["sleep", "60"], pass_fds=[fd])
            os.close(fd)
        raw.written(0)
        code, details, _ = raw.commit()
        for k in keep:
            os.close(k)
        if how == "kept open":
            os.close(fd)
    if child is not None:
        child.kill()
        child.wait()
    assert code == StatusCode.FAILED_PRECONDITION, details
    assert "writable descriptor of it is still open" in details
    assert_nothing_left(daemon, key_of(f"writer-{how}"))


def test_a_handed_descriptor_cannot_be_mapped_writable(daemon):
    """The descriptor is write-only: a shared writable mapping (which would
    outlive any close) needs O_RDWR, so the kernel refuses it."""
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="mapping"), sample_tensors())
        fd = raw.fd(0)
        try:
            with pytest.raises(PermissionError):
                # The header's length: the file holds it (nothing is preallocated).
                mmap.mmap(fd, raw.checked.layouts[0].data_start)
        finally:
            os.close(fd)
            raw.cancel()
    assert_nothing_left(daemon, key_of("mapping"))


def test_a_client_that_overwrites_the_header_is_refused(daemon):
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="header"), sample_tensors())
        fd = raw.write(0, close=False)
        os.pwrite(fd, b"{}", 8)
        os.close(fd)
        for i in range(len(raw.checked.layouts)):
            if i:
                raw.write(i)
            raw.written(i)
        code, details, _ = raw.commit()
    assert code == StatusCode.INVALID_ARGUMENT and "header the daemon wrote was overwritten" in details, details
    assert_nothing_left(daemon, key_of("header"))


def test_a_client_that_changes_the_size_is_refused(daemon):
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="size"), sample_tensors())
        fd = raw.write(0, close=False)
        os.ftruncate(fd, raw.checked.layouts[0].file_size + 4096)
        os.close(fd)
        raw.written(0)
        code, details, _ = raw.commit()
    assert code == StatusCode.FAILED_PRECONDITION and "planned" in details, details
    assert_nothing_left(daemon, key_of("size"))


def test_the_daemon_publishes_what_the_files_hold_not_what_the_client_meant(daemon):
    """Other bytes than the plan's tensors (here: the tensors + 1): the
    manifest's digests and the mapped tensors are those bytes; nothing in
    the manifest came from the client's word."""
    tensors = sample_tensors()
    other = {k: (v + 1 if v.is_floating_point() else v) for k, v in tensors.items()}
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="holds"), tensors)
        for i, lay in enumerate(raw.checked.layouts):
            fd = raw.fd(i)
            write_file(fd, lay, other)
            os.close(fd)
            raw.written(i)
        code, details, last = raw.commit()
        assert code == StatusCode.OK, details
        manifest = Manifest.from_json(last.committed.manifest_json)
        with client.acquire(manifest.key, verify="full") as lease:
            for name, t in other.items():
                assert torch.equal(lease.tensors()[name], t)


def test_descriptors_only_for_the_token_holder_and_unsealed_files(daemon):
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="tokens"), sample_tensors())
        raw.write(0)
        raw.written(0)
        wait_until(lambda: _refuses(client.socket, raw.token, 0))  # once the daemon sealed it
        with pytest.raises(NotFound):
            receive_descriptor(client.socket, "0" * 32, 1)
        with pytest.raises(Exception, match="out of range"):
            receive_descriptor(client.socket, raw.token, 99)
        raw.cancel()
    assert_nothing_left(daemon, key_of("tokens"))
    with pytest.raises(NotFound):  # the publication ended: its token is gone
        receive_descriptor(daemon.socket, raw.token, 1)


def _refuses(socket: str, token: str, index: int) -> bool:
    try:
        os.close(receive_descriptor(socket, token, index))
        return False
    except FailedPrecondition as exc:
        assert "sealed" in str(exc)
        return True


def test_another_uid_gets_no_descriptor(daemon):
    # Let the other user reach the socket (tests run as root; a node would
    # give the group access): the daemon's uid check must still hold.
    os.chmod(os.path.dirname(daemon.socket), 0o755)
    os.chmod(daemon.socket + ".pub", 0o666)
    with daemon.client() as client:
        raw = RawHandoff(client, identity(t="uid"), sample_tensors())
        user = nobody()
        code = ("from hwr_client.handoff import receive_descriptor\n"
                f"try:\n receive_descriptor({daemon.socket!r}, {raw.token!r}, 0)\nexcept Exception as e:\n"
                " print(type(e).__name__, e)\n")
        out = run_python_as(user.pw_uid, user.pw_gid, code)
        raw.cancel()
    assert out.stdout.startswith("PermissionDenied") and "uid" in out.stdout, out
    assert_nothing_left(daemon, key_of("uid"))


# -- protocol errors -------------------------------------------------------------------------


def test_protocol_misuse_is_invalid_and_leaves_nothing(daemon):
    tensors = sample_tensors()
    cases = {
        "out of order": lambda raw: (raw.write(1), raw.written(1)),
        "commit early": lambda raw: (raw.write(0), raw.written(0)),
        "twice": lambda raw: (raw.write(0), raw.written(0), raw.written(0)),
        "a chunk": lambda raw: raw.send(to_chunk(raw)),
        "too many bytes": lambda raw: raw.written(0, complete=False, nbytes=10**9),
    }
    with daemon.client() as client:
        for name, act in cases.items():
            raw = RawHandoff(client, identity(t=f"misuse-{name}"), tensors)
            act(raw)
            code, details, _ = raw.commit()
            assert code == StatusCode.INVALID_ARGUMENT, (name, details)
            assert_nothing_left(daemon, key_of(f"misuse-{name}"))


def to_chunk(raw: RawHandoff):
    from hwr_client.core._proto import hwr_pb2 as pb

    off, data = next(iter_payload(raw.checked.layouts[0], raw.tensors, 64))
    return pb.PublishRequest(chunk=pb.PayloadChunk(file_index=0, offset=off, data=bytes(data)))


# -- the caller's own stops -------------------------------------------------------------------


def test_before_commit_that_raises_publishes_nothing(daemon):
    with daemon.client() as client, pytest.raises(RuntimeError, match="changed"):
        client.publish(identity(t="veto"), sample_tensors(), before_commit=_raise)
    assert_nothing_left(daemon, key_of("veto"))


def _raise() -> None:
    raise RuntimeError("a tensor changed")


@pytest.mark.parametrize("handoff", [True, False])
def test_cancel_while_writing_publishes_nothing(daemon, handoff):
    cancel = threading.Event()
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        cancel.set()  # after the first progress report

    with daemon.client() as client, pytest.raises(Aborted, match="cancelled"):
        client.publish(identity(t=f"cancel-{handoff}"), big_tensors(160, blocks=2), progress=progress, cancel=cancel,
                       handoff=handoff)
    assert seen
    assert_nothing_left(daemon, key_of(f"cancel-{handoff}"))


def test_handoff_unavailable_is_raised_before_any_byte(tmp_path):
    with pytest.raises(HandoffUnavailable):
        receive_descriptor(str(tmp_path / "nothing.sock"), "0" * 32, 0)



def test_silent_connections_hold_no_thread_and_block_no_publication(daemon):
    """Connections that never send their line (a stalled or hostile client)
    wait in the selector, not in the answering threads: more of them than
    there are threads, and a publication still gets its descriptors."""
    import socket as pysocket

    from hwr_server.publish.handoff import THREADS

    silent = []
    try:
        for _ in range(THREADS * 3):
            s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            s.connect(daemon.socket + ".pub")
            silent.append(s)
        with daemon.client() as client:
            assert client.publish(identity(t="silent"), sample_tensors()).transport == "handoff"
        for s in silent:  # still waiting (not timed out, not closed): the publication went past them
            with pytest.raises(BlockingIOError):
                s.recv(1, pysocket.MSG_DONTWAIT)
    finally:
        for s in silent:
            s.close()
