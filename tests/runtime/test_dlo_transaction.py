"""The startup transaction: stages, ownership and failure rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound
from dlo_runtime import (
    OffloadOptions, ModelRecipe, Outcome, RegistrationAborted, Stage, StartupTransaction, retained,
)
from hwr_client.resolve import Mode, Resolution
from tests.conftest import identity
from tests.support.dlo import FakeRegistrar, TestLease, ToyModel, make_artifact, reference, skeleton

N = 3
WARM_STAGES = [s.value for s in Stage]


@dataclasses.dataclass
class Counters:
    skeletons: list = dataclasses.field(default_factory=list)
    canonical: list = dataclasses.field(default_factory=list)  # (skeleton, options)
    published: int = 0


def recipe(c: Counters, *, finalize=lambda m: m.eval()) -> ModelRecipe:
    """The toy integration; counts every skeleton, canonical load (ordinary
    materialization) and producer call."""

    def build():
        s = skeleton(N)
        c.skeletons.append(s)
        return s

    def load(skel, opts):
        c.canonical.append((skel, opts))
        skel.to_empty(device="cpu")
        skel.load_state_dict(reference(N).state_dict())
        return skel.init_runtime_buffers()

    def publish(model):
        c.published += 1

    return ModelRecipe(build, load, lambda m: list(m.blocks), finalize, publish)


def hit(lease, mode="preferred") -> Resolution:
    """The Resolution of a LOCAL_HIT on ``lease``."""
    return Resolution(Outcome.LOCAL_HIT, Mode(mode), lease=lease, key="k" * 64)


def miss(mode="preferred") -> Resolution:
    """The Resolution of a preferred-mode miss (a required miss is FAILED)."""
    return Resolution(Outcome.CANONICAL_FALLBACK, Mode(mode), key="k" * 64, reason="not in the store",
                      error=NotFound("no artifact"))


def failed(mode, error) -> Resolution:
    return Resolution(Outcome.FAILED, Mode(mode), key="k" * 64, reason=str(error), error=error)


def _params_in(model: nn.Module, regions) -> bool:
    return all(any(r.address <= p.data_ptr() < r.address + r.length for r in regions) for p in model.parameters())


def _steps(result_or_tx):
    return [s.what for s in result_or_tx.trail]


def test_warm_hit_walks_every_stage_with_zero_materialization(tmp_path):
    lease = TestLease(make_artifact(tmp_path, reference(N)))
    c = Counters()
    result = StartupTransaction("preferred", recipe(c), lambda: hit(lease)).run()
    assert result.outcome is Outcome.LOCAL_HIT
    assert [s for s in _steps(result) if s in WARM_STAGES] == WARM_STAGES
    assert c.canonical == [] and c.published == 0  # zero ordinary materialization, zero producer calls
    assert len(c.skeletons) == 1 and result.model is c.skeletons[0]
    assert _params_in(result.model, lease.regions())  # between forwards: all on the mapping
    assert result.backend.lease is lease and lease.closed == 0
    x = torch.randn(2, 8)
    assert torch.equal(result.model(x), reference(N)(x))
    result.backend.close()
    assert lease.closed == 1


def test_preferred_miss_loads_canonically_and_publishes():
    c = Counters()
    result = StartupTransaction("preferred", recipe(c), miss).run()
    assert result.outcome is Outcome.CANONICAL_FALLBACK
    assert len(c.canonical) == 1 and c.canonical[0][1].publish and c.published == 1
    assert result.backend.stats.transport == "ordinary"
    assert _steps(result)[-2:] == ["IN_SERVICE", "published"]  # serves first, then publishes
    result.backend.close()


def test_required_miss_fails_without_loading():
    c = Counters()
    required_miss = NotFound("HWR required: artifact kkkk is not in the store; populate the store first")
    tx = StartupTransaction("required", recipe(c), lambda: failed("required", required_miss))
    with pytest.raises(FailedPrecondition, match="required"):
        tx.run()
    assert c.canonical == [] and c.published == 0 and _steps(tx)[-1] == "FAILED"


def test_non_miss_lookup_error_is_failed_in_preferred_mode():
    c = Counters()
    tx = StartupTransaction("preferred", recipe(c), lambda: failed("preferred", InvalidArgument("bad identity")))
    with pytest.raises(InvalidArgument):
        tx.run()
    assert c.canonical == []


def test_disabled_never_looks_up():
    c = Counters()
    result = StartupTransaction("disabled", recipe(c), lambda: pytest.fail("looked up")).run()
    assert result.outcome is Outcome.DISABLED and c.published == 0
    result.backend.close()


def _mismatching_lease(tmp_path) -> TestLease:
    model = reference(N)
    model.blocks[1].up = nn.Linear(16, 17)  # the artifact disagrees with the skeleton
    return TestLease(make_artifact(tmp_path, model))


def test_plan_failure_preferred_loads_into_the_untouched_skeleton(tmp_path):
    lease = _mismatching_lease(tmp_path)
    c = Counters()
    result = StartupTransaction("preferred", recipe(c), lambda: hit(lease)).run()
    assert result.outcome is Outcome.CANONICAL_FALLBACK
    assert lease.closed == 1
    assert "COMMIT_STARTED" not in _steps(result)
    (skel, opts), = c.canonical
    assert skel is c.skeletons[0] and len(c.skeletons) == 1  # the same, untouched skeleton
    assert not opts.publish and c.published == 0
    result.backend.close()


def test_plan_failure_required_fails_and_closes(tmp_path):
    lease = _mismatching_lease(tmp_path)
    c = Counters()
    tx = StartupTransaction("required", recipe(c), lambda: hit(lease, "required"))
    with pytest.raises(FailedPrecondition, match="blocks.1.up"):
        tx.run()
    assert lease.closed == 1 and c.canonical == []
    assert all(p.is_meta for p in c.skeletons[0].parameters())


@pytest.mark.parametrize("mode", ["preferred", "required"])
def test_skeleton_build_failure_after_a_hit_closes_the_loaders_lease(tmp_path, mode):
    lease = TestLease(make_artifact(tmp_path, reference(N)))

    def build():
        raise ValueError("config.json: hidden must be divisible by heads")

    tx = StartupTransaction(mode, ModelRecipe(build, lambda s, o: s, lambda m: list(m.blocks)), lambda: hit(lease, mode))
    with pytest.raises(ValueError, match="divisible"):
        tx.run()
    assert lease.closed == 1
    assert _steps(tx)[-2:] == ["close_lease", "FAILED"]


def _failing_backend_tx(tmp_path, mode):
    lease = TestLease(make_artifact(tmp_path, reference(N)), fail_block_bytes=True)
    c = Counters()
    return lease, c, StartupTransaction(mode, recipe(c), lambda: hit(lease, mode))


def test_backend_setup_failure_preferred_drains_closes_and_retries_fresh(tmp_path):
    lease, c, tx = _failing_backend_tx(tmp_path, "preferred")
    result = tx.run()
    steps = _steps(result)
    assert result.outcome is Outcome.CANONICAL_FALLBACK
    assert lease.closed == 1
    # The backend owned the lease: it drained, released, then closed it.
    assert steps.index("backend.drain") < steps.index("backend.release") < steps.index("backend.close_lease")
    assert steps.index("backend.close_lease") < steps.index("discard_model") < steps.index("CANONICAL_LOAD")
    first, fresh = c.skeletons
    assert result.model is fresh and fresh is not first
    assert all(p.is_meta for p in first.parameters())  # the restored model is discarded
    (skel, opts), = c.canonical
    assert skel is fresh and (opts.use_hwr, opts.publish, opts.checkpoint_mmap) == (False, False, False)
    assert c.published == 0
    x = torch.randn(2, 8)
    assert torch.equal(result.model(x), reference(N)(x))
    result.backend.close()


def test_backend_setup_failure_required_fails_after_closing(tmp_path):
    lease, c, tx = _failing_backend_tx(tmp_path, "required")
    with pytest.raises(RuntimeError, match="failpoint"):
        tx.run()
    steps = _steps(tx)
    assert lease.closed == 1 and c.canonical == [] and steps[-1] == "FAILED"
    assert steps.index("backend.drain") < steps.index("backend.close_lease")
    assert all(p.is_meta for p in c.skeletons[0].parameters())


def test_finalization_violation_after_commit_closes_through_the_loader(tmp_path):
    lease = TestLease(make_artifact(tmp_path, reference(N)))
    c = Counters()

    def bad_finalize(m):  # byte-identical but private: breaks pointer neutrality
        m.embed.weight = nn.Parameter(m.embed.weight.detach().clone())

    result = StartupTransaction("preferred", recipe(c, finalize=bad_finalize), lambda: hit(lease)).run()
    steps = _steps(result)
    assert result.outcome is Outcome.CANONICAL_FALLBACK and lease.closed == 1
    assert "CARRIER_OWNED" not in steps
    assert [s.note for s in result.trail if s.what == "close_lease"] == ["loader"]
    assert steps.index("drain") < steps.index("close_lease") < steps.index("discard_model")
    result.backend.close()


def test_stuck_registration_aborts_both_modes_keeping_the_lease(tmp_path):
    for mode in ("preferred", "required"):
        lease = TestLease(make_artifact(tmp_path / mode, reference(N)))
        c = Counters()
        reg = FakeRegistrar(fail_at=1, unregister_failures=-1)
        opts = OffloadOptions(registrar=reg, chunk_bytes=4096)
        with pytest.raises(RegistrationAborted):
            StartupTransaction(mode, recipe(c), lambda: hit(lease, mode), opts).run()
        assert lease.closed == 0 and c.canonical == []
        stuck = [b for b in retained() if b.lease is lease]
        assert len(stuck) == 1
        reg.unregister_failures = 0
        stuck[0].close()  # teardown once the platform lets go
        assert lease.closed == 1


def test_run_twice_and_bad_mode_raise():
    with pytest.raises(InvalidArgument):
        StartupTransaction("sometimes", recipe(Counters()), miss)
    tx = StartupTransaction("disabled", recipe(Counters()), miss)
    tx.run().backend.close()
    with pytest.raises(FailedPrecondition):
        tx.run()


def test_warm_hit_on_a_real_daemon_lease(daemon):
    pytest.importorskip("hwr_client.lease")
    pytest.importorskip("hwr_client.publish")
    ref = reference(N)
    with daemon.client() as client:
        report = client.publish(identity(test="dlo-real-lease"), {k: v.clone() for k, v in ref.state_dict().items()})
        res = client.resolve(identity(test="dlo-real-lease"), mode="required")
        lease = res.lease
        c = Counters()
        result = StartupTransaction("required", recipe(c), lambda: res,
                                    OffloadOptions(registrar=FakeRegistrar())).run()
        assert result.outcome is Outcome.LOCAL_HIT and c.canonical == [] and c.published == 0
        assert result.backend.stats.transport == "registered"
        assert _params_in(result.model, lease.regions())
        x = torch.randn(2, 8)
        assert torch.equal(result.model(x), ref(x))
        result.backend.close()
        assert lease.closed


def test_toy_model_skeleton_is_meta():
    assert all(p.is_meta for p in skeleton(2).parameters())
    assert isinstance(skeleton(1), ToyModel)


def test_a_resolution_made_in_another_mode_is_refused():
    # The mode rule runs once, in resolve: a preferred-mode fallback handed
    # to a required start would turn a required miss into a canonical load.
    c = Counters()
    tx = StartupTransaction("required", recipe(c), miss)
    with pytest.raises(InvalidArgument, match="mode 'preferred'"):
        tx.run()
    assert c.canonical == [] and c.skeletons == [] and _steps(tx)[-1] == "FAILED"
