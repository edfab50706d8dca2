"""Per-uid shares of the daemon's streams and publication slots, against
the REAL daemon, with the attacker as uid ``nobody`` in several processes
(each its own pid, so per-process caps alone do not stop it):

- six processes of one uid holding eight Session streams each took all 48
  stream places of the landed daemon, and another user's worker could not
  open its session (a required worker FAILED);
- four processes each trickling one byte of a publication every half second
  held every publication slot of the landed daemon (its idle deadline never
  trips), and a normal publication waited for them.

Assertions are on counts, status codes and config-field names.
"""

from __future__ import annotations

import json
from collections import Counter

import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.plan import to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors
from tests.support.hostile_users import STREAM_HOG, TRICKLER
from tests.support.raw_publish import COMMIT, StatusCode, chunks, raw_publish
from tests.support.shared_node import finish, popen_nobody, served_to_nobody
from tests.support.streams import readline


def test_one_uid_forking_processes_cannot_take_every_stream(make_daemon_fixture, tmp_path):
    d = served_to_nobody(make_daemon_fixture, tmp_path, {"stream_first_message_timeout_s": 60.0})
    with d.client() as c:
        key = c.publish(identity(t="uid-streams"), sample_tensors()).key
    hogs, outcomes = [], []
    try:
        for _ in range(6):  # 6 processes x 8 streams = the landed daemon's 48 places
            p = popen_nobody(STREAM_HOG, d.socket, "8")
            hogs.append(p)
            line = readline(p, timeout=60)
            assert line, p.stderr.read() if p.poll() is not None else "no answer"
            outcomes += json.loads(line)
        opened = outcomes.count("OPENED")
        refused = [o for o in outcomes if o != "OPENED"]
        # Half of the 48 stream places (max_streams_per_uid = 0: the default share).
        assert opened == 24, Counter(o.split(":")[0] for o in outcomes)
        assert len(refused) == 24 and all(o.startswith("RESOURCE_EXHAUSTED") and "max_streams_per_uid" in o
                                          and "uid 65534" in o for o in refused), refused[:2]
        # Another user's worker opens its session and takes its lease.
        with d.client() as c, c.acquire(key) as lease:
            assert lease.manifest.key == key
    finally:
        finish(*hogs)


def test_trickling_publications_of_one_uid_leave_slots_to_others(make_daemon_fixture, tmp_path):
    d = served_to_nobody(make_daemon_fixture, tmp_path, {"publication_idle_s": 3.0})
    tricklers = []
    try:
        for i in range(4):  # max_publications: every global slot of the landed daemon
            p = popen_nobody(TRICKLER, d.socket, f"t{i}")
            tricklers.append(p)
            assert readline(p, timeout=60), p.stderr.read() if p.poll() is not None else "no answer"
        # A normal publication of the node's own worker, bounded well below
        # the tricklers' two minutes.
        tensors = {"w": torch.arange(64, dtype=torch.float32)}
        plan = build_plan(identity(t="uid-legit"), tensors)
        with d.client() as c:
            code, details = raw_publish(c, [pb.PublishRequest(plan=to_proto(plan)), *chunks(plan, tensors, 4096),
                                            COMMIT], timeout=30)
            assert code == StatusCode.OK, details
            assert c.lookup(plan.identity.key).key == plan.identity.key
        # Every trickler was ended by the rate floor (and none by a client deadline).
        ends = [json.loads(readline(p, timeout=90) or '["NONE", ""]') for p in tricklers]
        assert [code for code, _ in ends] == ["ABORTED"] * 4, ends
        assert all("publication_min_bytes_per_s" in details for _, details in ends), ends
    finally:
        finish(*tricklers)

