"""Layerwise offload (DLO) runtime fed from HWR leases.

- :func:`restore_model` — warm restore of a skeleton from a lease (plan,
  then commit; no copy) and :func:`finalize_shared` (proves shared
  finalization byte- and pointer-neutral). The function is not called
  ``restore``, so ``dlo_runtime.restore`` is always the submodule.
- :func:`enable_layerwise_offload` — two rotating device buffers, one
  contiguous copy per block, host transports registered / staging / ordinary.
- :class:`StartupTransaction` — the recorded, failure-safe hand-over of a
  lease from loader to backend.
- :func:`load_canonical_into` — canonical loading that releases each
  checkpoint tensor as soon as it is copied.
- :func:`offload_group` / :func:`validate_wave` — DLO's weight-sharding
  group (AllGather over DP or SP, or rank-local) and the wave rules of
  AllGather DP waves.
- :func:`from_pretrained` — a diffusers / transformers model directory
  through HWR and DLO with one call (:mod:`dlo_runtime.pretrained`; the
  libraries are imported only when it runs).
- :func:`lazy_pipeline` — a diffusers pipeline whose components load on
  first use through it and release after their last use in a call
  (:mod:`dlo_runtime.lazy`).
"""

from dlo_runtime.allgather import ALLGATHER, BlockSequenceMismatch, CollectiveFailed
from dlo_runtime.backend import BlockStats, OffloadBackend, OffloadStats, enable_layerwise_offload, retained
from dlo_runtime.canonical import CanonicalOptions, LoadReport, load_canonical_into
from dlo_runtime.checkpoint import CheckpointReader, iter_checkpoint
from dlo_runtime.cuda_host import CudaRegistrar, HostCapability, NullRegistrar, Registrar
from dlo_runtime.groups import GroupChoice, offload_group, validate_wave
from dlo_runtime.options import OffloadOptions
from dlo_runtime.pretrained import LoadedModel, from_pretrained
from dlo_runtime.lazy import LazyPipeline, lazy_pipeline
from dlo_runtime.restore import RestorePlan, RestoreResult, commit_restore, finalize_shared, plan_restore, restore_model
from dlo_runtime.transaction import ModelRecipe, Stage, StartupResult, StartupTransaction, discard_model
from dlo_runtime.transports import (
    ORDINARY, REGISTERED, STAGING, UNIFIED, RegistrationAborted, TransportChoice, UnregisterFailed,
)
# One definition of modes and outcomes for the client and the runtime.
from hwr_client.resolve import Mode, Outcome

__all__ = [
    "ALLGATHER", "BlockSequenceMismatch", "CollectiveFailed", "GroupChoice", "offload_group", "validate_wave",
    "BlockStats", "CanonicalOptions", "CheckpointReader", "CudaRegistrar", "HostCapability", "LoadReport", "Mode",
    "ModelRecipe", "NullRegistrar", "ORDINARY", "OffloadBackend", "OffloadOptions", "OffloadStats", "Outcome",
    "REGISTERED", "Registrar", "RegistrationAborted", "RestorePlan", "RestoreResult", "STAGING", "Stage",
    "StartupResult", "StartupTransaction", "TransportChoice", "UNIFIED", "UnregisterFailed", "commit_restore",
    "discard_model", "enable_layerwise_offload", "finalize_shared", "from_pretrained", "iter_checkpoint",
    "load_canonical_into", "LoadedModel", "LazyPipeline", "lazy_pipeline",
    "plan_restore", "restore_model", "retained",
]
