"""What a :func:`dlo_runtime.from_pretrained` start returns: the
:class:`LoadedModel` (the model and what owns its weights) and its
:class:`PretrainedReport` (what the start did and cost)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from torch import nn

from hwr_client.core.errors import InvalidArgument
from hwr_client.resolve import Outcome

from dlo_runtime.pretrained.contract import PretrainedContract
from dlo_runtime.pretrained.skeleton import nparams
from dlo_runtime.restore import tensor_slots


@dataclasses.dataclass
class PretrainedReport:
    """What a :func:`from_pretrained` start did and cost.

    Attributes:
        outcome: ``LOCAL_HIT``, ``CANONICAL_FALLBACK``, ``DISABLED`` or
            ``CHECKPOINT_MMAP`` (served from the checkpoint's own mapping).
        key: identity key ("" when disabled; after a cold start whose
            sources were still being hashed, "" until the background
            publication completes it: :attr:`LoadedModel.key` waits).
        contract: ``<library>:<Class>``; ``library_version`` its version.
        seconds: wall seconds per phase (``skeleton``, ``preflight``,
            ``resolve``: identity and lease in one call, ``start``,
            ``publish``), and ``total``.
        bytes_materialized: private bytes this process allocated for the
            model's tensors (0 on a warm start).
        producer_calls: canonical loads run (0 on a warm start).
        blocks: names of the streamed blocks, in order; ``streamed_bytes``
            their bytes; ``streamed_fraction`` their share of the parameters.
        notes: anything worth a look (streamed blocks under half the model;
            source files the worker hashed itself, why, and what would make
            the start fast).
        publish: the publish-after-load report on a preferred miss
            (``{"state": "running", ...}`` while it runs in the background;
            :meth:`LoadedModel.wait_published` waits for the final one).
        trail: the startup transaction's steps.
        host_plan: the host-weight plan taken: ``"checkpoint-mmap"``,
            ``"hwr"`` or ``"ordinary"``; ``host_plan_reason`` why
            (:mod:`dlo_runtime.pretrained.hostplan`).
        compile: with ``compile=``, the
            :class:`~dlo_runtime.compile.CompileReport` (filled in at the
            first call: hit / miss / published, seconds saved), else None.
    """

    outcome: str
    key: str = ""
    contract: str = ""
    library_version: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_materialized: int = 0
    producer_calls: int = 0
    checkpoint_bytes_read: int = 0
    blocks: list[str] = dataclasses.field(default_factory=list)
    streamed_bytes: int = 0
    streamed_fraction: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    publish: dict[str, Any] | None = None
    trail: list[str] = dataclasses.field(default_factory=list)
    host_plan: str = "hwr"
    host_plan_reason: str = ""
    compile: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return dataclasses.asdict(self)


class LoadedModel:
    """A model :func:`from_pretrained` started: ``model`` (eval mode, DLO
    hooks when a device was given), ``outcome``, ``key``, ``report``.
    :meth:`close` (or leaving the ``with`` block) tears down the backend,
    which closes the lease, then the client. After a preferred miss,
    ``publication`` is the :class:`~dlo_runtime.background.BackgroundPublication`
    that publishes for the next start (``report.publish`` holds its state)."""

    def __init__(self, model: nn.Module, report: PretrainedReport, *, backend: Any = None, client: Any = None,
                 contract: PretrainedContract | None = None):
        self.model, self.report = model, report
        self.backend, self.client, self.contract = backend, client, contract
        self.publication: Any = None

    def wait_published(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Waits at most ``timeout`` seconds (None: no bound) for the
        background publication of a preferred miss to end.

        Returns:
            Its final report (``state``, ``ok``, ``seconds``, ...), None
            while it still runs, or ``{}`` when this start publishes nothing.
        """
        return {} if self.publication is None else self.publication.wait_published(timeout)

    @property
    def outcome(self) -> Outcome:
        """How the start went (:class:`~hwr_client.resolve.Outcome`)."""
        return Outcome(self.report.outcome)

    @property
    def key(self) -> str:
        """The identity key ("" when HWR was disabled). After a cold start
        whose sources were still being hashed, waits for that identity
        (``report.key`` is "" until the publication completes it)."""
        if not self.report.key and self.publication is not None:
            self.report.key = self.publication.identity_key()
        return self.report.key

    @property
    def lease(self) -> Any:
        """The lease the backend owns on a warm start, else None."""
        return getattr(self.backend, "lease", None)

    def close(self, *, publication: str = "finish") -> None:
        """Backend (drain, unhook, close the lease), then the client. Idempotent.

        Args:
            publication: what becomes of a background publication still
                running: ``"finish"`` (default) lets it end on its own (it
                holds its own connection and the tensors it reads; interpreter
                exit waits at most ``dlo_runtime.background.EXIT_WAIT_S``),
                ``"abandon"`` ends it now (nothing published), ``"wait"``
                blocks until it ends.
        """
        if publication not in ("finish", "abandon", "wait"):
            raise InvalidArgument(f"publication={publication!r}: expected 'finish', 'abandon' or 'wait'")
        if self.publication is not None and publication != "finish":
            self.publication.close(wait_s=None if publication == "wait" else 0.0)
        elif self.publication is not None:
            self.publication.start_now()  # no first output is coming from a closed model
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def block_report(model: nn.Module, blocks: Sequence[nn.Module], report: PretrainedReport) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    report.blocks = [names[id(b)] for b in blocks]
    streamed = sum(s.tensor.nbytes for b in blocks for s in tensor_slots(b).slots)
    params = sum(p.numel() for b in blocks for p in b.parameters())
    report.streamed_bytes = streamed
    report.streamed_fraction = round(params / max(nparams(model), 1), 4)
    if report.streamed_fraction < 0.5:
        report.notes.append(f"streamed blocks hold {report.streamed_fraction:.0%} of the parameters (under half): "
                            "pass blocks=[...] to stream more")


__all__ = ["LoadedModel", "PretrainedReport", "block_report"]
