"""The seed's promotion gates, against the real daemon and real workers.

- a warm hit performs zero ordinary materialization and zero producer calls;
- disabled mode never connects to the daemon or creates a root;
- a planning failure leaves the skeleton untouched (and preferred falls back);
- no required tensor remains on meta;
- warm finalization changes neither bytes nor pointers (a violation fails);
- required mode starts warm after ``hwr prewarm`` and fails clearly without.
"""

from __future__ import annotations

import os

import pytest
import torch

import hwr_client
from dlo_runtime import contracts as contracts_mod
from dlo_runtime.contracts import check_no_meta
from dlo_runtime.contract_registry import get_contract
from dlo_runtime.models.tiny_dit import TinyDiTConfig, sample_inputs, write_checkpoint
from dlo_runtime.restore import compare_snapshots, plan_restore, snapshot
from dlo_runtime.worker import WorkerOptions, start_worker
from hwr_client.core.errors import FailedPrecondition

CFG = TinyDiTConfig(hidden=32, depth=3, heads=4, image=8, freq_dim=16)


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    write_checkpoint(path, CFG, seed=11)
    return path


def _opts(ckpt: str, daemon, mode: str = "preferred") -> WorkerOptions:
    return WorkerOptions("tiny-dit", ckpt, mode, socket=daemon.socket if daemon else None)


def _reference(ckpt: str) -> torch.Tensor:
    worker = start_worker(WorkerOptions("tiny-dit", ckpt, "disabled", offload=False))
    try:
        return worker.forward(*sample_inputs(CFG))
    finally:
        worker.close()


def test_the_ordinary_worker_is_resident_on_its_device(ckpt):
    """Finding 3: forward() moves the inputs to --device, so the resident
    model must be there too (on a CUDA node it was left on the CPU). The
    meta device stands in for a GPU: every tensor must have moved."""
    worker = start_worker(WorkerOptions("tiny-dit", ckpt, "disabled", offload=False, device="meta"))
    try:
        tensors = list(worker.model.parameters()) + list(worker.model.buffers())
        assert tensors and all(t.device.type == "meta" for t in tensors)
    finally:
        worker.close()


def _populate(ckpt: str, daemon) -> None:
    worker = start_worker(_opts(ckpt, daemon))
    try:
        assert worker.report.outcome == "CANONICAL_FALLBACK"
        worker.forward(*sample_inputs(CFG))  # serve first, then publish
        assert worker.publish().ok
    finally:
        worker.close()


def test_warm_hit_materializes_nothing_and_calls_no_producer(ckpt, daemon, monkeypatch):
    reference = _reference(ckpt)
    _populate(ckpt, daemon)
    contract = get_contract("tiny-dit")
    calls = []
    monkeypatch.setattr(type(contract), "canonical_load", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setattr(contracts_mod.CheckpointReader, "take", lambda *a: calls.append(a) or 1 / 0)
    before = (contract.counters.producer_calls, contract.counters.bytes_materialized)
    worker = start_worker(_opts(ckpt, daemon))
    try:
        report = worker.report
        assert report.outcome == "LOCAL_HIT"
        assert report.producer_calls == 0 and report.bytes_materialized == 0 and report.checkpoint_bytes_read == 0
        assert calls == [] and (contract.counters.producer_calls, contract.counters.bytes_materialized) == before
        assert report.trail[-1] == "IN_SERVICE: LOCAL_HIT" and "COMMIT_STARTED" in report.trail
        check_no_meta(worker.model)
        assert torch.equal(worker.forward(*sample_inputs(CFG)), reference)
        assert report.bytes_copied_to_device > 0 and report.transport in ("staging", "registered")
    finally:
        worker.close()


def test_disabled_mode_never_connects_or_creates_a_root(ckpt, tmp_path, monkeypatch):
    sock = str(tmp_path / "never" / "hwr.sock")
    monkeypatch.setenv("HWR_SOCKET", sock)

    def refuse(*args, **kwargs):
        raise AssertionError("disabled mode touched HWR")

    monkeypatch.setattr(hwr_client, "connect", refuse)
    monkeypatch.setattr(hwr_client.Client, "__init__", refuse)
    monkeypatch.setattr(contracts_mod.Contract, "identity", refuse)
    worker = start_worker(WorkerOptions("tiny-dit", ckpt, "disabled", socket=sock))
    try:
        assert worker.report.outcome == "DISABLED" and worker.client is None
        worker.forward(*sample_inputs(CFG))
    finally:
        worker.close()
    assert not os.path.exists(os.path.dirname(sock))


def _publish_mismatch(ckpt: str, daemon, tmp_path) -> None:
    """Publishes, under ``ckpt``'s identity, the tensors of a model with one
    more block: a plan against ``ckpt``'s skeleton must fail."""
    other = str(tmp_path / "other")
    write_checkpoint(other, TinyDiTConfig(hidden=32, depth=4, heads=4, image=8, freq_dim=16), seed=11)
    contract = get_contract("tiny-dit")
    with daemon.client() as client:
        client.publish(contract.identity(ckpt, client=client), contract.produce(other))


def test_planning_failure_leaves_the_skeleton_untouched(ckpt, daemon, tmp_path):
    _publish_mismatch(ckpt, daemon, tmp_path)
    contract = get_contract("tiny-dit")
    skeleton = contract.build_skeleton(ckpt)
    before = {n: (id(t), t.device.type) for n, t in skeleton.state_dict(keep_vars=True).items()}
    with daemon.client() as client:
        key = contract.identity(ckpt, client=client).key
        with client.acquire(key) as lease:
            with pytest.raises(FailedPrecondition, match="blocks.3"):
                plan_restore(skeleton, lease)
    assert {n: (id(t), t.device.type) for n, t in skeleton.state_dict(keep_vars=True).items()} == before
    # preferred: the transaction falls back to a canonical load; required fails.
    reference = _reference(ckpt)
    worker = start_worker(_opts(ckpt, daemon))
    try:
        assert worker.report.outcome == "CANONICAL_FALLBACK"
        assert any("plan failed" in t for t in worker.report.trail)
        assert torch.equal(worker.forward(*sample_inputs(CFG)), reference)
        assert worker.publish() is None  # a plan-failure fallback never republishes
    finally:
        worker.close()
    with pytest.raises(FailedPrecondition, match="blocks.3"):
        start_worker(_opts(ckpt, daemon, "required"))


def test_warm_finalization_is_byte_and_pointer_neutral(ckpt, daemon, monkeypatch):
    _populate(ckpt, daemon)
    worker = start_worker(_opts(ckpt, daemon, "required"))
    try:
        assert worker.report.outcome == "LOCAL_HIT"
        before = snapshot(worker.model)
        worker.contract.finalize(worker.model)
        assert compare_snapshots(before, snapshot(worker.model)) == []
        assert all(not t.is_meta for t in worker.model.state_dict().values())
    finally:
        worker.close()
    contract = get_contract("tiny-dit")

    def moving_finalize(model):
        model.pos_embed = model.pos_embed.clone()  # moves a pointer: not shared finalization
        return model

    monkeypatch.setattr(type(contract), "finalize", lambda self, m: moving_finalize(m))
    with pytest.raises(FailedPrecondition, match="pos_embed: data pointer moved"):
        start_worker(_opts(ckpt, daemon, "required"))


def test_required_starts_warm_after_prewarm_and_fails_clearly_before(ckpt, daemon):
    with pytest.raises(FailedPrecondition, match="prewarm"):
        start_worker(_opts(ckpt, daemon, "required"))
    proc = daemon.cli("prewarm", "--contract", "tiny-dit", "--checkpoint", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    again = daemon.cli("prewarm", "--contract", "tiny-dit", "--checkpoint", ckpt, "--json")
    assert '"already_published"' in again.stdout, again.stdout + again.stderr
    worker = start_worker(_opts(ckpt, daemon, "required"))
    try:
        assert worker.report.outcome == "LOCAL_HIT" and worker.report.producer_calls == 0
        assert torch.equal(worker.forward(*sample_inputs(CFG)), _reference(ckpt))
    finally:
        worker.close()


def test_no_required_tensor_remains_on_meta(ckpt, daemon):
    contract = get_contract("tiny-dit")
    tensors = contract.produce(ckpt)
    del tensors["pos_embed"]  # a loader-computed buffer the artifact forgot
    with daemon.client() as client:
        client.publish(contract.identity(ckpt, client=client), tensors)
    with pytest.raises(FailedPrecondition, match="pos_embed: missing from the artifact"):
        start_worker(_opts(ckpt, daemon, "required"))
    worker = start_worker(_opts(ckpt, daemon))  # preferred: canonical fallback, fully materialized
    try:
        assert worker.report.outcome == "CANONICAL_FALLBACK"
        check_no_meta(worker.model)
        assert not any(t.is_meta for t in worker.model.state_dict().values())
    finally:
        worker.close()
