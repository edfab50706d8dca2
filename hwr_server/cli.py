"""``hwr serve``: the only place the daemon reads flags, the config file and
the environment.

``HWR_FAILPOINT=<name>`` (testing only) arms one failpoint of
:mod:`hwr_server.failpoints`: the daemon kills itself with SIGKILL when it
reaches that step. An unknown name exits 2 before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from hwr_client.core.defaults import parse_size
from hwr_client.core.errors import HwrError
from hwr_server import failpoints
from hwr_server.config import ServerConfig

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the node daemon", description="Run the HWR node daemon (one per node).")
    p.add_argument("--root", help="store root (default: /var/lib/hwr as root, else ~/.local/share/hwr)")
    p.add_argument("--socket", help="runtime socket, mode 0660 (default: /run/hwr/hwr.sock or $XDG_RUNTIME_DIR/hwr/)")
    p.add_argument("--admin-socket", help="admin socket, mode 0600")
    p.add_argument("--config", help="TOML config file (flags override it)")
    p.add_argument("--capacity", help="byte budget of the root, e.g. 100MiB or 2TiB (0 = unlimited)")
    p.add_argument("--source-root", action="append", default=None, metavar="DIR",
                   help="restrict the checkpoint files the daemon vouches for to this directory (repeatable; "
                        "default: any file a caller of proven uid may read)")
    p.add_argument("--socket-group", help="group owning the runtime socket")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m hwr_server [serve flags]``: the daemon without the ``hwr``
    command line (which sits above every package and is not imported here);
    the flags are ``hwr serve``'s."""
    parser = argparse.ArgumentParser(prog="python -m hwr_server")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return int(args.func(args) or 0)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Config file first, then flags on top."""
    cfg = ServerConfig.from_file(args.config) if args.config else ServerConfig()
    overrides = {}
    for field in ("root", "socket", "admin_socket", "socket_group"):
        value = getattr(args, field, None)
        if value:
            overrides[field] = os.path.abspath(value) if field != "socket_group" else value
    if args.capacity is not None:
        overrides["capacity"] = parse_size(args.capacity)
    if args.source_root:
        overrides["source_roots"] = [os.path.abspath(p) for p in args.source_root]
    return dataclasses.replace(cfg, **overrides)


def run(args: argparse.Namespace) -> int:
    from hwr_server.daemon import serve

    try:
        config = config_from_args(args)
        arm_failpoint(os.environ.get("HWR_FAILPOINT", ""))
        return serve(config, dict(os.environ))
    except HwrError as exc:
        # One line on stderr (the journal under systemd): what is wrong and
        # the fix; exit 2, the CLI's code for bad input.
        print(f"hwr serve: {exc}", file=sys.stderr)
        return 2


def arm_failpoint(name: str) -> None:
    """Arms ``name`` (empty: none) so the daemon dies there (crash tests).

    Raises:
        InvalidArgument: not a failpoint name; the message lists where the
            names are.
    """
    if not name:
        return
    try:
        failpoints.arm(name)
    except HwrError as exc:
        raise type(exc)(f"HWR_FAILPOINT: {exc}") from None
    log.warning("failpoint %s armed: this daemon kills itself with SIGKILL when it gets there (testing only)", name)
