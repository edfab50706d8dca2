"""The asynchronous schedule's event ordering, checked on CPU.

The backend's stream/event API is a seam (``backend._cu``); here a recording
fake stands in for torch.cuda, with ``_async`` on, so every wait/record the
CUDA path issues is logged and checked against the rules:

- a copy into a slot waits for "compute done" of the block that last ran
  from that slot (buffer reuse), recorded after that block's forward;
- a block's compute waits for "copy done" of its slot before binding;
- a staging slot is host-waited before its memcpy and re-recorded after the
  DMA is queued;
- teardown synchronizes before anything is released.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dlo_runtime import OffloadBackend, OffloadOptions, restore_model
from tests.support.dlo import FakeRegistrar, TestLease, make_artifact, reference, skeleton


class _Stream:
    def __init__(self, cu, name):
        self.cu, self.name = cu, name

    def wait_event(self, event):
        self.cu.log.append(("wait", self.name, event))


class _Event:
    def __init__(self, cu):
        self.cu = cu

    def record(self, stream):
        self.cu.log.append(("record", stream.name, self))

    def synchronize(self):
        self.cu.log.append(("host_wait", self))


class FakeCuda:
    def __init__(self):
        self.log: list[tuple] = []
        self._current = "compute"

    def Stream(self, device):  # noqa: N802 - mirrors torch.cuda
        return _Stream(self, "copy")

    def Event(self):  # noqa: N802
        return _Event(self)

    @contextlib.contextmanager
    def stream(self, s):
        prev, self._current = self._current, s.name
        try:
            yield
        finally:
            self._current = prev

    def current_stream(self, device=None):
        return _Stream(self, self._current)

    def synchronize(self, device=None):
        self.log.append(("synchronize",))


def _instrumented(tmp_path, n_blocks, registrar):
    ref = reference(n_blocks)
    lease = TestLease(make_artifact(tmp_path, ref))
    skel = skeleton(n_blocks)
    restore_model(skel, lease)
    b = OffloadBackend(skel, list(skel.blocks), OffloadOptions(device="cpu", registrar=registrar, chunk_bytes=8192),
                       source=lease)
    cu = b._cu = FakeCuda()
    b._async = True
    load, pre, post = b._load, b._pre, b._post
    b._load = lambda j, s: (cu.log.append(("load", j, s)), load(j, s), cu.log.append(("load_end", j, s)))[1]
    b._pre = lambda j: (cu.log.append(("pre", j)), pre(j), cu.log.append(("bound", j, b._slot_of(j))))[1]
    b._post = lambda j: (cu.log.append(("post", j, b._slot_of(j))), post(j))[1]
    b.start()
    return ref, skel, b, cu


def _check(b, cu) -> dict:
    name = {id(e): (kind, s) for kind in ("copy_done", "compute_done", "staging_free")
            for s, e in enumerate(getattr(b._engine, kind))}
    ev = lambda e: name[id(e)]  # noqa: E731
    used = {0: False, 1: False}  # slot bound for compute at least once
    computed = {0: True, 1: True}  # compute_done recorded since the last bind
    copied = {0: False, 1: False}  # copy_done recorded for the slot's current load
    counts = {"loads": 0, "binds": 0}
    log = cu.log
    for i, entry in enumerate(log):
        if entry[0] == "load":
            _, j, s = entry
            end = next(k for k in range(i, len(log)) if log[k][0] == "load_end")
            inner = log[i:end]
            waits = [k for k, e in enumerate(inner) if e[:2] == ("wait", "copy") and ev(e[2]) == ("compute_done", s)]
            recs = [k for k, e in enumerate(inner) if e[:2] == ("record", "copy") and ev(e[2]) == ("copy_done", s)]
            assert waits and recs and waits[0] < recs[-1], f"load {j}->{s}: copy not ordered after compute_done"
            assert not used[s] or computed[s], f"load {j}->{s}: slot reused before its compute was recorded"
            if b._staging:
                hw = [k for k, e in enumerate(inner) if e[0] == "host_wait" and ev(e[1]) == ("staging_free", s)]
                sr = [k for k, e in enumerate(inner) if e[:2] == ("record", "copy") and ev(e[2]) == ("staging_free", s)]
                assert hw and sr and hw[0] < sr[0]
            copied[s] = True
            counts["loads"] += 1
        elif entry[0] == "bound":
            _, j, s = entry
            start = max(k for k in range(i) if log[k][0] == "pre")
            waits = [e for e in log[start:i] if e[:2] == ("wait", "compute") and ev(e[2]) == ("copy_done", s)]
            assert waits and copied[s], f"block {j} bound to slot {s} without waiting for its copy"
            used[s], computed[s] = True, False
            counts["binds"] += 1
        elif entry[0] == "record" and entry[1] == "compute" and ev(entry[2])[0] == "compute_done":
            computed[ev(entry[2])[1]] = True
    return counts


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 7])
@pytest.mark.parametrize("registered", [True, False])
def test_async_schedule_orders_copies_compute_and_reuse(tmp_path, n_blocks, registered):
    reg = FakeRegistrar(supported=registered)
    ref, skel, b, cu = _instrumented(tmp_path, n_blocks, reg)
    assert b.transport == ("registered" if registered else "staging")
    x = torch.randn(3, 8)
    for _ in range(3):
        assert torch.equal(skel(x), ref(x))
    counts = _check(b, cu)
    assert counts["binds"] == 3 * n_blocks
    b.close()
    sync = cu.log.index(("synchronize",))
    assert b.trail.index("drain") < b.trail.index("release") < b.trail.index("close_lease")
    assert all(e[0] != "load" for e in cu.log[sync:])


def test_checker_catches_a_missing_wait(tmp_path):
    """Negative control: drop the compute-side wait and the checker fails."""
    ref, skel, b, cu = _instrumented(tmp_path, 3, FakeRegistrar())
    skel(torch.randn(3, 8))
    cu.log = [e for e in cu.log if e[:2] != ("wait", "compute")]
    with pytest.raises(AssertionError, match="without waiting for its copy"):
        _check(b, cu)
    b.close()


def test_checker_catches_slot_reuse_without_compute_done(tmp_path):
    """Negative control: drop the compute-done records and the checker fails."""
    ref, skel, b, cu = _instrumented(tmp_path, 3, FakeRegistrar())
    skel(torch.randn(3, 8))
    cu.log = [e for e in cu.log if e[:2] != ("record", "compute")]
    with pytest.raises(AssertionError, match="slot reused before its compute was recorded"):
        _check(b, cu)
    b.close()
