"""Store commands: ``hwr import | ls | inspect | verify | rm | stats``.

Read-only calls go over the runtime socket (``client.reader``); mutating admin
calls (verify quarantines, rm deletes) over the admin socket (``client.admin``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.cli.compiled import belongs_to, compile_info
from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json, print_table
from hwr_client.core.errors import DataLoss, InvalidArgument
from hwr_client.core.identity import Identity


def _import(args: argparse.Namespace) -> int:
    try:
        with open(args.identity, "rb") as f:
            identity = _identity_of(f.read(), args.identity)
    except OSError as exc:
        raise InvalidArgument(f"{args.identity}: cannot read the identity ({exc.strerror})") from None
    # torch only for this command: the CLI module stays light for `hwr serve`.
    from hwr_client.tensors import read_safetensors

    tensors = {}
    origin: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: torch cannot enforce it, PROT_READ does
        for path in args.files:
            for name, t in read_safetensors(path).items():
                if name in tensors:
                    raise InvalidArgument(f"{path}: tensor {name!r} is also in {origin[name]}; names must be unique")
                tensors[name], origin[name] = t, path
    with client_from(args) as client:
        report = client.publish(identity, tensors, ordered=not args.unordered)
    if args.json:
        print_json({"key": report.key, "already_published": report.already_published,
                    "bytes_written": report.bytes_written, "seconds": round(report.seconds, 3),
                    "content_digest": report.manifest.content_digest})
    else:
        print(report.key)
    return 0


def _identity_of(raw: bytes, path: str) -> Identity:
    """The identity in ``raw``: an identity document, or an HWR manifest.json
    (its ``identity``; the config blob of a pushed artifact, as ``oras
    manifest fetch-config`` saves it)."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: not JSON ({exc})") from None
    if isinstance(doc, dict) and doc.get("format") == "hwr-manifest" and isinstance(doc.get("identity"), dict):
        return Identity.from_dict(doc["identity"])
    return Identity.from_json(raw)


def _ls(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        reply = client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest())
        rows = [_summary_dict(a) for a in reply.artifacts]
        belongs_to(client, rows)  # compile artifacts: the model and device each one is for
    if args.json:
        print_json([{k: v for k, v in r.items() if k != "belongs_to_text"} for r in rows])
        return 0
    print_table(
        [[r["key"][:16], r["state"] + (f" ({r['reason']})" if r["reason"] else ""), f"{r['contract_name']}@"
          f"{r['contract_version']}", r["size_bytes"], r["file_count"], r["block_count"], r["lease_count"],
          time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created_unix"])) if r["created_unix"] else "-",
          r.get("belongs_to_text") or "-"]
         for r in rows],
        ["KEY", "STATE", "CONTRACT", "BYTES", "FILES", "BLOCKS", "LEASES", "CREATED", "FOR"],
    )
    return 0


def _summary_dict(a: pb.ArtifactSummary) -> dict[str, Any]:
    out = {f.name: getattr(a, f.name) for f in a.DESCRIPTOR.fields}
    out["publisher"] = a.publisher.text  # who published it (docs/trust.md), one line
    return out


def _inspect(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        reply = client.call(client.reader.InspectArtifact, pb.InspectArtifactRequest(key=args.key))
    leases = [{f.name: getattr(x, f.name) for f in x.DESCRIPTOR.fields} for x in reply.leases]
    manifest = json.loads(reply.manifest_json) if reply.manifest_json else None
    compiled = compile_info(reply.manifest_json)
    if args.json:
        print_json({"summary": _summary_dict(reply.summary), "manifest": manifest, "leases": leases,
                    "compile": compiled})
        return 0
    for k, v in _summary_dict(reply.summary).items():
        print(f"{k:18} {v}")
    if compiled:
        print(f"{'compiled for':18} {compiled['describe']}")
        print(f"{'publisher figures':18} {compiled['figures']}")
    if manifest:
        print(f"{'content_digest':18} {manifest['content_digest']}")
        for f in manifest["files"]:
            print(f"file {f['index']:<4} {f['blob']}  {f['size']} bytes  {f['name']}")
        for b in manifest["blocks"]:
            print(f"block {b['index']:<3} {b['prefix']}  file {b['file']}  [{b['begin']}, {b['end']})")
    for x in leases:
        print(f"lease {x['lease_id_prefix']}  pid {x['pid']}  {x['client_name']}  since {x['acquired_unix']}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    if bool(args.key) == bool(args.all):
        raise InvalidArgument("hwr verify: give a KEY or --all")
    with client_from(args) as client:
        try:
            reply = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=args.key or "", all=args.all),
                                timeout=None)
        except DataLoss as exc:
            if args.json:
                print_json({"ok": False, "error": str(exc)})
            else:
                print(f"CORRUPT: {exc}")
            return 1
    results = [{"key": r.key, "ok": r.ok, "problems": list(r.problems), "quarantined": r.quarantined,
                "bytes_checked": r.bytes_checked} for r in reply.results]
    if args.json:
        print_json({"ok": all(r["ok"] for r in results), "results": results})
    else:
        for r in results:
            print(f"{r['key'][:16]}  {'ok' if r['ok'] else 'CORRUPT'}  {r['bytes_checked']} bytes checked")
    return 0 if all(r["ok"] for r in results) else 1


def _rm(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        reply = client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=args.key, force=args.force))
    if args.json:
        print_json({"key": args.key, "bytes_freed": reply.bytes_freed})
    else:
        print(f"deleted {args.key[:16]}: {reply.bytes_freed} bytes freed")
    return 0


def _stats(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        reply = client.call(client.reader.GetStats, pb.GetStatsRequest())
    stats = json.loads(reply.stats_json)
    if args.json:
        print_json(stats)
    else:
        print_table([[k, f"{v:g}"] for k, v in sorted(stats.items())], ["METRIC", "VALUE"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds import, ls, inspect, verify, rm and stats."""
    p = sub.add_parser("import", help="publish existing safetensors files as an artifact")
    p.add_argument("--identity", required=True, metavar="ID.json",
                   help="identity document (JSON file), or an HWR manifest.json holding one")
    p.add_argument("--unordered", action="store_true", help="send chunks out of order (testing)")
    p.add_argument("files", nargs="+", metavar="FILE.safetensors")
    p.set_defaults(func=_import)
    p = sub.add_parser("ls", help="list published and quarantined artifacts")
    p.set_defaults(func=_ls)
    p = sub.add_parser("inspect", help="show one artifact: summary, files, blocks, leases")
    p.add_argument("key")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("verify", help="deep-verify artifacts (exit 1 on corruption; corrupt ones are quarantined)")
    p.add_argument("key", nargs="?")
    p.add_argument("--all", action="store_true", help="verify every published artifact")
    p.set_defaults(func=_verify)
    p = sub.add_parser("rm", help="delete an artifact (refused while leased unless --force)")
    p.add_argument("key")
    p.add_argument("--force", action="store_true", help="delete even if leased; mapped readers keep their bytes")
    p.set_defaults(func=_rm)
    p = sub.add_parser("stats", help="store, lease, publication and GC figures")
    p.set_defaults(func=_stats)
    for name in ("import", "ls", "inspect", "verify", "rm", "stats"):
        parser = sub.choices[name]
        add_socket_flags(parser)
        add_json_flag(parser)
