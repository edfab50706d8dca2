"""``lazy_pipeline(..., compile=)`` on a real tiny FluxPipeline against a
real daemon, without an inductor compile (the end-to-end compile artifact
tests are in test_compile_artifacts.py): the switch reaches the deferred
component it names and only it, a required miss fails the call that needs
the artifact, and what cannot work is refused before anything loads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import dlo_runtime  # noqa: E402
from hwr_client.core.errors import InvalidArgument, NotFound  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import run_flux_pipeline, save_flux_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return save_flux_pipeline(str(tmp_path_factory.mktemp("flux") / "pipe"))


@pytest.fixture(scope="module")
def plain(pipe_dir, hwrd):
    """The lazy pipeline's image without compile (its components published)."""
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket) as lazy:
        return run_flux_pipeline(lazy.pipe)


def test_compile_reaches_the_named_component_only(pipe_dir, hwrd, plain):
    from torch._dynamo.utils import counters

    seen: dict[str, object] = {}
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket, compile={"transformer": {"backend": "eager"}}) as lazy:
        assert set(lazy.compile) == {"transformer"} and lazy.compile["transformer"].backend == "eager"
        load = lazy._load

        def recording(proxy):  # the LoadedModel of each load, for its report
            real = load(proxy)
            seen[proxy._lazy_name] = lazy._held[proxy._lazy_name].report.compile
            return real

        lazy._load = recording  # type: ignore[method-assign]
        frames = counters["stats"]["unique_graphs"]
        image = run_flux_pipeline(lazy.pipe)
    assert torch.equal(image, plain)
    assert counters["stats"]["unique_graphs"] > frames  # dynamo traced the transformer
    assert seen["text_encoder"] is None and seen["vae"] is None
    rep = seen["transformer"]
    assert rep.status == "bypassed" and "leaves no kernel cache" in rep.reason  # type: ignore[attr-defined]


@pytest.fixture
def own_folder(tmp_path, monkeypatch):
    """An inductor cache folder of the test's own, so the first call does
    not make this process a private one (and the environment is restored)."""
    from dlo_runtime.compile import folder

    path = tmp_path / "inductor"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    folder._reset_for_tests()
    yield str(path)
    folder._reset_for_tests()


def test_required_miss_fails_the_call_that_needs_the_artifact(pipe_dir, hwrd, plain, own_folder):
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket, mode="required",
                                   compile={"transformer": True}) as lazy:
        with pytest.raises(NotFound, match="HWR required: artifact .* is not in the store"):
            run_flux_pipeline(lazy.pipe)
        assert lazy.report["components"]["transformer"]["outcomes"] == ["LOCAL_HIT"]  # the weights were there


def test_what_cannot_work_is_refused_before_loading(pipe_dir, hwrd):
    with pytest.raises(InvalidArgument, match="offload=False"):
        dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket, device="cpu", compile=True)
    with pytest.raises(InvalidArgument, match="mixes"):
        dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket, compile={"transformer": True, "fullgraph": True})
