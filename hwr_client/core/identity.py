"""Artifact identity (DESIGN §3), shared by the daemon and the client.

An identity says which bytes an artifact holds: the final-layout contract, the
canonical source files, the runtime representation, the parallel layout, the
producer, and any extra byte-relevant input. Its **key** is the SHA-256 hex of
its canonical JSON: sorted keys, compact separators, UTF-8, no floats, no NaN.

Validation is strict: unknown fields are rejected and nothing is coerced
(``"1"`` is not ``1``, ``True`` is not ``1``). DP rank is deliberately not part
of the layout: DP replicas share one artifact.

Example:
    >>> ident = Identity.from_dict({
    ...     "contract": {"name": "tiny-dit", "version": 1},
    ...     "sources": [{"name": "model.safetensors", "content_id": "sha256:" + "0" * 64}],
    ...     "representation": {"dtype": "bfloat16"},
    ...     "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
    ...     "producer": {"id": "example", "version": "1"},
    ...     "extra": {}})
    >>> len(ident.key)
    64
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import AbstractSet, Any, Mapping

from hwr_client.core.errors import InvalidArgument

# \Z, not $: "$" also matches before a trailing newline.
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_CONTENT_ID = re.compile(r"^sha256:[0-9a-f]{64}$")

#: Runtime dtype names accepted in ``representation.dtype`` (torch spelling).
REPRESENTATION_DTYPES = frozenset(
    {"bfloat16", "float16", "float32", "float64", "int8", "uint8", "float8_e4m3fn", "float8_e5m2",
     "float8_e4m3fnuz", "float8_e5m2fnuz"}
)


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, compact, UTF-8, no floats/NaN.

    Raises:
        InvalidArgument: a float, a non-string key or an unsupported type.
    """
    _reject_floats(value, "$")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _reject_floats(value: Any, where: str) -> None:
    """Raises InvalidArgument at the first float, non-str key or non-JSON
    value in ``value``; ``where`` is its JSON path, for the message."""
    if isinstance(value, float):
        raise InvalidArgument(f"identity {where}: floats are not allowed in canonical JSON, got {value!r}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidArgument(f"identity {where}: object keys must be strings, got {k!r}")
            _reject_floats(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_floats(v, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (str, int, bool))):
        raise InvalidArgument(f"identity {where}: unsupported JSON type {type(value).__name__}")


def is_key(text: object) -> bool:
    """True when ``text`` looks like an identity key (64 lowercase hex)."""
    return isinstance(text, str) and bool(_HEX64.match(text))


def check_key(text: object) -> str:
    """Returns ``text`` if it is a well-formed identity key.

    Raises:
        InvalidArgument: anything else.
    """
    if not is_key(text):
        raise InvalidArgument(f"identity key {text!r}: expected 64 lowercase hex characters")
    return text  # type: ignore[return-value]


def _obj(doc: Any, where: str, required: AbstractSet[str], optional: AbstractSet[str] = frozenset()) -> dict:
    """``doc`` if it is an object with every ``required`` field and no field
    outside ``required`` and ``optional``."""
    if not isinstance(doc, dict):
        raise InvalidArgument(f"identity {where}: expected an object, got {type(doc).__name__}")
    unknown = set(doc) - required - optional
    if unknown:
        raise InvalidArgument(f"identity {where}: unknown field(s) {sorted(unknown)}; expected {sorted(required | optional)}")
    missing = required - set(doc)
    if missing:
        raise InvalidArgument(f"identity {where}: missing field(s) {sorted(missing)}")
    return doc


def _str(doc: dict, field: str, where: str) -> str:
    """``doc[field]`` if it is a non-empty str."""
    value = doc[field]
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"identity {where}.{field}: expected a non-empty string, got {value!r}")
    return value


def _int(doc: dict, field: str, where: str, minimum: int) -> int:
    """``doc[field]`` if it is an int (not a bool) of at least ``minimum``."""
    value = doc[field]
    # bool is an int subclass; True must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"identity {where}.{field}: expected an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"identity {where}.{field}: expected >= {minimum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Identity:
    """A validated identity document. Build with :meth:`from_dict`,
    :meth:`from_json` or :meth:`coerce`.

    ``document`` is the normalized document (sources sorted by name);
    ``canonical`` its canonical JSON bytes; ``key`` their SHA-256 hex, the
    artifact's name in the store.
    """

    document: Mapping[str, Any]
    canonical: bytes
    key: str

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Identity":
        """Validates ``doc`` and derives its canonical form and key.

        Raises:
            InvalidArgument: naming the offending field and what was expected.
        """
        doc = _obj(doc, "$", {"contract", "sources", "representation", "layout", "producer", "extra"})
        contract = _obj(doc["contract"], "contract", {"name", "version"})
        _str(contract, "name", "contract")
        _int(contract, "version", "contract", 0)
        sources = doc["sources"]
        if not isinstance(sources, list) or not sources:
            raise InvalidArgument(f"identity sources: expected a non-empty list, got {sources!r}")
        names = set()
        for i, src in enumerate(sources):
            src = _obj(src, f"sources[{i}]", {"name", "content_id"})
            name = _str(src, "name", f"sources[{i}]")
            if name in names:
                raise InvalidArgument(f"identity sources[{i}].name: duplicate source name {name!r}")
            names.add(name)
            if not isinstance(src["content_id"], str) or not _CONTENT_ID.match(src["content_id"]):
                raise InvalidArgument(
                    f"identity sources[{i}].content_id: expected 'sha256:<64 lowercase hex>', got {src['content_id']!r}"
                )
        rep = _obj(doc["representation"], "representation", {"dtype"}, {"policy"})
        if rep["dtype"] not in REPRESENTATION_DTYPES:
            raise InvalidArgument(
                f"identity representation.dtype: expected one of {sorted(REPRESENTATION_DTYPES)}, got {rep['dtype']!r}"
            )
        if "policy" in rep:
            _str(rep, "policy", "representation")
        layout = _obj(doc["layout"], "layout", {"tp_rank", "tp_size", "sp_size", "sp_backend"})
        tp_size = _int(layout, "tp_size", "layout", 1)
        tp_rank = _int(layout, "tp_rank", "layout", 0)
        if tp_rank >= tp_size:
            raise InvalidArgument(f"identity layout.tp_rank: expected < tp_size {tp_size}, got {tp_rank}")
        _int(layout, "sp_size", "layout", 1)
        _str(layout, "sp_backend", "layout")
        producer = _obj(doc["producer"], "producer", {"id", "version"})
        _str(producer, "id", "producer")
        _str(producer, "version", "producer")
        if not isinstance(doc["extra"], dict):
            raise InvalidArgument(f"identity extra: expected an object, got {type(doc['extra']).__name__}")
        # Sources are a set: canonical order is by name, so callers may list
        # them in any order and still get one key.
        normalized = dict(doc)
        normalized["sources"] = sorted(({"name": s["name"], "content_id": s["content_id"]} for s in sources),
                                       key=lambda s: s["name"])
        canonical = canonical_json(normalized)
        return cls(document=json.loads(canonical), canonical=canonical, key=hashlib.sha256(canonical).hexdigest())

    @classmethod
    def from_json(cls, text: str | bytes) -> "Identity":
        """Parses and validates an identity JSON document.

        Raises:
            InvalidArgument: not JSON, or not a valid identity.
        """
        try:
            doc = json.loads(text, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"identity JSON: not valid JSON ({exc})") from None
        return cls.from_dict(doc)

    @classmethod
    def coerce(cls, value: "Identity | Mapping[str, Any] | str | bytes") -> "Identity":
        """Accepts an Identity, a dict document or its JSON text.

        Raises:
            InvalidArgument: not JSON, or not a valid identity.
        """
        if isinstance(value, Identity):
            return value
        if isinstance(value, (str, bytes)):
            return cls.from_json(value)
        return cls.from_dict(value)

    @property
    def contract_name(self) -> str:
        """The final-layout contract's name (``tiny-dit``)."""
        return self.document["contract"]["name"]

    @property
    def contract_version(self) -> int:
        """The final-layout contract's version."""
        return self.document["contract"]["version"]

    def to_json(self) -> str:
        """The canonical JSON as text (what the key is the digest of)."""
        return self.canonical.decode("utf-8")


def _no_constant(name: str) -> None:
    """Refuses NaN and Infinity, which Python's JSON parser otherwise takes."""
    raise ValueError(f"{name} is not allowed")
