"""``hwr leases [--json]``: who holds which artifact, and for how long."""

from __future__ import annotations

import argparse
import time

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json, print_table


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``hwr leases``."""
    p = sub.add_parser("leases", help="list active leases (holder pid, key, age)",
                       description="List the daemon's leases: holder pid and name, artifact key, age, state "
                                   "('attached', or 'awaiting-reattach' during the grace period after a restart).")
    add_socket_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def run(args: argparse.Namespace) -> int:
    """Prints the lease table (or JSON). Read-only: works on the runtime socket."""
    with client_from(args) as client:
        reply = client.call(client.reader.ListLeases, pb.ListLeasesRequest())
    now = time.time()
    rows = [
        {"lease_id_prefix": x.lease_id_prefix, "key": x.key, "pid": x.pid, "client_name": x.client_name,
         "acquired_unix": x.acquired_unix, "age_s": max(0, int(now - x.acquired_unix)), "state": x.state}
        for x in reply.leases
    ]
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no leases")
        return 0
    print_table([[r["pid"], r["client_name"], r["key"][:16], _age(r["age_s"]), r["state"], r["lease_id_prefix"]]
                 for r in rows], ["PID", "CLIENT", "KEY", "AGE", "STATE", "LEASE"])
    return 0
