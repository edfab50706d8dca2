"""Named crash points in the durable sequences (DESIGN §4, §11).

Every step of a sequence that changes the store on disk (the commit, delete,
quarantine, startup recovery) calls :func:`hit` with its name just before it
runs. That is a no-op unless the process armed exactly that name with
:func:`arm`; then the process kills itself with SIGKILL there, the way a
power cut or an OOM kill would stop it: no ``finally``, no atexit, no flush.

Only ``hwr serve``'s entry (:mod:`hwr_server.cli`) arms a failpoint, from
``HWR_FAILPOINT``; library code never reads the environment. The crash
matrix (tests/server/test_crash_matrix.py) runs the real daemon once per name in
:data:`POINTS`, so a failpoint added here is covered without a new test.

``python -m hwr_server.failpoints`` prints every name, one per line.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from hwr_client.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class Failpoint:
    """One crash point.

    Attributes:
        name: ``<sequence>.<step>``, the value of ``HWR_FAILPOINT``.
        sequence: the durable sequence it belongs to ("commit", "delete",
            "quarantine", "recovery"): what a test drives to reach it.
        step: what is about to happen when the process dies there.
    """

    name: str
    sequence: str
    step: str


def _points(sequence: str, *steps: tuple[str, str]) -> tuple[Failpoint, ...]:
    return tuple(Failpoint(f"{sequence}.{name}", sequence, doc) for name, doc in steps)


#: Every failpoint, in the order of its sequence's numbered steps.
POINTS: tuple[Failpoint, ...] = (
    *_points(
        "commit",
        ("sync_payload", "1. fsync every payload file"),
        ("install_blobs", "2. move the payloads into blobs/, fsync blobs/"),
        ("write_manifest", "3. write and fsync manifest.json and its directory"),
        ("rename_artifact", "4. rename the artifact into artifacts/ (the publish point)"),
        ("sync_artifacts", "5. fsync artifacts/"),
        ("update_index", "6. add the artifact to the in-memory index"),
        ("reply", "7. return the manifest to the caller, who replies"),
    ),
    *_points(
        "delete",
        ("rename_to_trash", "1. rename artifacts/<key> into staging/ (the unpublish point)"),
        ("sync_artifacts", "2. fsync artifacts/"),
        ("update_index", "3. drop the artifact from the index"),
        ("unlink_blobs", "4. unlink the blobs no other artifact references"),
        ("remove_trash", "5. remove the renamed directory"),
    ),
    *_points(
        "quarantine",
        ("make_entry", "1. create quarantine/<key>.<reason>.<ts>/"),
        ("rename_artifact", "2. rename artifacts/<key> into the entry (the unpublish point)"),
        ("move_blobs", "3. move its corrupt and exclusive blobs into the entry"),
        ("sync_dirs", "4. fsync the entry, quarantine/, artifacts/ and blobs/"),
        ("update_index", "5. drop the artifact from the index, list it as quarantined"),
    ),
    *_points(
        "recovery",
        ("remove_staging", "1. remove staging leftovers"),
        ("remove_partial_quarantine", "2. remove quarantine entries an interrupted quarantine left"),
        ("check_artifacts", "3. check every artifact, quarantine the bad ones"),
        ("remove_orphans", "4. unlink blobs no manifest references"),
    ),
)

_BY_NAME = {p.name: p for p in POINTS}
_armed: str | None = None


def names() -> list[str]:
    """Every failpoint name, in sequence order."""
    return [p.name for p in POINTS]


def get(name: str) -> Failpoint:
    """The failpoint called ``name``.

    Raises:
        InvalidArgument: no failpoint has that name.
    """
    point = _BY_NAME.get(name)
    if point is None:
        raise InvalidArgument(
            f"failpoint {name!r}: unknown; expected one of the names `python -m hwr_server.failpoints` prints"
        )
    return point


def arm(name: str | None) -> None:
    """Makes :func:`hit` of ``name`` kill this process; None disarms.

    Raises:
        InvalidArgument: ``name`` is not a known failpoint (so a typo cannot
            silently run a test that never crashes).
    """
    global _armed
    _armed = None if name is None else get(name).name


def armed() -> str | None:
    """The armed failpoint's name, or None."""
    return _armed


def hit(name: str) -> None:
    """Kills this process with SIGKILL if ``name`` is armed; else returns.

    The message goes straight to fd 2 (no logging handler, no buffer) so the
    test that armed it can tell this death from any other.
    """
    if _armed is not None and name == _armed:
        os.write(2, f"hwr: failpoint {name} reached: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    """Prints every failpoint name, one per line."""
    sys.stdout.write("".join(f"{n}\n" for n in names()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
