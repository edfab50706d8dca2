"""Who may take whose artifacts (docs/trust.md; DESIGN §11a).

The rule. A caller running as uid U takes an artifact only if its
:class:`~hwr_server.access.publisher.Publisher` is trusted by U:

* published by U itself, by root, or by the daemon's own uid;
* published by a member of ``ServerConfig.trusted_publishers`` (users by
  name or uid, groups as ``group:NAME`` or ``group:GID``: their members and
  the users whose primary group it is, resolved when the daemon starts);
* pulled from a registry: it counts as published by the daemon only while
  it passes the signature rule: with ``[remote] trusted_keys`` configured,
  only if a trusted key signed it (checked at the pull, and again at every
  use against the keys configured now, so a key removed from the list stops
  vouching for what it signed); without ``trusted_keys``, the operator chose
  to trust the configured registry and every pull counts;
* unrecorded (published before the daemon recorded publishers) only with
  ``ServerConfig.trust_unrecorded_publishers``.

A caller without peer credentials (anonymous) has no uid of its own: it
trusts only root, the daemon and ``trusted_publishers``, which are what
"trusted by the node" means: what :meth:`TrustPolicy.node_trusts` answers,
and what a push requires (a node never pushes an artifact it would not
hand to an anonymous worker).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
from typing import Iterable

from hwr_client.core.errors import InvalidArgument, UntrustedPublisher
from hwr_server.access.peers import Peer
from hwr_server.access.publisher import Publisher

log = logging.getLogger(__name__)

GROUP_PREFIX = "group:"


def resolve_publishers(entries: Iterable[str], *, what: str = "config: trusted_publishers") -> frozenset[int]:
    """The uids ``trusted_publishers`` names: users by name or uid; groups
    (``group:NAME`` / ``group:GID``) as their members plus the users whose
    primary group they are.

    Raises:
        InvalidArgument: a user or group this system does not know (a typo
            must not silently trust nobody).
    """
    uids: set[int] = set()
    for entry in entries:
        if entry.startswith(GROUP_PREFIX):
            uids |= _group_members(entry[len(GROUP_PREFIX):], what)
        else:
            uids.add(_user(entry, what))
    return frozenset(uids)


def _user(name: str, what: str) -> int:
    try:
        return pwd.getpwuid(int(name)).pw_uid if name.isdigit() else pwd.getpwnam(name).pw_uid
    except (KeyError, OverflowError):
        raise InvalidArgument(f"{what}: no user {name!r} on this system; expected a user name or uid, or "
                              f"{GROUP_PREFIX}NAME for a group") from None


def _group_members(name: str, what: str) -> set[int]:
    try:
        group = grp.getgrgid(int(name)) if name.isdigit() else grp.getgrnam(name)
    except (KeyError, OverflowError):
        raise InvalidArgument(f"{what}: no group {name!r} on this system; expected {GROUP_PREFIX}NAME or "
                              f"{GROUP_PREFIX}GID") from None
    members = set()
    for member in group.gr_mem:
        try:
            members.add(pwd.getpwnam(member).pw_uid)
        except KeyError:
            log.warning("%s: group %s lists user %r, who does not exist; skipped", what, group.gr_name, member)
    members |= {p.pw_uid for p in pwd.getpwall() if p.pw_gid == group.gr_gid}
    return members


class TrustPolicy:
    """Applies the rule of the module docstring.

    Args:
        trusted_uids: the uids of ``trusted_publishers`` (resolved by
            :func:`resolve_publishers`).
        trusted_keys: ids of the ``[remote] trusted_keys`` (empty: pulls
            count as the daemon's without a signature).
        trust_unrecorded: ``ServerConfig.trust_unrecorded_publishers``.
        daemon_uid: the daemon's own uid (default: this process's).
    """

    def __init__(self, *, trusted_uids: frozenset[int] = frozenset(), trusted_keys: frozenset[str] = frozenset(),
                 trust_unrecorded: bool = False, daemon_uid: int | None = None):
        self.trusted_uids = trusted_uids
        self.trusted_keys = trusted_keys
        self.trust_unrecorded = trust_unrecorded
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid

    def node_trusts(self, pub: Publisher) -> bool:
        """Trusted by everyone on this node: root, the daemon, a trusted
        publisher, a pull that passes the signature rule."""
        if pub.via == "pull":
            return not self.trusted_keys or pub.signer in self.trusted_keys
        if pub.via == "unrecorded":
            return self.trust_unrecorded
        return pub.uid is not None and (pub.uid in (0, self.daemon_uid) or pub.uid in self.trusted_uids)

    def trusts(self, caller_uid: int | None, pub: Publisher) -> bool:
        """Whether a caller running as ``caller_uid`` (None: anonymous)
        takes an artifact of ``pub``."""
        if self.node_trusts(pub):
            return True
        return pub.via == "publish" and caller_uid is not None and pub.uid == caller_uid

    def check(self, peer: Peer, key: str, pub: Publisher) -> None:
        """Raises unless ``peer`` trusts ``pub``.

        Raises:
            UntrustedPublisher: naming the publisher, the caller and the fix.
        """
        if self.trusts(peer.uid, pub):
            return
        caller = "an anonymous caller" if peer.uid is None else f"uid {peer.uid}"
        raise UntrustedPublisher(f"artifact {key[:12]}: published by {pub.describe()}, which {caller} does not "
                                 f"trust ({self._why(pub)}); {self._fix(key, pub)}")

    def check_push(self, key: str, pub: Publisher) -> None:
        """Raises unless the node trusts ``pub`` (a push spreads it).

        Raises:
            UntrustedPublisher: naming the publisher.
        """
        if not self.node_trusts(pub):
            raise UntrustedPublisher(f"push {key[:12]}: published by {pub.describe()}, which this node does not "
                                     f"trust ({self._why(pub)}); only trusted publishers' artifacts are pushed")

    def _why(self, pub: Publisher) -> str:
        if pub.via == "pull":
            return "no key of [remote] trusted_keys signed it"
        if pub.via == "unrecorded":
            return "unrecorded publishers are trusted only with trust_unrecorded_publishers"
        return ("a worker takes artifacts of its own uid, root, the daemon's uid "
                f"({self.daemon_uid}) and trusted_publishers")

    @staticmethod
    def _fix(key: str, pub: Publisher) -> str:
        if pub.via == "pull":
            return f"`hwr rm {key}` and pull it again signed, or trust its signer's key"
        return (f"`hwr rm {key}` (admin socket) and publish it again as a trusted user, or add the publisher to "
                "trusted_publishers")


__all__ = ["GROUP_PREFIX", "TrustPolicy", "resolve_publishers"]
