"""How a string the daemon did not write itself goes into a log line.

Labels, client names, tensor and file names, registry answers, references
and paths come from clients or from a registry. Written as they are, a
newline in one starts a line of the attacker's choosing in the journal (a
forged ``INFO hwr_server...`` entry), a NUL cuts the line short for C
readers, and terminal escapes repaint whoever tails the log. Every log
call that prints such a string passes it through :func:`untrusted`::

    log.info("publication %s: file %s", pub_id, untrusted(label))

What it does: C0 and C1 control characters, DEL, the Unicode line and
paragraph separators and the backslash itself are written as Python
escapes (``\\n``, ``\\x00``, ``\\x1b``, ``\\u2028``, ``\\\\``), so the
line stays one line, reads the same in every viewer, and the escaped form
is unambiguous. Everything else (any other Unicode text) is kept. The
escaping runs only if the record is emitted (``__str__`` of a small
wrapper), so a debug line that is filtered out costs nothing. Long values
are cut at :data:`MAX_CHARS` with the count of what was left out.
"""

from __future__ import annotations

#: Characters of one untrusted value written to a log line; a longer value
#: ends with "…(+N chars)".
MAX_CHARS = 1024

_ESCAPES: dict[int, str] = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x5C: "\\\\", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape(text: str, *, limit: int = MAX_CHARS) -> str:
    """``text`` with every control character escaped (module docstring),
    at most ``limit`` characters of it."""
    cut = len(text) - limit
    if cut > 0:
        return text[:limit].translate(_ESCAPES) + f"…(+{cut} chars)"
    return text.translate(_ESCAPES)


class _Untrusted:
    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def __str__(self) -> str:
        value = self.value
        return escape(value if isinstance(value, str) else str(value))

    __repr__ = __str__


def untrusted(value: object) -> object:
    """Wraps a client- or registry-supplied value for a ``%s`` log argument:
    escaped when (and only if) the record is formatted.

    Example:
        >>> str(untrusted("a\\nINFO forged"))
        'a\\\\nINFO forged'
    """
    return _Untrusted(value)


__all__ = ["MAX_CHARS", "escape", "untrusted"]
