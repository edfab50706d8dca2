"""Lazy pipelines beyond FLUX: the use order derived from each class's
``model_cpu_offload_seq`` (the string diffusers' ``enable_model_cpu_offload``
follows), on a real StableDiffusion3Pipeline and WanPipeline (tiny random
components saved with ``save_pretrained``, tokenizers built locally)
against a real daemon: images equal the library pipeline's on the same
folder, every reload a LOCAL_HIT, one component held at a time; DLO on the
CPU (``device="cpu"``) releases cleanly; an explicit ``components=`` that
cannot be honoured is an error naming the component and why; what deferred
and why is logged; a component whose state a method changed is kept.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import dlo_runtime  # noqa: E402
from dlo_runtime.lazy import use_order_of  # noqa: E402
from dlo_runtime.lazy.policy import plan_components  # noqa: E402
from hwr_client.core.errors import InvalidArgument  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.lazy_pipelines import (run_sd3_pipeline, run_wan_pipeline, save_sd3_pipeline,  # noqa: E402
                                          save_wan_pipeline)
from tests.support.real_models import save_flux_pipeline  # noqa: E402

SD3 = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")
WAN = ("text_encoder", "transformer", "vae")


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    # CLIP saved in the runtime dtype: see the dtype-guard test for fp32.
    return save_sd3_pipeline(str(tmp_path_factory.mktemp("sd3") / "pipe"), clip_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return save_wan_pipeline(str(tmp_path_factory.mktemp("wan") / "pipe"))


def _calls(lazy, run, n=2):
    """``n`` calls; the images and each call's slice of the timeline."""
    images, cuts = [], [0]
    for _ in range(n):
        images.append(run(lazy.pipe))
        cuts.append(len(lazy.timeline))
    return images, [lazy.timeline[a:b] for a, b in zip(cuts, cuts[1:])]


def _one_at_a_time(call, names):
    return [w for _, w, _ in call] == [f"{op} {n}" for n in names for op in ("load", "release")]


def _assert_deferred_warm(lazy, names, calls=2):
    rep = lazy.report
    assert rep["calls"] == calls
    for name in names:
        r = rep["components"][name]
        assert r["deferred"] and r["loads"] == calls and r["unplanned_reloads"] == 0, (name, r)
        assert r["outcomes"][-1] == "LOCAL_HIT" and r["bytes_materialized"][-1] == 0, (name, r)
        assert not lazy.components[name].is_loaded
    sizes = [rep["components"][n]["resident_bytes"] for n in names]
    # The largest set at once is one component, far below the sum.
    assert rep["peak_component_bytes"] == max(sizes) < sum(sizes)


# -- the derived order and the plan --------------------------------------------------------


def test_use_orders_derive_from_model_cpu_offload_seq():
    from diffusers import (FluxImg2ImgPipeline, FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline,
                           WanPipeline)

    flux = use_order_of(FluxPipeline, ["text_encoder", "text_encoder_2", "transformer", "vae"])
    # The hand-written FLUX order this replaces: the derived one, less the absent image_encoder.
    assert flux.use_order == ("text_encoder", "text_encoder_2", "transformer", "vae")
    assert "model_cpu_offload_seq" in flux.source
    # img2img keeps its declaration: the VAE encodes before denoising and decodes after.
    img2img = use_order_of(FluxImg2ImgPipeline, flux.use_order)
    assert img2img.use_order == ("text_encoder", "text_encoder_2", "vae", "transformer", "vae")
    assert img2img.components == ("text_encoder", "text_encoder_2", "vae", "transformer")
    assert use_order_of(StableDiffusion3Pipeline, SD3).use_order == SD3
    assert use_order_of(WanPipeline, ["text_encoder", "transformer", "vae"]).use_order == WAN  # transformer_2 absent
    sd = use_order_of(StableDiffusionPipeline, ["text_encoder", "unet", "vae", "safety_checker"])
    assert sd.use_order == ("text_encoder", "unet", "vae")

    class NoOrder(FluxPipeline):
        model_cpu_offload_seq = None

    assert use_order_of(NoOrder, flux.use_order) is None


def test_a_component_that_cannot_defer_is_an_error_naming_it_and_why():
    from diffusers import StableDiffusionPipeline

    index = {"_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "PNDMScheduler"],
             "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
             "feature_extractor": ["transformers", "CLIPImageProcessor"], "image_encoder": [None, None]}
    order = use_order_of(StableDiffusionPipeline, [k for k, v in index.items() if isinstance(v, list) and v[0]])
    from dlo_runtime.lazy.build import _is_module

    def plan(requested, passed=()):
        return plan_components(StableDiffusionPipeline, index, requested=requested, passed=set(passed), order=order,
                               is_module=_is_module)

    cases = {("transformer",): "not a component of StableDiffusionPipeline",
             ("image_encoder",): "absent from the folder",
             ("safety_checker",): "excluded from offload by StableDiffusionPipeline._exclude_from_cpu_offload",
             ("tokenizer",): "transformers.CLIPTokenizer is not a torch module",
             ("scheduler",): "is not a torch module"}
    for requested, why in cases.items():
        with pytest.raises(InvalidArgument, match=why) as info:
            plan(requested)
        assert repr(requested[0]) in str(info.value)
    with pytest.raises(InvalidArgument, match="'unet' cannot defer: passed by the caller"):
        plan(("unet",), passed=("unet",))
    # The default: every module the order names; the others say why not.
    got = {d.name: d for d in plan(None, passed=("text_encoder",))}
    assert [n for n, d in got.items() if d.deferred] == ["unet", "vae"]
    assert "passed by the caller" in got["text_encoder"].why
    assert "excluded from offload" in got["safety_checker"].why
    assert set(got) == {"text_encoder", "unet", "vae", "safety_checker"}
    # A module outside the order (diffusers offloads it outside its chain) defers only when asked.
    assert [d.deferred for d in plan(("vae",)) if d.name in ("vae", "unet")] == [False, True]


def test_lazy_pipeline_refuses_explicit_components_it_cannot_honour(sd3_dir):
    from diffusers import FluxPipeline

    for comps, why in ((("tokenizer_3",), "'tokenizer_3' cannot defer: transformers.T5Tokenizer is not a torch module"),
                       (("unet",), "'unet' cannot defer: not a component of StableDiffusion3Pipeline"),
                       (("image_encoder",), "'image_encoder' cannot defer: absent from the folder"),
                       ("vae", "expected a sequence of component names")):
        with pytest.raises(InvalidArgument, match=why):
            dlo_runtime.lazy_pipeline(sd3_dir, components=comps, mode="disabled")
    with pytest.raises(InvalidArgument, match="'vae' cannot defer: passed by the caller"):
        dlo_runtime.lazy_pipeline(sd3_dir, components=("vae",), mode="disabled", vae=None)

    class NoOrder(FluxPipeline):
        model_cpu_offload_seq = None

    flux = save_flux_pipeline(sd3_dir + ".flux")
    with pytest.raises(InvalidArgument, match="'vae' cannot defer: NoOrder declares no model_cpu_offload_seq"):
        dlo_runtime.lazy_pipeline(flux, pipeline_class=NoOrder, components=("vae",), mode="disabled")


# -- StableDiffusion3Pipeline and WanPipeline, through a real daemon ------------------------


def test_sd3_defers_every_encoder_the_transformer_and_the_vae_from_its_offload_seq(sd3_dir, hwrd, caplog):
    from diffusers import StableDiffusion3Pipeline

    reference = run_sd3_pipeline(StableDiffusion3Pipeline.from_pretrained(sd3_dir, dtype=torch.bfloat16))
    with caplog.at_level(logging.INFO, logger="dlo_runtime.lazy"):
        lazy = dlo_runtime.lazy_pipeline(sd3_dir, socket=hwrd.socket)
    with lazy:
        assert lazy.report["use_order"] == list(SD3)
        assert "StableDiffusion3Pipeline.model_cpu_offload_seq" in lazy.report["use_order_source"]
        images, calls = _calls(lazy, run_sd3_pipeline)
        assert all(torch.equal(img, reference) for img in images)
        # Call 1 by the derived order (nothing counted yet), call 2 by the counts.
        assert all(_one_at_a_time(call, SD3) for call in calls), calls
        _assert_deferred_warm(lazy, SD3)
        assert lazy.reports["transformer"].streamed_blocks == 0  # no device: resident, no DLO
        assert lazy.reports["transformer"].outcomes == ["CANONICAL_FALLBACK", "LOCAL_HIT"]
        assert all(r.deferred for r in lazy.reports.values())  # no state change refused: hooks, flags
    logged = [r.getMessage() for r in caplog.records if r.name == "dlo_runtime.lazy.build"]
    assert any("deferred ['text_encoder', 'text_encoder_2', 'text_encoder_3', 'transformer', 'vae']" in m
               for m in logged), logged
    assert sum(": text_encoder_3 deferred: in the use order" in m for m in logged) == 1


def test_sd3_with_cfg_reloads_the_clip_encoders_once_then_follows_the_counts(sd3_dir, hwrd):
    """CFG encodes the negative prompt after the positive one (CLIP, CLIP,
    T5, CLIP, CLIP, T5): the offload string's order is too early for the CLIP
    encoders on call 1; they reload (counted, noted), and call 2 reloads
    nothing."""
    from diffusers import StableDiffusion3Pipeline

    def cfg(pipe):
        return run_sd3_pipeline(pipe, guidance_scale=3.0)

    reference = cfg(StableDiffusion3Pipeline.from_pretrained(sd3_dir, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(sd3_dir, socket=hwrd.socket) as lazy:
        images, calls = _calls(lazy, cfg)
        assert all(torch.equal(img, reference) for img in images)
        for name in ("text_encoder", "text_encoder_2"):
            r = lazy.reports[name]
            assert r.unplanned_reloads == 1 and r.loads == 3 and r.uses_per_call == 2, (name, r)
            assert any("declared release dropped" in n for n in r.notes)
        assert all(r.unplanned_reloads == 0 for n, r in lazy.reports.items() if n not in ("text_encoder",
                                                                                            "text_encoder_2"))
        second = [w for _, w, _ in calls[1]]
        assert second.count("load text_encoder") == 1 and second.index("release text_encoder_3") < second.index(
            "load transformer")
        sizes = [r.resident_bytes for r in lazy.reports.values()]
        assert lazy.peak_component_bytes < sum(sizes)


def test_wan_defers_from_its_offload_seq_without_the_absent_second_transformer(wan_dir, hwrd):
    from diffusers import WanPipeline

    reference = run_wan_pipeline(WanPipeline.from_pretrained(wan_dir, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(wan_dir, socket=hwrd.socket) as lazy:
        assert lazy.report["use_order"] == list(WAN) and "transformer_2" not in lazy.reports
        images, calls = _calls(lazy, run_wan_pipeline)
        assert all(torch.equal(img, reference) for img in images)
        assert all(_one_at_a_time(call, WAN) for call in calls), calls
        _assert_deferred_warm(lazy, WAN)
        assert all(r.deferred for r in lazy.reports.values())


def test_a_component_whose_state_a_method_changed_is_kept_resident(wan_dir, hwrd):
    """``vae.enable_tiling()`` sets a flag a reload would drop: the VAE is
    refused for deferral at its release and kept, so later calls tile too."""
    from diffusers import WanPipeline

    library = WanPipeline.from_pretrained(wan_dir, dtype=torch.bfloat16)
    library.vae.enable_tiling()
    reference = run_wan_pipeline(library)
    with dlo_runtime.lazy_pipeline(wan_dir, socket=hwrd.socket) as lazy:
        lazy.pipe.vae.enable_tiling()
        images, _ = _calls(lazy, run_wan_pipeline)
        vae = lazy.reports["vae"]
        assert not vae.deferred and "use_tiling: False -> True" in vae.why, vae.why
        assert vae.loads == 1 and lazy.components["vae"].is_loaded and lazy.components["vae"].use_tiling
        assert lazy.reports["transformer"].deferred and lazy.reports["transformer"].loads == 2
        assert all(torch.equal(img, reference) for img in images)


def test_clip_encoders_saved_in_fp32_defer_at_bf16(hwrd, tmp_path):
    """CLIPTextModelWithProjection saved in fp32, run in bf16: its text model
    is built by a nested ``_from_config``, which takes the dtype on its
    sub-config; the skeleton sets the requested dtype on every sub-config as
    transformers' from_pretrained does, so the encoders defer like the rest
    and the images equal the library's."""
    from diffusers import StableDiffusion3Pipeline

    fp32 = save_sd3_pipeline(str(tmp_path / "pipe"))
    reference = run_sd3_pipeline(StableDiffusion3Pipeline.from_pretrained(fp32, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(fp32, socket=hwrd.socket) as lazy:
        deferred = sorted(n for n, r in lazy.reports.items() if r.deferred)
        assert deferred == ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"], lazy.reports
        assert torch.equal(run_sd3_pipeline(lazy.pipe), reference)


# -- DLO on the CPU: device="cpu" ----------------------------------------------------------------


def test_device_cpu_streams_with_dlo_and_releases_cleanly(hwrd, tmp_path):
    """The reported case: transformer + VAE, text encoders None, prompt
    embeddings given, ``device="cpu"``: DLO streams the blocks, releases
    close the backend before the tensors go to meta, and the images equal
    the library's."""
    from diffusers import FluxPipeline

    flux = save_flux_pipeline(str(tmp_path / "flux"))
    none = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)

    def run(pipe):
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            return pipe(prompt_embeds=torch.randn(1, 12, 32, generator=g).to(torch.bfloat16),
                        pooled_prompt_embeds=torch.randn(1, 32, generator=g).to(torch.bfloat16), height=16, width=16,
                        num_inference_steps=2, guidance_scale=3.5, generator=torch.Generator().manual_seed(0),
                        output_type="pt").images

    reference = run(FluxPipeline.from_pretrained(flux, dtype=torch.bfloat16, **none))
    with dlo_runtime.lazy_pipeline(flux, components=("transformer", "vae"), dtype="bfloat16", device="cpu",
                                   socket=hwrd.socket, **none) as lazy:
        assert lazy.decision.offload and lazy.decision.device == "cpu"
        images, calls = _calls(lazy, run)
        assert all(torch.equal(img, reference) for img in images)
        assert all(_one_at_a_time(call, ("transformer", "vae")) for call in calls), calls
        _assert_deferred_warm(lazy, ("transformer", "vae"))
        assert "DLO streams blocks" in lazy.reports["transformer"].plan
        assert lazy.reports["transformer"].streamed_blocks == 4  # 2 double + 2 single blocks, each reload
        assert lazy.reports["text_encoder"].why == "loads normally: passed by the caller (pipeline_kwargs)"


def test_sd3_on_device_cpu_defers_through_dlo(sd3_dir, hwrd):
    from diffusers import StableDiffusion3Pipeline

    reference = run_sd3_pipeline(StableDiffusion3Pipeline.from_pretrained(sd3_dir, dtype=torch.bfloat16))
    with dlo_runtime.lazy_pipeline(sd3_dir, device="cpu", socket=hwrd.socket) as lazy:
        images, calls = _calls(lazy, run_sd3_pipeline)
        assert all(torch.equal(img, reference) for img in images)
        assert all(_one_at_a_time(call, SD3) for call in calls), calls
        _assert_deferred_warm(lazy, SD3)
        assert lazy.reports["transformer"].streamed_blocks == 2  # DLO streams both blocks
