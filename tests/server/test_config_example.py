"""deploy/hwr.toml.example against ServerConfig: the file is what the
generator writes, holds every key and no other, and loads to the defaults
(the [remote] table too, uncommented); the generator follows fields added to
the class and refuses an undocumented one."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib

import pytest

from hwr_client.core.defaults import default_paths
from hwr_server.config import RemoteConfig, ServerConfig
from hwr_server.config_example import SYSTEM_PATH_FIELDS, UndocumentedField, field_docs, render
from tests.support.paths import REPO_DIR

EXAMPLE = f"{REPO_DIR}/deploy/hwr.toml.example"
REGENERATE = "regenerate it: python -m hwr_server.config_example > deploy/hwr.toml.example"


def _text() -> str:
    with open(EXAMPLE) as f:
        return f.read()


def _uncommented(text: str, table: str) -> str:
    """``text`` with the commented ``[table]`` block made live, as an
    operator would: one ``# `` removed from each line from ``# [table]`` on."""
    head, sep, tail = text.partition(f"# [{table}]\n")
    assert sep, f"no commented [{table}] table"
    return head + f"[{table}]\n" + "\n".join(re.sub(r"^# ", "", ln) for ln in tail.split("\n"))


def _expected() -> ServerConfig:
    """The defaults, with the path fields as a daemon run as root fills them."""
    return dataclasses.replace(ServerConfig(), **dict(zip(SYSTEM_PATH_FIELDS, default_paths(uid=0, env={}))))


def test_example_is_what_the_generator_writes():
    assert _text() == render(), f"deploy/hwr.toml.example differs from ServerConfig's docs: {REGENERATE}"


def test_generator_command_prints_the_example():
    out = subprocess.run([sys.executable, "-m", "hwr_server.config_example"], capture_output=True, text=True,
                         cwd=REPO_DIR, timeout=120)
    assert out.returncode == 0 and out.stdout == _text(), out.stderr


def test_example_has_every_key_and_no_other():
    doc = tomllib.loads(_uncommented(_text(), "remote"))
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(doc) == fields, f"missing {sorted(fields - set(doc))}, extra {sorted(set(doc) - fields)}; {REGENERATE}"
    remote = {f.name for f in dataclasses.fields(RemoteConfig)}
    assert set(doc["remote"]) == remote, f"[remote] missing {sorted(remote - set(doc['remote']))}, " \
                                         f"extra {sorted(set(doc['remote']) - remote)}"
    # Commented, the table is not there: the example runs without a registry.
    assert "remote" not in tomllib.loads(_text())


def test_example_loads_to_the_defaults(tmp_path):
    loaded = ServerConfig.from_file(EXAMPLE).validate()
    assert loaded == _expected(), REGENERATE
    assert loaded.remote == RemoteConfig()
    # What the systemd unit's daemon (user hwr) runs with: the paths it
    # serves and the unit's StateDirectory / RuntimeDirectory, not its
    # user's home.
    assert (loaded.root, loaded.socket, loaded.admin_socket) == ("/var/lib/hwr", "/run/hwr/hwr.sock",
                                                                 "/run/hwr/admin.sock")
    live = tmp_path / "remote.toml"
    live.write_text(_uncommented(_text(), "remote"))
    with_remote = ServerConfig.from_file(str(live)).validate()
    assert with_remote == _expected() and with_remote.remote == RemoteConfig()


def test_a_changed_default_is_caught(tmp_path):
    # The check above must be able to fail: an example with one stale value.
    stale = tmp_path / "stale.toml"
    stale.write_text(_text().replace("\ngc_interval_s = 30.0\n", "\ngc_interval_s = 31.0\n"))
    assert ServerConfig.from_file(str(stale)) != _expected()
    assert stale.read_text() != render()


def test_every_field_has_its_doc_and_group():
    docs = {d.name: d for d in field_docs(ServerConfig)}
    assert list(docs) == [f.name for f in dataclasses.fields(ServerConfig)]
    assert docs["capacity"].group == "capacity and garbage collection"
    assert docs["max_artifact_tensors"].note.startswith("Checked at plan")
    assert "socket_group" in docs["socket"].doc
    text = _text()
    # A doc is in the file right above its key; sizes are written in units.
    assert "# Background scrub: re-hash unleased artifacts" in text and "\nmax_chunk_bytes = \"4MiB\"\n" in text
    assert "\n# min_rate_bytes = \"64KiB\"\n" in text


@dataclasses.dataclass
class _Extended(ServerConfig):
    # -- a group another engineer added --
    # It explains itself.
    #: A new knob, in widgets. Default 3.
    widgets: int = 3
    #: A size.
    spare_bytes: int = 2 * 1024 * 1024


@dataclasses.dataclass
class _Undocumented(ServerConfig):
    forgotten: int = 1


def test_generator_takes_a_field_added_to_the_class(tmp_path):
    text = render(_Extended)
    assert "# ---- a group another engineer added ----\n# It explains itself.\n" in text
    assert "# A new knob, in widgets. Default 3.\nwidgets = 3\n" in text
    assert "spare_bytes = \"2MiB\"" in text
    path = tmp_path / "extended.toml"
    path.write_text(text)
    loaded = _Extended.from_file(str(path))
    assert loaded.widgets == 3 and loaded.spare_bytes == 2 * 1024 * 1024 and loaded.capacity == 0


def test_an_undocumented_field_is_refused():
    with pytest.raises(UndocumentedField, match="_Undocumented.forgotten: no `#:` comment"):
        render(_Undocumented)
