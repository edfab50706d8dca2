"""The node's pinned bytes count each (file, byte) once (issue 23, finding
7): data-parallel workers registering one blob pin the same page-cache
pages. Unit tests on the pure accounting and on RegistrationAdmission with a
fake clock; the wire check against the REAL daemon."""

from __future__ import annotations

import grpc
import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument
from hwr_client.registration import RegistrationBroker
from hwr_server.config import ServerConfig
from hwr_server.registration.accounting import PinnedRange, check_ranges, union_bytes
from hwr_server.registration.admission import RegistrationAdmission
from tests.support.daemon import cleanup
from tests.support.registration import start as _start, stats as _stats

MIB = 1024 * 1024


def _r(key: str, lo_mib: int, n_mib: int) -> PinnedRange:
    return PinnedRange(key, lo_mib * MIB, n_mib * MIB)


def test_union_counts_each_file_byte_once():
    blob = (_r("inode:1:7", 0, 4), _r("inode:1:7", 4, 2))
    assert union_bytes([(6 * MIB, blob)]) == 6 * MIB
    # A second worker of the same blob adds nothing; an overlapping stitched
    # span adds only what is new; another file and a rangeless request add all.
    assert union_bytes([(6 * MIB, blob), (6 * MIB, blob)]) == 6 * MIB
    assert union_bytes([(6 * MIB, blob), (4 * MIB, (_r("inode:1:7", 5, 4),))]) == 9 * MIB
    assert union_bytes([(6 * MIB, blob), (2 * MIB, (_r("inode:1:8", 0, 2),)), (3 * MIB, ())]) == 11 * MIB
    assert union_bytes([]) == 0


@pytest.mark.parametrize("ranges, words", [
    ((_r("k", 0, 1),), "expected nbytes"),
    ((PinnedRange("", 0, MIB), PinnedRange("k", 0, MIB)), "key"),
    ((PinnedRange("k", 0, 0), PinnedRange("k", 0, 2 * MIB)), "length > 0"),
    ((PinnedRange("k" * 300, 0, 2 * MIB),), "key"),
])
def test_bad_ranges_are_invalid_argument(ranges, words):
    with pytest.raises(InvalidArgument, match=words):
        check_ranges("AdmitRegistration", 2 * MIB, ranges)
    check_ranges("AdmitRegistration", 2 * MIB, ())  # none: the nbytes count alone


def test_two_workers_of_one_blob_fit_a_budget_of_one_copy():
    sessions = {"a", "b", "c"}
    # One uid may hold the whole budget here: the per-uid share is tested
    # in test_registration_admission.py.
    cfg = ServerConfig(registration_budget_bytes=10 * MIB, registration_chunk_bytes=MIB,
                       registration_chunk_timeout_s=5.0, max_registrations_in_flight=4, registration_uid_share=1.0)
    adm = RegistrationAdmission(cfg, lambda s: s in sessions, clock=lambda: 1000.0)
    blob = (_r("inode:1:7", 0, 6),)
    first = adm.admit("a", 6 * MIB, pid=1, ranges=blob)
    second = adm.admit("b", 6 * MIB, pid=2, ranges=blob)  # 12 asked, 6 pinned: fits 10
    assert first.admitted and second.admitted
    s = adm.stats()
    assert s["hwr_registration_admitted_bytes"] == 6 * MIB and s["hwr_registration_requested_bytes"] == 12 * MIB
    # Another file's 6 MiB would pin 12 of 10: refused, and the detail says
    # how much of the request is new.
    other = adm.admit("c", 6 * MIB, pid=3, ranges=(_r("inode:1:8", 0, 6),))
    assert other.reason == "budget" and "6291456 not pinned yet" in other.detail
    # One worker leaving frees nothing the other still pins.
    assert adm.release("a", first.registration_id)
    assert adm.stats()["hwr_registration_admitted_bytes"] == 6 * MIB
    assert adm.end_session("b") == 1
    assert adm.stats()["hwr_registration_admitted_bytes"] == 0
    with pytest.raises(InvalidArgument, match="expected nbytes"):
        adm.admit("c", 6 * MIB, pid=3, ranges=(_r("inode:1:8", 0, 5),))


def test_the_daemon_counts_shared_pages_once_and_refuses_bad_ranges(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=8 * MIB, registration_chunk_bytes=MIB,
               max_registrations_in_flight=2)
    clients = [d.client(), d.client()]
    try:
        ranges = [("inode:9:42", 0, 3 * MIB), ("inode:9:42", 3 * MIB, 3 * MIB)]
        grants = [RegistrationBroker(c.session()).request(6 * MIB, label="dp worker", ranges=ranges, wait_s=0)
                  for c in clients]
        assert all(g.admitted for g in grants), grants
        s = _stats(d)
        assert s["hwr_registration_admitted_bytes"] == 6 * MIB
        assert s["hwr_registration_requested_bytes"] == 12 * MIB
        sid = clients[0].session().session_id()
        bad = pb.AdmitRegistrationRequest(session_id=sid, nbytes=MIB,
                                          ranges=[pb.PinnedRange(key="inode:9:42", offset=0, length=2 * MIB)])
        with pytest.raises(grpc.RpcError) as err:
            clients[0].session().runtime.AdmitRegistration(bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected nbytes" in err.value.details()
    finally:
        for c in clients:
            c.close()
        cleanup(d)
