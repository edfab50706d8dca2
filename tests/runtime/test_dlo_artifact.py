"""The shared DLO test pieces themselves: a real artifact round-trips, the test lease refuses pickling."""

from __future__ import annotations
import pickle
import pytest
import torch
from tests.support.dlo import TestLease, make_artifact, reference


def test_artifact_round_trip_views_equal_model(tmp_path):
    model = reference(3)
    art = make_artifact(tmp_path, model)
    views = art.tensors()
    for name, t in model.state_dict().items():
        assert torch.equal(views[name], t), name
    assert [b.prefix for b in art.blocks] == ["blocks.0.", "blocks.1.", "blocks.2."]
    sizes = [b.nbytes for b in art.blocks]
    assert len(set(sizes)) == 3  # heterogeneous


def test_test_lease_refuses_pickling(tmp_path):
    with pytest.raises(TypeError):
        pickle.dumps(TestLease(make_artifact(tmp_path, reference(1))))
