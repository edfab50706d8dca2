"""bench/hostile.py --quick runs end to end (so the script cannot rot) and its
figures keep their relations: the hostile streams are refused, the other
client is served, the huge plan is refused while the one at the limit is
accepted, and the legitimate publish commits while the hogs are ended; on
the shared node (attacker uid nobody) root's lookups are all served during
every attack, the flood is answered at once, the uid's streams stop at its
share, the tricklers are ended by the rate floor and root's registration is
admitted behind a stall; in the pull cases another process's Lookup is
served throughout, the bombs' bodies are never read, and every attack is
refused or bounded.

It runs in this process (main() with argv): the daemons, the hostile client
and the new worker are still real processes; only the bench's own imports
(torch, grpc) are shared with pytest's. No wall-clock threshold.
"""

from __future__ import annotations

import json
import sys

from tests.support.paths import REPO_DIR

REPO = REPO_DIR
sys.path.insert(0, REPO)

from bench import hostile  # noqa: E402


def test_bench_hostile_quick(tmp_path, capsys):
    out = tmp_path / "hostile.json"
    assert hostile.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "hostile streams" in printed and f"wrote {out}" in printed
    r = json.loads(out.read_text())
    assert r["quick"] is True and r["command"].endswith("bench/hostile.py --quick --out " + str(out))

    s = r["streams"]
    assert s["hostile_streams"] == 128
    assert s["refused"] > 0 and s["refused"] == s["hostile_streams"] - s["max_streams_anonymous"]
    assert s["refusals_name_the_field"] and s["hwr_streams_refused_total"] == s["refused"]
    assert set(s["outcome_codes"]) <= {"RESOURCE_EXHAUSTED", "CANCELLED"}
    for phase in ("baseline", "under_load"):
        p = s[phase]
        assert p["failed"] == [] and p["ok"] == p["calls"] > 0  # the other client: every call served
        assert 0 < p["getstats_ms"]["median"] <= p["getstats_ms"]["max"]
        assert 0 < p["lookup_ms"]["median"] <= p["lookup_ms"]["max"]
    assert s["first_lease"]["baseline"] is None  # --quick skips it
    assert s["first_lease"]["under_load"]["ok"], s["first_lease"]["under_load"]["error"]

    h = r["huge_plan"]
    [row] = h["refused"]
    assert row["tensors"] > h["max_artifact_tensors"] == h["at_limit"]["tensors"]
    assert row["code"] == "RESOURCE_EXHAUSTED" and row["names_the_field"]
    assert row["plan_bytes"] > h["at_limit"]["plan_bytes"]
    assert h["at_limit"]["accepted"]

    i = r["idle_publications"]
    assert i["legit_committed"] and i["hog_codes"] == {"ABORTED": i["hogs"]} and i["hogs"] > 0
    # Behind the hogs it waits for at least one idle deadline; alone it does not.
    assert i["legit_seconds"] > i["baseline_seconds"]

    shared = r["shared_node"]
    for name, case in shared.items():
        for phase in ("baseline", "under_attack"):
            lk = case[phase]["lookups"]
            assert lk["failed"] == [] and lk["ok"] == lk["calls"] > 0, (name, phase, lk)
            assert 0 < lk["p50_ms"] <= lk["max_ms"] and case[phase]["daemon"]["threads"] > 0
    f = shared["registration_flood"]
    assert f["slot_held"] and f["answers"] == {"queued": 4, "busy": f["flood"] - 4}
    u = shared["uid_streams"]
    assert (u["opened"], u["refused"]) == (24, 24) and u["root_first_lease"]["under_attack"]["ok"]
    t = shared["trickle_publications"]
    assert t["publish_under_attack"]["code"] == "OK" and t["trickler_ends"] == {"ABORTED": 4}
    assert shared["registration_stall"]["root_registration_under_stall"]["admitted"]

    # The pull cases: a hostile registry against a daemon each; another
    # process's Lookup served throughout, every attack refused or bounded.
    p = r["pull"]
    cases = p["cases"]
    for name, c in cases.items():
        assert c["lookup_errors"] == {} and c["lookup_ms"]["calls"] > 0, (name, c)
    for name in ("bomb_401", "bomb_307"):  # the bomb's body never read
        c = cases[name]
        assert c["peak_rss_mib_after"] - c["peak_rss_mib_before"] < p["bomb_bytes"] / 2**20 / 2, c
    assert cases["bomb_401"]["outcome"].startswith("PermissionDenied")
    assert cases["bomb_307"]["outcome"].startswith("OK")
    assert cases["trickle"]["outcome"].startswith("Unavailable") and "min_rate_bytes" in cases["trickle"]["outcome"]
    assert cases["hung_calls"]["outcome"].get("RESOURCE_EXHAUSTED", 0) >= p["calls"] - 8
    assert cases["held_64"]["outcome"].get("RESOURCE_EXHAUSTED", 0) >= 64 - 8
    for name in ("many_tensors", "many_layers"):
        assert cases[name]["outcome"].startswith("ResourceExhausted"), cases[name]
    assert cases["claimed_sizes"]["outcome"].endswith("3 of 3 unleased artifacts kept")
