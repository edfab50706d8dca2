"""A hostile registry against a real daemon: what a pulled artifact may be.
The plan limits a publication is held to (files, tensors, manifest bytes)
are applied to a pulled manifest before its payload is fetched; its labels
get the publication's checks (a NUL refused) and reach the log escaped (a
newline cannot forge a daemon log line; the same for a publication's
label in a refusal); and a stored blob whose bytes rotted is not linked
into a pull: the layer is fetched again and the pulled artifact verifies."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument, ResourceExhausted
from hwr_client.core.plan import to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity
from tests.support.hostile_pull import (  # noqa: F401 - fixtures, used by name
    REPO, hostile, node_for, nothing_visible, pull, source,
)
from tests.support.oci_nodes import BASE, SECOND, blob_gets, publish
from tests.support.oci_nodes import push as push_to
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.raw_publish import COMMIT, StatusCode, chunks, raw_publish

FORGED = "2099-01-01 00:00:00,000 INFO hwr_server.daemon: FORGED"


def _fetched(hits) -> list[str]:
    return [h.path.rsplit("/", 1)[-1] for h in hits if h.method == "GET" and "/blobs/" in h.path]


@pytest.mark.parametrize("limit,field", [({"max_artifact_files": 3}, "max_artifact_files"),
                                         ({"max_artifact_tensors": 8}, "max_artifact_tensors"),
                                         ({"max_manifest_bytes": 4096}, "max_manifest_bytes")])
def test_a_pulled_artifact_is_held_to_the_plan_limits(make_daemon_fixture, tmp_path, source, hostile, limit, field):
    """Four files, 14 tensors, a manifest of ~10 KB: each over one limit of
    the pulling node, refused before any layer is fetched (files and
    manifest size: before the config is)."""
    key, config, blobs = source.artifact(f"limits-{field}", file_target_bytes=1)
    doc = json.loads(config)
    assert len(doc["files"]) > 3 and len(doc["tensors"]) > 8 and len(config) > 4096
    hostile.add(REPO, config, blobs)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, top=limit)
    with pytest.raises(ResourceExhausted, match=field):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    fetched = _fetched(hostile.take())
    assert not set(fetched) & set(blobs), fetched  # no layer
    if field != "max_artifact_tensors":
        assert fetched == [], fetched  # not even the config
    nothing_visible(node)


def _forged(config: bytes, name: str) -> bytes:
    doc = json.loads(config)
    doc["files"][0]["name"] = name
    return json.dumps(doc).encode()


def test_a_nul_in_a_pulled_label_is_refused(make_daemon_fixture, tmp_path, source, hostile):
    key, config, blobs = source.artifact("nul")
    hostile.add(REPO, _forged(config, "weights\x00hidden"), blobs)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host)
    with pytest.raises(InvalidArgument, match=r"files\[0\].name contains a NUL"):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    assert not set(_fetched(hostile.take())) & set(blobs)
    nothing_visible(node)


def test_a_pulled_label_cannot_forge_a_log_line(make_daemon_fixture, tmp_path, source, hostile):
    """A label with a newline (accepted, as for a publication) reaches the
    warning a broken layer logs: escaped, one line."""
    key, config, blobs = source.artifact("newline")
    hostile.add(REPO, _forged(config, f"weights\n{FORGED}"), blobs)
    layer = json.loads(config)["files"][0]["blob"]
    hostile.cut = {layer: 100}  # file 0 breaks off once: "broke off ... resuming" names it
    node = node_for(make_daemon_fixture, tmp_path, hostile.host)
    assert pull(node, f"{hostile.host}/{REPO}:{key}").key == key
    log = node.log()
    assert "weights\\n2099-01-01" in log, log[-3000:]
    assert not [line for line in log.splitlines() if line.startswith("2099-01-01")], log[-3000:]


def test_a_published_label_cannot_forge_a_log_line(daemon):
    """A publication whose file label holds a newline and whose declared
    digest is wrong: the refusal names the label, and its log line stays one line."""
    tensors = {"w": torch.ones(4)}
    plan = build_plan(identity(t="forge"), tensors)
    msg = to_proto(plan)
    msg.files[0].name = f"f\n{FORGED}"
    msg.files[0].declared_sha256 = "0" * 64
    with daemon.client() as c:
        code, details = raw_publish(c, [pb.PublishRequest(plan=msg), *chunks(plan, tensors, 1 << 20), COMMIT])
    assert code == StatusCode.FAILED_PRECONDITION and FORGED in details, (code, details)
    log = daemon.log()
    assert "f\\n2099-01-01" in log, log[-3000:]
    assert not [line for line in log.splitlines() if line.startswith("2099-01-01")], log[-3000:]


def test_a_rotted_stored_blob_is_fetched_again_not_linked(nodes, registry):
    """Node C holds BASE; SECOND shares BASE's non-block file. That stored
    blob rots (same size, other bytes); pulling SECOND fetches the shared
    layer again instead of linking the rotten copy, the commit replaces the
    stored copy, and both artifacts verify (the landed daemon linked it by
    name and size and committed a corrupt artifact)."""
    _, proxy = registry
    a, c = nodes(), nodes()
    second = publish(a, "rot-second", SECOND)
    ref = f"{proxy.host}/hwr/rot"
    push_to(a, second, ref)
    base = publish(c, "rot-base", BASE)
    with a.client() as al, c.client() as cl:
        shared = {f.blob for f in cl.lookup(base).files} & {f.blob for f in al.lookup(second).files}
    assert len(shared) == 1
    (blob,) = shared
    path = os.path.join(c.root, "blobs", "sha256", blob)
    with open(path, "r+b") as f:  # root writes through the 0444 mode, in place: the bytes rot
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 64)
    proxy.take()
    assert pull(c, f"{ref}:{second}").key == second
    assert "sha256:" + blob in blob_gets(proxy.take())
    assert c.cli("verify", second).returncode == 0
    assert c.cli("verify", base).returncode == 0  # the fresh copy replaced the rotten one for BASE too
