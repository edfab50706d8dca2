"""Registry authentication and transport with real daemons: basic auth
against the real registry with an htpasswd file (bcrypt, written by
apache2-utils' ``htpasswd``), the bearer-token flow (a 401
``WWW-Authenticate: Bearer`` challenge, then a token request with the basic
credentials) answered by the test proxy in front of the registry, and TLS:
the real registry serving HTTPS with a certificate of a CA made here."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import FailedPrecondition, PermissionDenied
from tests.conftest import identity, sample_tensors
from tests.support.oci_registry import Proxy, make_registry, make_tls, remote_config

TENSORS = sample_tensors(blocks=2, seed=21)


def htpasswd_file(path: str, user: str, password: str) -> str:
    binary = shutil.which("htpasswd")
    if not binary:
        msg = "htpasswd (apache2-utils) is not installed; the registry needs a bcrypt htpasswd file (.ci/setup installs it)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    line = subprocess.run([binary, "-Bbn", user, password], check=True, capture_output=True, text=True).stdout
    with open(path, "w") as f:
        f.write(line)
    return path


def credentials(path: str, host: str, user: str, password: str) -> str:
    # 0600: the daemon refuses a credentials file other users may read.
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}, f)
    return path


def transfer(node, method: str, request):
    with node.client() as c:
        return c.transfer(getattr(c.admin, method), request)


def test_basic_auth_refuses_wrong_credentials_and_accepts_right_ones(make_daemon_fixture, tmp_path):
    reg = make_registry(str(tmp_path / "reg"), htpasswd=htpasswd_file(str(tmp_path / "htpasswd"), "hwr", "s3cret"))
    try:
        def node(name: str, password: str | None):
            creds = credentials(str(tmp_path / f"{name}.json"), reg.host, "hwr", password) if password else ""
            cfg = remote_config(str(tmp_path / f"{name}.toml"), credentials_file=creds)
            return make_daemon_fixture("--config", cfg, root=str(tmp_path / name))

        good, wrong, none = node("good", "s3cret"), node("wrong", "guess"), node("none", None)
        with good.client() as c:
            key = c.publish(identity(t="auth"), TENSORS).key
        ref = f"{reg.host}/hwr/auth"
        for refused in (wrong, none):
            with refused.client() as c:
                c.publish(identity(t="auth"), TENSORS)
            with pytest.raises(PermissionDenied, match="credentials"):
                transfer(refused, "Push", pb.PushRequest(key=key, reference=ref))
            with refused.client() as c:
                c.call(c.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=key))
        done = transfer(good, "Push", pb.PushRequest(key=key, reference=ref))
        for refused in (wrong, none):
            with pytest.raises(PermissionDenied):
                transfer(refused, "Pull", pb.PullRequest(reference=f"{ref}:{key}"))
            assert os.listdir(os.path.join(refused.root, "staging")) == []
        fresh = node("fresh", "s3cret")
        assert transfer(fresh, "Pull", pb.PullRequest(reference=f"{ref}:{key}")).manifest_digest == done.manifest_digest
        assert fresh.cli("verify", key).returncode == 0
    finally:
        reg.stop()


def test_bearer_token_flow(make_daemon_fixture, tmp_path):
    reg = make_registry(str(tmp_path / "reg"))
    proxy = Proxy(reg.host)
    proxy.bearer = ("robot", "t0ken-pass", "opaque-token-123")
    try:
        creds = credentials(str(tmp_path / "creds.json"), proxy.host, "robot", "t0ken-pass")
        a = make_daemon_fixture("--config", remote_config(str(tmp_path / "a.toml"), credentials_file=creds),
                                root=str(tmp_path / "a"))
        b = make_daemon_fixture("--config", remote_config(str(tmp_path / "b.toml"), credentials_file=creds),
                                root=str(tmp_path / "b"))
        anon = make_daemon_fixture("--config", remote_config(str(tmp_path / "c.toml")), root=str(tmp_path / "c"))
        with a.client() as c:
            key = c.publish(identity(t="bearer"), TENSORS).key
        ref = f"{proxy.host}/hwr/bearer"
        transfer(a, "Push", pb.PushRequest(key=key, reference=ref))
        assert transfer(b, "Pull", pb.PullRequest(reference=f"{ref}:{key}")).key == key
        tokens = [s for s in proxy.take() if s.method == "TOKEN"]
        # One token request per scope and daemon (cached), not one per request.
        assert 1 <= len(tokens) <= 4 and all("service=hwr-test" in s.path for s in tokens), tokens
        with pytest.raises(PermissionDenied):
            transfer(anon, "Pull", pb.PullRequest(reference=f"{ref}:{key}"))
    finally:
        proxy.close()
        reg.stop()


def test_tls_is_verified_against_the_ca_file(make_daemon_fixture, tmp_path):
    cert, key, ca = make_tls(str(tmp_path / "tls"))
    reg = make_registry(str(tmp_path / "reg"), tls=(cert, key, ca))
    repo = "hwr/tls"
    try:
        def node(name: str, ca_file: str):
            cfg = remote_config(str(tmp_path / f"{name}.toml"), https=True, ca_file=ca_file, registry=reg.host,
                                repository=repo, pull_on_miss=True, layer_attempts=1)
            return make_daemon_fixture("--config", cfg, root=str(tmp_path / name))

        a, b, blind = node("a", ca), node("b", ca), node("blind", "")
        with a.client() as c:
            key = c.publish(identity(t="tls"), TENSORS).key
        ref = f"{reg.host}/{repo}"
        pushed = transfer(a, "Push", pb.PushRequest(key=key, reference=ref))
        assert transfer(b, "Pull", pb.PullRequest(reference=f"{ref}:{key}")).manifest_digest == pushed.manifest_digest
        assert b.cli("verify", key).returncode == 0
        # The registry's certificate is not in the system store: without the
        # CA file every way in is refused, naming TLS verification; nothing is left.
        with pytest.raises(FailedPrecondition, match="TLS verification of registry .* failed"):
            transfer(blind, "Pull", pb.PullRequest(reference=f"{ref}:{key}"))
        with blind.client() as c:
            res = c.resolve(identity(t="tls"), mode="preferred")
            assert res.outcome == "CANONICAL_FALLBACK" and "TLS verification" in res.reason, res.reason
            res = c.resolve(identity(t="tls"), mode="required")
            assert res.outcome == "FAILED" and isinstance(res.error, FailedPrecondition)
            assert "ca_file" in str(res.error)
        for sub in ("staging", "artifacts", os.path.join("blobs", "sha256")):
            assert os.listdir(os.path.join(blind.root, sub)) == []
    finally:
        reg.stop()
