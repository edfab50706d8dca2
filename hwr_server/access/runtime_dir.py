"""The directory a daemon's socket lives in: created private, refused when
another user could tamper with it.

Without ``XDG_RUNTIME_DIR`` a non-root daemon's sockets go under
``/tmp/hwr-<uid>-run/hwr/``, a path any user can predict and create first.
A directory someone else owns or can write lets them plant
``hwr.sock.lock`` as a link to a file of ours (which the daemon then
truncates), or move our socket aside and serve their own in its place (our
workers then map whatever files the impostor names). So before any lock or
bind, :func:`prepare_socket_dir`:

1. creates the missing directories itself, 0700 (0755 for root, whose
   ``/run/hwr`` workers of the socket group must traverse; the socket's own
   mode and group decide who connects);
2. refuses the directory unless it and every directory above it pass
   :func:`hwr_client.core.defaults.check_trusted_dir` (owned by root or the
   daemon's user, not writable by others unless sticky, like ``/tmp``);
3. refuses a socket path that exists and is not a socket (a link, a file):
   the daemon never binds or unlinks through something it did not create.

The lock files are opened with ``O_NOFOLLOW`` (:mod:`hwr_server.access.lock`).
"""

from __future__ import annotations

import os
import socket
import stat

from hwr_client.core.defaults import check_trusted_dir
from hwr_client.core.errors import FailedPrecondition


def prepare_socket_dir(socket_path: str) -> str:
    """Makes the socket's directory exist, private, and checks it can be
    trusted (steps in the module docstring).

    Args:
        socket_path: the Unix socket the daemon is about to lock and bind.

    Returns:
        The directory.

    Raises:
        FailedPrecondition: the directory (or one above it) is owned or
            writable by another user, or the socket path is not a socket;
            the message names the path, its owner and mode.
    """
    uid = os.geteuid()
    directory = os.path.dirname(os.path.abspath(socket_path))
    _make_dirs(directory, 0o755 if uid == 0 else 0o700)
    check_trusted_dir(directory, uid=uid)
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return directory
    if not stat.S_ISSOCK(st.st_mode):
        raise FailedPrecondition(
            f"socket {socket_path}: exists and is not a Unix socket ({stat.filemode(st.st_mode)}, uid {st.st_uid}); "
            "expected a socket or nothing. Remove it if it is not yours to keep"
        )
    return directory


def listening_socket(path: str, *, mode: int, gid: int, backlog: int = 128) -> socket.socket:
    """A Unix stream socket bound at ``path`` with ``mode`` (and group
    ``gid`` unless -1), listening.

    umask 0177 while binding: the file is created 0600, never briefly
    wider than intended, then widened to ``mode`` (as the runtime socket is).

    Raises:
        OSError: the path cannot be bound.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    if gid != -1:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    sock.listen(backlog)
    return sock


def _make_dirs(directory: str, mode: int) -> None:
    """mkdir of each missing component with ``mode`` (os.makedirs would
    give the parents the umask's default, 0755, instead)."""
    missing = []
    d = directory
    while not os.path.lexists(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            # Someone created it between our look and our mkdir: it is not
            # ours, and check_trusted_dir decides whether it may be used.
            pass


__all__ = ["prepare_socket_dir"]
