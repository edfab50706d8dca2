"""Background scrub: corruption found and quarantined by the real daemon;
leased artifacts skipped and the pacing computed from the rate (against the
real Store in-process, with the lease manager as the seam)."""

from __future__ import annotations

import json
import os
import threading
import time

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_server.config import ServerConfig
from hwr_server.store.scrub import Scrubber
from tests.support.gc import collect, keys, publish, stats


def _corrupt(root: str, blob: str, offset: int = -100) -> None:
    path = os.path.join(root, "blobs", "sha256", blob)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    os.chmod(path, 0o444)


def _two_artifacts(make_daemon_fixture):
    d = make_daemon_fixture()
    with d.client() as c:
        good, bad = publish(c, "good", 2, seed=1), publish(c, "bad", 2, seed=2)
    d.stop()
    _corrupt(d.root, bad.manifest.files[-1].blob)  # a block file only "bad" uses
    return d, good, bad


def test_daemon_scrub_quarantines_corruption(make_daemon_fixture, tmp_path):
    d, good, bad = _two_artifacts(make_daemon_fixture)
    conf = tmp_path / "scrub.toml"
    conf.write_text('scrub_bytes_per_s = "1GiB"\n')
    d.extra_args += ["--config", str(conf)]
    d.start()
    with d.client() as c:
        deadline = time.monotonic() + 60
        while stats(c).get("hwr_scrub_artifacts_total", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = stats(c)
        assert s["hwr_scrub_artifacts_total"] == 2 and s["hwr_scrub_corrupt_total"] == 1
        assert s["hwr_scrub_bytes_total"] == good.manifest.size_bytes + bad.manifest.size_bytes
        assert s["hwr_verify_failures_total"] == 1
        assert keys(c) == {good.key}
        listed = {a.key: a for a in c.call(c.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts}
        assert listed[bad.key].state == "quarantined" and "scrub" in listed[bad.key].reason
        assert s['hwr_artifacts{state="quarantined"}'] == 1
        # GC removes quarantined artifacts first, before any published one.
        qbytes = s['hwr_store_bytes{state="quarantined"}']
        assert qbytes > 0
        res = collect(c, 1)
        assert res["items"][0]["kind"] == "quarantine" and res["items"][0]["name"].startswith(bad.key)
        assert res["items"][0]["bytes"] == qbytes
        assert os.listdir(os.path.join(d.root, "quarantine")) == []
        s2 = stats(c)
        assert s2['hwr_store_bytes{state="quarantined"}'] == 0 and s2['hwr_artifacts{state="quarantined"}'] == 0
        assert s2["hwr_gc_bytes_freed_total"] == res["bytes_freed"]
    out = d.cli("stats", "--json")
    assert json.loads(out.stdout)["hwr_scrub_corrupt_total"] == 1


class _Leases:
    """The lease-manager seam: a fixed set of pinned keys."""

    def __init__(self, pinned: set[str]):
        self._pinned = pinned

    def pinned_keys(self) -> set[str]:
        return set(self._pinned)


class _RecordingStop(threading.Event):
    """Records the pacing waits instead of sleeping."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):  # noqa: D401 - Event API
        self.waits.append(timeout)
        return False


def test_scrub_skips_leased_and_paces_by_rate(make_daemon_fixture):
    d, good, bad = _two_artifacts(make_daemon_fixture)
    from hwr_server.store.store import Store

    store = Store(ServerConfig(root=d.root).resolved())
    store.recover()
    rate = 1 << 20
    scrub = Scrubber(ServerConfig(root=d.root, scrub_bytes_per_s=rate), store, _Leases({bad.key}))
    scrub._stop = _RecordingStop()
    assert scrub.run_pass() == 1  # only "good": "bad" is leased
    assert scrub.skipped_leased_total == 1 and scrub.corrupt_total == 0
    assert set(store.keys()) == {good.key, bad.key}
    assert scrub._stop.waits == [good.manifest.size_bytes / rate]
    # The lease ends: the next pass finds and quarantines the corruption.
    scrub.leases = _Leases(set())
    assert scrub.run_pass() == 2
    assert scrub.corrupt_total == 1 and set(store.keys()) == {good.key}
    assert scrub.passes_total == 2 and scrub.stats()["hwr_scrub_corrupt_total"] == 1


def test_scrub_off_by_default():
    scrub = Scrubber(ServerConfig(), object(), None)
    assert not scrub.enabled
    scrub.start()
    assert scrub._thread is None
    scrub.stop()
