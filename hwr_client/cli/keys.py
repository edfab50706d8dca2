"""Signing keys: ``hwr keys generate | show | rotate PATH`` (docs/trust.md).

A node (or a fleet) signs what it pushes with one Ed25519 key, the file
``[remote] signing_key`` names; nodes that pull list its public half in
``[remote] trusted_keys``. These commands work on the key file directly, as
the user that will read it (the daemon's user: the daemon refuses a key
file another user owns or that others may read), and never talk to the
daemon: it reads the file at each push.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from hwr_client.cli.common import add_json_flag, print_json


def _describe(args: argparse.Namespace, public: Any, **extra: Any) -> None:
    if args.json:
        print_json({"id": public.id, "public_key": public.line, **extra})
    else:
        print(public.line)
        print(f"id {public.id}")
        for k, v in extra.items():
            print(f"{k.replace('_', ' ')} {v}")


def _generate(args: argparse.Namespace) -> int:
    from hwr_server.remote.signing import generate_key, public_of, write_private_key

    key = generate_key()
    write_private_key(args.path, key)
    _describe(args, public_of(key.public_key(), args.comment))
    return 0


def _show(args: argparse.Namespace) -> int:
    from hwr_server.remote.signing import load_private_key, public_of

    _describe(args, public_of(load_private_key(args.path, what="key file").public_key(), args.comment))
    return 0


def _link_unused(path: str, stamp: int) -> str:
    """Hard-links PATH to PATH.<stamp>.old, or PATH.<stamp>-<n>.old when an
    earlier rotation in the same second kept that name: link() never
    replaces, so a kept key is never lost to a second rotation."""
    for n in range(1000):
        kept = f"{path}.{stamp}.old" if n == 0 else f"{path}.{stamp}-{n}.old"
        try:
            os.link(path, kept)
            return kept
        except FileExistsError:
            continue
    raise FileExistsError(f"key file {path}: 1000 kept keys named {path}.{stamp}*.old; delete the old ones")


def _rotate(args: argparse.Namespace) -> int:
    """Replaces the key at PATH, keeping the old one as PATH.<unix>.old.

    Steps: 1. the old key is loaded (and so checked); 2. the new key is
    written to a fresh temporary name beside it (0600, fsynced); 3. the old
    file is hard-linked to its kept name; 4. the new one is renamed over
    PATH (atomic: a push reads the old key or the new one, never none);
    5. the directory is fsynced so both names survive a crash.
    """
    from hwr_server.remote.signing import generate_key, load_private_key, public_of, write_private_key

    old = public_of(load_private_key(args.path, what="key file").public_key(), args.comment)
    new_key = generate_key()
    stamp = int(time.time())
    tmp = f"{args.path}.{os.getpid()}.{stamp}.tmp"
    write_private_key(tmp, new_key)
    try:
        kept = _link_unused(args.path, stamp)
        os.replace(tmp, args.path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(os.path.dirname(os.path.abspath(args.path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    new = public_of(new_key.public_key(), args.comment)
    _describe(args, new, previous_id=old.id, previous_public_key=old.line, previous_key_file=kept)
    if not args.json:
        print("next: list the new public key in [remote] trusted_keys on every pulling node (keep the previous "
              "one until every artifact is pushed again: a push re-signs it with the new key), then remove the "
              "previous key from trusted_keys and delete the .old file")
    return 0


def register(sub: Any) -> None:
    """Adds ``keys generate|show|rotate``."""
    p = sub.add_parser("keys", help="signing keys of pushed artifacts (Ed25519)")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    for name, func, text in (
        ("generate", _generate, "create a new key file (mode 0600; refuses to overwrite) and print its public key"),
        ("show", _show, "print the public key and id of a key file (the line for [remote] trusted_keys)"),
        ("rotate", _rotate, "replace a key file with a new key, keeping the old one as PATH.<unix>.old"),
    ):
        q = keys.add_parser(name, help=text)
        q.add_argument("path", metavar="PATH", help="the private key file ([remote] signing_key)")
        q.add_argument("--comment", default="hwr", help="comment at the end of the public key line")
        add_json_flag(q)
        q.set_defaults(func=func)
