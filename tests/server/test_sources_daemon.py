"""Source identity against the REAL daemon (``hwr serve --source-root``):
ResolveSources, local fallback, the ``hwr sources`` CLI, build_identity."""

from __future__ import annotations

import json
import os
import threading

import pytest

import hwr_client
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli import main as cli_main
from hwr_client.core.errors import InvalidArgument, NotFound, PermissionDenied
from hwr_client.core.identity import Identity
from hwr_client.sources import build_identity, resolve_sources
from tests.support.sources import settle, sha, write

LAYOUT = {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"}
KW = dict(contract={"name": "tiny-dit", "version": 1}, layout=LAYOUT, representation={"dtype": "bfloat16"},
          producer={"id": "test", "version": "1"})


def stats(client) -> dict:
    return json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def served(make_daemon_fixture, src):
    return make_daemon_fixture("--source-root", str(src))


def test_cold_warm_and_restart(served, src):
    data = os.urandom(1 << 20)
    path = write(src / "model.safetensors", data)
    settle(path)
    with served.client() as client:
        cold, = client.resolve_sources([path])
        warm, = client.resolve_sources([path])
        assert (cold.content_id, cold.size, cold.cached, cold.origin) == (sha(data), len(data), False, "hashed")
        assert (warm.content_id, warm.cached, warm.origin) == (sha(data), True, "cache")
        s = stats(client)
        assert s["hwr_source_cache_hits_total"] == 1 and s["hwr_source_cache_misses_total"] == 1
    served.restart()
    with served.client() as client:
        assert client.resolve_sources([path])[0].origin == "cache"


def test_eight_concurrent_clients_one_hash(served, src):
    size = 256 * 1024 * 1024
    path = str(src / "big.safetensors")
    with open(path, "wb") as f:
        block = bytes(range(256)) * 4096
        for _ in range(size // len(block)):
            f.write(block)
    barrier = threading.Barrier(8)
    results: list = [None] * 8

    def call(i: int) -> None:
        with served.client() as client:  # eight processes' worth of channels
            barrier.wait()
            results[i] = client.resolve_sources([path])[0].content_id

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(set(results)) == 1 and results[0].startswith("sha256:")
    with served.client() as client:
        s = stats(client)
    assert s["hwr_source_hash_calls_total"] == 1 and s["hwr_source_hashed_bytes_total"] == size


def test_outside_roots_falls_back_to_local_hashing(served, src, tmp_path):
    inside = write(src / "in.bin", b"inside")
    outside = write(tmp_path / "other" / "out.bin", b"outside")
    with served.client() as client:
        with pytest.raises(PermissionDenied, match=f"source {outside}: outside the daemon's source roots"):
            client.call(client.runtime.ResolveSources, pb.ResolveSourcesRequest(paths=[outside]))
        out = client.resolve_sources([inside, outside])
    assert [(d.content_id, d.origin) for d in out] == [(sha(b"inside"), "hashed"), (sha(b"outside"), "local")]
    os.symlink(outside, src / "escape.bin")
    with served.client() as client:
        with pytest.raises(PermissionDenied, match="resolves to .* outside every source root"):
            client.call(client.runtime.ResolveSources, pb.ResolveSourcesRequest(paths=[str(src / "escape.bin")]))
        assert client.resolve_sources([str(src / "escape.bin")])[0].origin == "local"


def test_daemon_unavailable_falls_back(tmp_path, src):
    path = write(src / "a.bin", b"abc")
    with hwr_client.connect(str(tmp_path / "no-daemon.sock")) as client:
        (d,) = resolve_sources(client, [path])
    assert (d.content_id, d.cached, d.origin) == (sha(b"abc"), False, "local")


def test_clear_errors_through_the_daemon(served, src):
    (src / "dir").mkdir()
    os.mkfifo(src / "pipe")
    with served.client() as client:
        with pytest.raises(InvalidArgument, match="is a directory"):
            client.resolve_sources([str(src / "dir")])
        with pytest.raises(InvalidArgument, match="is a FIFO"):
            client.resolve_sources([str(src / "pipe")])
        with pytest.raises(NotFound, match=f"source {src}/missing.bin: no such file"):
            client.resolve_sources([str(src / "missing.bin")])


def test_cli_resolve_list_forget(served, src, monkeypatch, capsys):
    path = write(src / "m.safetensors", b"m" * 1000)
    settle(path)
    first = served.cli("sources", "resolve", path, "--json", check=True)  # the real `hwr` process once
    one, = json.loads(first.stdout)
    assert (one["content_id"], one["size"], one["cached"]) == (sha(b"m" * 1000), 1000, False)
    monkeypatch.setenv("HWR_SOCKET", served.socket)
    monkeypatch.setenv("HWR_ADMIN_SOCKET", served.admin_socket)

    def hwr(*args: str) -> str:
        capsys.readouterr()
        assert cli_main(list(args)) == 0
        return capsys.readouterr().out

    two, = json.loads(hwr("sources", "resolve", path, "--json"))
    assert (two["content_id"], two["cached"], two["origin"]) == (sha(b"m" * 1000), True, "cache")
    listed = json.loads(hwr("sources", "--json"))
    assert [(r["path"], r["content_id"], r["size"]) for r in listed] == [(path, sha(b"m" * 1000), 1000)]
    assert path in hwr("sources")
    assert "record dropped" in hwr("sources", "forget", path)
    assert "no record" in hwr("sources", "forget", path)
    assert json.loads(hwr("sources", "--json")) == []
    human = hwr("sources", "resolve", path)
    assert sha(b"m" * 1000) in human and "hashed" in human


def test_forget_needs_the_admin_socket(served, src):
    with served.client() as client:
        with pytest.raises(PermissionDenied, match="admin socket"):
            client.call(client.reader.ForgetSource, pb.ForgetSourceRequest(path=str(src / "x")))
        assert client.call(client.admin.ForgetSource, pb.ForgetSourceRequest(path=str(src / "x"))).forgotten is False


def test_source_roots_from_config_file(make_daemon_fixture, src, tmp_path):
    path = write(src / "a.bin", b"cfg")
    config = tmp_path / "hwr.toml"
    config.write_text(f"source_roots = [{json.dumps(str(src))}]\n")
    d = make_daemon_fixture("--config", str(config))
    with d.client() as client:
        assert client.resolve_sources([path])[0].origin == "hashed"


def _checkpoint(src):
    ckpt = src / "ckpt"
    write(ckpt / "diffusion_pytorch_model.safetensors", b"w" * 4096)
    write(ckpt / "config.json", b'{"hidden": 16}')
    write(ckpt / "sub" / "part.safetensors", b"p" * 100)
    write(ckpt / "README.md", b"not byte-relevant")
    write(ckpt / ".cache" / "huggingface" / "x.json", b"download metadata")
    return ckpt


def test_build_identity_same_key_with_and_without_daemon(served, src, tmp_path, monkeypatch):
    ckpt = _checkpoint(src)
    with served.client() as client:
        via_daemon = build_identity(sources=str(ckpt), client=client, **KW)
    monkeypatch.setenv("HWR_SOCKET", str(tmp_path / "nowhere.sock"))
    local = build_identity(sources=ckpt, **KW)  # client=None: default socket, no daemon there
    expected = Identity.from_dict({
        **KW, "extra": {},
        "sources": [{"name": "config.json", "content_id": sha(b'{"hidden": 16}')},
                    {"name": "diffusion_pytorch_model.safetensors", "content_id": sha(b"w" * 4096)},
                    {"name": "sub/part.safetensors", "content_id": sha(b"p" * 100)}],
    })
    assert via_daemon.key == local.key == expected.key
    files = [str(ckpt / "config.json"), str(ckpt / "sub" / "part.safetensors"),
             str(ckpt / "diffusion_pytorch_model.safetensors")]
    assert build_identity(sources=files, client=None, **KW).key == expected.key  # names relative to common parent
    mapping = {"a.safetensors": files[2]}
    assert build_identity(sources=mapping, extra={"x": 1}, **KW).document["sources"][0]["name"] == "a.safetensors"
    assert hwr_client.build_identity is build_identity


def test_build_identity_rejects_a_directory_without_weights(src):
    write(src / "only" / "config.json", b"{}")
    with pytest.raises(InvalidArgument, match="no weight file"):
        build_identity(sources=str(src / "only"), client=None, **KW)


def test_garbled_record_in_the_daemons_database(served, src):
    """A corrupt row in the live daemon's index.sqlite is a miss, never a
    wrong content id; the record is rewritten."""
    import sqlite3

    from hwr_server import db
    from hwr_server.sources.cache import TABLE

    data = b"g" * 5000
    path = write(src / "g.bin", data)
    settle(path)
    with served.client() as client:
        assert client.resolve_sources([path])[0].origin == "hashed"
        conn = sqlite3.connect(db.path_of(served.root), timeout=30)
        with conn:
            conn.execute(f"UPDATE {TABLE} SET content_id = ?", ("sha256:" + "0" * 64,))
        conn.close()
        again, = client.resolve_sources([path])
        assert (again.content_id, again.origin) == (sha(data), "hashed")
        assert client.resolve_sources([path])[0].origin == "cache"
