"""Canonical loading releases each checkpoint tensor once it is copied:
counted by weak references to the checkpoint tensors, not by timing."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file

from hwr_client.core.errors import FailedPrecondition
from dlo_runtime import iter_checkpoint, load_canonical_into
from tests.support.dlo import ToyModel, reference


def _checkpoint(model) -> dict[str, torch.Tensor]:
    # Fresh storage per tensor (what a checkpoint reader hands out).
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tracker(sd):
    refs = [(weakref.ref(t), t.numel() * t.element_size()) for t in sd.values()]
    peak = [0]

    def on_copied(name):
        peak[0] = max(peak[0], sum(n for r, n in refs if r() is not None))

    total = sum(n for _, n in refs)
    return on_copied, peak, total


def test_dict_is_drained_and_each_tensor_released_after_its_copy():
    ref = reference(3)
    sd = _checkpoint(ref)
    on_copied, peak, total = _tracker(sd)
    target = ToyModel(3)
    report = load_canonical_into(target, sd, on_copied=on_copied)
    assert sd == {}
    assert report.tensors == len(ref.state_dict()) and report.nbytes == total
    # After each copy, what is still alive is only what has not been read yet:
    # at the first callback that is everything but the first tensor.
    assert peak[0] < total
    for k, v in ref.state_dict().items():
        assert torch.equal(target.state_dict()[k], v)


def test_live_checkpoint_bytes_shrink_monotonically():
    sd = _checkpoint(reference(3))
    refs = [weakref.ref(t) for t in sd.values()]
    alive = []
    load_canonical_into(ToyModel(3), sd, on_copied=lambda n: alive.append(sum(r() is not None for r in refs)))
    assert alive == list(range(len(refs) - 1, -1, -1))  # one released per copy


def test_measurement_detects_retention():
    """Negative control: a caller that keeps the checkpoint alive is seen."""
    sd = _checkpoint(reference(2))
    keep = dict(sd)
    refs = [weakref.ref(t) for t in sd.values()]
    alive = []
    load_canonical_into(ToyModel(2), sd, on_copied=lambda n: alive.append(sum(r() is not None for r in refs)))
    assert alive == [len(refs)] * len(refs)
    del keep


@pytest.mark.parametrize("mmap", [True, False])
def test_file_reader_yields_one_tensor_at_a_time(tmp_path, mmap):
    ref = reference(2)
    path = str(tmp_path / "model.safetensors")
    save_file(_checkpoint(ref), path)
    live = []
    seen = []

    def track(item):
        live.append(weakref.ref(item[1]))
        return item

    def source():  # no local may hold a tensor while suspended
        it = iter_checkpoint([path], mmap=mmap)
        while True:
            try:
                yield track(next(it))
            except StopIteration:
                return

    def on_copied(name):
        seen.append(sum(r() is not None for r in live))

    target = ToyModel(2)
    load_canonical_into(target, source(), on_copied=on_copied)
    assert max(seen) == 0  # nothing read so far is still alive after its copy
    for k, v in ref.state_dict().items():
        assert torch.equal(target.state_dict()[k], v)


def test_strict_mismatch_and_meta_target_raise():
    sd = _checkpoint(reference(1))
    sd["stray"] = torch.zeros(1)
    with pytest.raises(FailedPrecondition, match="unexpected"):
        load_canonical_into(ToyModel(1), sd)
    with torch.device("meta"):
        meta = ToyModel(1)
    with pytest.raises(FailedPrecondition, match="meta"):
        load_canonical_into(meta, _checkpoint(reference(1)))


@pytest.mark.parametrize("mmap", [True, False])
def test_one_reader_for_both_ways_maps_or_reads_and_never_writes_the_file(tmp_path, mmap):
    """CheckpointReader reads through hwr_client.tensors.SafetensorsFile:
    mapped views (copy-on-write) or private buffers, the same tensors."""
    from dlo_runtime import CheckpointReader

    state = _checkpoint(reference(2))
    state["empty"] = torch.zeros(0, 4)
    path = str(tmp_path / "model.safetensors")
    save_file(state, path)
    before = open(path, "rb").read()
    with CheckpointReader(str(tmp_path), mmap=mmap) as reader:
        assert reader.names() == sorted(state)
        got = {n: reader.take(n) for n in reader.file_order()}
        reader.check_consumed("toy")
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    got["blocks.0.up.weight"].add_(1.0)  # a write to a view stays in this process
    assert open(path, "rb").read() == before
    with pytest.raises(FailedPrecondition, match="read twice"):
        reader.take("empty")


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    from dlo_runtime import CheckpointReader

    save_file({"a": torch.zeros(2), "b": torch.ones(1)}, str(tmp_path / "model-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-2.safetensors"))
    with pytest.raises(FailedPrecondition, match="'a' is in both .*model-1.*model-2"):
        CheckpointReader(str(tmp_path))
