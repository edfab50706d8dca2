"""Bad model directories through :func:`dlo_runtime.from_pretrained`: each a
clear error naming the file / key and the expectation, nothing published, no
staging left in the daemon's root."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

import dlo_runtime  # noqa: E402
from dlo_runtime.pretrained import PretrainedContract, check_loaded, model_files, resolve_class  # noqa: E402
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import save_model  # noqa: E402
from tests.support.paths import REPO_DIR


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny BERT and a tiny FLUX, saved once; tests copy them to break them."""
    base = tmp_path_factory.mktemp("good")
    return {"bert": save_model("bert", str(base / "bert")), "flux": save_model("flux", str(base / "flux"))}


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


def broken_copy(src: str, dst: str, edit) -> str:
    """A copy of ``src`` whose first shard is rewritten by ``edit(tensors)``."""
    shutil.copytree(src, dst)
    files = model_files(dst)
    first = sorted(files.weights)[0]
    tensors = load_file(first)
    edit(tensors)
    save_file(tensors, first, metadata={"format": "pt"})
    return dst


def assert_nothing_left(d, directory: str) -> None:
    files = model_files(directory)
    key = PretrainedContract(files, resolve_class(files)).identity(directory).key
    with d.client() as client:
        with pytest.raises(NotFound):
            client.lookup(key)
    staging = os.path.join(d.root, "staging")
    assert not os.path.isdir(staging) or os.listdir(staging) == []


def test_directory_without_config_or_weights(tmp_path, good):
    no_config = tmp_path / "no_config"
    shutil.copytree(good["bert"], no_config)
    os.remove(no_config / "config.json")
    with pytest.raises(NotFound, match="no config.json"):
        dlo_runtime.from_pretrained(str(no_config), mode="disabled")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(good["bert"], "config.json"), no_weights)
    with pytest.raises(NotFound, match=r"no weights; expected model\.safetensors or "):
        dlo_runtime.from_pretrained(str(no_weights))
    with pytest.raises(NotFound, match="no such directory"):
        dlo_runtime.from_pretrained(str(tmp_path / "nowhere"))


def test_class_the_library_does_not_have(tmp_path, good):
    d = tmp_path / "unknown"
    shutil.copytree(good["flux"], d)
    doc = json.loads((d / "config.json").read_text())
    doc["_class_name"] = "NoSuchTransformer2DModel"
    (d / "config.json").write_text(json.dumps(doc))
    with pytest.raises(InvalidArgument, match=r"class 'NoSuchTransformer2DModel' is not in the installed diffusers"):
        dlo_runtime.from_pretrained(str(d))


def test_missing_library_names_the_extra(good, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(FailedPrecondition, match=r"pip install 'hwr\[transformers\]'"):
        dlo_runtime.from_pretrained(good["bert"])


def _drop_one(tensors):
    del tensors[sorted(tensors)[0]]


def _reshape_one(tensors):
    name = next(n for n in sorted(tensors) if tensors[n].dim() == 2)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])


@pytest.mark.parametrize("mode", ["preferred", "required"])
def test_checkpoint_that_does_not_fit_the_class(mode, tmp_path, good, hwrd):
    """A shape mismatch fails in every mode, as the library's own load does,
    before any daemon call and naming the shard, the key and both shapes."""
    directory = broken_copy(good["bert"], str(tmp_path / "broken"), _reshape_one)
    with pytest.raises(FailedPrecondition, match=r"model-00001-of-\d+\.safetensors: '.+' has shape \[\d+, \d+\], "
                                                  r"transformers:BertModel expects"):
        dlo_runtime.from_pretrained(directory, socket=hwrd.socket, mode=mode, progress=False)
    assert_nothing_left(hwrd, directory)


def test_a_checkpoint_lacking_a_tensor_is_not_published(tmp_path, good, hwrd):
    """The library initializes a tensor the checkpoint lacks; HWR does not
    publish such bytes: required names the tensor, preferred loads with the
    library (tests/runtime/test_real_models_fallback.py) and nothing is published."""
    directory = broken_copy(good["bert"], str(tmp_path / "broken"), _drop_one)
    with pytest.raises(FailedPrecondition, match=r"lacks 1 tensor\(s\) of transformers:BertModel that the library "
                                                  r"would initialize freshly \(e\.g\. '.+' \["):
        dlo_runtime.from_pretrained(directory, socket=hwrd.socket, mode="required", progress=False)
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, progress=False) as loaded:
        assert loaded.outcome == "DISABLED" and loaded.key == ""
    assert_nothing_left(hwrd, directory)


def test_block_names_and_meta_leftovers_are_named(good):
    with pytest.raises(InvalidArgument, match="'nope' is not a submodule of BertModel"):
        dlo_runtime.from_pretrained(good["bert"], mode="disabled", blocks=["nope"], device="cpu")
    with dlo_runtime.from_pretrained(good["bert"], mode="disabled", blocks=["encoder.layer.0"], device="cpu") as few:
        assert few.report.blocks == ["encoder.layer.0"] and few.report.streamed_fraction < 0.5
        assert any("under half" in n for n in few.report.notes)

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("table", torch.empty(4, device="meta"), persistent=False)

    with pytest.raises(FailedPrecondition, match=r"non-persistent buffers \['table'\] are on meta"):
        check_loaded(Half(), "half")
    with pytest.raises(InvalidArgument, match="fuse_qkv_projections"):
        files = model_files(good["bert"])
        PretrainedContract(files, resolve_class(files), fuse_qkv=True)


def test_the_runtime_imports_no_model_library_until_a_load():
    import subprocess

    code = ("import dlo_runtime, dlo_runtime.pretrained, sys\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'accelerate')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_DIR).stdout
    assert out.strip() == "[]"


def test_model_class_overrides_the_config_and_must_have_from_config(good):
    from transformers import BertModel

    with dlo_runtime.from_pretrained(good["bert"], model_class=BertModel, mode="disabled") as loaded:
        assert type(loaded.model) is BertModel and loaded.report.contract == "transformers:BertModel"
    with pytest.raises(InvalidArgument, match="expected a class with from_config"):
        dlo_runtime.from_pretrained(good["bert"], model_class=object, mode="disabled")


def test_block_groups_with_an_explicit_prefix():
    from hwr_client.tensors import build_plan
    from tests.conftest import identity

    names = ["enc.block.0.layer.0.w", "enc.block.0.layer.1.w"]
    tensors = {n: torch.zeros(2) for n in names + ["head.w"]}
    # The names' common prefix is the layer list, not the block the backend streams.
    assert build_plan(identity(t="a"), tensors, blocks=[names]).blocks[0].prefix == "enc.block.0.layer."
    assert build_plan(identity(t="a"), tensors, blocks=[("enc.block.0.", names)]).blocks[0].prefix == "enc.block.0."
    with pytest.raises(InvalidArgument, match="must end in '.' and prefix every tensor"):
        build_plan(identity(t="a"), tensors, blocks=[("enc.block.1.", names)])
