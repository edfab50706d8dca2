"""The offload options: one record for every way the DLO backend is started.

:func:`~dlo_runtime.backend.enable_layerwise_offload`,
:class:`~dlo_runtime.backend.OffloadBackend` and the startup transaction all
take an :class:`OffloadOptions`, so a new option (a rank layout for
multi-rank gathers, a registration budget) is one new field here and reaches
every entry point without another signature to keep in step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dlo_runtime.cuda_host import Registrar
from dlo_runtime.transports import MAX_CHUNK_BYTES
from hwr_client.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """How the layerwise offload backend runs.

    Attributes:
        device: compute device the streamed blocks are copied to:
            ``"cuda:N"`` (asynchronous copies on a copy stream), ``"cuda"``
            (the current CUDA device) or ``"cpu"`` (a copy thread plays the
            copy stream). Default ``"cpu"``.
        resident_blocks: number of leading blocks kept on the device and
            never streamed. Default 0.
        pin_memory: the pin policy: False disables host registration and
            pinned staging. Default True.
        registration_limit_gib: ceiling on the source's mapped bytes
            registered with ``cudaHostRegister``, in GiB; 0 means no
            ceiling (default). A tiny value forces the staging transport on
            a CUDA node. The backend's own pinned buffers (staging slots,
            shards, packed blocks) are not counted here: the daemon's
            budget bounds them (:mod:`dlo_runtime.pinned`).
        registrar: the CUDA host-registration seam; None (default) uses the
            platform's (:func:`~dlo_runtime.cuda_host.default_registrar`).
            Tests pass fakes.
        chunk_bytes: largest range, in bytes, one ``cudaHostRegister`` call
            gets. Default :data:`~dlo_runtime.transports.MAX_CHUNK_BYTES`
            (64 GiB).
        process_group: the existing ``torch.distributed`` group DLO shards
            host weights over (see :func:`dlo_runtime.groups.offload_group`):
            a group of G > 1 ranks selects the AllGather transport (each rank
            keeps 1/G of every streamed block); None or a group of one is
            rank-local. Default None.
        collective_timeout_s: seconds an AllGather collective may take before
            the forward fails with ``CollectiveFailed`` naming it (gloo: each
            wait; NCCL: the group's watchdog timeout applies instead); 0
            waits forever. Default 300.

    Example:
        >>> opts = OffloadOptions(device="cuda:0", registration_limit_gib=32)
        >>> opts.updated(resident_blocks=2).resident_blocks
        2
    """

    device: str | torch.device = "cpu"
    resident_blocks: int = 0
    pin_memory: bool = True
    registration_limit_gib: float = 0.0
    registrar: Registrar | None = None
    chunk_bytes: int = MAX_CHUNK_BYTES
    process_group: Any = None
    collective_timeout_s: float = 300.0

    def updated(self, **fields: Any) -> "OffloadOptions":
        """A copy with ``fields`` replaced.

        Raises:
            TypeError: a name that is not an option (the message lists them).
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(f"offload options: unknown option(s) {unknown}; expected some of {sorted(names)}")
        return dataclasses.replace(self, **fields) if fields else self


def validate_offload(module: nn.Module, blocks: list[nn.Module], options: OffloadOptions) -> None:
    """The arguments of :func:`~dlo_runtime.backend.enable_layerwise_offload`,
    checked before anything is taken or changed.

    Raises:
        InvalidArgument: naming the argument and what was expected.
    """
    resident, limit_gib = options.resident_blocks, options.registration_limit_gib
    if not blocks:
        raise InvalidArgument("enable_layerwise_offload: expected at least one block, got none")
    ids = {id(m) for m in module.modules()}
    for i, b in enumerate(blocks):
        if id(b) not in ids:
            raise InvalidArgument(f"enable_layerwise_offload: block {i} is not a submodule of the module")
    if len({id(b) for b in blocks}) != len(blocks):
        raise InvalidArgument("enable_layerwise_offload: a block is listed twice")
    if not 0 <= resident <= len(blocks):
        raise InvalidArgument(f"enable_layerwise_offload: resident_blocks={resident}, expected 0..{len(blocks)}")
    if limit_gib < 0:
        raise InvalidArgument(f"enable_layerwise_offload: registration_limit_gib={limit_gib}, expected >= 0")
    if options.collective_timeout_s < 0:
        raise InvalidArgument(f"enable_layerwise_offload: collective_timeout_s={options.collective_timeout_s}, "
                              f"expected >= 0")
