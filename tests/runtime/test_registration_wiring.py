"""The DLO transport registers through the node daemon's admission.

A REAL daemon on a temp socket, REAL leases (published, acquired, mapped),
the real backend; the only fake is the registrar seam, which here also
records what the daemon had counted when each call began (so the order
prefault -> request -> register -> report is checked from the daemon's side)
and can add latency, fail at chunk k or hang. Assertions are on counts and
orders; time bounds are generous polls only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time

import pytest
import torch

from dlo_runtime import REGISTERED, STAGING, RegistrationAborted, enable_layerwise_offload, restore_model, retained
from dlo_runtime import transports
from hwr_client.lease import local_lease
from hwr_client.mapping import PAGE_SIZE
from hwr_client.registration import RegistrationBroker, broker_for
from tests.conftest import identity
from tests.support.daemon import cleanup
from tests.support.dlo import FakeRegistrar, make_artifact, reference, skeleton
from tests.support.registration import poll as _poll, start as _start, stats as _stats

MIB = 1024 * 1024
BUDGET = MIB
N_BLOCKS = 3
ADMITTED = 'hwr_registration_admissions_total{outcome="admitted"}'


def _figures(s: dict) -> tuple[float, float, float]:
    """What the daemon has counted: admissions, chunk reports, admitted bytes."""
    return s[ADMITTED], s["hwr_registration_chunks_total"], s["hwr_registration_admitted_bytes"]


class WatchingRegistrar(FakeRegistrar):
    """FakeRegistrar that records the daemon's figures as each register call
    begins, then sleeps ``latency_s``; call ``hang_at`` blocks until
    ``hang`` is set (``hanging`` tells the test it does)."""

    def __init__(self, daemon, *, latency_s: float = 0.0, hang_at: int | None = None, **kw):
        super().__init__(**kw)
        self.daemon = daemon
        self.latency_s = latency_s
        self.hang_at = hang_at
        self.hang, self.hanging = threading.Event(), threading.Event()
        self.seen: list[tuple[float, float, float]] = []

    def register(self, address, nbytes, flags):
        k = sum(1 for c in self.calls if c[0] == "register")
        self.seen.append(_figures(_stats(self.daemon)))
        if k == self.hang_at:
            self.hanging.set()
            assert self.hang.wait(60), "the test never let the hung call go"
        time.sleep(self.latency_s)
        return super().register(address, nbytes, flags)


def _publish(d) -> tuple:
    ref = reference(N_BLOCKS)
    with d.client() as c:
        key = c.publish(identity(test="reg-wiring"), {k: v.clone() for k, v in ref.state_dict().items()}).key
    return d, ref, key


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A daemon whose chunks are one page (a toy lease spans several) and a
    published toy model: (daemon, reference model, key)."""
    d = _start(tmp_path_factory.mktemp("reg-wiring"), registration_budget_bytes=BUDGET,
               registration_chunk_bytes=PAGE_SIZE)
    try:
        yield _publish(d)
    finally:
        cleanup(d)


@contextlib.contextmanager
def _worker(d, key):
    """One worker: its own client (so its own session), a lease, and a
    skeleton restored from it."""
    client = d.client()
    try:
        lease = client.acquire(key)
        skel = skeleton(N_BLOCKS)
        restore_model(skel, lease)
        yield client, lease, skel
    finally:
        client.close()


def _offload(skel, lease, registrar, **kw):
    return enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease, registrar=registrar, **kw)


def _total(lease) -> int:
    return sum(r.aligned_length for r in lease.regions())


def _worker_bytes(s: dict, client) -> float:
    tag = f'session="{client.session().session_id()[:6]}"'
    return sum(v for k, v in s.items() if k.startswith("hwr_registration_worker_bytes") and tag in k)


def test_admitted_registration_is_chunked_reported_and_returned(node, monkeypatch):
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel):
        total = _total(lease)
        assert total > PAGE_SIZE  # several of the daemon's one-page chunks
        before = _stats(d)
        faulted: list[tuple[float, float, float]] = []
        monkeypatch.setattr(transports, "prefault", lambda a, n: faulted.append(_figures(_stats(d))) or "fake")
        reg = WatchingRegistrar(d, latency_s=0.02)
        handle = _offload(skel, lease, reg)
        stats = handle.stats
        assert stats.transport == REGISTERED and "admitted by the node daemon" in stats.reason
        # Re-planned to the daemon's chunk size (the options allowed 64 GiB).
        registers = [c for c in reg.calls if c[0] == "register"]
        assert [c[2] for c in registers] == [PAGE_SIZE] * (total // PAGE_SIZE)
        assert stats.registered_bytes == total
        base_admitted, base_chunks, base_bytes = _figures(before)
        # Prefault before the request: nothing admitted yet while faulting.
        assert faulted and all(f == (base_admitted, base_chunks, base_bytes) for f in faulted)
        # Then admitted once, and chunk k registered after k reports.
        assert reg.seen == [(base_admitted + 1, base_chunks + k, base_bytes + total) for k in range(len(registers))]
        after = _stats(d)
        assert _figures(after) == (base_admitted + 1, base_chunks + len(registers), base_bytes + total)
        assert after["hwr_registration_chunk_bytes_total"] - before["hwr_registration_chunk_bytes_total"] == total
        # Each report carried its call's seconds (latency included).
        reported_s = after["hwr_registration_chunk_seconds_total"] - before["hwr_registration_chunk_seconds_total"]
        assert reported_s >= 0.02 * len(registers)
        assert after["hwr_registrations_in_flight"] == 0  # the last report freed the slot
        assert _worker_bytes(after, client) == total  # `hwr stats`: registered bytes per worker
        x = torch.randn(3, 8)
        assert torch.equal(skel(x), ref(x))
        handle.close()
        assert reg.registered == {}
        done = _stats(d)
        assert done["hwr_registration_admitted_bytes"] == base_bytes
        assert _worker_bytes(done, client) == 0
        assert done["hwr_registrations_released_total"] == before["hwr_registrations_released_total"] + 1


def test_data_parallel_workers_of_one_lease_are_counted_once(node):
    """Two workers (two sessions) register the same published blobs: the
    daemon's node figure is ONE copy of the lease, each worker's own figure
    the whole lease (finding 7: the driver pins the same page-cache pages)."""
    d, ref, key = node
    with _worker(d, key) as (client_a, lease_a, skel_a), _worker(d, key) as (client_b, lease_b, skel_b):
        base = _stats(d)["hwr_registration_admitted_bytes"]
        handles = [_offload(skel, lease, FakeRegistrar()) for skel, lease in ((skel_a, lease_a), (skel_b, lease_b))]
        assert [h.stats.transport for h in handles] == [REGISTERED, REGISTERED]
        s = _stats(d)
        total = _total(lease_a)
        assert s["hwr_registration_admitted_bytes"] == base + total
        assert _worker_bytes(s, client_a) == total and _worker_bytes(s, client_b) == total
        handles[0].close()
        assert _stats(d)["hwr_registration_admitted_bytes"] == base + total  # b still pins them all
        handles[1].close()
        assert _stats(d)["hwr_registration_admitted_bytes"] == base


def test_over_budget_stages_without_a_registrar_call(node):
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel), d.client() as other:
        total = _total(lease)
        # Another worker holds all but less than this lease of the budget.
        holder = RegistrationBroker(other.session(), wait_s=0)
        held = holder.request(BUDGET - total + PAGE_SIZE, label="holder")
        assert held.admitted
        try:
            refused = _stats(d)['hwr_registration_admissions_total{outcome="budget"}']
            reg = FakeRegistrar()
            handle = _offload(skel, lease, reg)
            assert handle.stats.transport == STAGING
            assert "not admitted by the node daemon (budget)" in handle.stats.reason
            assert reg.calls == []
            assert _stats(d)['hwr_registration_admissions_total{outcome="budget"}'] == refused + 1
            x = torch.randn(3, 8)
            assert torch.equal(skel(x), ref(x))
            handle.close()
        finally:
            assert holder.release(held)
    assert _stats(d)["hwr_registration_admitted_bytes"] == 0


def test_failure_at_chunk_k_rolls_back_and_returns_the_budget(node):
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel):
        before = _stats(d)
        reg = FakeRegistrar(fail_at=2)
        handle = _offload(skel, lease, reg)
        assert handle.stats.transport == STAGING and "range 2" in handle.stats.reason
        assert [c[0] for c in reg.calls] == ["register"] * 3 + ["unregister"] * 2 and reg.registered == {}
        after = _stats(d)
        assert after["hwr_registration_chunks_total"] == before["hwr_registration_chunks_total"] + 2
        assert after["hwr_registration_admitted_bytes"] == before["hwr_registration_admitted_bytes"]
        assert after["hwr_registrations_in_flight"] == 0
        assert after["hwr_registrations_released_total"] == before["hwr_registrations_released_total"] + 1
        assert "rolled back" in d.log()  # the daemon logs the release's reason
        x = torch.randn(3, 8)
        assert torch.equal(skel(x), ref(x))
        handle.close()


def test_a_failed_rollback_keeps_the_bytes_admitted_until_unregistered(node):
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel):
        base = _stats(d)["hwr_registration_admitted_bytes"]
        reg = FakeRegistrar(fail_at=2, unregister_failures=-1)
        with pytest.raises(RegistrationAborted):
            _offload(skel, lease, reg)
        # Two pages are still pinned: the node keeps counting the grant.
        assert reg.registered
        s = _stats(d)
        assert s["hwr_registration_admitted_bytes"] == base + _total(lease)
        assert _worker_bytes(s, client) == _total(lease)
        stuck = [b for b in retained() if b.lease is lease]
        assert len(stuck) == 1
        reg.unregister_failures = 0
        stuck[0].close()  # the retry unregisters, then releases
        assert reg.registered == {}
        assert _stats(d)["hwr_registration_admitted_bytes"] == base


def test_a_daemon_chunk_below_a_page_stages_and_releases(node):
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel):
        broker = RegistrationBroker(client.session())
        real_request = broker.request
        broker.request = lambda n, **kw: dataclasses.replace(real_request(n, **kw), chunk_bytes=100)  # type: ignore
        reg = FakeRegistrar()
        choice = transports.register_regions(reg, reg.cap, lease.regions(), keepalive=lease, prefault_fn=None,
                                             broker=broker)
        assert choice.kind == STAGING and "below one page" in choice.reason
        assert reg.calls == [] and choice.grant is not None and choice.grant.admitted
        assert _stats(d)["hwr_registration_admitted_bytes"] == 0


def test_which_sources_ask_the_daemon(node, tmp_path):
    d, ref, key = node
    artifact = make_artifact(tmp_path, ref)
    assert broker_for(local_lease(artifact.manifest, artifact.paths)) is None  # no daemon session
    assert broker_for(None) is None
    with _worker(d, key) as (client, lease, skel):
        broker = broker_for(lease)
        assert broker is not None and broker.session is client.session()
        # A session closed under the lease: staging, never a pin the node
        # did not count.
        client.close()
        reg = FakeRegistrar()
        handle = _offload(skel, lease, reg)
        assert handle.stats.transport == STAGING and "(daemon)" in handle.stats.reason
        assert reg.calls == []
        handle.close()


def test_a_hung_chunk_trips_the_watchdog_and_blocks_only_its_own_worker(tmp_path):
    d, ref, key = _publish(_start(tmp_path, registration_budget_bytes=BUDGET, registration_chunk_bytes=PAGE_SIZE,
                                  registration_chunk_timeout_s=0.5))
    thread = None
    try:
        with _worker(d, key) as (client_a, lease_a, skel_a), _worker(d, key) as (client_b, lease_b, skel_b):
            hung = WatchingRegistrar(d, hang_at=1)
            got: dict = {}

            def start_a() -> None:
                try:
                    got["handle"] = _offload(skel_a, lease_a, hung)
                except BaseException as exc:  # reported by the main thread
                    got["error"] = exc

            thread = threading.Thread(target=start_a, name="hung-worker")
            thread.start()
            assert hung.hanging.wait(60), got
            s = _poll(d, lambda s: s["hwr_registration_watchdog_stalled"] == 1, "watchdog tripped")
            assert s["hwr_registration_chunks_total"] == 1  # chunk 0 reported, chunk 1 hangs
            assert s["hwr_registrations_in_flight"] == 0  # the stalled one gave its slot up
            # Worker B (another session) takes the slot the stall gave up and
            # registers: one worker's stall must not make the node refuse
            # everyone (a client that admits and never reports would).
            reg_b = FakeRegistrar()
            handle_b = _offload(skel_b, lease_b, reg_b)
            assert handle_b.stats.transport == REGISTERED, handle_b.stats.reason
            assert any(c[0] == "register" for c in reg_b.calls)
            x = torch.randn(3, 8)
            assert torch.equal(skel_b(x), ref(x))
            handle_b.close()
            hung.hang.set()
            thread.join(60)
            assert not thread.is_alive() and "error" not in got, got
            handle_a = got["handle"]
            assert handle_a.stats.transport == REGISTERED
            _poll(d, lambda s: s["hwr_registration_watchdog_stalled"] == 0, "stall cleared")
            assert torch.equal(skel_a(x), ref(x))
            handle_a.close()
            assert _stats(d)["hwr_registration_admitted_bytes"] == 0
    finally:
        if thread is not None and thread.is_alive():
            hung.hang.set()
            thread.join(60)
        cleanup(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_registration_goes_through_the_daemon(node):
    """The real CudaRegistrar behind the daemon's admission: registered in
    one-page chunks, counted per worker, returned on close."""
    from tests.support.dlo import cuda_capability as _capability

    _capability()  # skips where the code declines registration
    d, ref, key = node
    with _worker(d, key) as (client, lease, skel):
        handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease)
        assert handle.stats.transport == REGISTERED and "admitted by the node daemon" in handle.stats.reason
        assert handle.stats.registration_calls == _total(lease) // PAGE_SIZE
        assert _worker_bytes(_stats(d), client) == _total(lease)
        x = torch.randn(3, 8, device="cuda")
        # Against the reference on the same device: the same kernels.
        assert torch.equal(skel(x), copy.deepcopy(ref).cuda()(x))
        handle.close()
        assert _stats(d)["hwr_registration_admitted_bytes"] == 0
