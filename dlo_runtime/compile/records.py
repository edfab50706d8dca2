"""Records of the compile switch: what a model is (for the key) and what its
first compiled call did (the report)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import is_key

#: Report statuses: the first call has not run yet / it restored a compile
#: artifact / there was none, so the model compiled and publishes one /
#: HWR was not used (disabled mode, another backend, an unsafe cache folder).
PENDING, HIT, MISS, BYPASSED = "pending", "hit", "miss", "bypassed"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a compile artifact is compiled FOR, the model half of its key.

    Attributes:
        name: ``<library>:<Class>`` (or a module's qualified class name).
        dtype: the model's dtype (the artifact's representation).
        weights_key: the identity key of the model's HWR weight artifact;
            the compile artifact then belongs to it (and travels with it as
            its referrer). "" when there is none.
        config_sha256: SHA-256 hex of the model's ``config.json``, the key
            when there is no weight artifact (compiled code depends on the
            architecture, not on weight values, unless the options freeze
            weights into the graph: then give ``weights_key``).
        library_version: the modelling library's version (its code is what
            is traced).
    """

    name: str
    dtype: str
    weights_key: str = ""
    config_sha256: str = ""
    library_version: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("compile source: expected a model name")
        if self.weights_key and not is_key(self.weights_key):
            raise InvalidArgument(f"compile source {self.name}: weights_key {self.weights_key!r}; expected an "
                                  "identity key (64 lowercase hex)")
        if not self.weights_key and not is_key(self.config_sha256):
            raise InvalidArgument(f"compile source {self.name}: expected weights_key or config_sha256 (64 hex)")


@dataclasses.dataclass
class CompileReport:
    """What the compile switch did, filled in as it happens (the first
    compiled call, then the background publication).

    Attributes:
        status: ``pending`` until the first compiled call; then ``hit`` (a
            compile artifact restored before it), ``miss`` (none: compiled
            here, then published) or ``bypassed`` (HWR not used: ``reason``).
        key: the compile artifact's identity key ("" until the first call).
        reason: why this status (one line).
        publish: "" / ``scheduled`` / ``published`` / ``already_published``
            / ``failed: <error>`` / ``skipped: <why>``.
        seconds: ``restore`` (lease, verify, write the cache entries),
            ``first_call`` (the first compiled call, compile included),
            ``first_output`` (both), ``cold_first_output`` (what the compile
            that produced the artifact took, as its publisher measured it)
            and ``saved`` (cold minus this first output) on a hit;
            ``publish`` on a miss.
        files, bytes: cache entries restored (hit) or published (miss).
        notes: anything worth a look.
    """

    status: str = PENDING
    key: str = ""
    reason: str = ""
    publish: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    files: int = 0
    bytes: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # Not a field: dataclasses.asdict() of a report that holds this one
        # must not try to copy a lock.
        self._done = threading.Event()

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return dataclasses.asdict(self)

    def wait_published(self, timeout: float | None = None) -> bool:
        """Waits until the publication after a miss has ended (or there is
        none to wait for); True when it has. For tests and benchmarks: a
        worker never needs to wait."""
        return self._done.wait(timeout)

    def settle(self) -> None:
        """Marks the report final (nothing more will change it)."""
        self._done.set()


__all__ = ["BYPASSED", "CompileReport", "HIT", "MISS", "ModelSource", "PENDING"]
