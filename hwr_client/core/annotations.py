"""Annotations: an opaque, size-limited JSON object that a producer attaches
to an artifact's plan and that the daemon stores, unchanged, in its manifest.

HWR never interprets what is inside. It exists so that an integration can
keep the facts its own runtime needs next to the bytes (vLLM-Omni: each
tensor's kind and role, its format metadata and schema names) without a
second file beside the store. Annotations are neither part of the identity
key nor of the content digest: two publications of one identity with
different annotations are the same artifact (the first one wins, like the
bytes), so an integration that cares compares them itself.

The envelope is versioned and validated like every other field::

    {"schema_version": 1, "data": {<any JSON object>}}

* ``schema_version``: an integer, 1 (the only version this code reads);
* ``data``: a JSON object; values are objects, lists, strings, integers,
  booleans or null — no floats (the canonical-JSON rule of identities:
  their text does not round-trip the same in every language), at most
  :data:`MAX_ANNOTATIONS_DEPTH` levels deep;
* the canonical JSON of the whole (sorted keys, compact, UTF-8) is at most
  :data:`MAX_ANNOTATIONS_BYTES` bytes.

Torch-free and client-free: the daemon imports it.
"""

from __future__ import annotations

import json
from typing import Any

from hwr_client.core.errors import InvalidArgument

#: The only envelope version this code writes and reads.
ANNOTATIONS_SCHEMA_VERSION = 1
#: Largest canonical JSON of an annotations object, bytes (1 MiB): room for
#: a short record per tensor of a model with ~10,000 tensors, small next to
#: the manifest's own limit (ServerConfig.max_manifest_bytes, 32 MiB).
MAX_ANNOTATIONS_BYTES = 1024 * 1024
#: Deepest nesting of objects and lists inside ``data``.
MAX_ANNOTATIONS_DEPTH = 16
_FIELDS = frozenset({"schema_version", "data"})


def check_annotations(doc: Any, *, what: str = "annotations") -> dict[str, Any]:
    """Returns ``doc`` as a plain dict if it is a valid annotations object.

    Args:
        doc: the parsed object (``{"schema_version": 1, "data": {...}}``).
        what: names the object in errors (``publication plan: annotations``).

    Raises:
        InvalidArgument: naming the field at fault (``annotations.schema_version``,
            ``annotations.data.<path>``) or the size and its limit.
    """
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{what}: expected an object {{schema_version, data}}, got {type(doc).__name__}")
    unknown, missing = set(doc) - _FIELDS, _FIELDS - set(doc)
    if unknown or missing:
        raise InvalidArgument(f"{what}: fields {sorted(doc)}; expected exactly ['data', 'schema_version']")
    version = doc["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != ANNOTATIONS_SCHEMA_VERSION:
        raise InvalidArgument(f"{what}.schema_version: {version!r}; expected {ANNOTATIONS_SCHEMA_VERSION} "
                              "(the only annotations schema this version of HWR reads)")
    if not isinstance(doc["data"], dict):
        raise InvalidArgument(f"{what}.data: expected an object, got {type(doc['data']).__name__}")
    _check_value(doc["data"], f"{what}.data", 0)
    size = len(annotations_json(doc).encode("utf-8"))
    if size > MAX_ANNOTATIONS_BYTES:
        raise InvalidArgument(f"{what}: {size} bytes of canonical JSON exceeds the limit {MAX_ANNOTATIONS_BYTES} "
                              "(MAX_ANNOTATIONS_BYTES); keep annotations to a short record per tensor")
    return doc


def _check_value(value: Any, where: str, depth: int) -> None:
    """Raises InvalidArgument at the first float, non-str key, non-JSON value
    or nesting deeper than MAX_ANNOTATIONS_DEPTH; ``where`` is its path."""
    if isinstance(value, (dict, list)):
        if depth >= MAX_ANNOTATIONS_DEPTH:
            raise InvalidArgument(f"{where}: nested deeper than {MAX_ANNOTATIONS_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict) and not isinstance(k, str):
                raise InvalidArgument(f"{where}: object keys must be strings, got {k!r}")
            _check_value(v, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]", depth + 1)
    elif isinstance(value, float):
        raise InvalidArgument(f"{where}: floats are not allowed (canonical JSON), got {value!r}; "
                              "store the number as a string")
    elif not (value is None or isinstance(value, (str, int, bool))):
        raise InvalidArgument(f"{where}: unsupported JSON type {type(value).__name__}")


def annotations_json(doc: dict[str, Any]) -> str:
    """The canonical JSON text of an annotations object (sorted keys,
    compact); what the plan carries on the wire."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parse_annotations(text: str, *, what: str = "annotations") -> dict[str, Any] | None:
    """Parses and checks the wire form; ``""`` (no annotations) is None.

    Raises:
        InvalidArgument: longer than the limit (checked before parsing),
            not JSON, or not a valid annotations object.
    """
    if not text:
        return None
    # A str of n characters holds at least n UTF-8 bytes: refuse what cannot
    # fit before the parser allocates anything for it.
    if len(text) > MAX_ANNOTATIONS_BYTES:
        raise InvalidArgument(f"{what}: {len(text)} characters exceeds the limit {MAX_ANNOTATIONS_BYTES} bytes "
                              "(MAX_ANNOTATIONS_BYTES)")
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{what}: not valid JSON ({exc})") from None
    return check_annotations(doc, what=what)


def _no_constant(name: str) -> None:
    """Refuses NaN and Infinity, which Python's JSON parser otherwise takes."""
    raise ValueError(f"{name} is not allowed")
