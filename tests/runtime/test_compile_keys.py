"""The compile switch and the compile artifact's key, without compiling:
what ``compile=`` accepts, that every part of the key changes the key
(option, toolchain, device, shapes, grad mode, model source) and nothing
else does, and what ``hwr_client.core.compile_link`` reads back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlo_runtime.compile import ModelSource, parse_compile, per_component, settings_for_pretrained
from dlo_runtime.compile.key import (compile_identity, device_document, device_of, inductor_config_digest,
                                     input_document, toolchain)
from dlo_runtime.compile.settings import CompileSettings
from hwr_client.core.compile_link import device_matches, is_compile, target_of
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity
from tests.conftest import SAMPLE_IDENTITY

WEIGHTS = "ab" * 32
SOURCE = ModelSource(name="transformers:LlamaForCausalLM", dtype="float32", weights_key=WEIGHTS,
                     library_version="4.0")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: int = 1) -> torch.Tensor:
        return self.lin(x) * scale


def key(settings: CompileSettings | None = None, *, source: ModelSource = SOURCE, tools: dict | None = None,
        x: torch.Tensor | None = None, device: dict | None = None, **kwargs) -> str:
    settings = settings or CompileSettings()
    model = Tiny()
    args = (torch.zeros(2, 3, 4) if x is None else x,)
    inputs = input_document(model, args, kwargs, dynamic=settings.dynamic)
    return compile_identity(source, settings, tools=tools or toolchain(),
                            device=device or device_document(device_of(model, args, kwargs)), inputs=inputs,
                            inductor_config=inductor_config_digest()).key


# -- the switch -----------------------------------------------------------------------


def test_parse_compile_accepts_torch_compile_arguments():
    assert parse_compile(False) is None and parse_compile(None) is None
    assert parse_compile(True) == CompileSettings()
    s = parse_compile({"mode": "max-autotune-no-cudagraphs", "fullgraph": True, "dynamic": False})
    assert s is not None and s.torch_kwargs() == {"backend": "inductor", "fullgraph": True, "dynamic": False,
                                                   "mode": "max-autotune-no-cudagraphs"}
    s = parse_compile({"options": {"epilogue_fusion": False, "max_fusion_size": 32}})
    assert s is not None and s.torch_kwargs()["options"] == {"epilogue_fusion": False, "max_fusion_size": 32}
    assert parse_compile({"backend": "eager"}).cached is False  # type: ignore[union-attr]


@pytest.mark.parametrize("value, words", [
    ({"fullgrpah": True}, "unknown torch.compile argument"),
    ({"backend": lambda gm, inputs: gm}, "callable backend"),
    ({"mode": "default", "options": {"a": 1}}, "not both"),
    ({"options": {"pass": object()}}, "not plain data"),
    ({"options": {"x": float("nan")}}, "finite"),
    ({"dynamic": "yes"}, "True, False or None"),
    ("max-autotune", "expected True, False or a dict"),
])
def test_parse_compile_refuses_what_no_key_can_hold(value, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_compile(value)


def test_per_component_applies_to_all_or_names_each():
    names = ["transformer", "text_encoder"]
    assert per_component(None, names) == {}
    assert set(per_component(True, names)) == set(names)
    assert per_component({"dynamic": False}, names)["text_encoder"].dynamic is False
    only = per_component({"transformer": {"fullgraph": True}}, names)
    assert list(only) == ["transformer"] and only["transformer"].fullgraph
    with pytest.raises(InvalidArgument, match="mixes"):
        per_component({"transformer": True, "dynamic": False}, names)
    with pytest.raises(InvalidArgument, match="not loaded lazily"):
        per_component({"vae": True}, names)


def test_compile_with_layerwise_offload_is_refused_before_loading():
    with pytest.raises(InvalidArgument, match="layerwise offload"):
        settings_for_pretrained(True, device="cpu")
    assert settings_for_pretrained(False, device="cpu") is None


# -- the key --------------------------------------------------------------------------


def test_same_inputs_same_key():
    assert key() == key()


def test_each_compile_option_is_part_of_the_key():
    keys = {key(), key(CompileSettings(dynamic=False)), key(CompileSettings(fullgraph=True)),
            key(CompileSettings(mode="max-autotune")), key(CompileSettings(options={"epilogue_fusion": False})),
            key(CompileSettings(options={"epilogue_fusion": True}))}
    assert len(keys) == 6


def test_toolchain_versions_and_install_paths_are_part_of_the_key():
    base = toolchain()
    assert set(base) == {"torch", "triton", "python", "cxx", "torch_dir", "python_include"}
    changed = [{**base, field: base[field] + "x"} for field in base]
    assert len({key(tools=base), *(key(tools=t) for t in changed)}) == len(base) + 1


def test_device_kind_and_capability_are_part_of_the_key():
    cpu = device_document(torch.device("cpu"))
    assert cpu["kind"] == "cpu" and cpu["capability"] == torch.backends.cpu.get_cpu_capability().lower()
    other_isa = {**cpu, "capability": "avx2" if cpu["capability"] != "avx2" else "default"}
    h100 = {"kind": "cuda", "capability": "9.0", "name": "NVIDIA H100", "runtime": "cuda 12.8"}
    a100 = {**h100, "capability": "8.0", "name": "NVIDIA A100"}
    assert len({key(device=cpu), key(device=other_isa), key(device=h100), key(device=a100)}) == 4


def test_shapes_dtypes_scalars_and_grad_mode_are_part_of_the_key():
    base = key()
    assert key(x=torch.zeros(3, 3, 4)) != base
    assert key(x=torch.zeros(2, 3, 4, dtype=torch.bfloat16)) != base
    assert key(scale=2) != key(scale=3)
    with torch.no_grad():
        assert key() != base


def test_dynamic_shapes_key_on_rank_and_the_sizes_torch_specializes():
    dyn = CompileSettings(dynamic=True)
    assert key(dyn, x=torch.zeros(2, 3, 4)) == key(dyn, x=torch.zeros(5, 3, 4))
    assert key(dyn, x=torch.zeros(1, 3, 4)) != key(dyn, x=torch.zeros(5, 3, 4))  # 0 and 1 are specialized
    assert key(dyn, x=torch.zeros(2, 3)) != key(dyn, x=torch.zeros(2, 3, 4))


def test_model_source_weights_or_config_is_part_of_the_key():
    by_config = ModelSource(name=SOURCE.name, dtype="float32", config_sha256="cd" * 32)
    other_weights = ModelSource(name=SOURCE.name, dtype="float32", weights_key="ef" * 32)
    assert len({key(), key(source=by_config), key(source=other_weights)}) == 3
    with pytest.raises(InvalidArgument, match="weights_key or config_sha256"):
        ModelSource(name="x", dtype="float32")
    with pytest.raises(InvalidArgument, match="identity key"):
        ModelSource(name="x", dtype="float32", weights_key="not hex")


def test_inductor_global_config_is_part_of_the_key(monkeypatch):
    import torch._inductor.config as inductor_config

    before = key()
    monkeypatch.setattr(inductor_config, "epilogue_fusion", not inductor_config.epilogue_fusion)
    assert key() != before


# -- what the store reads back --------------------------------------------------------


def _identity(source: ModelSource, device: dict) -> Identity:
    model = Tiny()
    return compile_identity(source, CompileSettings(), tools=toolchain(), device=device,
                            inputs=input_document(model, (torch.zeros(1, 4),), {}, dynamic=None),
                            inductor_config="x")


def test_compile_link_reads_what_an_artifact_belongs_to():
    ident = _identity(SOURCE, {"kind": "cuda", "capability": "9.0", "name": "H200", "runtime": ""})
    target = target_of(ident)
    assert is_compile(ident) and target is not None
    assert (target.weights_key, target.config_id, target.model, target.device) == \
        (WEIGHTS, "", "transformers:LlamaForCausalLM", "cuda:9.0")
    assert "weights abababababababab" in target.describe()
    by_config = target_of(_identity(ModelSource(name="m:M", dtype="float32", config_sha256="cd" * 32),
                                    device_document(torch.device("cpu"))))
    assert by_config is not None and by_config.weights_key == "" and by_config.config_id == "sha256:" + "cd" * 32
    assert target_of(Identity.from_dict(SAMPLE_IDENTITY)) is None  # a weight artifact


def test_device_patterns():
    assert device_matches("cuda:9.0", ["*"]) and device_matches("cuda:9.0", ["cuda"])
    assert device_matches("cuda:9.0", ["cuda:9.0"]) and not device_matches("cuda:9.0", ["cuda:8.0", "cpu"])
    assert device_matches("cpu:avx512", ["cpu"]) and not device_matches("cpu:avx512", [])
