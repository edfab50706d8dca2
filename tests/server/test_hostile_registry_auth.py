"""A hostile registry against a real daemon: where credentials may go, and
which credentials file the daemon trusts. A Bearer realm elsewhere is
never asked (no SSRF, no token forwarded) unless listed in
``token_realms``; basic credentials never go to a plain-HTTP realm of an
https registry; an https->http redirect on the same host:port is refused
before the token goes out in clear. The credentials file: a symbolic
link, a file others may write or read, one of another owner, a FIFO or a
1 GiB file are refused naming the rule (the FIFO without blocking
GetStats), and a rotated file is re-read after the 401."""

from __future__ import annotations

import base64
import json
import os
import threading

import grpc
import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import FailedPrecondition, PermissionDenied
from tests.support.hostile_pull import (  # noqa: F401 - fixtures, used by name
    REPO, hostile, node_for, nothing_visible, pull, source,
)
from tests.support.hostile_registry import HostileRegistry
from tests.support.oci_registry import make_tls


def creds_file(path, host: str, user: str, password: str, *, mode: int = 0o600) -> str:
    """A docker config.json for ``host``, written to a new inode (a rotation
    is a rename over the old one, as `docker login` and config management do)."""
    tmp = f"{path}.new"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}, f)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return str(path)


@pytest.fixture
def service():
    """A loopback service that answers a token to the registry's basic
    credentials: what a realm pointing elsewhere would make the daemon ask."""
    svc = HostileRegistry()
    svc.auth = ("bearer", "", "stolen-token", "u", "p")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls(str(tmp_path_factory.mktemp("tls")))


def test_a_realm_elsewhere_is_never_asked(make_daemon_fixture, tmp_path, source, hostile, service):
    key, config, blobs = source.artifact("realm")
    hostile.add(REPO, config, blobs)
    hostile.auth = ("bearer", f"http://{service.host}/token", "stolen-token", "u", "p")
    cfg = {"credentials_file": creds_file(tmp_path / "c.json", hostile.host, "u", "p")}
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra=cfg)
    with pytest.raises(PermissionDenied, match="token_realms"):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    assert service.take() == []  # not asked, so no credentials sent and no token to forward
    nothing_visible(node)
    # Listed by the operator: the same realm is trusted.
    allowed = node_for(make_daemon_fixture, tmp_path, hostile.host, name="allowed",
                       extra={**cfg, "token_realms": [f"http://{service.host}"]})
    assert pull(allowed, f"{hostile.host}/{REPO}:{key}").key == key
    assert [h.authorization.split()[0] for h in service.take()] == ["Basic"]


def test_basic_credentials_never_go_to_a_plain_http_realm(make_daemon_fixture, tmp_path, source, tls, service):
    """An https registry naming a plain-http realm: refused before the
    allow-list is even consulted (it would carry the password in clear)."""
    key, config, blobs = source.artifact("downgrade-realm")
    reg = HostileRegistry(tls=tls)
    try:
        reg.add(REPO, config, blobs)
        reg.auth = ("bearer", f"http://{service.host}/token", "stolen-token", "u", "p")
        cfg = {"credentials_file": creds_file(tmp_path / "c.json", reg.host, "u", "p")}
        node = node_for(make_daemon_fixture, tmp_path, reg.host, https=True, ca_file=tls[2], extra=cfg)
        with pytest.raises(PermissionDenied, match="plain-http token realm"):
            pull(node, f"{reg.host}/{REPO}:{key}")
        assert service.take() == []
        nothing_visible(node)
    finally:
        reg.close()


def test_an_https_to_http_redirect_is_refused_before_the_token_leaves(make_daemon_fixture, tmp_path, source, tls):
    """Same host and port, only the scheme changes (the server answers TLS
    and plain HTTP on one port): the landed daemon compared hosts only and
    sent the bearer token in clear."""
    key, config, blobs = source.artifact("downgrade-redirect")
    reg = HostileRegistry(tls=tls)
    try:
        reg.add(REPO, config, blobs)
        reg.auth = ("bearer", f"https://{reg.host}/token", "secret-token", "u", "p")
        reg.redirect_to = f"http://{reg.host}"
        cfg = {"credentials_file": creds_file(tmp_path / "c.json", reg.host, "u", "p")}
        node = node_for(make_daemon_fixture, tmp_path, reg.host, https=True, ca_file=tls[2], extra=cfg)
        with pytest.raises(FailedPrecondition, match="from https to plain http"):
            pull(node, f"{reg.host}/{REPO}:{key}")
        hits = reg.take()
        assert any(h.status == 307 for h in hits)
        assert [h for h in hits if h.scheme == "http"] == []  # nothing at all went out in clear
        nothing_visible(node)
    finally:
        reg.close()


@pytest.mark.parametrize("rule", ["other-writable", "other-readable", "symlink", "owner"])
def test_an_untrusted_credentials_file_is_refused(make_daemon_fixture, tmp_path, source, hostile, rule):
    key, config, blobs = source.artifact(f"creds-{rule}")
    hostile.add(REPO, config, blobs)
    hostile.auth = ("basic", "u", "p")
    path = tmp_path / "c.json"
    creds_file(path, hostile.host, "u", "p", mode={"other-writable": 0o666, "other-readable": 0o644}.get(rule, 0o600))
    expect = {"other-writable": "lets other users write", "other-readable": "lets other users read",
              "symlink": "symbolic link", "owner": "owned by uid"}[rule]
    if rule == "symlink":
        os.symlink(path, tmp_path / "link.json")
        path = tmp_path / "link.json"
    if rule == "owner":
        os.chown(path, 65534, 65534)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra={"credentials_file": str(path)})
    with pytest.raises(FailedPrecondition, match=expect):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    assert [h for h in hostile.take() if h.authorization] == []
    nothing_visible(node)


def test_a_fifo_or_huge_credentials_file_blocks_nothing(make_daemon_fixture, tmp_path, source, hostile):
    """A FIFO: refused at once without a writer (the landed daemon blocked
    in open() holding the remote's lock, and GetStats hung on both
    sockets). A 1 GiB (sparse) file: refused by its size, never read."""
    key, config, blobs = source.artifact("fifo")
    hostile.add(REPO, config, blobs)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o600)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra={"credentials_file": str(fifo)})
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            pull(node, f"{hostile.host}/{REPO}:{key}", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=run)
    t.start()
    with node.client() as c:
        for stub in (c.reader, c.admin):  # the runtime socket's reader, then the admin socket
            try:
                c.call(stub.GetStats, pb.GetStatsRequest(), timeout=10)
            except grpc.RpcError as err:  # pragma: no cover - the failure this test exists for
                pytest.fail(f"GetStats while a pull opens a FIFO: {err.code().name}")
    t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], FailedPrecondition), outcome
    assert "not a regular file" in str(outcome[0])
    huge = tmp_path / "huge.json"
    with open(os.open(huge, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.truncate(1 << 30)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, name="huge", extra={"credentials_file": str(huge)})
    with pytest.raises(FailedPrecondition, match="larger than"):
        pull(node, f"{hostile.host}/{REPO}:{key}")


def test_a_rotated_credentials_file_is_read_again_after_a_401(make_daemon_fixture, tmp_path, source, hostile):
    key, config, blobs = source.artifact("rotate")
    hostile.add(REPO, config, blobs)
    hostile.auth = ("basic", "u", "new-password")
    path = creds_file(tmp_path / "c.json", hostile.host, "u", "old-password")
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra={"credentials_file": path})
    with pytest.raises(PermissionDenied):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    creds_file(path, hostile.host, "u", "new-password")  # rotated; the daemon keeps running
    assert pull(node, f"{hostile.host}/{REPO}:{key}").key == key
    assert "credentials file changed" in node.log()
