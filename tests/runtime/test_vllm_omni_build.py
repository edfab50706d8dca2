"""``get_or_build`` of the HWR store for vLLM-Omni, against a real daemon:
one publication for two processes, a concurrent publisher met through the
daemon's single flight (JOINED on equal content, IDENTITY_COLLISION on
other content), a daemon stopped mid-run (a retryable FAILED value, never
an exception), and the writer's checks on misbehaving producers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tests.support import vllm_omni as vo
from tests.support.daemon import cleanup, make_daemon
from tests.support.paths import REPO_DIR
from tests.support.raw_publish import COMMIT, chunks

api = vo.load()

from dlo_runtime.integrations import vllm_omni as adapter  # noqa: E402
from dlo_runtime.integrations.vllm_omni.build import staged_plan  # noqa: E402
from dlo_runtime.integrations.vllm_omni.records import hwr_identity  # noqa: E402
from dlo_runtime.integrations.vllm_omni.store import HwrHostWeightStore, StoreSettings  # noqa: E402
from dlo_runtime.integrations.vllm_omni.writer import StagingWriter  # noqa: E402
from hwr_client.core._proto import hwr_pb2 as pb  # noqa: E402
from hwr_client.core.plan import to_proto  # noqa: E402

S, META, F = api.StoreStatus, api.ValidationLevel.MANIFEST_AND_METADATA, api.FailureCode


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    adapter.install(socket=d.socket, admin_socket=d.admin_socket)
    yield d
    adapter.uninstall()
    cleanup(d)


def store(root):
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(root)))
    assert rt.store is not None, rt._initialization_failure
    return rt.store


def stat(d, name: str) -> int:
    client = d.client()
    return int(json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)[name])


COMMITTED, CONFLICT = 'hwr_publications_total{outcome="committed"}', 'hwr_publications_total{outcome="conflict"}'

_PROCESS = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from tests.support import vllm_omni as vo
    api = vo.load()
    from dlo_runtime.integrations import vllm_omni as adapter
    me, other, socket, root, marks = sys.argv[1:6]
    marks = Path(marks)
    adapter.install(socket=socket)
    ident = vo.identity(api, name="two-processes")

    def hold(writer):
        # The builder waits until the other process has missed, so that it
        # can only join, never find the artifact on its first lookup.
        end = time.monotonic() + 60
        while not (marks / (other + ".missed")).exists() and time.monotonic() < end:
            time.sleep(0.02)
        (marks / (me + ".produced")).write_text("1")

    store = api.HostWeightRuntime.from_config(vo.runtime_config(api, root)).store
    lookup, first = store.lookup, []
    def observed(*args, **kwargs):
        result = lookup(*args, **kwargs)
        if not first:
            first.append(1)
            (marks / (me + ".missed")).write_text(result.status.value)
        return result
    store.lookup = observed
    res = store.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights(), before=hold),
                             validation=api.ValidationLevel.MANIFEST_AND_METADATA, deadline=time.monotonic() + 120)
    w = {n: t.float().sum().item() for n, t in res.lease.tensors.items()}
    print(json.dumps({"status": res.status.value, "sums": w}))
""")


def test_two_processes_building_one_identity_publish_once(hwrd, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    before = stat(hwrd, COMMITTED)
    env = dict(os.environ, PYTHONPATH=REPO_DIR)
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, me, other, hwrd.socket, str(tmp_path / "root"),
                               str(marks)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for me, other in (("p1", "p2"), ("p2", "p1"))]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert sorted(r["status"] for r in results) == ["built", "joined"]
    assert results[0]["sums"] == results[1]["sums"]
    assert len(list(marks.glob("*.produced"))) == 1  # one producer ran
    assert {m.read_text() for m in marks.glob("*.missed")} == {"miss"}
    assert stat(hwrd, COMMITTED) == before + 1  # one publication


def _held_publication(d, plan, tensors):
    """A publication of ``plan`` that holds the daemon's claim on its key
    until ``release`` is set, then sends ``tensors`` and commits."""
    claimed, release, done = threading.Event(), threading.Event(), {}

    def requests():
        yield pb.PublishRequest(plan=to_proto(plan))
        release.wait(60)
        yield from chunks(plan, tensors, 1 << 16)
        yield COMMIT

    def run():
        events = d.client().runtime.Publish(requests(), timeout=120)
        next(events)  # accepted: the daemon holds the claim from here
        claimed.set()
        done["committed"] = next(events).committed.key

    thread = threading.Thread(target=run)
    thread.start()
    assert claimed.wait(30)
    return release, thread, done


def _expected_plan(s, ident, tensors, tmp_path, **producer_kw):
    """The plan and staged tensors the store will publish for ``ident``."""
    (tmp_path / "expected").mkdir()
    writer = StagingWriter(tmp_path / "expected")
    metadata = vo.Producer(api, ident, tensors, **producer_kw).produce(writer)
    staged = writer.finish(ident, metadata)
    return staged_plan(hwr_identity(ident, s.domain), staged), staged.tensors()


@pytest.mark.parametrize("theirs", ["equal", "other bytes", "other record"])
def test_a_publisher_in_flight_is_joined_on_equal_content_else_a_collision(hwrd, tmp_path, theirs):
    ident = vo.identity(api, name=f"in-flight-{theirs}")
    s = store(tmp_path / "root")
    ours = vo.weights()
    plan, staged = _expected_plan(s, ident, ours if theirs != "other bytes" else vo.weights(seed=9), tmp_path,
                                  metadata={"policy": "other"} if theirs == "other record" else None)
    conflicts = stat(hwrd, CONFLICT)
    release, thread, done = _held_publication(hwrd, plan, staged)
    result = {}
    producer = vo.Producer(api, ident, ours)
    worker = threading.Thread(target=lambda: result.setdefault("r", s.get_or_build(
        api.BuildRequest(ident), producer, validation=META, deadline=time.monotonic() + 60)))
    worker.start()
    end = time.monotonic() + 60
    while stat(hwrd, CONFLICT) == conflicts and time.monotonic() < end:  # the store met the single flight
        time.sleep(0.05)
    release.set()
    thread.join(60)
    worker.join(60)
    assert done["committed"] == s.key(ident)
    r = result["r"]
    if theirs == "equal":
        assert r.status is S.JOINED and torch.equal(r.lease.tensors["norm.weight"], ours["norm.weight"])
        r.lease.close()
    else:
        assert r.status is S.FAILED and r.failure.code is F.IDENTITY_COLLISION and not r.failure.retryable
        assert ("content" if theirs == "other bytes" else "record") in r.failure.message
    assert producer.calls == 1
    assert list((s.staging_dir).iterdir()) == []


def test_already_published_during_production_settles_by_content(hwrd, tmp_path):
    ident = vo.identity(api, name="already")
    s = store(tmp_path / "root")
    plan, staged = _expected_plan(s, ident, vo.weights(), tmp_path)
    release, thread, done = _held_publication(hwrd, plan, staged)

    def finish_theirs(_writer):  # theirs commits while ours produces
        release.set()
        thread.join(60)

    committed = stat(hwrd, COMMITTED)
    r = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights(), before=finish_theirs),
                       validation=META, deadline=time.monotonic() + 60)
    assert r.status is S.JOINED, r.failure
    assert stat(hwrd, COMMITTED) == committed + 1
    r.lease.close()


def test_a_daemon_stopped_mid_run_gives_retryable_failed_values(tmp_path):
    d = make_daemon(tmp_path).start()
    try:
        # This daemon's store class, bound as install() binds it (the
        # module's installed class serves the module's daemon).
        bound = type("Bound", (HwrHostWeightStore,), {"settings": StoreSettings(socket=d.socket)})
        config = vo.runtime_config(api, str(tmp_path / "root"))
        s = bound(config.domain, config.capacity, config.integrity)
        ident = vo.identity(api, name="stopped")
        s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights()), validation=META,
                       deadline=time.monotonic() + 30).lease.close()
        # Stopped while a build produces: the publication cannot reach it.
        other = vo.identity(api, name="stopped-mid-build")
        r = s.get_or_build(api.BuildRequest(other), vo.Producer(api, other, vo.weights(), before=lambda w: d.stop()),
                           validation=META, deadline=time.monotonic() + 30)
        assert r.status is S.FAILED and r.failure.retryable and r.failure.code is F.DOMAIN_UNAVAILABLE
        assert list(s.staging_dir.iterdir()) == []
        # Stopped: lookups are FAILED values; preferred falls back, required fails; nothing raises.
        r = s.lookup(ident, validation=META)
        assert r.status is S.FAILED and r.failure.retryable and r.failure.code is F.DOMAIN_UNAVAILABLE
        for mode, outcome in (("preferred", api.ResolutionOutcome.CANONICAL_FALLBACK),
                              ("required", api.ResolutionOutcome.FAILED)):
            rt = api.HostWeightRuntime(vo.runtime_config(api, str(tmp_path / "root"), mode=mode), s)
            res = rt.resolve(ident, producer=vo.Producer(api, ident, vo.weights()))
            assert res.report.outcome is outcome and res.report.attempts[0].failure.retryable
        # Retryable means it: once the daemon is back, the artifact is a hit again.
        d.start()
        end, r = time.monotonic() + 120, None
        while time.monotonic() < end:
            r = s.lookup(ident, validation=META)
            if r.status is not S.FAILED:
                break
            time.sleep(0.5)
        assert r is not None and r.status is S.HIT, r.failure
        r.lease.close()
    finally:
        cleanup(d)


class FnProducer(vo.Producer):
    """A producer whose body is ``fn(writer, self)``."""

    def __init__(self, ident, fn, tensors=None, **kw):
        super().__init__(api, ident, tensors or vo.weights(), **kw)
        self.fn = fn

    def produce(self, writer):
        self.calls += 1
        self.fn(writer, self)
        p = self.ident.producer
        return api.ProductionMetadata(producer_schema=p.manifest_schema, restorer_schema=p.restorer_schema)


def _one_file(writer, p, names, ordered=True, name="m.safetensors"):
    return writer.open_tensor_file(name, tuple(p.write_spec(n) for n in names), ordered=ordered)


def _out_of_order(w, p):
    with _one_file(w, p, ["blocks.0.attn.bias", "norm.weight"]) as f:
        f.write_tensor("norm.weight", p.tensors["norm.weight"])


def _overlap(w, p):
    with _one_file(w, p, ["blocks.0.attn.weight"], ordered=False) as f:
        t = p.tensors["blocks.0.attn.weight"]
        f.write_rows("blocks.0.attn.weight", 0, t[:5])
        f.write_rows("blocks.0.attn.weight", 4, t[4:])


def _incomplete(w, p):
    with _one_file(w, p, ["blocks.0.attn.weight"], ordered=False) as f:
        f.write_rows("blocks.0.attn.weight", 0, p.tensors["blocks.0.attn.weight"][:7])


def _undeclared(w, p):
    with _one_file(w, p, ["norm.weight"]) as f:
        f.write_tensor("scale", p.tensors["scale"])


def _wrong_shape(w, p):
    with _one_file(w, p, ["norm.weight"]) as f:
        f.write_tensor("norm.weight", torch.zeros(5))


def _unsafe_name(w, p):
    _one_file(w, p, ["norm.weight"], name="../escape.safetensors")


def _unstorable(w, p):
    w.open_tensor_file("m.safetensors", (api.TensorWriteSpec("c", (2,), torch.complex64),))


def _typed(w, p):
    raise api.HostWeightError(api.HostWeightFailure(stage=api.ResolutionStage.CANONICAL_LOADING,
                                                    code=F.CANONICAL_SOURCE_FAILED, retryable=False,
                                                    message="source changed under the producer"))


def _crash(w, p):
    raise RuntimeError("the producer broke")


@pytest.mark.parametrize(("fn", "code", "text"), [
    (_out_of_order, F.PRODUCER_FAILED, "ordered file expects tensor 'blocks.0.attn.bias' at byte 0"),
    (_overlap, F.PRODUCER_FAILED, "overlaps the earlier write"),
    (_incomplete, F.PRODUCER_FAILED, "not fully written"),
    (_undeclared, F.PRODUCER_FAILED, "not declared in this file"),
    (_wrong_shape, F.PRODUCER_FAILED, "declared (4,)"),
    (_unsafe_name, F.PRODUCER_FAILED, "safe basename"),
    (_unstorable, F.PRODUCER_FAILED, "not storable"),
    (_typed, F.CANONICAL_SOURCE_FAILED, "source changed under the producer"),
    (_crash, F.PRODUCER_FAILED, "the producer broke"),
])
def test_producer_failures_are_typed_and_leave_nothing(hwrd, tmp_path, fn, code, text):
    ident = vo.identity(api, name=f"bad-{fn.__name__}")
    s = store(tmp_path / "root")
    r = s.get_or_build(api.BuildRequest(ident), FnProducer(ident, fn), validation=META,
                       deadline=time.monotonic() + 30)
    assert r.status is S.FAILED and r.failure.code is code and not r.failure.retryable
    assert text in r.failure.message
    assert s.lookup(ident, validation=META).status is S.MISS
    assert list(s.staging_dir.iterdir()) == []


def test_capacity_and_unordered_row_writes(hwrd, tmp_path):
    ident = vo.identity(api, name="rows")
    small = api.HostWeightRuntime.from_config(vo.runtime_config(
        api, str(tmp_path / "small"), capacity=api.CapacityPolicy(max_artifact_bytes=64))).store
    r = small.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights()), validation=META,
                           deadline=time.monotonic() + 30)
    assert r.status is S.FAILED and r.failure.code is F.ARTIFACT_TOO_LARGE and r.failure.retryable
    # Row chunks, last rows first, in files declared unordered: the same bytes.
    tensors = vo.weights(seed=4)
    r = store(tmp_path / "root").get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, tensors, rows=True),
                                              validation=META, deadline=time.monotonic() + 30)
    assert r.status is S.BUILT, r.failure
    assert all(torch.equal(r.lease.tensors[n], t) for n, t in tensors.items())
    r.lease.close()


def test_writer_files_open_at_once_abort_and_finish(tmp_path):
    ident = vo.identity(api, name="writer")
    p = vo.Producer(api, ident, vo.weights())
    w = StagingWriter(tmp_path)
    a = w.open_tensor_file("a.safetensors", (p.write_spec("norm.weight"),))
    b = w.open_tensor_file("b.safetensors", (p.write_spec("scale"),))
    a.abort()  # its name and tensors are free again; b stays open
    c = w.open_tensor_file("a.safetensors", (p.write_spec("norm.weight"),))
    with pytest.raises(Exception, match="declared in 'b.safetensors'"):
        w.open_tensor_file("d.safetensors", (p.write_spec("scale"),))
    metadata = api.ProductionMetadata(producer_schema=ident.producer.manifest_schema,
                                      restorer_schema=ident.producer.restorer_schema)
    with pytest.raises(Exception, match="left payload files open"):
        w.finish(ident, metadata)
    c.write_tensor("norm.weight", p.tensors["norm.weight"])
    c.close()
    b.write_tensor("scale", p.tensors["scale"])
    b.close()
    with pytest.raises(Exception, match="schemas"):
        w.finish(ident, api.ProductionMetadata(producer_schema="other", restorer_schema="x"))
    staged = w.finish(ident, metadata)
    assert [f.name for f in staged.files] == ["a.safetensors", "b.safetensors"]
    views = staged.tensors()
    assert torch.equal(views["norm.weight"], p.tensors["norm.weight"]) and torch.equal(views["scale"], p.tensors["scale"])
    assert sorted(os.listdir(tmp_path)) == ["00001.bin", "00002.bin"]  # the aborted 00000.bin is gone
