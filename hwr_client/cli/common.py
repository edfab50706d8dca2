"""Helpers shared by the CLI modules: socket flags, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hwr_client.client import Client


def add_socket_flags(parser: argparse.ArgumentParser) -> None:
    """``--socket``/``--admin-socket``; else HWR_SOCKET/HWR_ADMIN_SOCKET,
    else the defaults."""
    parser.add_argument("--socket", help="runtime socket (default: $HWR_SOCKET or the daemon default)")
    parser.add_argument("--admin-socket", help="admin socket (default: $HWR_ADMIN_SOCKET or the daemon default)")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: machine-readable output instead of a table."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def client_from(args: argparse.Namespace) -> Client:
    """A client on the sockets of ``args`` (see :func:`add_socket_flags`)."""
    return Client(getattr(args, "socket", None), admin_socket=getattr(args, "admin_socket", None))


def print_json(value: Any) -> None:
    """``value`` as indented JSON on stdout, keys sorted (stable output)."""
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    """Left-aligned columns sized to content."""
    table = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
