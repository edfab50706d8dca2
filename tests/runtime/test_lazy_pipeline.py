"""Lazy pipelines (:func:`dlo_runtime.lazy_pipeline`) on a real diffusers
FluxPipeline (CLIP + T5 encoders, transformer, VAE; tiny random components
saved with ``save_pretrained``, tokenizers built locally) against a real
daemon: images equal the library pipeline's bit for bit, every reload is a
LOCAL_HIT with nothing materialized, the peak is the largest component
(the first call too, from the declared use order), a
failing call releases what it loaded, a mutated component is refused for
deferral, config-only reads load nothing; and the unified-memory decision.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import dlo_runtime  # noqa: E402
from dlo_runtime.lazy import LazyComponent  # noqa: E402
from dlo_runtime.placement import host_offload  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.lazy_pipelines import Sampler  # noqa: E402
from tests.support.real_models import run_flux_pipeline, save_flux_pipeline  # noqa: E402

NAMES = ("text_encoder", "text_encoder_2", "transformer", "vae")


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return save_flux_pipeline(str(tmp_path_factory.mktemp("flux") / "pipe"))


@pytest.fixture(scope="module")
def reference(pipe_dir):
    """The library pipeline's image (every component resident)."""
    from diffusers import FluxPipeline

    return run_flux_pipeline(FluxPipeline.from_pretrained(pipe_dir, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def two_calls(pipe_dir, hwrd):
    """One lazy pipeline, called twice: (lazy, images, timeline length after call 1)."""
    lazy = dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket)
    first = run_flux_pipeline(lazy.pipe)
    mark = len(lazy.timeline)
    second = run_flux_pipeline(lazy.pipe)
    yield lazy, [first, second], mark
    lazy.close()


def test_two_calls_equal_the_library_and_reload_warm(two_calls, reference):
    lazy, images, _ = two_calls
    assert all(torch.equal(img, reference) for img in images)
    rep = lazy.report["components"]
    for name in NAMES:
        r = rep[name]
        assert r["deferred"] and r["loads"] == 2, (name, r)
        # The first load published; the reload is a lease and views.
        assert r["outcomes"] == ["CANONICAL_FALLBACK", "LOCAL_HIT"], (name, r)
        assert r["bytes_materialized"][0] > 0 and r["bytes_materialized"][1] == 0, (name, r)
        assert not lazy.components[name].is_loaded  # released after the call
    assert lazy.calls == 2


def test_every_call_holds_one_component_at_a_time(two_calls):
    lazy, _, mark = two_calls
    sizes = {n: r["resident_bytes"] for n, r in lazy.report["components"].items()}
    one_at_a_time = [f"{op} {n}" for n in NAMES for op in ("load", "release")]
    # Call 1 releases at the declared use order (nothing counted yet), call 2
    # after the counted last uses: the same points, the largest at once.
    for call in (lazy.timeline[:mark], lazy.timeline[mark:]):
        assert [w for _, w, _ in call] == one_at_a_time
        assert all(b == 0 for _, w, b in call if w.startswith("release")), call  # nothing else held
    assert max(b for _, _, b in lazy.timeline[mark:]) == max(sizes.values())
    assert all(r["unplanned_reloads"] == 0 for r in lazy.report["components"].values())
    assert "counted" in lazy.reports["transformer"].release and "declared last stage (3)" in lazy.reports["vae"].release


def test_a_path_the_declared_order_misses_reloads_counted_and_then_follows_the_counts(pipe_dir, hwrd, two_calls):
    """True CFG encodes the prompt twice (CLIP, T5, CLIP, T5): CLIP's declared
    release (before T5) is too early on call 1; it reloads, is counted and
    noted, and from call 2 on the counts decide."""
    from diffusers import FluxPipeline

    def true_cfg(pipe):
        with torch.no_grad():
            return pipe(prompt="a photo of a cat", negative_prompt="blurry", true_cfg_scale=2.0, height=16, width=16,
                        num_inference_steps=1, max_sequence_length=12, generator=torch.Generator().manual_seed(0),
                        output_type="pt").images

    reference = true_cfg(FluxPipeline.from_pretrained(pipe_dir, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket) as lazy:
        images = [true_cfg(lazy.pipe)]
        clip = lazy.reports["text_encoder"]
        # Two prompt encodings: twice the uses of a plain call.
        assert clip.unplanned_reloads == 1 and clip.loads == 2
        assert clip.uses_per_call == 2 * two_calls[0].reports["text_encoder"].uses_per_call
        assert any("used after its declared release" in n for n in clip.notes)
        assert any("declared release dropped" in n for n in clip.notes)
        assert "declared" not in clip.release
        mark = len(lazy.timeline)
        images.append(true_cfg(lazy.pipe))
        assert clip.unplanned_reloads == 1 and clip.loads == 3  # call 2: one load, held for both encodes
        # Call 2 releases CLIP after its counted last use, before the transformer loads.
        second = [w for _, w, _ in lazy.timeline[mark:]]
        assert second.count("load text_encoder") == 1
        assert second.index("release text_encoder") < second.index("load transformer"), second
        assert all(r.unplanned_reloads == 0 for n, r in lazy.reports.items() if n != "text_encoder")
        assert all(torch.equal(img, reference) for img in images)


def test_proxies_are_honest_and_config_reads_load_nothing(two_calls):
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import T5EncoderModel

    lazy, _, _ = two_calls
    pipe = lazy.pipe
    loads = {n: lazy.reports[n].loads for n in NAMES}
    assert isinstance(pipe.vae, AutoencoderKL) and isinstance(pipe.transformer, FluxTransformer2DModel)
    assert isinstance(pipe.text_encoder_2, T5EncoderModel) and isinstance(pipe.vae, torch.nn.Module)
    assert type(pipe.vae) is LazyComponent
    # Self-returning methods hand back the proxy: it stays releasable.
    pipe.vae = pipe.vae.to("cpu")
    pipe.vae = pipe.vae.to("cpu")
    assert pipe.vae is lazy.components["vae"]
    assert [m for m, _, _ in lazy.components["vae"]._lazy_pending] == ["to"]  # recorded once, applied per load
    assert pipe.transformer.eval() is pipe.transformer and pipe.text_encoder.requires_grad_(False) is pipe.text_encoder
    # Config-only reads: answered by the meta skeleton.
    assert pipe.vae.config.scaling_factor == pytest.approx(1.5035)
    assert pipe.transformer.config.in_channels == 4 and pipe.transformer.dtype == torch.bfloat16
    assert pipe.text_encoder_2.dtype == torch.bfloat16 and pipe.vae.device == torch.device("cpu")
    assert not hasattr(pipe.transformer, "_hf_hook")
    assert pipe.device == torch.device("cpu")
    assert {n: lazy.reports[n].loads for n in NAMES} == loads
    assert not any(lazy.components[n].is_loaded for n in NAMES)


def test_a_call_failing_inside_the_transformer_releases_what_it_loaded(two_calls, monkeypatch):
    from diffusers import FluxTransformer2DModel

    from dlo_runtime.pretrained import LoadedModel

    lazy, _, _ = two_calls

    def boom(self, *args, **kwargs):
        raise RuntimeError("boom inside the transformer")

    monkeypatch.setattr(FluxTransformer2DModel, "forward", boom)
    with pytest.raises(RuntimeError, match="boom inside the transformer"):
        run_flux_pipeline(lazy.pipe)
    assert not any(lazy.components[n].is_loaded for n in NAMES)
    assert lazy.timeline[-1][2] == 0
    # A release that fails too never replaces the exception being raised.
    close = LoadedModel.close

    def failing_close(self):
        close(self)
        raise OSError("release failed")

    monkeypatch.setattr(LoadedModel, "close", failing_close)
    with pytest.raises(RuntimeError, match="boom inside the transformer") as info:
        run_flux_pipeline(lazy.pipe)
    assert any("release failed" in n for n in getattr(info.value, "__notes__", []))
    assert lazy.calls == 2  # failed calls change neither the count nor the recorded uses


def test_a_component_mutated_after_load_is_refused_for_deferral(pipe_dir, hwrd, reference):
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket) as lazy:
        def rebind_every_block(pipe, i, t, kwargs):
            # The seed's example: a feature that writes into every block.
            for blk in pipe.transformer.transformer_blocks:
                w = blk.norm1.linear.weight
                w.data = w.data * 2
            return kwargs

        with torch.no_grad():
            mutated = lazy.pipe(prompt="a photo of a cat", height=16, width=16, num_inference_steps=2,
                                guidance_scale=3.5, max_sequence_length=12, output_type="pt",
                                generator=torch.Generator().manual_seed(0),
                                callback_on_step_end=rebind_every_block).images
        rep = lazy.reports["transformer"]
        assert not rep.deferred and "changed after load" in rep.why, rep.why
        assert lazy.components["transformer"].is_loaded  # kept resident: it never reloads different
        assert not torch.equal(mutated, reference)
        loads = rep.loads
        run_flux_pipeline(lazy.pipe)
        assert rep.loads == loads and lazy.reports["vae"].loads == 2  # the others still defer
        # An attribute set through the proxy is a mutation too.
        lazy.pipe.vae.use_slicing = True
        assert not lazy.reports["vae"].deferred and "use_slicing" in lazy.reports["vae"].why


def test_img2img_holds_the_vae_from_encode_to_decode(pipe_dir, hwrd):
    from diffusers import FluxImg2ImgPipeline

    def img2img(pipe):
        with torch.no_grad():
            return pipe(prompt="a red dog", image=torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1)),
                        strength=0.75, height=16, width=16, num_inference_steps=4, guidance_scale=3.5,
                        max_sequence_length=12, generator=torch.Generator().manual_seed(0), output_type="pt").images

    reference = img2img(FluxImg2ImgPipeline.from_pretrained(pipe_dir, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(pipe_dir, pipeline_class=FluxImg2ImgPipeline, socket=hwrd.socket) as lazy:
        images = [img2img(lazy.pipe)]
        mark = len(lazy.timeline)
        images.append(img2img(lazy.pipe))
        assert all(torch.equal(img, reference) for img in images)
        sizes = {n: r.resident_bytes for n, r in lazy.reports.items()}
        # Call 1 (declared order) and call 2 (counted uses) release at the same points.
        for call in (lazy.timeline[:mark], lazy.timeline[mark:]):
            assert [w for _, w, _ in call] == [
                "load text_encoder", "release text_encoder", "load text_encoder_2", "release text_encoder_2",
                "load vae", "load transformer", "release transformer", "release vae"]
            assert max(b for _, _, b in call) == sizes["transformer"] + sizes["vae"]
        assert all(r.outcomes[-1] == "LOCAL_HIT" and r.bytes_materialized[-1] == 0 for r in lazy.reports.values())
        assert all(r.unplanned_reloads == 0 for r in lazy.reports.values())


def test_a_deferred_component_a_call_does_not_use_is_not_loaded_and_says_so(pipe_dir, hwrd):
    with dlo_runtime.lazy_pipeline(pipe_dir, socket=hwrd.socket) as lazy:
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # precomputed embeddings: neither text encoder runs
            lazy.pipe(prompt_embeds=torch.randn(1, 12, 32, generator=g).to(torch.bfloat16),
                      pooled_prompt_embeds=torch.randn(1, 32, generator=g).to(torch.bfloat16), height=16, width=16,
                      num_inference_steps=1, output_type="pt")
        for name in ("text_encoder", "text_encoder_2"):
            rep = lazy.reports[name]
            assert rep.loads == 0 and rep.uses_per_call == 0
            assert any("not used in a call" in n for n in rep.notes)
        assert lazy.reports["transformer"].loads == 1 and not lazy.reports["transformer"].notes


def test_a_class_without_a_use_order_loads_normally_says_so_and_counts_calls(pipe_dir, hwrd, reference):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    class MyFlux(FluxPipeline):  # declares no order: nothing to release by
        model_cpu_offload_seq = None

    with dlo_runtime.lazy_pipeline(pipe_dir, pipeline_class=MyFlux, socket=hwrd.socket) as lazy:
        assert type(lazy.pipe.transformer) is FluxTransformer2DModel and not lazy.components
        assert isinstance(lazy.pipe, MyFlux) and torch.equal(run_flux_pipeline(lazy.pipe), reference)
        run_flux_pipeline(lazy.pipe)
        rep = lazy.report
        assert rep["calls"] == 2 and rep["use_order"] is None
        assert set(rep["components"]) == set(NAMES)
        assert all(not r["deferred"] and "declares no model_cpu_offload_seq" in r["why"]
                   for r in rep["components"].values())
        assert any("MyFlux" in n for n in rep["notes"])


def test_a_subclass_inherits_the_order_and_defers(pipe_dir, hwrd, reference):
    """A subclass inherits ``model_cpu_offload_seq`` (diffusers' own offload
    follows it too); the mutation checks guard what it does differently."""
    from diffusers import FluxPipeline

    class MyFlux(FluxPipeline):
        pass

    with dlo_runtime.lazy_pipeline(pipe_dir, pipeline_class=MyFlux, socket=hwrd.socket) as lazy:
        assert torch.equal(run_flux_pipeline(lazy.pipe), reference)
        assert all(r.deferred and r.loads == 1 for r in lazy.reports.values())


def test_unified_memory_turns_host_offload_off_in_one_place():
    integrated = host_offload("cuda:0", None, probe=lambda d: True)
    assert not integrated.offload and integrated.unified_memory and "cudaDevAttrIntegrated" in integrated.reason
    assert not host_offload("cuda:0", True, probe=lambda d: True).offload  # even when asked for
    assert host_offload("cuda:0", None, probe=lambda d: False).offload
    assert not host_offload("cuda:0", False, probe=lambda d: False).offload
    assert not host_offload(None).offload
    # The default probe: MPS is unified without asking any driver; the CPU is not.
    mps = host_offload("mps")
    assert mps.unified_memory and not mps.offload
    assert host_offload("cpu").offload and not host_offload("cpu").unified_memory


# -- peak memory, sampled -----------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_peak_rss_is_the_largest_component_not_the_sum(hwrd, tmp_path_factory):
    from diffusers import FluxPipeline

    wide = save_flux_pipeline(str(tmp_path_factory.mktemp("wide") / "pipe"), wide=8, shard="1GB")
    with dlo_runtime.lazy_pipeline(wide, socket=hwrd.socket) as lazy:
        run_flux_pipeline(lazy.pipe)  # cold: publishes (and leaves the page cache hot)
    # A fresh worker's lazy pipeline on a warm store: its FIRST call (nothing
    # counted yet, the declared order) and its second (the counts).
    with dlo_runtime.lazy_pipeline(wide, socket=hwrd.socket) as lazy:
        with Sampler() as first_rss:
            first_image = run_flux_pipeline(lazy.pipe)
        with Sampler() as lazy_rss:
            lazy_image = run_flux_pipeline(lazy.pipe)
        sizes = {n: r["resident_bytes"] for n, r in lazy.report["components"].items()}
        assert all(r["outcomes"] == ["LOCAL_HIT"] * 2 for r in lazy.report["components"].values())
    largest, total = max(sizes.values()), sum(sizes.values())
    assert total - largest > 0.6 * largest  # the T5 encoder is big enough to tell sum from max
    # The same components, warm from the same artifacts, all resident: the sum.
    with Sampler() as resident_rss:
        loaded = {n: dlo_runtime.from_pretrained(wide, subfolder=n, socket=hwrd.socket, progress=False) for n in NAMES}
        pipe = FluxPipeline.from_pretrained(wide, dtype=torch.bfloat16, **{n: m.model for n, m in loaded.items()})
        resident_image = run_flux_pipeline(pipe)
    assert all(m.outcome == "LOCAL_HIT" for m in loaded.values())
    del pipe
    for m in loaded.values():
        m.close()
    assert torch.equal(lazy_image, resident_image) and torch.equal(first_image, resident_image)
    slack = 8 << 20  # activations and the skeleton of a reload, at 16x16
    assert first_rss.delta <= 1.15 * largest + slack, (first_rss.delta, sizes)
    assert lazy_rss.delta <= 1.15 * largest + slack, (lazy_rss.delta, sizes)
    assert resident_rss.delta >= 0.9 * total, (resident_rss.delta, sizes)
    assert lazy_rss.delta < resident_rss.delta - 0.5 * (total - largest)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_dlo_streams_and_the_images_equal_the_resident_pipeline_on_cuda(pipe_dir, hwrd):
    """Written for a CUDA node, not run on the CPU-only one it was written on."""
    from diffusers import FluxPipeline

    resident = FluxPipeline.from_pretrained(pipe_dir, dtype=torch.bfloat16).to("cuda:0")
    expected = run_flux_pipeline(resident).cpu()
    del resident
    with dlo_runtime.lazy_pipeline(pipe_dir, device="cuda:0", socket=hwrd.socket) as lazy:
        decision = lazy.report["placement"]
        images = [run_flux_pipeline(lazy.pipe).cpu() for _ in range(2)]
        if decision["unified_memory"]:
            assert not decision["offload"]  # an integrated GPU: resident on the device, no DLO
        else:
            assert decision["offload"] and lazy.pipe._execution_device == torch.device("cuda:0")
        assert all(r.outcomes[-1] == "LOCAL_HIT" for r in lazy.reports.values())
    # Not bitwise: cuBLAS may pick other kernels for weights in DLO's slot
    # buffers (other alignment) than for the resident module's own tensors.
    for img in images:
        torch.testing.assert_close(img, expected, atol=2e-2, rtol=0)
