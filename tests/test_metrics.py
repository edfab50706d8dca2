"""Metrics: stats keys -> Prometheus families, loopback-only HTTP, atomic
textfile. The daemon is a stand-in object here (the seam Metrics reads);
tests/test_gc_daemon.py scrapes the real daemon."""

from __future__ import annotations

import os
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hwr_client.errors import InvalidArgument
from hwr_server.config import ServerConfig
from hwr_server.metrics import Metrics, check_loopback, families, parse_key


def test_parse_key():
    assert parse_key("hwr_gc_runs_total") == ("hwr_gc_runs_total", {})
    assert parse_key('hwr_store_bytes{state="published"}') == ("hwr_store_bytes", {"state": "published"})
    assert parse_key('x{a="1", b="q\\"t"}') == ("x", {"a": "1", "b": 'q"t'})
    for bad in ("", "1abc", 'x{a=1}', 'x{a="1"', 'x{="1"}'):
        with pytest.raises(InvalidArgument):
            parse_key(bad)


def _parsed(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _fake_daemon(tmp_path, **cfg) -> types.SimpleNamespace:
    store = types.SimpleNamespace(stats=lambda: {'hwr_store_bytes{state="published"}': 100,
                                                 'hwr_store_bytes{state="staging"}': 5,
                                                 'hwr_publications_total{outcome="committed"}': 3})

    def broken():
        raise RuntimeError("boom")

    return types.SimpleNamespace(
        config=ServerConfig(root=str(tmp_path), **cfg), stats=lambda: {"hwr_recovery_seconds": 0.5},
        store=store, leases=types.SimpleNamespace(stats=broken), sources=None,
        gc=types.SimpleNamespace(stats=lambda: {"hwr_gc_runs_total": 2, "bad key": 1}), scrub=None,
    )


def test_families_types_and_labels():
    fams = {f.name: f for f in families({'hwr_store_bytes{state="published"}': 7, "hwr_gc_runs_total": 2,
                                         "hwr_leases_active": 1, "nonsense{": 3, "hwr_x": "NaNish"})}
    assert fams["hwr_gc_runs"].type == "counter" and fams["hwr_store_bytes"].type == "gauge"
    assert [(s.name, s.labels, s.value) for s in fams["hwr_store_bytes"].samples] == [
        ("hwr_store_bytes", {"state": "published"}, 7.0)]
    assert "nonsense" not in fams and "hwr_x" not in fams


def test_render_merges_components_and_survives_a_broken_one(tmp_path):
    m = Metrics(_fake_daemon(tmp_path))
    got = _parsed(m.render().decode())
    assert got[("hwr_store_bytes", (("state", "published"),))] == 100
    assert got[("hwr_publications_total", (("outcome", "committed"),))] == 3
    assert got[("hwr_gc_runs_total", ())] == 2 and got[("hwr_recovery_seconds", ())] == 0.5
    assert ("hwr_uptime_seconds", ()) in got
    assert not any(k[0].startswith("python_") or k[0].startswith("process_") for k in got)


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464", "example.com:9464", "9464", ":9464"])
def test_non_loopback_listen_is_refused(tmp_path, listen):
    with pytest.raises(InvalidArgument, match="metrics_listen"):
        Metrics(_fake_daemon(tmp_path, metrics_listen=listen))


def test_loopback_forms_are_accepted():
    assert check_loopback("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert check_loopback("localhost:0") == ("127.0.0.1", 0)
    assert check_loopback("[::1]:9464") == ("::1", 9464)


def test_http_endpoint_on_loopback(tmp_path):
    m = Metrics(_fake_daemon(tmp_path, metrics_listen="127.0.0.1:0"))
    m.start()
    try:
        host, port = m.address
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            got = _parsed(r.read().decode())
        assert got[("hwr_store_bytes", (("state", "staging"),))] == 5
    finally:
        m.stop()
    assert m.address is None


def test_textfile_written_atomically(tmp_path):
    path = tmp_path / "prom" / "hwr.prom"
    m = Metrics(_fake_daemon(tmp_path, metrics_textfile=str(path), metrics_textfile_interval_s=3600.0))
    m.start()  # first write at start
    assert _parsed(path.read_text())[("hwr_gc_runs_total", ())] == 2
    m.stop()  # last write at stop
    assert m.textfile_writes == 2
    assert sorted(os.listdir(path.parent)) == ["hwr.prom"]  # no temp file left
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
