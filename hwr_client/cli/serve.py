"""``hwr serve``: the daemon's flags and its entry live with the daemon
(:mod:`hwr_server.cli`), so ``python -m hwr_server`` has them without this
command line; this module only hangs them under ``hwr``.

The import is inside :func:`register` because the CLI is the one layer that
may reach up into the daemon package, and only where a command needs it.
:mod:`hwr_server.cli` is light at import (no grpc, no torch): the daemon
itself is imported when ``hwr serve`` runs.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from hwr_server.cli import register as register_serve

    register_serve(sub)
