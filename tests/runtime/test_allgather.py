"""DLO AllGather over real processes with gloo on 127.0.0.1.

The launcher, the scenarios the ranks run and the module fixture are the
harness in :mod:`tests.support.allgather`; here, the checks of what the
ranks report, and the in-process tables. Scenarios that break the group (a
divergent rank, a stalled rank, a SIGKILLed rank) run last in their launch.
"""

from __future__ import annotations

import signal

import pytest
import torch

from hwr_client.core.errors import InvalidArgument
from dlo_runtime import GroupChoice, offload_group, validate_wave
from dlo_runtime.allgather import ShardPlan
from dlo_runtime.worker import WorkerOptions, run
from tests.support.allgather import KILL_TIMEOUT_S, MEDIUM, STALL_TIMEOUT_S, assert_ok, launch
from tests.support.allgather import setup  # noqa: F401 - the module fixture, used by name


def _check_parity_and_memory(res, setup, size):
    assert_ok(res["tinydit_ordinary"], "tinydit_ordinary")
    for row in res["tinydit_ordinary"]:
        assert row["digests"] == setup["resident_small"]  # bitwise, two passes (wrap-around prefetch)
        assert row["transport"] == "allgather" and row["group_size"] == size
        assert row["placeholder_nan"]  # between uses no rank holds the whole block
        for n, h2d, coll, copies in zip(row["blocks"], row["h2d"], row["collective"], row["copies"]):
            plan = ShardPlan.of(n, size, 0)
            assert h2d == copies * plan.shard and coll == copies * (size - 1) * plan.shard
        assert row["buffer_bytes"] == max(ShardPlan.of(n, size, 0).padded for n in row["blocks"])
        # The sequence check is exchanged one load ahead: one exchange per
        # load (+ the first), and only the first load waited for its own.
        assert row["loads"] == sum(row["copies"]) and row["exchanges"] == row["loads"] + 1
        assert row["blocking"] == 1
    assert_ok(res["toy_uneven"], "toy_uneven")
    blocks = res["toy_uneven"][0]["blocks"]
    assert any(n % (size * 64) for n in blocks), f"toy blocks {blocks} divide evenly: the test would not test padding"
    for row in res["toy_uneven"]:
        assert row["digests"] == [setup["toy"]] * 3
    # Across the group the shards are one copy of the streamed bytes (+ padding).
    total = sum(row["shard_bytes"] for row in res["toy_uneven"])
    assert sum(blocks) <= total == sum(ShardPlan.of(n, size, 0).padded for n in blocks)

    assert_ok(res["lease"], "lease")
    keys = {row["key"] for row in res["lease"]}
    assert len(keys) == 1  # DP replicas share one artifact
    for row in res["lease"]:
        assert row["outcome"] == "LOCAL_HIT" and row["transport"] == "allgather"
        assert row["digest"] == setup["resident_medium"]
        # The lease was closed right after the shards were cut, before the
        # first gather; the mapping is gone from the process.
        trail = row["trail"]
        assert trail.index("shards") < trail.index("close_lease") < trail.index("prefetched")
        assert not row["lease_open"] and row["blob_mappings"] == 0
        steps = [t.split(":")[0] for t in row["tx"]]
        assert steps.index("CARRIER_OWNED") < steps.index("BACKEND_OWNED") < steps.index("BACKEND_READY")
        streamed, shards, buf = row["streamed"], row["shard_bytes"], row["buffer_bytes"]
        # 1/G, padding at most one alignment unit per block
        assert shards <= streamed / size + MEDIUM.depth * size * 64
        # Private host bytes this rank added: its shards and the two slots,
        # not a copy of the model (rank-local without a shared lease: all of it).
        # (Measured across the backend's setup: shards cut, non-streamed
        # tensors copied out of the mapping, lease closed, both slots
        # gathered into by the initial prefetch.)
        marks = dict(row["marks"])
        delta = (marks["ready"] - marks["setup"]) * 1024
        assert 0.9 * shards <= delta <= shards + 2 * buf + (8 << 20), (delta, shards, buf, streamed, row["marks"])
        # Serving rebuilds no private copy of the model either. (What a
        # forward adds here, activations and allocator/gloo caches on a
        # loaded machine, measured 0.3-0.55x of the streamed bytes at 12
        # blocks of this width: a bound on "no copy", not a tight figure.)
        assert (marks["forward"] - marks["ready"]) * 1024 < 0.8 * streamed, row["marks"]


def _check_fails_everywhere(rows, name, error_type, needle, size):
    for r, row in enumerate(rows):
        assert row is not None, f"{name}: rank {r} wrote no result (hung)"
        assert not row["ok"] and row["type"] == error_type, (r, row)
        assert needle in row["error"], row["error"]


# -- tests ---------------------------------------------------------------------------


def test_two_ranks_parity_lease_divergence_and_stall(setup, tmp_path):
    res = launch(2, ["tinydit_ordinary", "toy_uneven", "lease", "cold", "consistent_skip", "divergent", "stall"],
                  dict(setup, base=None, resident=0), str(tmp_path))
    _check_parity_and_memory(res, setup, 2)
    assert_ok(res["cold"], "cold")
    cold = [row["cold"] for row in res["cold"]]
    for r, row in enumerate(cold):
        assert row["outcome"] == "CANONICAL_FALLBACK" and row["transport"] == "allgather"
        assert row["digest"] == setup["resident_small"][0]
        assert row["refused"]  # placeholders never reach the store
    # Exactly one publication, by the group's rank 0, before its backend sharded the model.
    assert cold[0]["kept"] and cold[0]["publish"] == {"ok": True, "already": False, "bytes": cold[0]["publish"]["bytes"]}
    assert cold[0]["publish"]["bytes"] > 0
    steps = [t.split(":")[0] for t in cold[0]["tx"]]
    assert steps.count("published") == 1 and steps.index("published") < steps.index("BACKEND_READY")
    assert not cold[1]["kept"] and cold[1]["publish"] is None
    assert "publish_skipped: AllGather rank 1 of 2: group rank 0 publishes the shared artifact" in cold[1]["tx"]
    assert "published" not in [t.split(":")[0] for t in cold[1]["tx"]]
    warm = [row["warm"] for row in res["cold"]]
    assert len({w["key"] for w in warm}) == 1
    for row in res["cold"]:
        w = row["warm"]
        assert w["outcome"] == "LOCAL_HIT" and w["transport"] == "allgather" and not w["pending"] and row["hit"]
        assert w["digest"] == setup["resident_small"][0]  # bitwise equal to the cold start and the resident model
    assert_ok(res["consistent_skip"], "consistent_skip")
    for row in res["consistent_skip"]:
        assert row["digests"] == row["want"] and row["digests"] != setup["resident_small"]
        assert row["revisions"] > 0  # the ranks revised the announced sequence together
    _check_fails_everywhere(res["divergent"], "divergent", "BlockSequenceMismatch", "block sequence differs", 2)
    assert "rank 1: load 3 of block 0" in res["divergent"][0]["error"]
    stall = res["stall"][0]
    assert stall is not None and not stall["ok"] and stall["type"] == "CollectiveFailed", stall
    assert "all_gather_single" in stall["error"] and "timed out" in stall["error"].lower()
    assert float(stall["error"].rsplit("after ", 1)[1].rstrip("s]")) < STALL_TIMEOUT_S + 5


def test_three_ranks_parity_resident_block_and_sigkill(setup, tmp_path):
    res = launch(3, ["tinydit_ordinary", "toy_uneven", "lease", "sigkill"], dict(setup, base=None, resident=1),
                  str(tmp_path))
    _check_parity_and_memory(res, setup, 3)
    assert res["exitcodes"][2] == -signal.SIGKILL
    for r in (0, 1):
        row = res["sigkill"][r]
        assert row is not None and not row["ok"] and row["type"] == "CollectiveFailed", (r, row)
        assert "all_gather_single" in row["error"]
        assert float(row["error"].rsplit("after ", 1)[1].rstrip("s]")) < KILL_TIMEOUT_S + 5


def test_four_ranks_parity(setup, tmp_path):
    res = launch(4, ["tinydit_ordinary", "toy_uneven", "lease"], dict(setup, base=None, resident=0), str(tmp_path))
    _check_parity_and_memory(res, setup, 4)


# -- in-process tables ---------------------------------------------------------------


class _G:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n

    def rank(self):
        return 0


@pytest.mark.parametrize("kw,kind,size", [
    (dict(dp_size=1, sp_size=1), "rank-local", 1),
    (dict(dp_size=1, sp_size=1, tp_size=4), "rank-local", 1),  # TP is never DLO's group
    (dict(dp_size=2, sp_size=1, dp_group=_G(2)), "dp", 2),
    (dict(dp_size=2, sp_size=4, dp_group=_G(2), sp_group=_G(4)), "dp", 2),  # DP first
    (dict(dp_size=1, sp_size=4, sp_group=_G(4)), "sp", 4),
    (dict(dp_size=1, sp_size=2, tp_size=2, sp_group=_G(2)), "sp", 2),
    (dict(dp_size=4, sp_size=1, dp_group=_G(4), allgather=False), "rank-local", 1),
    (dict(dp_size=2, sp_size=2, hsdp=True, allgather=False), "rank-local", 1),  # HSDP without AllGather
])
def test_offload_group_table(kw, kind, size):
    choice = offload_group(**kw)
    assert isinstance(choice, GroupChoice) and (choice.kind, choice.size) == (kind, size)
    assert choice.allgather == (kind != "rank-local") and choice.reason
    assert (choice.group is None) == (kind == "rank-local")


@pytest.mark.parametrize("kw,needle", [
    (dict(dp_size=2, sp_size=1, hsdp=True, dp_group=_G(2)), "HSDP with DLO AllGather is refused"),
    (dict(dp_size=1, sp_size=1, hsdp=True), "HSDP with DLO AllGather is refused"),
    (dict(dp_size=2, sp_size=1), "no dp_group was given"),
    (dict(dp_size=2, sp_size=1, dp_group=_G(4)), "dp_group has 4 ranks, expected dp_size=2"),
    (dict(dp_size=0, sp_size=1), "dp_size=0"),
    (dict(dp_size=1, sp_size=2.0), "sp_size=2.0"),
])
def test_offload_group_refusals(kw, needle):
    with pytest.raises(InvalidArgument, match=needle):
        offload_group(**kw)


def test_group_of_one_is_rank_local(tmp_path):
    from dlo_runtime import enable_layerwise_offload
    from tests.support.dlo import reference

    model, ref = reference(3), reference(3)
    handle = enable_layerwise_offload(model, list(model.blocks), device="cpu", process_group=_G(1))
    try:
        x = torch.randn(2, 8)
        assert torch.equal(model(x), ref(x))
        assert handle.stats.transport == "ordinary" and handle.stats.group_size == 1
    finally:
        handle.close()


@pytest.mark.parametrize("requests,needle", [
    ([{"num_inference_steps": 20}, {}], "request 1 has no explicit num_inference_steps"),
    ([{"num_inference_steps": 20}, {"num_inference_steps": 28}],
     r"num_inference_steps differs across requests \(request 0: 20, request 1: 28\)"),
    ([{"num_inference_steps": 0}], "num_inference_steps=0"),
    ([{"num_inference_steps": 4, "height": 512}, {"num_inference_steps": 4, "height": 768}],
     r"height differs across requests \(request 0: 512, request 1: 768\)"),
    ([{"num_inference_steps": 4, "guidance_scale": 3.5}, {"num_inference_steps": 4}],
     r"guidance_scale differs .*request 1: None"),
])
def test_validate_wave_refusals(requests, needle):
    with pytest.raises(InvalidArgument, match=needle):
        validate_wave(requests)
    validate_wave(requests, allgather=False)  # the rank-local path imposes none of it


def test_validate_wave_accepts_a_synchronized_wave():
    class Req:
        def __init__(self, prompt):
            self.prompt, self.num_inference_steps, self.height, self.width = prompt, 8, 256, 256

    validate_wave([Req("a cat"), Req("a dog")])  # prompts may differ: they do not change the collectives
    validate_wave([{"num_inference_steps": 8, "prompt": "x", "seed": 1}, {"num_inference_steps": 8, "seed": 2}])
    validate_wave([])


def test_shard_plan_pads_to_group_times_alignment():
    for n in (1, 63, 64, 1000, 4096, 12345):
        for g in (2, 3, 4):
            plans = [ShardPlan.of(n, g, r) for r in range(g)]
            assert plans[0].padded % (g * 64) == 0 and plans[0].padded >= n
            assert plans[0].padded - n < g * 64
            assert [p.begin for p in plans] == [r * plans[0].shard for r in range(g)]


# -- launching and identity -----------------------------------------------------------


def test_worker_entry_takes_the_torchrun_environment(setup):
    """``python -m dlo_runtime.worker --dp 2`` under a torchrun-style
    environment, launched as ``hwr demo --ranks 2`` launches it: two ranks
    warm-start from the daemon's lease with AllGather over the DP group and
    match the resident model; the demo's row and checks hold."""
    from hwr_client.cli import demo
    from hwr_client.cli.workers import WorkerProcesses

    workers = WorkerProcesses()
    try:
        outs = demo.spawn_ranks(workers, setup["medium"], setup["socket"], 2, device="cpu")
        assert [p.returncode for p in workers.procs] == [0, 0]  # released: both exited cleanly
    finally:
        workers.kill_all()
    assert [o["rank"] for o in outs] == [0, 1]
    for o in outs:
        assert o["world_size"] == 2 and o["dlo_group"] == "dp" and o["dlo_group_size"] == 2
        assert o["outcome"] == "LOCAL_HIT" and o["transport"] == "allgather" and o["group_size"] == 2
        assert o["output_sha256"] == setup["resident_medium"]
        assert o["pss_kib"] > 0
    assert outs[0]["shard_bytes"] == outs[1]["shard_bytes"] > 0  # each rank holds its half
    assert len({o["pid"] for o in outs}) == 2
    row = demo._row("ranks 1-2: warm, AllGather", outs, setup["resident_medium"])
    assert row["outputs_equal"] and row["pss_sum_kib"] == sum(o["pss_kib"] for o in outs)
    model_bytes = 2 * outs[0]["shard_bytes"]  # the ranks' shards: one copy of the streamed blocks
    assert demo.ranks_checks(row, outs, model_bytes) == []
    # The checks fail loudly: a rank-local row, or shards above a model copy.
    assert "expected allgather" in demo.ranks_checks(dict(row, transport="ordinary"), outs, model_bytes)[0]
    assert "expected one copy" in demo.ranks_checks(row, outs, model_bytes - 1)[0]


def test_worker_entry_refuses_a_world_that_is_not_dp_times_sp(setup):
    from dlo_runtime.worker import _init_topology

    with pytest.raises(InvalidArgument, match="WORLD_SIZE=4 but --dp 2 --sp 1 needs 2 ranks"):
        _init_topology({"WORLD_SIZE": "4"}, 2, 1, "cpu", 10)
    with pytest.raises(InvalidArgument, match=r"\['RANK', 'MASTER_ADDR', 'MASTER_PORT'\] not set"):
        _init_topology({"WORLD_SIZE": "2"}, 2, 1, "cpu", 10)
    assert _init_topology({}, 1, 1, "cpu", 10)["dlo_group"] == "rank-local"


def test_identity_two_tp_ranks_by_two_dp_replicas(setup):
    """2 TP x 2 DP: replica 0 of each TP rank publishes (cold start), replica
    1 warm-starts; DP replicas share one artifact key, TP ranks get their own."""
    keys: dict[tuple[int, int], str] = {}
    digests = set()
    for dp in (0, 1):
        for tp in (0, 1):
            mode = "preferred" if dp == 0 else "required"
            opts = WorkerOptions("tiny-dit", setup["small"], mode, setup["socket"], layout=f"tp_rank={tp},tp_size=2")
            worker, result = run(opts, forward=True, publish=dp == 0)
            worker.close()
            assert result["outcome"] == ("CANONICAL_FALLBACK" if dp == 0 else "LOCAL_HIT"), result
            if dp == 0:
                assert result["publish"] and result["publish"].get("ok", True), result["publish"]
            keys[(tp, dp)] = result["key"]
            digests.add(result["output_sha256"])
    assert keys[(0, 0)] == keys[(0, 1)] and keys[(1, 0)] == keys[(1, 1)]
    assert keys[(0, 0)] != keys[(1, 0)]
    assert len(digests) == 1  # (this test model's TP ranks hold the same bytes)
