"""Helpers shared by several test modules (moved from tests/server/test_registration_admission.py)."""

from __future__ import annotations

import json
import time

from hwr_client.core._proto import hwr_pb2 as pb
from tests.support.daemon import make_daemon


def start(tmp_path, **cfg) -> object:
    conf = tmp_path / "hwr.toml"
    conf.write_text("".join(f"{k} = {v!r}\n" for k, v in cfg.items()))
    return make_daemon(tmp_path, "--config", str(conf)).start()


def stats(d) -> dict:
    with d.client() as c:
        return json.loads(c.reader.GetStats(pb.GetStatsRequest(), timeout=10).stats_json)


def poll(d, pred, what: str, bound_s: float = 20.0) -> dict:
    deadline = time.monotonic() + bound_s
    while True:
        s = stats(d)
        if pred(s):
            return s
        assert time.monotonic() < deadline, f"{what}: not reached within {bound_s} s; stats {s}"
        time.sleep(0.05)
