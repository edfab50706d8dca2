"""``hwr sources``: the daemon's source-digest cache.

- ``hwr sources [--json]``: list the cache records (runtime socket).
- ``hwr sources resolve PATH... [--json]``: content ids and cache state, from
  the daemon or, for paths outside its source roots / without a daemon,
  hashed here. ``--json`` prints a list, in argument order, of
  ``{"path", "content_id", "size", "cached", "origin"}``.
- ``hwr sources forget PATH``: drop one record (admin socket).
"""

from __future__ import annotations

import argparse
import datetime

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json, print_table
from hwr_client.core.digests import absolute_path


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``sources`` and its subcommands to the ``hwr`` parser."""
    parser = sub.add_parser("sources", help="source-digest cache: list, resolve, forget")
    add_socket_flags(parser)
    add_json_flag(parser)
    parser.set_defaults(func=cmd_list)
    verbs = parser.add_subparsers(dest="sources_command", metavar="{resolve,forget}")

    resolve = verbs.add_parser("resolve", help="content ids of files (cached by the daemon where it can)")
    resolve.add_argument("paths", nargs="+", metavar="PATH")
    # SUPPRESS: `hwr sources --json resolve X` keeps the parent's --json.
    resolve.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    resolve.set_defaults(func=cmd_resolve)

    forget = verbs.add_parser("forget", help="drop the cache record of PATH (admin socket)")
    forget.add_argument("path", metavar="PATH")
    forget.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    forget.set_defaults(func=cmd_forget)


def cmd_list(args: argparse.Namespace) -> int:
    """Prints the daemon's source-digest records. Read-only: works on the
    runtime socket."""
    with client_from(args) as client:
        reply = client.call(client.reader.ListSources, pb.ListSourcesRequest())
    records = [
        {"path": r.path, "content_id": r.content_id, "size": r.size, "mtime_ns": r.mtime_ns,
         "recorded_unix": r.recorded_unix}
        for r in reply.records
    ]
    if args.json:
        print_json(records)
        return 0
    rows = [
        [r["path"], r["content_id"][:19] + "…", r["size"],
         datetime.datetime.fromtimestamp(r["recorded_unix"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")]
        for r in records
    ]
    print_table(rows, ["PATH", "CONTENT_ID", "SIZE", "RECORDED"])
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    """Prints the content id of each PATH (the daemon's cache, else hashed
    here)."""
    paths = [absolute_path(p) for p in args.paths]
    with client_from(args) as client:
        digests = client.resolve_sources(paths)
    if args.json:
        print_json([d.to_dict() for d in digests])
        return 0
    print_table([[d.path, d.content_id, d.size, "yes" if d.cached else "no", d.origin] for d in digests],
                ["PATH", "CONTENT_ID", "SIZE", "CACHED", "ORIGIN"])
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """Drops the daemon's record of PATH (admin socket); the next resolve
    hashes it again."""
    path = absolute_path(args.path)
    with client_from(args) as client:
        reply = client.call(client.admin.ForgetSource, pb.ForgetSourceRequest(path=path))
    if args.json:
        print_json({"path": path, "forgotten": reply.forgotten})
    else:
        print(f"{path}: {'record dropped' if reply.forgotten else 'no record'}")
    return 0
