"""The ``hwr`` command line.

Each group of subcommands lives in its own module with a ``register(sub)``
function: ``serve`` (hwr_client.cli.serve, the flags of hwr_server.cli), ``store`` (import/ls/inspect/verify/rm/
stats), ``leases``, ``sources``, ``gc``, ``remote`` (push/pull), ``keys`` (signing keys), ``demo``
(demo/prewarm). Errors from
the daemon are printed as one line and mapped to an exit code; ``--verbose``
shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hwr_client.core.errors import HwrError

#: Modules providing ``register(subparsers)``, in help order.
COMMAND_MODULES = (
    "hwr_client.cli.serve",
    "hwr_client.cli.store",
    "hwr_client.cli.leases",
    "hwr_client.cli.sources",
    "hwr_client.cli.gc",
    "hwr_client.cli.remote",
    "hwr_client.cli.keys",
    "hwr_client.cli.demo",
)

#: Exit codes: 1 = verification found corruption; 2 = usage / bad input;
#: 3 = not found; 4 = precondition/conflict; 5 = daemon unreachable; 6 other.
EXIT_CODES = {
    "InvalidArgument": 2, "NotFound": 3, "FailedPrecondition": 4, "Aborted": 4, "AlreadyExists": 4,
    "ResourceExhausted": 4, "PermissionDenied": 4, "Unavailable": 5, "DataLoss": 1, "UntrustedPublisher": 4,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``hwr`` parser with every command module's subcommands; a module
    whose package is not installed is left out."""
    parser = argparse.ArgumentParser(prog="hwr", description="Host Weight Runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one ``hwr`` command; returns its exit code (see
    :data:`EXIT_CODES`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except HwrError as exc:
        if args.verbose:
            raise
        print(f"hwr {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_CODES.get(type(exc).__name__, 6)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
