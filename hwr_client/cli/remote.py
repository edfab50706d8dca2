"""Registry commands: ``hwr push KEY REF`` and ``hwr pull REF`` (admin socket).

The daemon does the transfer (it reads and commits its own store); the
command prints its progress with MB/s on stderr and the outcome on stdout,
with the signature a push made or a pull verified (docs/trust.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json


def _printer(quiet: bool) -> Callable[[pb.TransferProgress], None]:
    """Progress lines with MB/s on stderr (nothing with --json)."""
    t0 = time.monotonic()

    def show(p: pb.TransferProgress) -> None:
        if quiet:
            return
        secs = max(time.monotonic() - t0, 1e-6)
        sys.stderr.write(f"\r{p.layers_done}/{p.layers_total} layers  {p.bytes_done / 2**20:.1f}/"
                         f"{p.bytes_total / 2**20:.1f} MiB  {p.bytes_done / secs / 1e6:.1f} MB/s")
        sys.stderr.flush()

    return show


def _report(args: argparse.Namespace, done: pb.TransferDone, verb: str) -> int:
    if not args.json and not done.already_present:
        sys.stderr.write("\n")
    mbps = done.bytes_transferred / done.seconds / 1e6 if done.seconds > 0 else 0.0
    if args.json:
        print_json({"key": done.key, "reference": done.reference, "manifest_digest": done.manifest_digest,
                    "bytes_transferred": done.bytes_transferred, "layers_transferred": done.layers_transferred,
                    "layers_skipped": done.layers_skipped, "seconds": round(done.seconds, 3),
                    "mb_per_s": round(mbps, 1), "already_present": done.already_present,
                    "signature_digest": done.signature_digest, "signer": done.signer})
    elif done.already_present:
        print(f"{done.key}: already in the store")
    else:
        print(f"{verb} {done.key[:16]} {done.reference}: {done.layers_transferred} layers "
              f"({done.layers_skipped} skipped), {done.bytes_transferred} bytes in {done.seconds:.2f} s "
              f"({mbps:.1f} MB/s)")
        if done.signer:
            what = f"signature {done.signature_digest} by" if done.signature_digest else "signature verified:"
            print(f"{what} {done.signer}")
    return 0


def _push(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        done = client.transfer(client.admin.Push, pb.PushRequest(key=args.key, reference=args.reference),
                               progress=_printer(args.json))
    return _report(args, done, "pushed")


def _pull(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        done = client.transfer(client.admin.Pull, pb.PullRequest(reference=args.reference),
                               progress=_printer(args.json))
    return _report(args, done, "pulled")


def register(sub: Any) -> None:
    """Adds push and pull."""
    p = sub.add_parser("push", help="push an artifact to an OCI registry (REF = host[:port]/repository[:tag])")
    p.add_argument("key", help="identity key of a published artifact")
    p.add_argument("reference", metavar="REF", help="host[:port]/repository[:tag]; the tag defaults to the key")
    add_socket_flags(p)
    add_json_flag(p)
    p.set_defaults(func=_push)
    p = sub.add_parser("pull", help="pull an artifact from an OCI registry into the store")
    p.add_argument("reference", metavar="REF", help="host[:port]/repository:KEY or host[:port]/repository@sha256:…")
    add_socket_flags(p)
    add_json_flag(p)
    p.set_defaults(func=_pull)
