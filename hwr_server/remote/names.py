"""Names in the registry API: a reference (``host/repository:tag`` or
``@sha256:…``), an origin (scheme and host, what credentials are bound to),
and a ``WWW-Authenticate`` challenge. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

from hwr_client.core.errors import InvalidArgument

_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*\Z")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")


#: (scheme, host[:port]): where a request goes, and what credentials are bound to.
Origin = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Reference:
    """``host[:port]/repository[:tag|@sha256:…]``; ``tag`` and ``digest``
    may both be empty (the caller fills the tag with the key)."""

    host: str
    repository: str
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        tail = f"@{self.digest}" if self.digest else (f":{self.tag}" if self.tag else "")
        return f"{self.host}/{self.repository}{tail}"

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest, else the tag."""
        return self.digest or self.tag


def parse_reference(text: str) -> Reference:
    """Parses ``host[:port]/repository[:tag|@sha256:<hex>]``.

    Raises:
        InvalidArgument: naming the part that is wrong.
    """
    what = f"registry reference {text!r}"
    host, sep, rest = text.partition("/")
    if not sep or not host or not rest:
        raise InvalidArgument(f"{what}: expected host[:port]/repository[:tag]")
    digest = tag = ""
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidArgument(f"{what}: digest {digest!r}, expected sha256:<64 lowercase hex>")
    elif ":" in rest.rsplit("/", 1)[-1]:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.match(tag):
            raise InvalidArgument(f"{what}: tag {tag!r}, expected [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}")
    if not _REPO.match(rest):
        raise InvalidArgument(f"{what}: repository {rest!r}, expected lowercase path components")
    return Reference(host, rest, tag, digest)


def parse_origin(text: str, *, what: str) -> Origin:
    """``scheme://host[:port]`` (an entry of ``[remote] token_realms``).

    Raises:
        InvalidArgument: another scheme, no host, or a path, query or user part.
    """
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("http", "https") or not url.netloc or url.path not in ("", "/") or url.query \
            or "@" in url.netloc:
        raise InvalidArgument(f"{what}: {text!r}, expected an origin like https://auth.example[:port] "
                              "(scheme and host, no path)")
    return url.scheme, url.netloc.lower()


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, params) of a ``WWW-Authenticate`` header."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


__all__ = ["Origin", "Reference", "parse_challenge", "parse_origin", "parse_reference"]
