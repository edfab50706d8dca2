"""``from_pretrained(host_plan="auto")`` takes the cheapest path for the
case and reports the one it took: a same-dtype checkpoint is served from
its own mapping (outcome CHECKPOINT_MMAP, no daemon call), a cast goes
through HWR (cold, then LOCAL_HIT) with preflight's reasons, the skeleton
preflight built is the one the HWR start uses (the model is built once),
and a required start never takes the checkpoint's mapping."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import dlo_runtime  # noqa: E402
from dlo_runtime.pretrained.contract import PretrainedContract  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import MODELS, output_of  # noqa: E402


def _save(directory: str, dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    MODELS["flux"][0]().to(dtype).save_pretrained(directory, max_shard_size="20KB")
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("auto")
    return {"bf16": _save(str(base / "bf16"), torch.bfloat16), "fp32": _save(str(base / "fp32"), torch.float32)}


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()  # no options
    yield d
    cleanup(d)


@pytest.fixture
def builds(monkeypatch):
    """Counts model constructions (the contract's one seam that builds)."""
    count = [0]
    real = PretrainedContract._build

    def counting(self, *, fused):
        count[0] += 1
        return real(self, fused=fused)

    monkeypatch.setattr(PretrainedContract, "_build", counting)
    return count


def library(directory: str) -> torch.Tensor:
    with dlo_runtime.from_pretrained(directory, mode="disabled") as loaded:
        return output_of(loaded.model, "flux")


def test_same_dtype_is_served_from_the_checkpoint_and_says_so(dirs, monkeypatch, builds):
    import hwr_client

    def no_daemon(*a, **k):
        raise AssertionError("checkpoint-mmap must not reach the daemon")

    monkeypatch.setattr(hwr_client, "connect", no_daemon)
    with dlo_runtime.from_pretrained(dirs["bf16"], host_plan="auto", progress=False) as loaded:
        rep = loaded.report
        assert loaded.outcome == "CHECKPOINT_MMAP" and rep.outcome == "CHECKPOINT_MMAP"
        assert rep.host_plan == "checkpoint-mmap" and rep.key == "" and rep.publish is None
        assert rep.host_plan_reason.startswith("checkpoint-mmap (host_plan='auto'): runtime layout equals")
        assert "no daemon call" in rep.host_plan_reason and rep.bytes_materialized == 0
        assert {"skeleton", "preflight", "total"} <= set(rep.seconds)
        out = output_of(loaded.model, "flux")
    assert builds[0] == 1
    assert torch.equal(out, library(dirs["bf16"]))


def test_a_cast_goes_through_hwr_with_one_skeleton(dirs, hwrd, builds):
    expected = library(dirs["fp32"])
    builds[0] = 0
    outcomes = []
    for _ in range(2):
        with dlo_runtime.from_pretrained(dirs["fp32"], host_plan="auto", socket=hwrd.socket, progress=False,
                                         device="cpu") as loaded:
            rep = loaded.report
            assert rep.host_plan == "hwr" and loaded.key
            assert rep.host_plan_reason.startswith("hwr (host_plan='auto'): checkpoint-mmap refused:")
            assert "(a cast)" in rep.host_plan_reason
            outcomes.append(str(loaded.outcome))
            assert torch.equal(output_of(loaded.model, "flux"), expected)
    assert outcomes == ["CANONICAL_FALLBACK", "LOCAL_HIT"]
    # One construction per start: preflight's skeleton is the one restored
    # (warm) or loaded (cold; fp32 needs no fused copy).
    assert builds[0] == 2


def test_required_never_takes_the_checkpoint_mapping(dirs, hwrd):
    with dlo_runtime.from_pretrained(dirs["bf16"], host_plan="auto", mode="preferred", socket=hwrd.socket,
                                     progress=False) as loaded:
        assert loaded.outcome == "CHECKPOINT_MMAP"
    with pytest.raises(Exception, match="prewarm"):
        dlo_runtime.from_pretrained(dirs["bf16"], host_plan="auto", mode="required", socket=hwrd.socket,
                                    progress=False)


def test_a_same_dtype_cold_start_through_hwr_copies_nothing(dirs, tmp_path):
    """host_plan="hwr" on a bf16 checkpoint: the cold start binds views of
    the checkpoint's mapping as the library does (0 bytes materialized, not
    the model's size), the background publication reads them, and the next
    start is a LOCAL_HIT with the same output."""
    d = make_daemon(tmp_path).start()  # a store of its own: the cold start must miss
    try:
        expected = library(dirs["bf16"])
        with dlo_runtime.from_pretrained(dirs["bf16"], socket=d.socket, progress=False) as cold:
            assert str(cold.outcome) == "CANONICAL_FALLBACK" and cold.report.producer_calls == 1
            assert cold.report.bytes_materialized == 0, cold.report
            assert cold.report.checkpoint_bytes_read > 0
            assert torch.equal(output_of(cold.model, "flux"), expected)
            assert cold.wait_published()["state"] == "published"
        with dlo_runtime.from_pretrained(dirs["bf16"], socket=d.socket, progress=False) as warm:
            assert str(warm.outcome) == "LOCAL_HIT" and warm.report.bytes_materialized == 0
            assert torch.equal(output_of(warm.model, "flux"), expected)
    finally:
        cleanup(d)


def test_a_cold_start_does_not_wait_for_the_sources_hashes(dirs, tmp_path, monkeypatch):
    """A certain miss returns while its sources are still being hashed: the
    background publication waits for the identity, never the start. The
    seam: the deferred identity's completion (hwr_client.start._complete)
    held until the start has returned."""
    import threading

    import hwr_client.start

    release, entered = threading.Event(), threading.Event()
    real = hwr_client.start._complete

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(hwr_client.start, "_complete", held)
    d = make_daemon(tmp_path).start()
    try:
        with dlo_runtime.from_pretrained(dirs["fp32"], socket=d.socket, progress=False) as cold:
            # Returned with the identity still incomplete: no key yet, the publication waiting for it.
            assert entered.wait(60) and str(cold.outcome) == "CANONICAL_FALLBACK"
            assert cold.report.key == "" and cold.report.publish["state"] == "running"
            release.set()
            assert cold.wait_published(60)["state"] == "published"
            assert cold.key and cold.report.key == cold.key
        with dlo_runtime.from_pretrained(dirs["fp32"], socket=d.socket, progress=False) as warm:
            assert str(warm.outcome) == "LOCAL_HIT" and warm.key == cold.key
    finally:
        release.set()
        cleanup(d)
