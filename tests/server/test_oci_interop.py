"""Pushed artifacts that standard OCI tools can read (docs/many-nodes.md,
"Reading an artifact with standard tools"): the ORAS Python SDK pulls every
payload file of an artifact pushed to the real registry under its name,
each hashing to the blob it came from, and a directory ORAS pulled imports
back with ``hwr import`` to the same key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import oras.provider
import pytest

from hwr_client.core.errors import FailedPrecondition
from hwr_server.remote.oci import FILEPATH_ANNOTATION, TITLE_ANNOTATION, file_titles
from hwr_server.remote.registry import RegistryClient
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.oci_nodes import nothing_left, publish, pull, push


def test_oras_pulls_every_file_under_its_name_and_hwr_import_takes_them_back(nodes, registry, tmp_path):
    reg, _ = registry
    repo = "hwr/oras"
    a = nodes(repo)
    key = publish(a, "oras")  # one file per block: several layers
    with a.client() as c:
        manifest = c.lookup(key)
    assert len(manifest.files) > 2
    done = push(a, key, f"{reg.host}/{repo}")
    target = f"{reg.host}/{repo}:{key}"
    client = oras.provider.Registry(insecure=True)
    oci = client.get_manifest(target)
    assert oci["layers"] and all(lay["annotations"][TITLE_ANNOTATION] == lay["annotations"][FILEPATH_ANNOTATION]
                                 for lay in oci["layers"])
    outdir = tmp_path / "pulled"
    files = client.pull(target=target, outdir=str(outdir))
    assert sorted(os.path.basename(f) for f in files) == sorted(f.name for f in manifest.files)
    assert sorted(os.listdir(outdir)) == sorted(f.name for f in manifest.files)  # nothing else arrived
    for f in manifest.files:
        with open(outdir / f.name, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == f.blob
    # The config blob is the HWR manifest (`oras manifest fetch-config`):
    # it holds the identity `hwr import` needs.
    config = str(tmp_path / "manifest.json")
    client.download_blob(target, oci["config"]["digest"], config)
    with open(config, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == oci["config"]["digest"][7:]
    b = nodes()
    r = b.cli("import", "--identity", config, "--json", *(str(outdir / f.name) for f in manifest.files))
    assert r.returncode == 0, r.stderr
    imported = json.loads(r.stdout)
    assert imported["key"] == key == done.key
    assert imported["content_digest"] == manifest.content_digest
    with b.client() as c:
        again = c.lookup(key)
    assert {t.name: t.sha256 for t in again.tensors} == {t.name: t.sha256 for t in manifest.tensors}


def test_a_pull_refuses_a_title_that_is_not_a_safe_file_name(nodes, registry):
    reg, proxy = registry
    repo = "hwr/titles"
    a = nodes(repo)
    key = publish(a, "titles")
    done = push(a, key, f"{reg.host}/{repo}")
    client = RegistryClient(reg.host, insecure=True)
    raw, ctype = client.get_manifest(repo, done.manifest_digest, limit=1 << 20)
    doc = json.loads(raw)
    b = nodes(repo)
    for bad in ("../../etc/evil", "a/b", "..", "line\nbreak", "nul\x00"):
        doc["layers"][0]["annotations"][TITLE_ANNOTATION] = bad
        body = json.dumps(doc).encode()
        digest = client.put_manifest(repo, "sha256:" + hashlib.sha256(body).hexdigest(), body, ctype)
        with pytest.raises(FailedPrecondition, match="is not a safe file name"):
            pull(b, f"{proxy.host}/{repo}@{digest}")
        nothing_left(b)


def test_titles_fall_back_to_indexes_when_names_are_not_safe_or_unique(nodes):
    a = nodes()
    key = publish(a, "names")
    with a.client() as c:
        manifest = c.lookup(key)
    assert file_titles(manifest) == [f.name for f in manifest.files]

    def renamed(*names: str):
        files = tuple(dataclasses.replace(f, name=n) for f, n in zip(manifest.files, names))
        return dataclasses.replace(manifest, files=files)

    rest = [f.name for f in manifest.files[2:]]
    for names in (["x.safetensors", "x.safetensors", *rest], ["../up", "ok", *rest], ["dir/x", "ok", *rest]):
        assert file_titles(renamed(*names)) == [f"{i:05d}.safetensors" for i in range(len(manifest.files))]
