"""Who may have a source file vouched for: the access rule of
ResolveSources and ResolveLease (DESIGN §6).

The daemon runs as root and must never vouch for a file its caller could
not read itself. Each path is resolved ONCE
(:func:`hwr_client.core.digests.open_path`, an ``O_PATH`` descriptor); the
real path, the type, the caller's access and the read all go through that
descriptor, so a link flipped meanwhile cannot swap in another file. The
file is answered for only when all hold:

1. where the daemon may read from:

   - **no source roots configured** (the default): any regular file, for a
     caller whose uid the daemon has PROVEN (the credentials handshake of
     :mod:`hwr_server.access.peers`) and that says which file it sees at
     that path (:class:`Seen`: device, inode, size, mtime). The walk of
     step 2 then starts at ``/``. A caller whose uid is not proven (an old
     client, raw gRPC, a process in a pid namespace the daemon cannot see)
     gets nothing: the file's mode bits alone cannot say that it may read
     the file;
   - **source roots configured** (``--source-root``, ``source_roots``): an
     operator's restriction. The real path must lie under one of them; a
     caller of unknown uid is answered by the "others" rule below, and a
     caller that sends no :class:`Seen` is answered too (the operator
     vouched that paths there name the same files to every caller);

   Either way, a :class:`Seen` that the daemon's file does not match is
   refused: the caller's path names another file than the daemon's (it
   runs in another mount namespace: a container, the daemon's systemd
   ``PrivateTmp``; or the file changed meanwhile), and answering for the
   daemon's file would give the caller a wrong identity. A caller may lie
   about what it sees; that only changes its own answer, and step 2 still
   holds for its proven uid;

2. the caller may search every directory from that source root (``/``
   without roots) down to it and read the file itself
   (:func:`may_access`). While the caller's uid is unknown the caller is
   treated as "others": the file must be ``o+r`` and every directory from
   the source root down ``o+x``, and neither may carry a POSIX ACL (it
   could deny a user the mode bits allow). A known uid gets the kernel's
   owner/group/other rule, erring on "no": uid 0 everything, the owner its
   owner bits, any other uid the group AND the other bits (its groups are
   not known yet);
3. walking that real path again from the source root, one component at a
   time without following links, reaches the same inode (it was not moved).

A cache record, a hub name and a hash are all answered only after these
checks, so a record made for one caller is never a way around them. Anything
refused is PERMISSION_DENIED; the client then hashes the file itself, with
its own rights. Errors about what lies beyond a directory the caller may not
search (a missing name, a directory) are the same PERMISSION_DENIED, so
probing through the daemon tells nothing either.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat

from hwr_client.core.digests import (
    check_path_text, check_regular, normalize_path, open_path, real_path_of, reopen_for_reading,
)
from hwr_client.core.errors import FailedPrecondition, HwrError, InvalidArgument, PermissionDenied
from hwr_server.access.peers import Peer


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


#: Permission bits as the kernel tests them, per class (owner, group, other).
READ, SEARCH = 4, 1


def has_acl(fd: int) -> bool:
    """True when the inode ``fd`` pins carries a POSIX access ACL, or when
    that cannot be told (then its mode bits are not the whole story).

    Read through ``/proc/self/fd``: an ``O_PATH`` descriptor takes no
    ``fgetxattr`` on older kernels; the magic link reaches the same inode.
    """
    try:
        os.getxattr(f"/proc/self/fd/{fd}", "system.posix_acl_access")
    except OSError as exc:
        return exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP)
    return True


def may_access(peer: Peer, st: os.stat_result, want: int, *, acl: bool) -> bool:
    """Whether ``peer`` may ``want`` (:data:`READ` or :data:`SEARCH`) the
    inode of ``st``, by the kernel's owner/group/other rule, erring on "no".

    - uid 0: yes (it reads and searches everything).
    - the owner: the owner bits.
    - a known uid that is not the owner: its groups are not known, so the
      group AND the other bits must allow it; an ACL makes it "no".
    - unknown uid (:data:`hwr_server.access.peers.ANONYMOUS`): the caller may be
      anyone, owner included, so every class must allow it; an ACL makes it
      "no". For ordinary modes this is exactly "others may" (``o+r`` /
      ``o+x``).
    """
    uid = peer.uid
    if uid == 0:
        return True
    if uid is not None and uid == st.st_uid:
        shifts: tuple[int, ...] = (6,)
    elif acl:
        return False
    else:
        shifts = (3, 0) if uid is not None else (6, 3, 0)
    return all((st.st_mode >> shift) & want == want for shift in shifts)


def _who(peer: Peer) -> str:
    return "a caller of unknown uid" if peer.uid is None else f"uid {peer.uid}"


#: Appended to every refusal: the rule and what happens next.
_RULE = ("the daemon vouches only for files its caller could read itself (caller's uid unknown: files readable by "
         "others (o+r) in directories searchable by others (o+x) from the source root down, no ACLs); the client "
         "hashes the file itself")

#: Why a caller of unproven uid gets nothing from a daemon without source
#: roots; the client shows it in its report (it names the fix).
UNPROVEN_CALLER = ("the daemon (no source roots configured) vouches for a file only to a caller whose uid it has "
                   "proven with the credentials handshake (the runtime socket's '.cred' side socket), and this "
                   "caller proved none (an older client, raw gRPC, a process in a pid namespace the daemon cannot "
                   "see, or a credentials socket it may not connect to); the client hashes the file itself")


@dataclasses.dataclass(frozen=True)
class Seen:
    """A source file as the caller sees it: ``stat`` with symlinks followed.
    Device and inode name the file, size and mtime its version."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Seen":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def matches(self, st: os.stat_result) -> bool:
        """True when ``st`` (the daemon's fstat) is this very file version."""
        return Seen.of(st) == self


class SourceAccess:
    """Checks requested source paths against the source roots and the
    caller's rights; see the module doc. Stateless, thread-safe.

    Args:
        roots: the source roots, as real paths (symlinks resolved); empty:
            no restriction, proven callers only (module doc, step 1).
    """

    def __init__(self, roots: list[str]):
        self.roots = list(roots)

    @property
    def restricted(self) -> bool:
        """True when source roots restrict where the daemon reads."""
        return bool(self.roots)

    def root_of(self, real: str) -> str | None:
        """The outermost source root holding ``real`` (the most directories
        to check), or None; ``/`` when no roots restrict the daemon."""
        if not self.roots:
            return "/"
        inside = [r for r in self.roots if _under(real, r)]
        return min(inside, key=len) if inside else None

    def check_caller(self, peer: Peer) -> None:
        """Checks, once per request, what does not depend on the path: a
        daemon without source roots answers only a proven caller (module
        doc, step 1).

        Raises:
            PermissionDenied: naming why (the client hashes itself).
        """
        if not self.roots and peer.uid is None:
            raise PermissionDenied(f"sources: {UNPROVEN_CALLER}")

    def outside(self, path: str, norm: str, real: str) -> PermissionDenied:
        """The refusal of ``path`` (normalized ``norm``) whose real path
        ``real`` lies outside every source root."""
        if any(_under(norm, r) for r in self.roots):
            return PermissionDenied(
                f"source {path}: a link under a source root that resolves to {real}, outside every source "
                f"root {self.roots}; refused"
            )
        return PermissionDenied(
            f"source {path}: outside the daemon's source roots {self.roots} (an operator's restriction: add a "
            "root with --source-root, or configure none so that the daemon vouches for any file its caller may "
            "read); the client hashes it itself meanwhile"
        )

    def check(self, path: str, peer: Peer, seen: Seen | None = None) -> tuple[str, os.stat_result, str]:
        """Checks one requested path for ``peer`` (module doc, steps 1-3),
        all on ONE resolution of the name. The per-request part of step 1
        (:meth:`check_caller`) is the caller's to run first.

        Returns:
            (normalized path, fstat of the file, its real path).

        Raises:
            InvalidArgument: a relative path, a NUL byte, PATH_MAX or more
                bytes, a directory, FIFO or device.
            PermissionDenied: outside the source roots; no roots and
                ``peer``'s uid unknown or no ``seen``; ``seen`` given and not
                the daemon's file; ``peer`` (or the daemon) may not read it;
                or behind a directory ``peer`` may not search (whatever the
                file-system error there was).
            NotFound: a missing file or a broken link, where ``peer`` may look.
            FailedPrecondition: the file moved while it was checked.
        """
        if not isinstance(path, str) or not os.path.isabs(path):
            raise InvalidArgument(f"source {path!r}: expected an absolute path")
        check_path_text(path, f"source {path!r}")
        norm = normalize_path(path)
        if not self.roots and peer.uid is None:
            # check_caller refuses the whole request first; this keeps a
            # direct caller of check() from ever walking for an unknown uid.
            raise PermissionDenied(f"source {path}: {UNPROVEN_CALLER}")
        try:
            pfd = open_path(norm)
        except HwrError as exc:
            raise self._unless_hidden(path, norm, exc, peer) from None
        try:
            real = real_path_of(pfd, path)
            root = self.root_of(real)
            if root is None:
                raise self.outside(path, norm, real)
            st = os.fstat(pfd)
            self._walk(path, real, root, st, peer)
            check_regular(path, st)
            # The daemon's own right to read it (a non-root daemon): checked
            # on the same inode, before the caller's, so its error says which.
            os.close(reopen_for_reading(pfd, path))
            if not may_access(peer, st, READ, acl=has_acl(pfd)):
                raise PermissionDenied(
                    f"source {path}: {_who(peer)} may not read {real} (mode {stat.S_IMODE(st.st_mode):04o}, owner "
                    f"uid {st.st_uid}, gid {st.st_gid}); {_RULE}"
                )
            self._same_file(path, st, seen)
        finally:
            os.close(pfd)
        return norm, st, real

    def _same_file(self, path: str, st: os.stat_result, seen: Seen | None) -> None:
        """Step 1's last rule: the caller's file is the daemon's (module doc)."""
        if seen is None:
            if not self.roots:
                raise PermissionDenied(
                    f"source {path}: the caller did not say which file it sees there (device, inode: an older "
                    "client), so the daemon (no source roots) cannot tell that it resolves the same file; the "
                    "client hashes the file itself")
            return
        if not seen.matches(st):
            raise PermissionDenied(
                f"source {path}: the caller sees another file there (device {seen.dev}, inode {seen.ino}, "
                f"{seen.size} bytes) than the daemon does: the caller runs in another mount namespace (a "
                "container, or the daemon's PrivateTmp) or the file changed meanwhile; the client hashes the "
                "file itself")

    def _walk(self, path: str, real: str, root: str, st: os.stat_result, peer: Peer) -> None:
        """Checks that ``peer`` may search every directory from ``root`` down
        to ``real``'s parent, walking ``real`` one component at a time from
        ``root`` without following links, and that the walk ends on the
        inode of ``st`` (nothing was moved meanwhile).

        Each directory is opened ``O_PATH | O_NOFOLLOW`` beneath the one
        before, so the directory whose mode is checked is the one the walk
        passes through (no name is looked up twice).

        Raises:
            PermissionDenied: a directory ``peer`` may not search.
            FailedPrecondition: the file or a directory moved while checked.
        """
        parts = real[len(root):].strip("/").split("/") if real != root else []
        if not parts:
            return  # the root itself (a directory: check_regular refuses it)
        moved = FailedPrecondition(f"source {path}: moved or replaced while it was checked; retry")
        try:
            dfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise moved from None
        here = root
        try:
            for i, name in enumerate(parts):
                dst = os.fstat(dfd)
                if not may_access(peer, dst, SEARCH, acl=has_acl(dfd)):
                    raise PermissionDenied(
                        f"source {path}: {_who(peer)} may not search directory {here} (mode "
                        f"{stat.S_IMODE(dst.st_mode):04o}, owner uid {dst.st_uid}, gid {dst.st_gid}); {_RULE}"
                    )
                if i == len(parts) - 1:
                    leaf = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if (leaf.st_dev, leaf.st_ino) != (st.st_dev, st.st_ino):
                        raise moved
                    return
                nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd, here = nfd, os.path.join(here, name)
        except OSError:  # a component vanished or became a link: it moved
            raise moved from None
        finally:
            os.close(dfd)

    def _unless_hidden(self, path: str, norm: str, exc: HwrError, peer: Peer) -> HwrError:
        """``exc`` (the name could not be opened: missing, a broken link,
        ...) when ``peer`` could have learned that itself; otherwise a
        PERMISSION_DENIED that tells nothing, so the daemon (root) is no
        oracle for what lies in directories the caller may not search.

        The deepest ancestor that opens is checked like a file's directories
        (:meth:`_walk`) and must itself be searchable by ``peer``.
        """
        parent = os.path.dirname(norm)
        while True:
            try:
                pfd = open_path(parent)
                break
            except HwrError:
                if parent == "/":
                    return exc
                parent = os.path.dirname(parent)
        try:
            real = real_path_of(pfd, path)
            root = self.root_of(real)
            if root is None:
                return self.outside(path, norm, real)
            st = os.fstat(pfd)
            self._walk(path, real, root, st, peer)
            if stat.S_ISDIR(st.st_mode) and not may_access(peer, st, SEARCH, acl=has_acl(pfd)):
                return PermissionDenied(f"source {path}: {_who(peer)} may not search directory {real}; {_RULE}")
        except HwrError as refused:
            return refused
        finally:
            os.close(pfd)
        return exc
