"""Where a component's weights live: the unified-memory decision, made once.

On a device that shares one physical pool with the host (a CUDA device with
``cudaDevAttrIntegrated`` = 1, e.g. GB10 / Jetson; Apple MPS), host offload
frees nothing: "host" and "device" memory are the same pages, so moving
weights to the host only adds copies and a second resident copy. There the
host offload modes are turned off and components load straight onto the
device. :func:`host_offload` is the one place this is decided, so every call
site (:func:`dlo_runtime.lazy.lazy_pipeline`, a user's own loader) sees the
same answer; the probe is injectable so the decision is tested on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class OffloadDecision:
    """Whether DLO host offload runs for a device, and why.

    Attributes:
        device: the compute device (None: resident on the CPU).
        offload: stream blocks from host memory (DLO) or not.
        unified_memory: the device shares the host's memory pool.
        reason: the decision in words (goes into reports).
    """

    device: str | None
    offload: bool
    unified_memory: bool
    reason: str


def probe_unified_memory(device: torch.device) -> bool:
    """True on MPS and on a CUDA device whose ``cudaDevAttrIntegrated`` is 1
    (read through the registrar seam, the same probe DLO's transports use)."""
    if device.type == "mps":
        return True
    if device.type != "cuda":
        return False
    from dlo_runtime.cuda_host import default_registrar

    return bool(default_registrar(device).capability(device).unified_memory)


def host_offload(device: str | torch.device | None, requested: bool | None = None, *,
                 probe: Callable[[torch.device], bool] | None = None) -> OffloadDecision:
    """Decides once whether host offload (DLO streaming) runs on ``device``.

    Args:
        device: the compute device; None keeps weights resident on the CPU.
        requested: True / False force it where it can make sense; None
            (auto) offloads on a discrete accelerator and on the CPU "device"
            DLO supports, and never on unified memory.
        probe: ``device -> unified?``; default :func:`probe_unified_memory`.
            Tests inject device properties here.

    Returns:
        The decision. On unified memory ``offload`` is False even when
        requested, and ``reason`` says so.
    """
    if device is None:
        return OffloadDecision(None, False, False, "no device: components stay resident on the CPU")
    dev = torch.device(device)
    unified = bool((probe or probe_unified_memory)(dev))
    if unified:
        why = "requested, but " if requested else ""
        return OffloadDecision(str(dev), False, True,
                               f"{why}{dev} shares one memory pool with the host (cudaDevAttrIntegrated / MPS): "
                               "host offload frees nothing there, so it is off and components load onto the device")
    if requested is False:
        return OffloadDecision(str(dev), False, False, f"offload=False: components resident on {dev}")
    return OffloadDecision(str(dev), True, False, f"{dev} is discrete: DLO streams blocks from host memory")


__all__ = ["OffloadDecision", "host_offload", "probe_unified_memory"]
