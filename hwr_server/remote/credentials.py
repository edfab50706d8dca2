"""The registry credentials file (``[remote] credentials_file``): read only
when it can be trusted, never blocking, bounded, and re-read when it changes.

A docker-style ``config.json`` (``{"auths": {"host:port": {"auth":
base64("user:pass")}}}``, or ``username``/``password`` fields). The file is
a secret that decides where the node's pushes go, so it is held to the rule
OpenSSH applies to a private key (:func:`read_private_file`, which the
node's signing keys use too):

* opened with ``O_NOFOLLOW | O_NONBLOCK``: a symbolic link is refused, not
  followed, and a FIFO or a device can never block the opening thread;
* a regular file, owned by root or by the daemon's user;
* writable by nobody else (no group or other write bit) and readable by
  no other user (no "other" bits; group read is allowed, e.g. 0640
  root:hwr);
* at most :data:`MAX_CREDENTIALS_BYTES`, read through the checked
  descriptor.

Anything else is ``FailedPrecondition`` naming the path and the rule (a
retry cannot help until the file is fixed). :class:`CredentialSource`
caches what it read with the file's identity (device, inode, size, mtime)
and reads again only when that changed, so a rotated file is picked up at
the next 401 without a restart.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import stat
import threading

from hwr_client.core.errors import FailedPrecondition, InvalidArgument

#: The largest credentials file read, bytes (a config.json with a few
#: hundred registries is ~100 KiB).
MAX_CREDENTIALS_BYTES = 1 << 20

Credentials = tuple[str, str]
_Stamp = tuple[int, int, int, int]


def read_private_file(path: str, *, what: str, max_bytes: int) -> tuple[bytes, _Stamp]:
    """Reads a secret file under the rule of the module docstring.

    Args:
        path: the file.
        what: names it in errors (``credentials file``, ``signing key``).
        max_bytes: the largest size accepted.

    Returns:
        (contents, (st_dev, st_ino, st_size, st_mtime_ns)).

    Raises:
        FailedPrecondition: a link, not a regular file, another owner, group
            or other write bits, other read bits, too large.
        InvalidArgument: it cannot be opened (missing, no permission).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FailedPrecondition(f"{what} {path}: is a symbolic link; expected the file itself "
                                     "(a link could be re-pointed by whoever owns its directory)") from None
        raise InvalidArgument(f"{what} {path}: cannot read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        _check_mode(st, path, what, max_bytes)
        data = b""
        while len(data) <= max_bytes:
            part = os.read(fd, max_bytes + 1 - len(data))
            if not part:
                break
            data += part
        if len(data) > max_bytes:  # grew after the fstat
            raise FailedPrecondition(f"{what} {path}: larger than {max_bytes} bytes")
        return data, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


def _check_mode(st: os.stat_result, path: str, what: str, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FailedPrecondition(f"{what} {path}: not a regular file (mode {stat.filemode(st.st_mode)}); "
                                 "expected a plain file")
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise FailedPrecondition(f"{what} {path}: owned by uid {st.st_uid}; expected root or the daemon's uid {me}")
    if st.st_mode & 0o027:
        raise FailedPrecondition(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
                                 f"{'write' if st.st_mode & 0o022 else 'read'} it; expected 0600 or 0640 "
                                 f"(`chmod 600 {path}`)")
    if st.st_size > max_bytes:
        raise FailedPrecondition(f"{what} {path}: {st.st_size} bytes, larger than {max_bytes}; expected a small "
                                 "config.json")


def parse_credentials(data: bytes, path: str, host: str) -> Credentials | None:
    """(user, password) for ``host`` from a config.json's bytes; None when
    it has no entry for the host.

    Raises:
        InvalidArgument: not JSON, or a malformed entry.
    """
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidArgument(f"credentials file {path}: not JSON ({exc})") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise InvalidArgument(f"credentials file {path}: expected an object with an 'auths' object")
    for name in (host, f"https://{host}", f"http://{host}"):
        entry = auths.get(name)
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str):
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode("utf-8").partition(":")
            except (ValueError, UnicodeDecodeError):
                raise InvalidArgument(f"credentials file {path}: auths[{name!r}].auth is not base64 of "
                                      "user:password") from None
            if sep:
                return user, password
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return entry["username"], entry["password"]
        raise InvalidArgument(f"credentials file {path}: auths[{name!r}] has neither auth nor username/password")
    return None


def load_credentials(path: str, host: str) -> Credentials | None:
    """(user, password) for ``host`` from the file at ``path`` (checked as
    the module docstring says); None when it has no entry.

    Raises:
        FailedPrecondition / InvalidArgument: see :func:`read_private_file`
            and :func:`parse_credentials`.
    """
    data, _ = read_private_file(path, what="credentials file", max_bytes=MAX_CREDENTIALS_BYTES)
    return parse_credentials(data, path, host)


class CredentialSource:
    """The credentials of one registry host, re-read when the file changes.

    Args:
        path: the credentials file ("" = anonymous).
        host: ``host[:port]`` whose entry is used.

    Raises:
        FailedPrecondition / InvalidArgument: the file, at construction.
    """

    def __init__(self, path: str, host: str):
        self.path, self.host = path, host
        self._lock = threading.Lock()
        self._stamp: _Stamp | None = None
        self._credentials: Credentials | None = None
        if path:
            self.reload()

    def get(self) -> Credentials | None:
        """The credentials as last read."""
        with self._lock:
            return self._credentials

    def reload(self) -> bool:
        """Reads the file again if its identity changed (a rotation);
        returns True when the credentials it holds changed.

        Raises:
            FailedPrecondition / InvalidArgument: the file as it is now.
        """
        if not self.path:
            return False
        try:
            st = os.stat(self.path, follow_symlinks=False)
            stamp: _Stamp | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None  # read_private_file says why
        with self._lock:
            if stamp is not None and stamp == self._stamp:
                return False
        data, stamp = read_private_file(self.path, what="credentials file", max_bytes=MAX_CREDENTIALS_BYTES)
        creds = parse_credentials(data, self.path, self.host)
        with self._lock:
            changed = creds != self._credentials
            self._credentials, self._stamp = creds, stamp
        return changed


__all__ = ["MAX_CREDENTIALS_BYTES", "CredentialSource", "load_credentials", "parse_credentials",
           "read_private_file"]
