"""One buggy or hostile client must not take the daemon's threads:
stream admission, the first-message deadline, the
peer credentials handshake and the per-session lease cap, against the REAL
daemon.

Hostile streams are raw gRPC calls whose request iterators block on an
Event (they never send, or send one message and stop); every wait is bounded
and every assertion is a count, a status code or a generous relation.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from hwr_client.channel import forget_peer_token, open_channel
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import ResourceExhausted, UntrustedPublisher
from tests.conftest import identity, sample_tensors
from tests.support.paths import REPO_DIR
from tests.support.streams import CALL_BOUND_S, HOSTILE, readline, wait_for

REPO = REPO_DIR


def config(tmp_path, **fields) -> str:
    path = tmp_path / "hwr.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return str(path)


def stats(d) -> dict:
    with d.client() as c:
        return json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S).stats_json)


def publish(d, **extra) -> str:
    with d.client() as c:
        return c.publish(identity(test="hostile-streams", **extra), sample_tensors()).key


class Streams:
    """Streams held open by THIS process; each outcome (status code name and
    details) is recorded when its call ends."""

    def __init__(self, channel: grpc.Channel):
        self.stub = pb_grpc.RuntimeStub(channel)
        self.release = threading.Event()
        self.calls: list = []
        self.outcomes: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _watch(self, call) -> None:
        try:
            for _ in call:
                pass
            outcome = ("OK", "")
        except grpc.RpcError as err:
            outcome = (err.code().name, err.details() or "")
        with self._lock:
            self.outcomes.append(outcome)

    def _start(self, call) -> None:
        self.calls.append(call)
        threading.Thread(target=self._watch, args=(call,), daemon=True).start()

    def _blocked(self, *first):
        yield from first
        self.release.wait()

    def silent_session(self, timeout: float | None = None) -> None:
        self._start(self.stub.Session(self._blocked(), timeout=timeout))

    def opened_session(self) -> None:
        opener = pb.SessionRequest(open=pb.SessionOpen(pid=os.getpid(), client_name="hostile"))
        self._start(self.stub.Session(self._blocked(opener)))

    def silent_publish(self, timeout: float | None = None) -> None:
        self._start(self.stub.Publish(self._blocked(), timeout=timeout))

    def codes(self) -> list[str]:
        with self._lock:
            return [code for code, _ in self.outcomes]

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()


@pytest.fixture
def streams():
    held: list[Streams] = []

    def make(channel: grpc.Channel) -> Streams:
        s = Streams(channel)
        held.append(s)
        return s

    yield make
    for s in held:
        s.close()


def raw_channel(d) -> grpc.Channel:
    """A channel WITHOUT the peer token: the anonymous peer."""
    return grpc.insecure_channel(f"unix:{d.socket}")


def test_one_process_with_128_idle_streams_leaves_the_node_usable(make_daemon_fixture, tmp_path):
    """The old daemon gave every thread to these streams (GetStats
    DEADLINE_EXCEEDED, a new worker's session UNAVAILABLE)."""
    d = make_daemon_fixture()  # the default caps, as shipped
    key = publish(d)
    hostile = subprocess.Popen([sys.executable, "-c", HOSTILE, d.socket], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert hostile.stdout.readline().strip() == "open"

        def outcomes():
            hostile.stdin.write("\n")
            hostile.stdin.flush()
            return json.loads(hostile.stdout.readline())

        # All but the anonymous peer's 8 are refused at once, naming the cap.
        # (Admitted silent sessions may also end by now: CANCELLED after the
        # first-message deadline.)
        assert wait_for(lambda: len(outcomes()) >= 120, timeout=30, step=0.2)
        got = outcomes()
        refused = [details for code, details in got if code == "RESOURCE_EXHAUSTED"]
        assert len(refused) == 120 and {code for code, _ in got} <= {"RESOURCE_EXHAUSTED", "CANCELLED"}
        assert all("max_streams_anonymous" in details for details in refused)
        # Another client's unary calls are served, on both sockets.
        with d.client() as c:
            c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S)
            c.call(c.admin.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S)
            c.call(c.runtime.Lookup, pb.LookupRequest(key=key), timeout=CALL_BOUND_S)
            # ... and a new worker (its own peer) opens a session and maps.
            with c.acquire(key) as lease:
                assert lease.manifest.key == key
        figures = stats(d)
        assert figures["hwr_streams_refused_total"] == 120
        assert figures["hwr_streams_active"] <= 8  # the hostile's admitted ones
    finally:
        hostile.kill()
        hostile.wait()


def test_the_per_process_cap_counts_the_pid_the_kernel_names(make_daemon_fixture, tmp_path, streams):
    """The handshake's peer is the calling process as SO_PEERCRED says: its
    streams use its own cap, never the anonymous one or another's."""
    d = make_daemon_fixture("--config", config(tmp_path, max_streams_per_peer=3, max_streams_anonymous=2,
                                                   stream_first_message_timeout_s=60.0))
    code = textwrap.dedent("""
        import os, sys, threading, grpc
        from hwr_client.channel import open_channel
        from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
        stub = pb_grpc.RuntimeStub(open_channel(sys.argv[1]))
        never = threading.Event()
        out_lock = threading.Lock()
        def silent():
            never.wait()
            yield pb.SessionRequest()
        def watch(call):
            try:
                next(call)
            except grpc.RpcError as err:
                # One write per line: print(a, b) writes its pieces apart,
                # and two watcher threads would interleave them.
                with out_lock:
                    sys.stdout.write(f"{err.code().name} {err.details()}\\n")
                    sys.stdout.flush()
        print(os.getpid(), flush=True)
        for _ in range(5):
            threading.Thread(target=watch, args=(stub.Session(silent()),), daemon=True).start()
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", code, d.socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        pid = int(readline(child))
        for _ in range(2):
            line = readline(child)
            assert line.startswith("RESOURCE_EXHAUSTED"), line
            assert f"pid {pid} (uid {os.getuid()})" in line and "max_streams_per_peer" in line
        # The anonymous peer's cap is its own: 2 of 3 admitted, the 3rd refused.
        anon = streams(raw_channel(d))
        for _ in range(3):
            anon.silent_session()
        assert wait_for(lambda: anon.codes() == ["RESOURCE_EXHAUSTED"], timeout=10)
        # A third process's session is admitted (no one else's cap counts).
        key = publish(d)
        with d.client() as c, c.acquire(key):
            pass
        assert stats(d)["hwr_streams_refused_total"] == 3
    finally:
        child.kill()
        child.wait()


def test_a_stream_that_sends_nothing_is_ended(make_daemon_fixture, tmp_path, streams):
    d = make_daemon_fixture("--config", config(tmp_path, stream_first_message_timeout_s=1.0))
    anon = streams(raw_channel(d))
    # The client's own deadline is the bound: the old daemon waited for it
    # (DEADLINE_EXCEEDED); now the daemon ends the stream first.
    anon.silent_session(timeout=15)
    anon.silent_publish(timeout=15)
    assert wait_for(lambda: len(anon.codes()) == 2, timeout=20)
    assert anon.codes() == ["CANCELLED", "CANCELLED"]
    figures = wait_for(lambda: (f := stats(d))["hwr_streams_active"] == 0 and f, timeout=10)
    assert figures and figures["hwr_streams_first_message_timeouts_total"] == 2
    # A session that sent its SessionOpen is not ended by that deadline.
    key = publish(d)
    with d.client() as c, c.acquire(key) as lease:
        time.sleep(2.5)  # more than twice the first-message deadline
        assert c.session().reconnects == 0 and not lease.lost


def test_streams_cannot_take_the_threads_kept_for_unary_calls(make_daemon_fixture, tmp_path, streams):
    """grpc_threads = 8: 4 for streams, 4 kept for unary calls."""
    d = make_daemon_fixture("--config", config(tmp_path, grpc_threads=8, max_streams_anonymous=16,
                                                   stream_first_message_timeout_s=60.0))
    anon = streams(raw_channel(d))
    for _ in range(3):
        anon.silent_session()
    anon.silent_publish()
    anon.silent_publish()  # the 5th stream
    assert wait_for(lambda: anon.codes() == ["RESOURCE_EXHAUSTED"], timeout=10)
    [(_, details)] = anon.outcomes
    assert "grpc_threads=8" in details and "the limit is 4" in details
    # Eight unary calls at once are all served by the four threads left.
    results: list[str] = []

    def get_stats() -> None:
        with d.client() as c:
            try:
                c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S)
                results.append("OK")
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                results.append(type(exc).__name__)

    threads = [threading.Thread(target=get_stats) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=CALL_BOUND_S + 5)
    assert results == ["OK"] * 8


def test_preferred_resolve_is_a_miss_when_the_daemon_is_full(make_daemon_fixture, tmp_path, streams):
    """Sessions exhausted made preferred mode FAILED."""
    d = make_daemon_fixture("--config", config(tmp_path, grpc_threads=8, max_streams_anonymous=16))
    key = publish(d)
    ident = identity(test="hostile-streams")
    anon = streams(raw_channel(d))
    for _ in range(4):
        anon.opened_session()  # real sessions: the old daemon's cap counted these
    assert wait_for(lambda: stats(d)["hwr_sessions_active"] == 4, timeout=10)
    with d.client() as c:
        res = c.resolve(ident, mode="preferred")
        assert res.key == key
        assert (res.outcome, type(res.error)) == ("CANONICAL_FALLBACK", ResourceExhausted)
        assert "cannot take this worker now" in res.reason
    with d.client() as c:
        res = c.resolve(ident, mode="required")
        assert (res.outcome, type(res.error)) == ("FAILED", ResourceExhausted)
    anon.close()  # room again: the same call is a hit
    assert wait_for(lambda: stats(d)["hwr_sessions_active"] == 0, timeout=10)
    with d.client() as c:
        res = c.resolve(ident, mode="preferred")
        assert res.outcome == "LOCAL_HIT"
        res.lease.close()


def test_a_session_holds_at_most_max_leases_per_session(make_daemon_fixture, tmp_path):
    """A session may hold at most ``max_leases_per_session`` leases."""
    d = make_daemon_fixture("--config", config(tmp_path, max_leases_per_session=3))
    key = publish(d)
    with d.client() as c:
        leases = [c.acquire(key) for _ in range(3)]
        with pytest.raises(ResourceExhausted, match=r"the limit is 3 per session \(max_leases_per_session\)"):
            c.acquire(key)
        assert len(c.call(c.reader.ListLeases, pb.ListLeasesRequest()).leases) == 3  # nothing recorded
        leases[0].close()
        leases[0] = c.acquire(key)  # a released place is usable
        for lease in leases:
            lease.close()


def test_the_session_pid_is_the_kernels_not_the_claim(daemon, streams):
    key = publish(daemon)
    forget_peer_token(daemon.socket)
    liar = pb_grpc.RuntimeStub(open_channel(daemon.socket))
    outbox: list = [pb.SessionRequest(open=pb.SessionOpen(pid=1, client_name="liar"))]
    done = threading.Event()

    def requests():
        yield outbox[0]
        done.wait()

    call = liar.Session(requests())
    try:
        sid = next(call).opened.session_id
        liar.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, key=key), timeout=CALL_BOUND_S)
        with daemon.client() as c:
            [row] = c.call(c.reader.ListLeases, pb.ListLeasesRequest()).leases
        assert (row.pid, row.client_name) == (os.getpid(), "liar")
    finally:
        done.set()
        call.cancel()


def test_a_daemon_without_the_credentials_socket_still_serves(make_daemon_fixture):
    """An older daemon has no ``.cred`` socket: the client sends no token
    and is served as the anonymous peer. What an anonymous process publishes
    is trusted by nobody (docs/trust.md): the publication commits, and a
    lease of it is refused naming the anonymous publisher, not served."""
    d = make_daemon_fixture()
    os.unlink(d.socket + ".cred")
    forget_peer_token(d.socket)
    key = publish(d)
    with d.client() as c, pytest.raises(UntrustedPublisher, match="anonymous"):
        c.acquire(key)


def test_a_forged_or_foreign_token_is_the_anonymous_peer(make_daemon_fixture, tmp_path, streams):
    """max_streams_anonymous = 0: only callers with a token we issued get a
    stream. A token with another pid, or a guessed MAC, is anonymous."""
    d = make_daemon_fixture("--config", config(tmp_path, max_streams_anonymous=0,
                                                   stream_first_message_timeout_s=60.0))
    forget_peer_token(d.socket)
    from hwr_client.channel import peer_token

    token = peer_token(d.socket)
    assert token is not None and token.startswith(f"v2.{os.getpid()}.{os.getuid()}.")
    stub = pb_grpc.RuntimeStub(raw_channel(d))
    other_pid = token.replace(f"v2.{os.getpid()}.", "v2.1.", 1)
    guessed = token[:-4] + ("0000" if not token.endswith("0000") else "1111")
    v1 = ".".join(["v1", *token.split(".")[1:3], token.split(".")[-1]])  # the old format: not accepted
    for forged in (other_pid, guessed, v1, "", "x" * 4096):
        call = stub.Session(iter(()), metadata=[("hwr-peer-token", forged)], timeout=CALL_BOUND_S)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "anonymous" in err.value.details() and "max_streams_anonymous" in err.value.details()
    key = publish(d)  # a Publish stream with our own token is admitted ...
    with d.client() as c, c.acquire(key):  # ... and so is a session
        pass


def test_peer_tokens_survive_a_restart_and_a_planted_key_link_is_replaced(make_daemon_fixture, tmp_path, streams):
    """The MAC key is <root>/peer.key: a restarted daemon still knows the
    tokens it issued (re-attaching clients keep their identity), and a link
    planted at that name is replaced, never followed."""
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"x" * 32)
    os.symlink(victim, root / "peer.key")
    d = make_daemon_fixture("--config", config(tmp_path, max_streams_anonymous=0,
                                                   stream_first_message_timeout_s=60.0), root=str(root))
    assert victim.read_bytes() == b"x" * 32
    st = os.lstat(root / "peer.key")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    forget_peer_token(d.socket)
    from hwr_client.channel import peer_token

    token = peer_token(d.socket)
    d.restart()
    stub = pb_grpc.RuntimeStub(raw_channel(d))
    opener = pb.SessionRequest(open=pb.SessionOpen(pid=os.getpid(), client_name="restarted"))
    call = stub.Session(iter([opener]), metadata=[("hwr-peer-token", token)], timeout=CALL_BOUND_S)
    assert next(call).opened.session_id  # admitted: not the (refused) anonymous peer
    call.cancel()
