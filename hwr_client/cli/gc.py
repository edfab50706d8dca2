"""``hwr gc [--dry-run] [--json] [--target SIZE]``: plan or run garbage
collection on the admin socket."""

from __future__ import annotations

import argparse

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json, print_table
from hwr_client.core.defaults import human, parse_size


def _rows(items: list[dict]) -> list[list[str]]:
    """Table rows; an artifact row shows (in parentheses) the bytes of the
    blob rows that follow it, which are what its removal frees."""
    rows = []
    for n, i in enumerate(items):
        size = human(i["bytes"])
        if i["kind"] == "artifact":
            freed = 0
            for j in items[n + 1:]:
                if j["kind"] != "blob":
                    break
                freed += j["bytes"]
            size = f"({human(freed)})"
        name = i["name"][:16] if i["kind"] in ("artifact", "blob") else i["name"]
        rows.append([i["kind"] if i["kind"] != "blob" else "  blob", name, size, i["reason"]])
    return rows


def run(args: argparse.Namespace) -> int:
    """Runs the command; returns the exit code."""
    target = parse_size(args.target) if args.target else 0
    with client_from(args) as client:
        reply = client.call(client.admin.CollectGarbage,
                            pb.CollectGarbageRequest(dry_run=args.dry_run, target_bytes=target), timeout=600)
    items = [{"kind": i.kind, "name": i.name, "bytes": i.bytes, "reason": i.reason} for i in reply.items]
    if args.json:
        print_json({"items": items, "bytes_freed": reply.bytes_freed, "executed": reply.executed,
                    "usage_before": reply.usage_before, "usage_after": reply.usage_after,
                    "deferred_reason": reply.deferred_reason, "dry_run": args.dry_run})
        return 0
    if items:
        print_table(_rows(items), ["KIND", "NAME", "BYTES", "REASON"])
    verb = "would free" if not reply.executed else "freed"
    print(f"{verb} {human(reply.bytes_freed)} in {len(items)} items; usage "
          f"{human(reply.usage_before)} -> {human(reply.usage_after)}")
    if reply.deferred_reason:
        print(f"not collected now: {reply.deferred_reason}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``hwr gc``."""
    p = sub.add_parser("gc", help="plan (--dry-run) or run garbage collection (admin socket)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--target", metavar="SIZE", help="collect down to this usage (e.g. 80GiB); "
                   "default: the low watermark")
    add_json_flag(p)
    add_socket_flags(p)
    p.set_defaults(func=run)
