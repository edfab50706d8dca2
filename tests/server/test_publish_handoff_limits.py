"""The node's publication limits on the handoff transport, where the bytes
arrive by the client's pwrite into a file the daemon does not watch:

- capacity is admitted as bytes arrive, never for sizes claimed: a file's
  data size when its descriptor is first handed out (the branch before the
  merge collected for the whole plan at the first descriptor);
- nothing is preallocated: a full disk is the client's ENOSPC at pwrite,
  RESOURCE_EXHAUSTED, and nothing is left;
- the minimum rate counts the bytes each ``written`` newly reports: a client
  that trickles its progress, or claims every byte at once and then idles,
  ends ABORTED by ``publication_min_bytes_per_s``.

Against the real daemon; assertions on status codes, config-field names and
the artifacts left.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import ResourceExhausted
from hwr_client.handoff import write_file
from hwr_client.tensors import iter_payload
from tests.conftest import identity
from tests.server.test_hostile_publications import assert_nothing_left, key_of
from tests.support.handoff import RawHandoff
from tests.support.shared_node import toml

MiB = 1 << 20


def _mib(n: int, v: float, blocks: int = 1) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.full((n * MiB // 4 // blocks,), float(v + i)) for i in range(blocks)}


def _keys(node) -> set[str]:
    with node.client() as c:
        return {a.key for a in c.call(c.admin.ListArtifacts, pb.ListArtifactsRequest()).artifacts}


def _configured(make_daemon_fixture, tmp_path, fields: dict, *args: str, root: str | None = None):
    path = tmp_path / f"limits-{len(os.listdir(tmp_path))}.toml"
    path.write_text(toml(fields))
    return make_daemon_fixture("--config", str(path), *args, root=root)


def test_a_descriptor_admits_its_own_file_only(make_daemon_fixture, tmp_path):
    """Capacity 100 MiB, three unleased 24 MiB artifacts (high watermark 90
    MiB). A 40 MiB plan in five 8 MiB files whose client takes file 0's
    descriptor, writes it and goes away deletes none of them; the whole
    publication deletes one, as much as its bytes need."""
    node = _configured(make_daemon_fixture, tmp_path, {}, "--capacity", "100MiB")
    with node.client() as c:
        kept = {c.publish(identity(t=f"kept{v}"), _mib(24, v)).key for v in (1, 2, 3)}
    tensors = _mib(40, 7, blocks=5)
    with node.client() as c:
        raw = RawHandoff(c, identity(t="one-file"), tensors, file_target_bytes=8 * MiB)
        assert raw.token and len(raw.checked.layouts) == 5
        raw.write(0)
        assert _keys(node) == kept
        raw.cancel()
    _no_staging(node)
    assert _keys(node) == kept
    with node.client() as c:
        report = c.publish(identity(t="one-file"), tensors, file_target_bytes=8 * MiB)
        assert report.transport == "handoff"
    left = _keys(node)
    assert report.key in left and len(left & kept) == 2, left


def _no_staging(node) -> None:
    deadline = time.monotonic() + 10  # the stream's teardown runs just after the status
    while os.listdir(os.path.join(node.root, "staging")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(os.path.join(node.root, "staging")) == []


def _trickle(raw: RawHandoff, claims, every_s: float) -> tuple[grpc.StatusCode, str]:
    """Sends file 0's progress claims, one per ``every_s``, until the call ends."""
    for nbytes in claims:
        if raw.call.done():
            break
        raw.written(0, complete=False, nbytes=nbytes)
        time.sleep(every_s)
    code, details, _ = raw.result()
    return code, details


@pytest.mark.parametrize("how", ["trickled", "claimed-at-once"])
def test_the_rate_floor_counts_what_written_reports(make_daemon_fixture, tmp_path, how):
    """A client that holds its descriptor and reports a byte more every
    0.3 s never trips the idle deadline (2 s); one that claims the whole
    file at once and then repeats the claim gains one rate window, not
    more. Both end ABORTED by publication_min_bytes_per_s (64 KiB/s), their
    staging removed."""
    d = _configured(make_daemon_fixture, tmp_path, {"publication_idle_s": 2.0,
                                                     "publication_min_bytes_per_s": 64 * 1024})
    tensors = _mib(1, 3)
    with d.client() as c:
        raw = RawHandoff(c, identity(t=how), tensors, timeout=120)
        size = raw.checked.layouts[0].data_size
        assert size > 2 * 64 * 1024  # the whole file covers one 2 s window, not two
        fd = raw.fd(0)
        try:
            claims = range(1, 400) if how == "trickled" else [size] * 400
            code, details = _trickle(raw, claims, 0.3)
        finally:
            os.close(fd)
    assert code == grpc.StatusCode.ABORTED and "publication_min_bytes_per_s" in details, (code, details)
    assert_nothing_left(d, key_of(how))


def test_a_slow_honest_client_passes_the_floor(make_daemon_fixture, tmp_path):
    """256 KiB every 0.4 s, each followed by its `written` progress: well
    over the floor of 64 KiB/s across several 1 s windows of waiting. It
    publishes (were `written` not counted, the first window would end it)."""
    d = _configured(make_daemon_fixture, tmp_path, {"publication_idle_s": 1.0,
                                                     "publication_min_bytes_per_s": 64 * 1024})
    tensors = _mib(2, 4)
    with d.client() as c:
        raw = RawHandoff(c, identity(t="slow"), tensors, timeout=120)
        lay = raw.checked.layouts[0]
        fd = raw.fd(0)
        try:
            done = 0
            for off, data in iter_payload(lay, tensors, 256 * 1024):
                os.pwrite(fd, data, lay.data_start + off)
                done += len(data)
                raw.written(0, complete=False, nbytes=done)
                time.sleep(0.4)
        finally:
            os.close(fd)
        raw.written(0)
        code, details, last = raw.commit()
    assert code == grpc.StatusCode.OK and last.WhichOneof("kind") == "committed", (code, details)
    assert done == lay.data_size and done // (256 * 1024) >= 8  # 3.2 s of waiting: three windows at least


def _fill(path: str) -> None:
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\xff" * size)
            except OSError:
                pass


def test_a_full_disk_is_the_clients_enospc(make_daemon_fixture, small_disk, tmp_path):
    """Nothing is preallocated: the plan fits, the descriptor is handed out,
    then the disk fills; the client's pwrite gets ENOSPC, which is
    RESOURCE_EXHAUSTED, and nothing is left. With the disk still full, the
    next descriptor is refused by the admission (the store's space check)."""
    d = make_daemon_fixture(root=os.path.join(small_disk, "root"))
    tensors = _mib(16, 5, blocks=2)
    filler = os.path.join(small_disk, "filler")
    with d.client() as c:
        raw = RawHandoff(c, identity(t="fills"), tensors, file_target_bytes=8 * MiB)
        assert len(raw.checked.layouts) == 2
        fd = raw.fd(0)
        try:
            _fill(filler)
            with pytest.raises(ResourceExhausted, match="disk is full"):
                write_file(fd, raw.checked.layouts[0], tensors)
        finally:
            os.close(fd)
        with pytest.raises(ResourceExhausted):
            raw.fd(1)
        raw.cancel()
    assert_nothing_left(d, key_of("fills"))
    os.unlink(filler)
    with d.client() as c:
        report = c.publish(identity(t="fills"), tensors)
        assert report.transport == "handoff" and c.lookup(report.key).key == report.key
