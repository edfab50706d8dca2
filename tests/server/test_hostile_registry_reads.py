"""A hostile registry against a real daemon: what the daemon reads of an
answer, and how long it waits for one. Bodies of a 401 and of a redirect
are never read (the daemon's peak RSS stays put under a 512 MiB body), a
layer trickled a byte at a time is cut at the minimum rate (holding one
preallocation step of disk, not the claimed size), a response head
trickled a byte at a time is cut at ``timeout_s``, and a registry that
ignores ``Range`` is read from the start instead of failing the pull."""

from __future__ import annotations

import threading

import pytest
import torch

from hwr_client.core.errors import PermissionDenied, Unavailable
from tests.support.hostile_pull import (  # noqa: F401 - fixtures, used by name
    MiB, REPO, hostile, node_for, nothing_visible, peak_rss_mib, pull, pull_on_miss, source, staging_bytes,
)

BOMB = 512 * MiB
#: Peak RSS the daemon may gain while a bomb is thrown at it (the bomb is 512 MiB).
RSS_SLACK_MIB = 96


def test_a_401_body_is_never_read(make_daemon_fixture, tmp_path, source, hostile):
    """PullOnMiss (a runtime rpc: any user of the socket) against a registry
    whose 401 carries 512 MiB: refused for want of credentials, the body
    never read (the landed daemon read it whole: peak RSS +512 MiB)."""
    key, config, blobs = source.artifact("401")
    hostile.add(REPO, config, blobs)
    hostile.auth = ("basic", "u", "p")
    hostile.unauthorized_body = BOMB
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, pull_on_miss=True)
    before = peak_rss_mib(node)
    with pytest.raises(PermissionDenied, match="credentials"):
        pull_on_miss(node, key, timeout=120)
    assert peak_rss_mib(node) - before < RSS_SLACK_MIB, (before, peak_rss_mib(node))
    sent = [h.body_bytes for h in hostile.take() if h.status == 401]
    assert sent and max(sent) < 64 * MiB, sent  # the daemon hung up; the rest never left the server
    nothing_visible(node)


def test_a_redirect_body_is_never_read(make_daemon_fixture, tmp_path, source, hostile):
    """Every blob GET answered 307 with 512 MiB of body: the redirect is
    followed, its body never read, and the pull completes."""
    key, config, blobs = source.artifact("307")
    hostile.add(REPO, config, blobs)
    hostile.redirect_body = BOMB
    node = node_for(make_daemon_fixture, tmp_path, hostile.host)
    before = peak_rss_mib(node)
    assert pull(node, f"{hostile.host}/{REPO}:{key}", timeout=300).key == key
    assert peak_rss_mib(node) - before < RSS_SLACK_MIB, (before, peak_rss_mib(node))
    hops = [h for h in hostile.take() if h.status == 307]
    assert hops and max(h.body_bytes for h in hops) < 64 * MiB, hops
    assert node.cli("verify", key).returncode == 0


def _big(source, tag: str):
    """One 40 MiB layer."""
    return source.artifact(tag, {"blocks.0.w": torch.full((10 * MiB,), 1.0)})


def test_a_trickled_layer_is_cut_at_the_minimum_rate(make_daemon_fixture, tmp_path, source, hostile):
    """A byte every 50 ms of a 40 MiB layer: cut once a ``timeout_s`` window
    (2 s) brought less than ``min_rate_bytes``; staging held one
    preallocation step, not the 40 MiB the registry claimed, and is removed
    (the landed daemon preallocated the claim and waited for ever)."""
    key, config, blobs = _big(source, "trickle")
    hostile.add(REPO, config, blobs)
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra={"timeout_s": 2.0, "layer_attempts": 1})
    hostile.trickle_s, (hostile.trickle_blob,) = 0.05, blobs
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pull(node, f"{hostile.host}/{REPO}:{key}", timeout=60)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert hostile.trickling.wait(60)
    held = staging_bytes(node)
    t.join(90)
    assert not t.is_alive()
    assert held < 20 * MiB, held
    assert len(errors) == 1 and isinstance(errors[0], Unavailable), errors
    assert "min_rate_bytes" in str(errors[0]), errors[0]
    nothing_visible(node)


def test_a_trickled_response_head_is_cut_at_the_timeout(make_daemon_fixture, tmp_path, source, hostile):
    """Status line and headers at a byte every 0.5 s (each recv well inside
    the socket timeout, the whole head ~75 s): cut after ``timeout_s``."""
    key, config, blobs = source.artifact("head")
    hostile.add(REPO, config, blobs)
    hostile.head_trickle_s = 0.5
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, extra={"timeout_s": 2.0})
    with pytest.raises(Unavailable, match="timeout_s"):
        pull(node, f"{hostile.host}/{REPO}:{key}", timeout=40)
    nothing_visible(node)


def test_a_registry_that_ignores_range_is_read_from_the_start(make_daemon_fixture, tmp_path, source, hostile):
    """The first GET of the layer breaks off after 1000 bytes; the resume's
    Range is answered 200 with the whole blob (RFC 9110 allows it): the
    daemon starts the layer over and commits (the landed one refused the
    200 and failed the pull for good)."""
    key, config, blobs = source.artifact("range", {"blocks.0.w": torch.arange(262144, dtype=torch.float32)})
    hostile.add(REPO, config, blobs)
    (layer,) = blobs
    hostile.cut = {layer: 1000}
    hostile.ignore_range = True
    node = node_for(make_daemon_fixture, tmp_path, hostile.host)
    done = pull(node, f"{hostile.host}/{REPO}:{key}")
    assert done.key == key and done.layers_transferred == 1
    gets = [h for h in hostile.take() if h.method == "GET" and h.path.endswith(layer)]
    assert [(bool(h.range), h.status) for h in gets] == [(False, 200), (True, 200)], gets
    assert gets[0].body_bytes == 1000 and gets[1].body_bytes == len(blobs[layer])
    assert node.cli("verify", key).returncode == 0
