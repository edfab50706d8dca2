"""vLLM-Omni's runtime on the HWR store, against a real daemon: what
``HostWeightRuntime.from_config`` builds once the adapter is installed, the
store results (HIT, MISS, BUILT, JOINED, INVALID, FAILED) as typed values,
the lease it hands out, and how the adapter is switched on and off."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import time
import tomllib

import pytest
import torch

from tests.support import vllm_omni as vo
from tests.support.daemon import cleanup, make_daemon
from tests.support.paths import REPO_DIR

api = vo.load()

from dlo_runtime.integrations import vllm_omni as adapter  # noqa: E402
from dlo_runtime.integrations.vllm_omni import installer as install_mod  # noqa: E402
from dlo_runtime.integrations.vllm_omni.store import HwrHostWeightStore  # noqa: E402
from hwr_client.core._proto import hwr_pb2 as pb  # noqa: E402
from hwr_client.core.errors import FailedPrecondition  # noqa: E402

S, META = api.StoreStatus, api.ValidationLevel.MANIFEST_AND_METADATA


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    adapter.install(socket=d.socket, admin_socket=d.admin_socket)
    yield d
    adapter.uninstall()
    cleanup(d)


def store(tmp_path, **policies):
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "root"), **policies))
    assert rt.store is not None, rt._initialization_failure
    return rt.store


def deadline(s: float = 30.0) -> float:
    return time.monotonic() + s


def stats(d) -> dict[str, float]:
    import json

    client = d.client()
    return json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)


def test_from_config_builds_the_hwr_store_and_resolves_miss_built_hit(hwrd, tmp_path):
    ident = vo.identity(api, name="mbh")
    tensors = vo.weights()
    producer = vo.Producer(api, ident, tensors)
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "root")))
    assert isinstance(rt.store, HwrHostWeightStore)
    # MISS: the runtime falls back (preferred) and the producer was not allowed to run yet.
    miss = rt.resolve(ident)
    assert miss.report.outcome is api.ResolutionOutcome.CANONICAL_FALLBACK
    assert [a.result.value for a in miss.report.attempts] == ["miss", "skipped"]
    assert rt.store.lookup(ident, validation=META).status is S.MISS
    # BUILT: the store ran the producer and published.
    built = rt.store.get_or_build(api.BuildRequest(ident), producer, validation=META, deadline=deadline())
    assert built.status is S.BUILT and built.failure is None
    assert {n: torch.equal(built.lease.tensors[n], t) for n, t in tensors.items()} == dict.fromkeys(tensors, True)
    built.lease.close()
    # HIT: from the daemon, through the runtime and directly; the producer never runs again.
    hit = rt.resolve(ident, producer=producer)
    assert hit.report.outcome is api.ResolutionOutcome.LOCAL_HIT
    hit.lease.close()
    again = rt.store.get_or_build(api.BuildRequest(ident), producer, validation=META, deadline=deadline())
    assert again.status is S.HIT
    again.lease.close()
    assert producer.calls == 1
    # REQUIRED mode on a miss fails startup, as with vLLM-Omni's own store.
    req = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "root"), mode="required"))
    assert req.resolve(vo.identity(api, name="absent")).report.outcome is api.ResolutionOutcome.FAILED


def test_the_artifact_in_the_daemon_carries_the_identity_and_record(hwrd, tmp_path):
    ident = vo.identity(api, name="record")
    s = store(tmp_path)
    res = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights()), validation=META,
                         deadline=deadline())
    res.lease.close()
    manifest = hwrd.client().lookup(s.key(ident))
    extra = manifest.identity.document["extra"]["vllm_omni"]
    assert extra["identity"] == ident.canonical_bytes.decode() and extra["key"] == ident.key
    assert extra["domain"] == {"root": str((tmp_path / "root").resolve()), "scope": "node", "domain_id": "node"}
    record = manifest.annotations["data"]["vllm_omni"]
    assert record["tensor_classes"] == {"scale": ["buffer", "persistent_buffer"]}
    # vLLM-Omni's format metadata keeps its float as canonical text (HWR's annotations hold none).
    assert record["format_metadata"] == '{"policy":"test","ratio":0.5}'
    assert res.lease.manifest.format_metadata.to_value() == {"policy": "test", "ratio": 0.5}
    # The vLLM-Omni manifest: its content digest over its own records, its
    # file names, HWR's blobs.
    wm = res.lease.manifest
    assert [f.file_name for f in wm.files] == ["model-00000.safetensors", "model-00001.safetensors"]
    assert {f.sha256 for f in wm.files} == {f.blob for f in manifest.files}
    # Its per-tensor SHA-256s: the HWR manifest holds them (format 1, PlanSpec.tensor_sha256).
    assert manifest.format_version == 1
    assert {t.name: t.sha256 for t in wm.tensors} == {t.name: t.sha256 for t in manifest.tensors}
    assert all(len(t.sha256) == 64 for t in wm.tensors)
    assert res.lease.provenance.identity_digest == ident.key and res.lease.provenance.validation_level == META.value


def test_same_identity_in_another_root_is_another_artifact_with_shared_blobs(hwrd, tmp_path):
    ident = vo.identity(api, name="domains")
    a, b = store(tmp_path / "a"), store(tmp_path / "b")
    assert a.key(ident) != b.key(ident)
    for s in (a, b):
        res = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights()), validation=META,
                             deadline=deadline())
        assert res.status is S.BUILT
        res.lease.close()
    ma, mb = (hwrd.client().lookup(s.key(ident)) for s in (a, b))
    assert [f.blob for f in ma.files] == [f.blob for f in mb.files]  # the bytes are stored once


def test_joined_when_another_builder_publishes_while_we_wait(hwrd, tmp_path):
    ident = vo.identity(api, name="joined")
    started, go, b_looked = threading.Event(), threading.Event(), threading.Event()

    def hold(_writer):
        started.set()
        assert go.wait(30)

    a_producer = vo.Producer(api, ident, vo.weights(), before=hold)
    b_producer = vo.Producer(api, ident, vo.weights())
    a, b = store(tmp_path), store(tmp_path)
    b_lookup = b.lookup

    def observed_lookup(*args, **kwargs):
        result = b_lookup(*args, **kwargs)
        b_looked.set()
        return result

    b.lookup = observed_lookup  # observes when B has missed and goes for the build lock
    results = {}
    ta = threading.Thread(target=lambda: results.__setitem__("a", a.get_or_build(
        api.BuildRequest(ident), a_producer, validation=META, deadline=deadline())))
    ta.start()
    assert started.wait(30)
    tb = threading.Thread(target=lambda: results.__setitem__("b", b.get_or_build(
        api.BuildRequest(ident), b_producer, validation=META, deadline=deadline())))
    tb.start()
    assert b_looked.wait(30)
    go.set()
    ta.join(60)
    tb.join(60)
    assert results["a"].status is S.BUILT and results["b"].status is S.JOINED
    assert (a_producer.calls, b_producer.calls) == (1, 0)
    for r in results.values():
        r.lease.close()


def test_lease_is_vllm_omnis_class_with_per_tensor_storages_and_releases_the_hwr_lease(hwrd, tmp_path):
    ident = vo.identity(api, name="lease")
    s = store(tmp_path)
    res = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights(), per_file=2),
                         validation=api.ValidationLevel.FULL_CHECKSUM, deadline=deadline())
    lease = res.lease
    assert type(lease) is api.HostWeightLease
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in lease.tensors.values()}
    assert len(storages) == len(lease.tensors)
    for t in lease.tensors.values():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert sum(r.address <= lo and hi <= r.address + r.length for r in lease.mapped_regions) == 1
    assert len(lease.mapped_regions) == len(lease.manifest.files) == 3
    client = hwrd.client()
    held = [x for x in client.call(client.reader.ListLeases, pb.ListLeasesRequest()).leases if x.key == s.key(ident)]
    assert len(held) == 1
    lease.close()
    held = [x for x in client.call(client.reader.ListLeases, pb.ListLeasesRequest()).leases if x.key == s.key(ident)]
    assert held == []


def test_damaged_bytes_are_invalid_then_rebuilt(hwrd, tmp_path):
    ident = vo.identity(api, name="damaged")
    s = store(tmp_path)
    producer = vo.Producer(api, ident, vo.weights())
    s.get_or_build(api.BuildRequest(ident), producer, validation=META, deadline=deadline()).lease.close()
    with hwrd.client().acquire(s.key(ident)) as hwr_lease:
        path = hwr_lease.paths[0]
        offset = hwr_lease.manifest.tensors[0].offset
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    # FULL_CHECKSUM finds it: INVALID (the daemon confirms and quarantines).
    found = s.lookup(ident, validation=api.ValidationLevel.FULL_CHECKSUM)
    assert found.status is S.INVALID and found.failure.code is api.FailureCode.CHECKSUM_MISMATCH
    # Quarantined: INVALID for any lookup, and the runtime's producer rebuilds it.
    again = s.lookup(ident, validation=META)
    assert again.status is S.INVALID and again.failure.code is api.FailureCode.ARTIFACT_DENIED
    assert not again.failure.retryable
    rebuilt = s.get_or_build(api.BuildRequest(ident), producer, validation=META, deadline=deadline())
    assert rebuilt.status is S.BUILT and producer.calls == 2
    assert torch.equal(rebuilt.lease.tensors["blocks.0.attn.bias"], producer.tensors["blocks.0.attn.bias"])
    rebuilt.lease.close()


def test_an_artifact_that_is_not_exactly_the_identity_is_invalid(hwrd, tmp_path, monkeypatch):
    a, b = vo.identity(api, name="exact-a"), vo.identity(api, name="exact-b")
    s = store(tmp_path)
    s.get_or_build(api.BuildRequest(a), vo.Producer(api, a, vo.weights()), validation=META,
                   deadline=deadline()).lease.close()
    # The seam: B's key mapped onto A's artifact, as a collision of keys would.
    real_key = s.key
    monkeypatch.setattr(s, "key", lambda ident: real_key(a))
    wrong = s.lookup(b, validation=META)
    assert wrong.status is S.INVALID and wrong.failure.code is api.FailureCode.MANIFEST_INCOMPATIBLE
    assert "differs from the requested" in wrong.failure.message
    monkeypatch.undo()
    # An HWR artifact under the right identity but not written by the adapter (no record).
    from dlo_runtime.integrations.vllm_omni.records import hwr_identity

    c = vo.identity(api, name="exact-c")
    hwrd.client().publish(hwr_identity(c, s.domain), vo.weights())
    bare = s.lookup(c, validation=META)
    assert bare.status is S.INVALID and bare.failure.code is api.FailureCode.MANIFEST_INCOMPATIBLE
    client = hwrd.client()
    assert all(x.key != s.key(c) for x in client.call(client.reader.ListLeases, pb.ListLeasesRequest()).leases)


def test_refusals_are_typed_values(hwrd, tmp_path):
    # A dtype HWR has no name for: not retryable, as a configuration error.
    odd = vo.identity(api, name="odd", dtype="torch.complex64")
    res = store(tmp_path).lookup(odd, validation=META)
    assert res.status is S.FAILED and res.failure.code is api.FailureCode.UNSUPPORTED and not res.failure.retryable
    # What vLLM-Omni's own store refuses at construction, refused alike.
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(
        api, str(tmp_path / "v"), integrity=api.IntegrityPolicy(local_lookup=api.ValidationLevel.FS_VERITY)))
    assert rt._initialization_failure.code is api.FailureCode.UNSUPPORTED
    # A root that is a file: retryable; one others may write: not.
    (tmp_path / "file").write_text("x")
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "file")))
    assert rt._initialization_failure.code is api.FailureCode.DOMAIN_UNAVAILABLE
    assert rt._initialization_failure.retryable
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "open")))
    assert not rt._initialization_failure.retryable
    assert rt.resolve(vo.identity(api, name="x")).report.outcome is api.ResolutionOutcome.FAILED
    # Producers vLLM-Omni's store refuses.
    ident = vo.identity(api, name="scope")
    other = vo.Producer(api, vo.identity(api, name="other"), vo.weights())
    res = store(tmp_path).get_or_build(api.BuildRequest(ident), other, validation=META, deadline=deadline())
    assert res.status is S.FAILED and res.failure.code is api.FailureCode.PRODUCER_UNAVAILABLE


def test_cleanup_removes_unleased_artifacts_only(hwrd, tmp_path):
    ident = vo.identity(api, name="cleanup")
    s = store(tmp_path)
    lease = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, vo.weights()), validation=META,
                           deadline=deadline()).lease
    busy = s.cleanup(ident)
    assert busy.code is api.FailureCode.ACTIVE_LEASE and busy.retryable
    lease.close()
    assert s.cleanup(ident) is None
    assert s.lookup(ident, validation=META).status is S.MISS
    assert s.cleanup(ident) is None  # nothing left: nothing to do


def test_install_is_pinned_reversible_and_switched_by_the_plugin(hwrd, tmp_path, monkeypatch):
    import vllm_omni.host_weight_runtime.filesystem as fs

    assert adapter.installed() and issubclass(fs.FilesystemHostWeightStore, HwrHostWeightStore)
    assert fs.FilesystemHostWeightStore.settings.socket == hwrd.socket
    adapter.uninstall()
    try:
        assert not adapter.installed() and fs.FilesystemHostWeightStore.__name__ == "FilesystemHostWeightStore"
        rt = api.HostWeightRuntime.from_config(vo.runtime_config(api, str(tmp_path / "fs")))
        assert not isinstance(rt.store, HwrHostWeightStore)  # vLLM-Omni's own store again
        # The plugin does nothing unless switched on, then installs with HWR_SOCKET.
        monkeypatch.delenv(adapter.ENV_SWITCH, raising=False)
        adapter.plugin()
        assert not adapter.installed()
        monkeypatch.setenv(adapter.ENV_SWITCH, "1")
        monkeypatch.setenv("HWR_SOCKET", hwrd.socket)
        adapter.plugin()
        assert adapter.installed() and fs.FilesystemHostWeightStore.settings.socket == hwrd.socket
        # Another vLLM-Omni version is refused with a clear error, and nothing changes.
        adapter.uninstall()
        monkeypatch.setattr(install_mod.importlib.metadata, "version", lambda name: "0.31.0")
        with pytest.raises(FailedPrecondition, match=r"vllm-omni 0.31.0 is installed.*tested only with 0.30.0"):
            adapter.install(socket=hwrd.socket)
        with pytest.raises(FailedPrecondition, match="0.31.0"):
            adapter.plugin()
        assert not adapter.installed()
    finally:
        monkeypatch.undo()
        adapter.install(socket=hwrd.socket, admin_socket=hwrd.admin_socket)
    assert importlib.metadata.version("vllm-omni") in adapter.SUPPORTED_VERSIONS


def test_the_plugin_is_registered_in_vllm_omnis_entry_point_group():
    with open(os.path.join(REPO_DIR, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f)["project"]["entry-points"]
    target = groups["vllm_omni.general_plugins"]["hwr"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is adapter.plugin


def test_fp8_fnuz_round_trips_through_the_store(hwrd, tmp_path):
    ident = vo.identity(api, name="fnuz", dtype="torch.float8_e4m3fnuz")
    tensors = {"blocks.0.w": torch.randn(8, 8).to(torch.float8_e4m3fnuz),
               "blocks.0.v": torch.randn(4).to(torch.float8_e5m2fnuz), "scale": torch.tensor(0.5)}
    s = store(tmp_path)
    res = s.get_or_build(api.BuildRequest(ident), vo.Producer(api, ident, tensors), validation=META,
                         deadline=deadline())
    assert res.status is S.BUILT, res.failure
    for name, t in tensors.items():
        got = res.lease.tensors[name]
        assert got.dtype is t.dtype and torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert {e.dtype for e in res.lease.manifest.tensors} >= {"torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz"}
    res.lease.close()

