"""PSS measurement of worker processes, for ``hwr demo`` and the benches.

PSS (proportional set size) charges a shared page 1/k to each of its k
mappers, so the sum over processes is what the node really pays. The
/proc readers are the worker's own (:mod:`dlo_runtime.worker`, which
reports its PSS too), so the demo, the benches and the worker count the
same way. That module imports torch: each function imports it on use, so
building the CLI parser stays torch-free.

Example:
    >>> row = process_pss(proc.pid)            # doctest: +SKIP
    >>> row["pss_kib"], row["pss_artifact_kib"]  # doctest: +SKIP
"""

from __future__ import annotations

import subprocess
import sys


def pss_kib(pid: int | str = "self") -> int:
    """Proportional set size of process ``pid`` in KiB
    (``/proc/PID/smaps_rollup``); 0 when it has no Pss line."""
    from dlo_runtime.worker import pss_kib as read  # torch: see the module doc

    return read(pid)


def process_pss(pid: int | str = "self") -> dict[str, int]:
    """The PSS of process ``pid`` in KiB: ``pss_kib`` (total) and its split
    by what backs it (``pss_artifact_kib``, ``pss_anon_kib``,
    ``pss_files_kib``; see :func:`dlo_runtime.worker.pss_breakdown`).

    Read it while every process of a group is alive: a shared page's share
    grows when another mapper exits.
    """
    from dlo_runtime.worker import pss_breakdown  # torch: see the module doc

    return {"pss_kib": pss_kib(pid), **pss_breakdown(pid)}


def baseline_pss_kib() -> int:
    """PSS (KiB) of a fresh process that imported the worker stack (torch,
    the runtime, the client) but holds no model: what every worker pays
    before its weights.

    Raises:
        subprocess.CalledProcessError: the measuring interpreter failed.
    """
    code = "import dlo_runtime.worker as w, torch; print(w.pss_kib())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
