"""``deploy/hwr.toml.example``, generated from :class:`ServerConfig`.

    python -m hwr_server.config_example > deploy/hwr.toml.example

Every field of :class:`~hwr_server.config.ServerConfig` becomes a key set to
its default, under the field's ``#:`` comment in ``hwr_server/config.py``
(its documentation: unit, meaning, examples), in the field's order and
grouped by the class's ``# -- title --`` lines. A nested config (the
``[remote]`` table) comes last and commented out: it needs a registry. Its
comment lines start with ``##`` so that removing one ``# `` from each line
of the block leaves a valid table.

Two decisions, written down here and in the file's header:

- ``root``, ``socket`` and ``admin_socket`` default to "" (the daemon fills
  them in for its user, :func:`hwr_client.core.defaults.default_paths`). The
  example writes what "" means for a daemon run as root (``/var/lib/hwr``,
  ``/run/hwr/...``) instead, because ``deploy/install.sh`` installs this file
  as ``/etc/hwr/hwr.toml`` for the systemd unit, which runs the daemon as
  user ``hwr``: "" would give that user's home and runtime directories.
- Everything else is the default as it is: the file is a complete reference
  that loads to the defaults (tests/server/test_config_example.py), and an
  operator changes only what should differ.

The field docs are read from the class's source (the way Sphinx's autodoc
reads ``#:`` comments), so a field added by anyone is picked up; one without
a ``#:`` comment is refused (:class:`UndocumentedField`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import textwrap
from typing import Any

from hwr_client.core.defaults import default_paths
from hwr_server.config import ServerConfig, is_size_key

#: Width of the generated comment lines.
WIDTH = 88

#: Fields whose "" default the daemon fills from default_paths(): the example
#: writes the values of a daemon run as root (see the module doc).
SYSTEM_PATH_FIELDS = ("root", "socket", "admin_socket")

_GROUP = re.compile(r"^# --\s*(.*?)\s*-*$")
_FIELD = re.compile(r"^\s+(\w+)\s*:")
_MEMBER = re.compile(r"^    (def |@)")

HEADER = """\
# Configuration of `hwr serve` (TOML). deploy/install.sh installs this file as
# /etc/hwr/hwr.toml, which the systemd unit passes as --config; elsewhere run
# `hwr serve --config FILE`. Flags of `hwr serve` override the file.
#
# Every key, set to its default: change only what should differ. Unknown keys
# are rejected. Sizes take a number of bytes or B, KB/MB/GB/TB, KiB/MiB/GiB/TiB.
# root, socket and admin_socket default to "" (the daemon's user's defaults);
# they are written out here as a daemon run as root uses them, because the
# systemd unit runs it as user hwr.
#
# Generated from the field docs in hwr_server/config.py by
#   python -m hwr_server.config_example > deploy/hwr.toml.example
# Edit those docs, not this file (tests/server/test_config_example.py checks).
"""


class UndocumentedField(ValueError):
    """A config field has no ``#:`` comment in the source."""


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One field's documentation as written above it in the source.

    Attributes:
        name: the field (the TOML key).
        doc: its ``#:`` lines, joined.
        group: the title of the ``# -- title --`` group it is in ("" before any).
        note: the plain ``#`` lines right after that title, joined.
    """

    name: str
    doc: str
    group: str = ""
    note: str = ""


def field_docs(cls: type) -> list[FieldDoc]:
    """The fields of dataclass ``cls`` in order, with their source comments
    (those of a base class's fields from the base's source).

    Raises:
        UndocumentedField: a field without a ``#:`` comment (naming it).
    """
    found: dict[str, FieldDoc] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            found.update(_parse_source(klass))
    out = []
    for f in dataclasses.fields(cls):
        doc = found.get(f.name)
        if doc is None or not doc.doc:
            raise UndocumentedField(f"{cls.__name__}.{f.name}: no `#:` comment above the field in "
                                    f"{inspect.getsourcefile(cls)}; document its meaning, unit and default there")
        out.append(doc)
    return out


def _parse_source(cls: type) -> dict[str, FieldDoc]:
    """The fields ``cls``'s own class body declares, with their comments."""
    names = {f.name for f in dataclasses.fields(cls)}
    lines, _ = inspect.getsourcelines(cls)
    found: dict[str, FieldDoc] = {}
    group = ""
    note: list[str] = []
    pending: list[str] = []
    in_header = False  # right after a group title, plain comments are its note
    for raw in lines[1:]:
        if _MEMBER.match(raw):
            break  # methods follow the fields
        line = raw.strip()
        title = _GROUP.match(line)
        if title:
            group, note, pending, in_header = title.group(1), [], [], True
        elif line.startswith("#:"):
            pending.append(line[2:].strip())
            in_header = False
        elif line.startswith("#"):
            if in_header:
                note.append(line[1:].strip())
        else:
            field = _FIELD.match(raw)
            if field and field.group(1) in names:
                found[field.group(1)] = FieldDoc(field.group(1), " ".join(pending), group, " ".join(note))
                pending, in_header = [], False
    return found


def toml_value(key: str, value: Any) -> str:
    """``value`` as TOML, sizes in the largest binary unit that is exact
    (``4194304`` -> ``"4MiB"``), so that the config loader reads it back
    unchanged.

    Raises:
        TypeError: a type the config loader does not take.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return _size(value) if is_size_key(key) else str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return "[" + ", ".join(json.dumps(x) for x in value) + "]"
    raise TypeError(f"config key {key}: no TOML form for {type(value).__name__} {value!r}")


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % scale == 0:
            return f'"{n // scale}{unit}"'
    return str(n)


def _comment(text: str, prefix: str) -> list[str]:
    # reST literals read as Markdown ones in a TOML comment.
    return textwrap.wrap(text.replace("``", "`"), WIDTH, initial_indent=prefix, subsequent_indent=prefix,
                         break_on_hyphens=False, break_long_words=False)


def _title(group: str) -> str:
    """A group title without the module names an operator has no use for:
    ``trust in publishers (hwr_server.access.trust; docs/trust.md)`` ->
    ``trust in publishers (docs/trust.md)``."""
    text = re.sub(r"hwr_server\.[\w.]+(?:, \.\w+)*;?\s*", "", group)
    return re.sub(r"\s*\(\s*\)", "", text).strip()


def _section(cls: type, values: Any, *, commented: bool,
             overrides: dict[str, Any]) -> tuple[list[str], list[tuple[FieldDoc, Any]]]:
    """The lines of ``cls``'s scalar fields, and its nested tables for later."""
    doc_prefix, key_prefix = ("## ", "# ") if commented else ("# ", "")
    out: list[str] = []
    tables: list[tuple[FieldDoc, Any]] = []
    group = ""
    for fd in field_docs(cls):
        value = getattr(values, fd.name)
        if dataclasses.is_dataclass(value):
            tables.append((fd, value))
            continue
        if fd.group != group:
            group = fd.group
            out += ["", *_comment(f"---- {_title(group)} ----", doc_prefix), *_comment(fd.note, doc_prefix)]
        out += ["", *_comment(fd.doc, doc_prefix)]
        out.append(f"{key_prefix}{fd.name} = {toml_value(fd.name, overrides.get(fd.name, value))}")
    return out, tables


def render(cls: type[ServerConfig] = ServerConfig) -> str:
    """The whole example file for ``cls`` (see the module doc).

    Raises:
        UndocumentedField: a field has no ``#:`` comment.
    """
    paths = dict(zip(SYSTEM_PATH_FIELDS, default_paths(uid=0, env={})))
    lines, tables = _section(cls, cls(), commented=False, overrides=paths)
    for fd, value in tables:
        body, nested = _section(type(value), value, commented=True, overrides={})
        if nested:
            raise TypeError(f"[{fd.name}]: a table inside a table is not supported by the example")
        title = _comment(f"---- {_title(fd.group)} ----", "# ") if fd.group else []
        lines += ["", *title, *_comment(fd.doc, "# "),
                  "# Uncomment the table to use it (remove one '# ' from each line below).", f"# [{fd.name}]"]
        lines += body
    return HEADER + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Prints the example to stdout (no arguments)."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m hwr_server.config_example > deploy/hwr.toml.example", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
