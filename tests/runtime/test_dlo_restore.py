"""Warm restore: plan -> commit, zero copies, and the finalization guard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition
from hwr_client.local import write_artifact
from hwr_client.mapping import MappedArtifact
from hwr_client.tensors import build_plan
from dlo_runtime import finalize_shared, plan_restore, restore_model
from tests.conftest import identity
from tests.support.dlo import ToyModel, make_artifact, reference, skeleton


def _in_regions(t: torch.Tensor, regions) -> bool:
    p = t.data_ptr()
    return any(r.address <= p < r.address + r.length for r in regions)


def test_restore_binds_views_with_zero_copies(tmp_path):
    model = reference(3)
    art = make_artifact(tmp_path, model)
    skel = skeleton(3)
    result = restore_model(skel, art)
    assert result.copies == 0
    assert result.tensors == len(model.state_dict())
    views = art.tensors()
    for name, t in skel.state_dict().items():
        assert t.data_ptr() == views[name].data_ptr(), name
        assert _in_regions(t, art.regions())
    x = torch.randn(4, 8)
    assert torch.equal(skel(x), model(x))


def test_plan_failure_leaves_skeleton_untouched(tmp_path):
    art = make_artifact(tmp_path, reference(2))
    skel = skeleton(2)
    skel.blocks[1].up = nn.Linear(16, 17, device="meta")  # shape differs from the artifact
    before = {n: (id(p), p.device.type) for n, p in skel.named_parameters()}
    with pytest.raises(FailedPrecondition) as err:
        restore_model(skel, art)
    msg = str(err.value)
    assert "blocks.1.up.weight" in msg and "blocks.1.up.bias" in msg
    assert {n: (id(p), p.device.type) for n, p in skel.named_parameters()} == before
    assert all(p.is_meta for p in skel.parameters())


def test_plan_names_missing_extra_and_dtype(tmp_path):
    art = make_artifact(tmp_path, reference(2))
    skel = skeleton(2)
    skel.blocks[0].gate = nn.Parameter(torch.empty(16, device="meta"))  # fp32, artifact has bf16
    del skel.final_norm.bias
    skel.final_norm.register_parameter("bias", None)
    skel.extra = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(FailedPrecondition) as err:
        plan_restore(skel, art)
    msg = str(err.value)
    assert "blocks.0.gate" in msg and "bfloat16" in msg
    assert "extra: missing from the artifact" in msg
    assert "final_norm.bias: in the artifact but not" in msg


def test_non_persistent_buffer_left_on_meta_fails_plan(tmp_path):
    art = make_artifact(tmp_path, reference(1))
    with torch.device("meta"):
        skel = ToyModel(1)  # cache buffer never initialised
    with pytest.raises(FailedPrecondition, match="blocks.0.cache: non-persistent buffer left on meta"):
        plan_restore(skel, art)


def test_finalization_guard_accepts_neutral_work(tmp_path):
    art = make_artifact(tmp_path, reference(2))
    skel = skeleton(2)
    restore_model(skel, art)
    hooks = []
    finalize_shared(skel, lambda m: (m.eval(), hooks.append(m.register_forward_hook(lambda *a: None))))
    assert len(hooks) == 1


def test_finalization_guard_detects_pointer_move(tmp_path):
    art = make_artifact(tmp_path, reference(2))
    skel = skeleton(2)
    restore_model(skel, art)

    def cast(m):  # byte-identical copy, but no longer backed by the lease
        m.embed.weight = nn.Parameter(m.embed.weight.detach().clone())

    with pytest.raises(FailedPrecondition, match="embed.weight: data pointer moved"):
        finalize_shared(skel, cast)


def test_finalization_guard_detects_byte_change(tmp_path):
    model = reference(1)
    skel = ToyModel(1)
    skel.load_state_dict(model.state_dict())  # private writable copy

    def bump(m):
        with torch.no_grad():
            m.blocks[0].scale.add_(1)

    with pytest.raises(FailedPrecondition, match="blocks.0.scale: bytes changed"):
        finalize_shared(skel, bump)


def test_tied_parameters_are_restored_in_every_owner(tmp_path):
    model = reference(1)
    model.final_norm.weight = model.blocks[0].norm.weight  # tied: one tensor, two owners
    sd = dict(model.state_dict())
    del sd["final_norm.weight"]  # the artifact stores a tied tensor once
    manifest, paths = write_artifact(str(tmp_path), build_plan(identity(tied=1), sd), sd)
    art = MappedArtifact(manifest, paths)
    skel = skeleton(1)
    skel.final_norm.weight = skel.blocks[0].norm.weight
    restore_model(skel, art)
    assert skel.final_norm.weight is skel.blocks[0].norm.weight
    assert not skel.final_norm.weight.is_meta
    x = torch.randn(2, 8)
    assert torch.equal(skel(x), model(x))


def test_guard_hashes_nothing_inside_the_read_only_mapping(tmp_path, monkeypatch):
    from dlo_runtime import restore as r  # the submodule: the function is exported as restore_model

    art = make_artifact(tmp_path, reference(2))
    skel = skeleton(2)
    restore_model(skel, art)
    calls = []
    real = r._digest
    monkeypatch.setattr(r, "_digest", lambda t: (calls.append(1), real(t))[1])
    finalize_shared(skel, lambda m: m.eval(), regions=art.regions())
    assert calls == []  # O(tensors), not O(bytes): pointers prove PROT_READ bytes
    finalize_shared(skel, lambda m: m.eval())
    assert len(calls) == 2 * len(skel.state_dict())  # without regions: every tensor, twice

    def swap(m):
        m.embed.weight = nn.Parameter(m.embed.weight.detach().clone())

    with pytest.raises(FailedPrecondition, match="embed.weight: data pointer moved"):
        finalize_shared(skel, swap, regions=art.regions())


def test_the_restore_submodule_and_restore_model_are_both_reachable():
    import types

    import dlo_runtime
    from dlo_runtime.restore import restore_model as direct

    assert isinstance(dlo_runtime.restore, types.ModuleType)  # no function shadows the submodule
    assert dlo_runtime.restore_model is direct is dlo_runtime.restore.restore_model
