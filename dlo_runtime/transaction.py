"""The startup transaction: resolve -> restore -> hand the lease to the
backend, with every step recorded and every failure rule enforced.

Stages of a warm start::

    UNRESOLVED -> LEASE_OWNED_BY_LOADER -> RESTORE_PLANNED -> COMMIT_STARTED
      -> CARRIER_OWNED -> BACKEND_OWNED -> BACKEND_READY -> IN_SERVICE

Failure rules (seed "Pre-service transaction boundary"):

- before COMMIT_STARTED: close the loader's lease; ``preferred`` loads
  canonically into the untouched skeleton, ``required`` fails;
- from COMMIT_STARTED through BACKEND_READY: drain device work, drop hooks,
  staging, plan and model references, close the lease through its current
  owner (loader, carrier or backend), discard the restored model; then
  ``preferred`` builds a FRESH canonical model with HWR, publication and
  checkpoint mmap bypassed, ``required`` fails;
- a registration whose rollback failed aborts startup in both modes, with
  the lease kept open (closing it would unmap memory the driver holds);
- what a miss means in each mode, and that a lookup error other than a miss
  is FAILED in both modes, is decided once, by
  :func:`hwr_client.resolve.resolve`: the transaction consumes its
  :class:`~hwr_client.resolve.Resolution` (LOCAL_HIT: warm start;
  CANONICAL_FALLBACK: canonical load; FAILED: raise).

Publication after a canonical miss: rank-local, once in service; under
AllGather, only on the group's rank 0 and before the backend shards the
model (the only moment full tensors exist; see :class:`ModelRecipe`), so
DP replicas get one shared artifact and never a placeholder.

Model construction is the caller's (:class:`ModelRecipe`), so any model can
plug in; this module only sequences it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from hwr_client.carrier import LeaseCarrier
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound
from hwr_client.resolve import Mode, Outcome, Resolution, parse_mode

from dlo_runtime.allgather import group_size
from dlo_runtime.backend import OffloadBackend
from dlo_runtime.canonical import CanonicalOptions
from dlo_runtime.restore import commit_restore, finalize_shared, plan_restore
from dlo_runtime.options import OffloadOptions
from dlo_runtime.transports import RegistrationAborted

log = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    """Where a warm start is; the trail records each one reached, in order."""

    UNRESOLVED = "UNRESOLVED"
    LEASE_OWNED_BY_LOADER = "LEASE_OWNED_BY_LOADER"
    RESTORE_PLANNED = "RESTORE_PLANNED"
    COMMIT_STARTED = "COMMIT_STARTED"
    CARRIER_OWNED = "CARRIER_OWNED"
    BACKEND_OWNED = "BACKEND_OWNED"
    BACKEND_READY = "BACKEND_READY"
    IN_SERVICE = "IN_SERVICE"


@dataclasses.dataclass(frozen=True)
class Step:
    """One trail entry: a stage reached or an action taken, with a note."""

    what: str
    note: str
    at: float  # time.monotonic()


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """How to build the model; supplied by the model integration.

    ``build_skeleton`` returns a fresh skeleton (meta is fine) each call;
    ``load_canonical(skeleton, options)`` materializes it canonically (cold,
    byte-changing work included) and returns the model; ``select_blocks``
    names the streamable blocks in execution order; ``finalize`` is the
    shared, non-byte-changing finalization; ``publish_after_load`` publishes
    after a canonical miss (never called on a hit or during recovery). Under
    AllGather (``options.process_group`` of G > 1 ranks) it is called on the
    group's rank 0 only, BEFORE the backend starts (afterwards the model's
    streamed tensors are placeholders): it must take the full tensors then;
    the other ranks record ``publish_skipped``. A publisher that sends
    synchronously here holds the other ranks in their first collective for
    its duration (bounded by ``collective_timeout_s``); the worker and
    ``from_pretrained`` only take the tensors here and publish them after
    serving, on a thread of their own (:mod:`dlo_runtime.background`).
    """

    build_skeleton: Callable[[], nn.Module]
    load_canonical: Callable[[nn.Module, CanonicalOptions], nn.Module]
    select_blocks: Callable[[nn.Module], Sequence[nn.Module]]
    finalize: Callable[[nn.Module], Any] = lambda m: None
    publish_after_load: Callable[[nn.Module], Any] | None = None


@dataclasses.dataclass(frozen=True)
class StartupResult:
    """A start that reached IN_SERVICE.

    Attributes:
        outcome: LOCAL_HIT, CANONICAL_FALLBACK or DISABLED.
        model: the model in service.
        backend: its started offload backend (owns the lease on a hit).
        trail: every stage and action, in order.
    """

    outcome: Outcome
    model: nn.Module
    backend: OffloadBackend
    trail: tuple[Step, ...]


def discard_model(model: nn.Module) -> None:
    """Points every parameter and buffer at meta, dropping the model's
    references to restored (mapped) or device memory."""
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                     requires_grad=p.requires_grad)
        for attr, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[attr] = torch.empty(b.shape, dtype=b.dtype, device="meta")


class StartupTransaction:
    """One worker start. ``run()`` once; read ``trail`` afterwards (also on
    failure).

    The mode rule (what a miss, an unusable artifact or an unreachable
    daemon means in each mode) is applied once, by
    :func:`hwr_client.resolve.resolve`; the transaction acts on the
    :class:`~hwr_client.resolve.Resolution` it returns and owns only the
    rules after a hit (plan, commit, hand-over, recovery).

    Args:
        mode: a :class:`~hwr_client.resolve.Mode` or its string value.
        recipe: how to build and load the model.
        resolve: the loader's lookup, called once unless ``mode`` is
            disabled: returns the Resolution of this start's identity,
            resolved in ``mode`` (on LOCAL_HIT the transaction owns its
            lease from then on).
        options: offload backend options.

    Raises:
        InvalidArgument: ``mode`` is not a mode.

    Example:
        >>> tx = StartupTransaction("preferred", recipe,                           # doctest: +SKIP
        ...                         lambda: client.resolve(identity, mode="preferred"))
        >>> result = tx.run(); result.outcome                                      # doctest: +SKIP
        <Outcome.LOCAL_HIT: 'LOCAL_HIT'>
    """

    def __init__(self, mode: Mode | str, recipe: ModelRecipe, resolve: Callable[[], Resolution],
                 options: OffloadOptions | None = None):
        self.mode = parse_mode(mode)
        self.recipe = recipe
        self.resolve = resolve
        self.options = options or OffloadOptions()
        self.trail: list[Step] = []
        self.stage: Stage | None = None
        self._ran = False

    def _record(self, what: str, note: str = "") -> None:
        self.trail.append(Step(what, note, time.monotonic()))
        log.info("startup %s%s", what, f": {note}" if note else "")

    def _enter(self, stage: Stage, note: str = "") -> None:
        self.stage = stage
        self._record(stage.value, note)

    def run(self) -> StartupResult:
        """Runs the start.

        Returns:
            The model in service, its backend, the outcome and the trail.

        Raises:
            FailedPrecondition: a required start without a usable artifact
                (resolve's message says how to populate the store), or a
                failure before service in required mode.
            RegistrationAborted: stuck registration (both modes).
            HwrError: any other FAILED resolution (both modes), raised as
                resolve reported it.
        """
        if self._ran:
            raise FailedPrecondition("startup transaction: run() called twice; build a new transaction")
        self._ran = True
        self._enter(Stage.UNRESOLVED, self.mode.value)
        if self.mode is Mode.DISABLED:
            return self._canonical(self.recipe.build_skeleton(), CanonicalOptions(False, False, True), Outcome.DISABLED)
        res = self._lookup()
        if res.outcome is Outcome.LOCAL_HIT:
            return self._warm(res.lease)
        return self._canonical(self.recipe.build_skeleton(), CanonicalOptions(), Outcome.CANONICAL_FALLBACK)

    def _lookup(self) -> Resolution:
        """The Resolution of a LOCAL_HIT or CANONICAL_FALLBACK; raises on
        FAILED (never silently a miss)."""
        try:
            res = self.resolve()
        except Exception as exc:
            self._record("FAILED", f"lookup: {exc}")
            raise
        if res.mode is not self.mode:
            self._record("FAILED", f"resolved in mode {res.mode.value}")
            raise InvalidArgument(f"startup ({self.mode.value}): the resolution was made in mode {res.mode.value!r}; "
                                  f"resolve with the transaction's mode")
        if res.outcome is Outcome.FAILED:
            self._record("FAILED", res.reason)
            error = res.error or FailedPrecondition(
                f"startup ({self.mode.value}): HWR resolve of {res.key[:12] or '-'} FAILED: {res.reason}")
            if isinstance(error, NotFound):
                # resolve answers the lookup (the artifact is not there); a
                # start answers its own precondition: a required start needs
                # a populated store. The message says how to populate it.
                raise FailedPrecondition(str(error)) from error
            raise error
        if res.outcome is Outcome.CANONICAL_FALLBACK:
            self._record("MISS", res.reason)
        return res

    def _warm(self, lease: Any) -> StartupResult:
        self._enter(Stage.LEASE_OWNED_BY_LOADER)
        try:
            skeleton = self.recipe.build_skeleton()
        except BaseException as exc:
            # The loader owns the lease: a failed build must not leak it.
            lease.close()
            self._record("close_lease", "loader (skeleton build failed)")
            self._record("FAILED", f"build_skeleton: {exc}")
            raise
        try:
            plan = plan_restore(skeleton, lease)
        except Exception as exc:
            lease.close()
            self._record("close_lease", "loader (plan failed)")
            if self.mode is Mode.REQUIRED:
                self._record("FAILED", str(exc))
                raise
            # The skeleton is untouched: the plan changes nothing.
            opts = CanonicalOptions(use_hwr=False, publish=False, checkpoint_mmap=True)
            return self._canonical(skeleton, opts, Outcome.CANONICAL_FALLBACK, note=f"plan failed: {exc}")
        self._enter(Stage.RESTORE_PLANNED, f"{len(plan.bindings)} tensors")
        self._enter(Stage.COMMIT_STARTED)
        carrier: LeaseCarrier | None = None
        backend: OffloadBackend | None = None
        try:
            commit_restore(skeleton, plan)
            finalize_shared(skeleton, self.recipe.finalize, regions=lease.regions())
            carrier, lease = LeaseCarrier(lease), None
            self._enter(Stage.CARRIER_OWNED)
            blocks = self.recipe.select_blocks(skeleton)
            backend = self._backend(skeleton, blocks, carrier)
            self._enter(Stage.BACKEND_OWNED)
            backend.start()
            self._enter(Stage.BACKEND_READY)
        except RegistrationAborted as exc:
            del plan  # the plan holds views into the lease: drop them with the model
            self._record("FAILED", f"registration stuck, lease kept open: {exc}")
            self._note_backend(backend)
            discard_model(skeleton)
            raise
        except Exception as exc:
            del plan  # the plan holds views into the lease: drop them with the model
            self._abort_after_commit(exc, lease, carrier, backend, skeleton)
            if self.mode is Mode.REQUIRED:
                self._record("FAILED", str(exc))
                raise
            fresh = self.recipe.build_skeleton()
            opts = CanonicalOptions(use_hwr=False, publish=False, checkpoint_mmap=False)
            return self._canonical(fresh, opts, Outcome.CANONICAL_FALLBACK, note=f"fresh retry after: {exc}")
        self._enter(Stage.IN_SERVICE, Outcome.LOCAL_HIT.value)
        return StartupResult(Outcome.LOCAL_HIT, skeleton, backend, tuple(self.trail))

    def _backend(self, model: nn.Module, blocks: Sequence[nn.Module], source: Any) -> OffloadBackend:
        return OffloadBackend(model, blocks, self.options, source=source)

    def _note_backend(self, backend: OffloadBackend | None) -> None:
        if backend is not None:
            for t in backend.trail:
                self._record(f"backend.{t}")

    def _abort_after_commit(self, exc: BaseException, lease: Any, carrier: LeaseCarrier | None,
                            backend: OffloadBackend | None, model: nn.Module) -> None:
        """Drain -> release references -> close via the current owner ->
        discard the model."""
        self._record("ABORT", f"{self.stage.value if self.stage else '?'}: {exc}")
        if backend is not None:
            # The backend owns the lease: only its abort may drain and close.
            backend.abort()
            self._note_backend(backend)
        else:
            if str(self.options.device).startswith("cuda") and torch.cuda.is_available():
                torch.cuda.synchronize()  # no device work may still read restored views
            self._record("drain")
            self._record("release")
            if carrier is not None:
                carrier.close()
                self._record("close_lease", "carrier")
            elif lease is not None:
                lease.close()
                self._record("close_lease", "loader")
        discard_model(model)
        self._record("discard_model")

    def _canonical(self, skeleton: nn.Module, opts: CanonicalOptions, outcome: Outcome, note: str = "") -> StartupResult:
        self._record("CANONICAL_LOAD", f"{outcome.value} use_hwr={opts.use_hwr} publish={opts.publish} "
                                       f"checkpoint_mmap={opts.checkpoint_mmap} {note}".strip())
        model = self.recipe.load_canonical(skeleton, opts)
        self.recipe.finalize(model)
        publish = opts.publish and self.recipe.publish_after_load is not None
        group = self.options.process_group
        size = group_size(group)
        if publish and size > 1:
            # AllGather: the backend is about to point every streamed tensor
            # at a placeholder and keep only a 1/G shard, so the full
            # canonical tensors exist only now. The group's replicas (DP, or
            # SP) share one identity: its rank 0 publishes, here, BEFORE the
            # backend starts (the recipe takes what it needs from the model
            # now; the worker keeps references to the full tensors until its
            # deferred publication ends, one transient copy on one rank),
            # and every other rank skips. So a later start of the group is a
            # LOCAL_HIT on every rank, and no placeholder is ever published.
            if group.rank() == 0:
                self._publish(model, f"group rank 0 of {size}, before AllGather sharding")
            else:
                self._record("publish_skipped", f"AllGather rank {group.rank()} of {size}: "
                                                f"group rank 0 publishes the shared artifact")
        backend = self._backend(model, self.recipe.select_blocks(model), None).start()
        self._enter(Stage.BACKEND_READY, "ordinary")
        self._enter(Stage.IN_SERVICE, outcome.value)
        if publish and size == 1:
            self._publish(model)
        return StartupResult(outcome, model, backend, tuple(self.trail))

    def _publish(self, model: nn.Module, note: str = "") -> None:
        assert self.recipe.publish_after_load is not None
        try:
            self.recipe.publish_after_load(model)
            self._record("published", note)
        except Exception as exc:  # publication is for the next start; never fails this one
            log.warning("publish after load failed (the next start will load canonically again): %s", exc)
            self._record("publish_failed", str(exc))
