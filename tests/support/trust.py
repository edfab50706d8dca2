"""Helpers of the trust tests: an attacker running as ``nobody`` that
publishes through a daemon's runtime socket, and signing keys."""

from __future__ import annotations

import json
import os
import pwd

from tests.support.privdrop import run_python_as

NOBODY = pwd.getpwnam("nobody")

#: The attacker: publishes each identity with every weight 666.0 (the
#: finding: `blocks.0.w[0,0] = 666.0` loaded by another user's required
#: worker), then looks its first artifact up, which it may use (mapping it
#: needs the store's directory, which a test's temp root keeps from nobody).
_CHILD = r"""
import json, os, sys
import hwr_client
from hwr_client.core._proto import hwr_pb2 as pb
from tests.conftest import sample_tensors
ids = json.loads(os.environ["T_IDS"])
planted = {k: v * 0 + 666 for k, v in sample_tensors(blocks=2).items()}
out = {"uid": os.getuid(), "keys": []}
with hwr_client.connect(os.environ["T_SOCKET"]) as c:
    for ident in ids:
        out["keys"].append(c.publish(ident, planted).key)
    out["own"] = c.call(c.runtime.Lookup, pb.LookupRequest(key=out["keys"][0])).publisher.text
print(json.dumps(out))
"""


def open_to_nobody(daemon) -> None:
    """Lets nobody reach a daemon started with ``--socket-group nogroup``
    (as a worker in group "hwr" would): its socket's directory, which
    mkdtemp made 0700, becomes 0755 (the socket's own mode decides)."""
    os.chmod(os.path.dirname(daemon.socket), 0o755)


def publish_as_nobody(daemon, *idents) -> dict:
    """Runs the attacker as nobody; returns {"uid", "keys", "own"}."""
    env = dict(os.environ, T_SOCKET=daemon.socket, T_IDS=json.dumps(list(idents)))
    r = run_python_as(NOBODY.pw_uid, NOBODY.pw_gid, _CHILD, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["uid"] == NOBODY.pw_uid
    return out


def new_key(path: str):
    """Writes a fresh signing key file at ``path``; returns (private key, PublicKey)."""
    from hwr_server.remote.signing import generate_key, public_of, write_private_key

    key = generate_key()
    write_private_key(path, key)
    return key, public_of(key.public_key())


def keys_toml(*, signing: str = "", trusted: tuple = ()) -> str:
    """[remote] lines: ``signing_key`` and ``trusted_keys`` (PublicKey objects)."""
    out = f'signing_key = "{signing}"\n' if signing else ""
    if trusted:
        out += "trusted_keys = [" + ", ".join(json.dumps(k.line) for k in trusted) + "]\n"
    return out
