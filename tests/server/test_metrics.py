"""Metrics: stats keys -> Prometheus families, loopback-only HTTP, atomic
textfile. The daemon is a stand-in object here (the seam Metrics reads);
tests/server/test_gc_daemon.py scrapes the real daemon."""

from __future__ import annotations

import os
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hwr_client.core.errors import InvalidArgument
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


def _metrics(daemon: types.SimpleNamespace) -> Metrics:
    """Metrics over the stand-in's components, wired as the daemon wires them."""
    sources = [(n, getattr(daemon, n)) for n in ("store", "leases", "sources", "gc", "scrub")
               if getattr(daemon, n) is not None]
    return Metrics(daemon.config, [*sources, ("daemon", daemon)])


def test_families_types_and_labels():
    fams = {f.name: f for f in families({'hwr_store_bytes{state="published"}': 7, "hwr_gc_runs_total": 2,
                                         "hwr_leases_active": 1, "nonsense{": 3, "hwr_x": "NaNish"})}
    assert fams["hwr_gc_runs"].type == "counter" and fams["hwr_store_bytes"].type == "gauge"
    assert [(s.name, s.labels, s.value) for s in fams["hwr_store_bytes"].samples] == [
        ("hwr_store_bytes", {"state": "published"}, 7.0)]
    assert "nonsense" not in fams and "hwr_x" not in fams


def test_render_merges_components_and_survives_a_broken_one(tmp_path):
    daemon = _fake_daemon(tmp_path)
    m = daemon.metrics = _metrics(daemon)
    got = _parsed(m.render().decode())
    assert got[("hwr_store_bytes", (("state", "published"),))] == 100
    assert got[("hwr_publications_total", (("outcome", "committed"),))] == 3
    assert got[("hwr_gc_runs_total", ())] == 2 and got[("hwr_recovery_seconds", ())] == 0.5
    assert ("hwr_uptime_seconds", ()) in got
    assert not any(k[0].startswith("python_") or k[0].startswith("process_") for k in got)


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464", "example.com:9464", "9464", ":9464"])
def test_non_loopback_listen_is_refused(tmp_path, listen):
    with pytest.raises(InvalidArgument, match="metrics_listen"):
        _metrics(_fake_daemon(tmp_path, metrics_listen=listen))


def test_loopback_forms_are_accepted():
    assert check_loopback("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert check_loopback("localhost:0") == ("127.0.0.1", 0)
    assert check_loopback("[::1]:9464") == ("::1", 9464)


def test_http_endpoint_on_loopback(tmp_path):
    m = _metrics(_fake_daemon(tmp_path, metrics_listen="127.0.0.1:0"))
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
    m = _metrics(_fake_daemon(tmp_path, metrics_textfile=str(path), metrics_textfile_interval_s=3600.0))
    m.start()  # first write at start
    assert _parsed(path.read_text())[("hwr_gc_runs_total", ())] == 2
    m.stop()  # last write at stop
    assert m.textfile_writes == 2
    assert sorted(os.listdir(path.parent)) == ["hwr.prom"]  # no temp file left
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


# -- against the real daemon ---------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return _parsed(r.read().decode())


def _v(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_daemon_metrics_follow_each_scenario(make_daemon_fixture, tmp_path):
    import json
    import time

    from tests.support.gc import collect, publish

    port = _free_port()
    textfile = tmp_path / "textfile" / "hwr.prom"
    conf = tmp_path / "hwr.toml"
    conf.write_text(f'metrics_listen = "127.0.0.1:{port}"\nmetrics_textfile = "{textfile}"\n'
                    f'metrics_textfile_interval_s = 0.1\n')
    d = make_daemon_fixture("--config", str(conf))
    m0 = _scrape(port)
    with d.client() as c:
        # Publication: +1 committed, +1 artifact, bytes and seconds grow.
        r = publish(c, "m1", 4)
        m1 = _scrape(port)
        assert _v(m1, "hwr_publications_total", outcome="committed") - _v(m0, "hwr_publications_total",
                                                                          outcome="committed") == 1
        assert _v(m1, "hwr_artifacts", state="published") - _v(m0, "hwr_artifacts", state="published") == 1
        assert _v(m1, "hwr_store_bytes", state="published") - _v(m0, "hwr_store_bytes", state="published") \
            == r.manifest.size_bytes
        assert _v(m1, "hwr_publication_bytes_total") - _v(m0, "hwr_publication_bytes_total") == r.bytes_written
        assert _v(m1, "hwr_publication_seconds_total") > _v(m0, "hwr_publication_seconds_total")
        # Same key again: +1 already_published, nothing else grows.
        publish(c, "m1", 4)
        m2 = _scrape(port)
        assert _v(m2, "hwr_publications_total", outcome="already_published") == 1
        assert _v(m2, "hwr_store_bytes", state="published") == _v(m1, "hwr_store_bytes", state="published")
        # Lease: +1 active; release: back.
        lease = c.acquire(r.key)
        assert _v(_scrape(port), "hwr_leases_active") == _v(m2, "hwr_leases_active") + 1
        lease.close()
        deadline = time.monotonic() + 30
        while _v(_scrape(port), "hwr_leases_active") != _v(m2, "hwr_leases_active") and time.monotonic() < deadline:
            time.sleep(0.05)
        # GC: +1 run, bytes freed = the artifact's bytes, published bytes to 0.
        res = collect(c, 1)
        m3 = _scrape(port)
        assert _v(m3, "hwr_gc_runs_total") - _v(m2, "hwr_gc_runs_total") == 1
        assert _v(m3, "hwr_gc_bytes_freed_total") - _v(m2, "hwr_gc_bytes_freed_total") == res["bytes_freed"] \
            == r.manifest.size_bytes
        assert _v(m3, "hwr_store_bytes", state="published") == 0
        assert _v(m3, "hwr_artifacts", state="published") == 0
        for name in ("hwr_verify_failures_total", "hwr_source_cache_hits_total", "hwr_source_cache_misses_total",
                     "hwr_recovery_seconds", "hwr_uptime_seconds", "hwr_sessions_active"):
            assert any(k[0] == name for k in m3), name
        assert ("hwr_store_bytes", (("state", "deleted_mapped"),)) in m3
        assert ("hwr_store_bytes", (("state", "staging"),)) in m3
    # `hwr stats --json` shows the same figures (every key is a Prometheus sample).
    out = d.cli("stats", "--json")
    assert out.returncode == 0, out.stderr
    from hwr_server.metrics import parse_key

    scraped = _scrape(port)
    for key, value in json.loads(out.stdout).items():
        name, labels = parse_key(key)
        assert (name, tuple(sorted(labels.items()))) in scraped, key
        if name.endswith("_total") and "seconds" not in name and not name.startswith("hwr_metrics_"):
            assert scraped[(name, tuple(sorted(labels.items())))] == value, key
    # The textfile is rewritten periodically with the same exposition.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if textfile.exists() and _v(_parsed(textfile.read_text()), "hwr_gc_runs_total") == 1:
            break
        time.sleep(0.05)
    assert _v(_parsed(textfile.read_text()), "hwr_gc_runs_total") == 1


def test_daemon_refuses_non_loopback_metrics_address(make_daemon_fixture, tmp_path):
    conf = tmp_path / "hwr.toml"
    conf.write_text('metrics_listen = "0.0.0.0:9464"\n')
    d = make_daemon_fixture("--config", str(conf), start=False)
    d.start(wait=False)
    assert d.proc.wait(60) != 0
    assert "loopback" in d.log()
