"""A Hugging Face hub id where HWR wants a local directory: from_pretrained,
lazy_pipeline and `hwr prewarm --model` say that HWR loads local directories
and name the local snapshot when a hub cache (a fake one under tmp_path,
HF_HOME pointing at it, huggingface_hub's layout) holds it; the named
snapshot then loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dlo_runtime
from dlo_runtime.pretrained.hub import hub_cache_dir, hub_snapshot
from hwr_client.core.errors import NotFound
from tests.support.paths import REPO_DIR
from tests.support.real_models import save_model

HUB_ID = "black-forest-labs/FLUX.1-dev"


def _cache_model(hf_home, repo_id: str, revision: str = "0123abcd") -> str:
    """A hub cache entry as huggingface_hub writes one: refs/main naming the
    revision, the files under snapshots/<revision>."""
    folder = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True)
    return str(snapshot)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no folder named like the hub id under the cwd
    return home


def test_from_pretrained_names_the_cached_snapshot_and_it_loads(hf_home):
    snapshot = save_model("bert", _cache_model(hf_home, HUB_ID))
    with pytest.raises(NotFound) as info:
        dlo_runtime.from_pretrained(HUB_ID, mode="disabled")
    assert str(info.value) == (f"model directory {HUB_ID}: no such directory. HWR loads local directories only "
                               f"and never downloads; this hub id is in the local hub cache: pass its snapshot "
                               f"{snapshot}")
    # Following the advice works.
    with dlo_runtime.from_pretrained(snapshot, mode="disabled") as loaded:
        assert loaded.outcome == "DISABLED"
        assert type(loaded.model).__name__ == "BertModel"


def test_uncached_hub_id_says_how_to_get_it(hf_home):
    with pytest.raises(NotFound) as info:
        dlo_runtime.from_pretrained("org/not-cached", subfolder="transformer", mode="disabled")
    text = str(info.value)
    assert text.startswith("model directory org/not-cached: no such directory. HWR loads local directories only")
    assert "`hf download org/not-cached`" in text
    assert f"{hf_home}/hub/models--org--not-cached/snapshots/<revision>" in text


def test_a_missing_path_that_is_no_hub_id_stays_plain(hf_home, tmp_path):
    for path in (str(tmp_path / "nowhere"), "./nowhere/model"):
        with pytest.raises(NotFound, match=r"no such directory$"):
            dlo_runtime.from_pretrained(path, mode="disabled")


def test_lazy_pipeline_names_the_snapshot(hf_home):
    snapshot = _cache_model(hf_home, "stabilityai/stable-diffusion-3-medium-diffusers", revision="feed")
    with pytest.raises(NotFound) as info:
        dlo_runtime.lazy_pipeline("stabilityai/stable-diffusion-3-medium-diffusers")
    assert str(info.value).startswith("pipeline directory stabilityai/stable-diffusion-3-medium-diffusers: no such "
                                      "directory. HWR loads local directories only")
    assert str(info.value).endswith(f"pass its snapshot {snapshot}")


def test_hwr_prewarm_model_hub_id(hf_home, tmp_path):
    snapshot = _cache_model(hf_home, HUB_ID)
    env = dict(os.environ, PYTHONPATH=REPO_DIR, HF_HOME=str(hf_home))
    out = subprocess.run([sys.executable, "-m", "hwr_client.cli", "prewarm", "--model", HUB_ID,
                          "--socket", str(tmp_path / "none.sock")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 3, out.stderr
    assert out.stderr.splitlines()[-1] == (f"hwr prewarm: NotFound: model directory {HUB_ID}: no such directory. "
                                           "HWR loads local directories only and never downloads; this hub id is in "
                                           f"the local hub cache: pass its snapshot {snapshot}")


def test_cache_location_follows_huggingface_hub(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == "/a"
    assert hub_cache_dir({"HF_HOME": "/b"}) == "/b/hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"}) == "/c/huggingface/hub"
    assert hub_cache_dir({}) == os.path.expanduser("~/.cache/huggingface/hub")
    # Without refs/main: the newest snapshot.
    folder = tmp_path / "hub" / "models--o--n" / "snapshots"
    for i, rev in enumerate(("old", "new")):
        (folder / rev).mkdir(parents=True)
        os.utime(folder / rev, (1000 + i, 1000 + i))
    assert hub_snapshot("o/n", {"HF_HUB_CACHE": str(tmp_path / "hub")}) == str(folder / "new")
    assert hub_snapshot("o/absent", {"HF_HUB_CACHE": str(tmp_path / "hub")}) is None
