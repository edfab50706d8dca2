"""The registrar seam: the few CUDA runtime calls host registration needs.

Everything that decides *what* to register, in which order, and what to do
when a call fails lives in :mod:`dlo_runtime.transports` and is tested on CPU
with fake registrars. This module only talks to the CUDA runtime:

- ``cudaDeviceGetAttribute`` for the capability probe
  (``cudaDevAttrHostRegisterSupported`` = 99,
  ``cudaDevAttrHostRegisterReadOnlySupported`` = 113,
  ``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` = 100,
  ``cudaDevAttrIntegrated`` = 18, the unified-memory signal);
- ``cudaHostRegister(ptr, size, flags)`` / ``cudaHostUnregister(ptr)``;
- ``cudaGetLastError`` to clear the per-thread error a failed call leaves
  behind (otherwise the next kernel-launch check in torch raises it as if the
  kernel had failed).

The runtime library is the one already loaded into the process by torch
(found in ``/proc/self/maps``), so the error state we clear is torch's. When
no shared ``libcudart`` is loaded (a static build), registration falls back to
``torch.cuda.cudart()`` for register/unregister and the probe reports that
errors cannot be cleared, which makes the registrar decline registration:
an error we cannot clear would poison the next unrelated CUDA call.

None of this code ran on a GPU while it was written (README.md, "DLO
runtime" → "What ran where"); it follows the CUDA runtime API reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from typing import Protocol

import torch

log = logging.getLogger(__name__)

#: cudaHostRegister flags (cuda_runtime_api.h).
HOST_REGISTER_DEFAULT = 0x00
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08

#: cudaDeviceAttr values (identical to the driver's CU_DEVICE_ATTRIBUTE_*).
ATTR_INTEGRATED = 18
ATTR_PAGEABLE_MEMORY_ACCESS = 88
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_PAGEABLE_USES_HOST_PAGE_TABLES = 100
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113


@dataclasses.dataclass(frozen=True)
class HostCapability:
    """What the platform allows for host memory of one device.

    ``reason`` says, in words, why registration is not possible when
    ``host_register_supported`` is False.
    """

    platform: str  # "cuda" or "cpu"
    host_register_supported: bool
    read_only_supported: bool
    uses_host_page_tables: bool
    unified_memory: bool
    reason: str = ""


class Registrar(Protocol):
    """The seam between registration policy and the CUDA runtime.

    ``register``/``unregister``/``clear_error`` return a cudaError_t code
    (0 = cudaSuccess); they never raise for a CUDA error.
    """

    def capability(self, device: torch.device) -> HostCapability:
        """What ``device``'s platform supports (probed once per call)."""
        ...

    def register(self, address: int, nbytes: int, flags: int) -> int:
        """cudaHostRegister of ``nbytes`` at ``address`` with ``flags``."""
        ...

    def unregister(self, address: int) -> int:
        """cudaHostUnregister of the range registered at ``address``."""
        ...

    def clear_error(self) -> int:
        """Returns and resets this thread's last CUDA error."""
        ...


class NullRegistrar:
    """The registrar of a platform without host registration (CPU, or CUDA
    where the runtime cannot be reached). Every call is refused."""

    def __init__(self, reason: str = "no CUDA device: host registration does not apply"):
        self.reason = reason

    def capability(self, device: torch.device) -> HostCapability:
        """No registration, with ``reason``."""
        return HostCapability(device.type, False, False, False, False, self.reason)

    def register(self, address: int, nbytes: int, flags: int) -> int:
        """Never called: the capability says no (a call is a policy bug)."""
        raise AssertionError("NullRegistrar.register called: the capability probe said no")

    def unregister(self, address: int) -> int:
        """Never called: nothing was registered (a call is a policy bug)."""
        raise AssertionError("NullRegistrar.unregister called: nothing was registered")

    def clear_error(self) -> int:
        """Nothing to clear: 0 (cudaSuccess)."""
        return 0


def _loaded_cudart_path() -> str | None:
    """Path of the libcudart shared object mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


class CudaRegistrar:
    """Registrar over the process's CUDA runtime (ctypes on libcudart)."""

    def __init__(self) -> None:
        self._lib: ctypes.CDLL | None = None
        path = _loaded_cudart_path()
        if path is not None:
            try:
                # dlopen of an already-loaded object returns the same handle,
                # so the error state we clear is the one torch checks.
                lib = ctypes.CDLL(path)
                lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
                lib.cudaHostRegister.restype = ctypes.c_int
                lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
                lib.cudaHostUnregister.restype = ctypes.c_int
                lib.cudaGetLastError.argtypes = []
                lib.cudaGetLastError.restype = ctypes.c_int
                lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
                lib.cudaDeviceGetAttribute.restype = ctypes.c_int
                self._lib = lib
            except (OSError, AttributeError) as exc:
                log.warning("libcudart at %s unusable for host registration: %s", path, exc)

    def _attr(self, attr: int, index: int) -> int | None:
        assert self._lib is not None
        value = ctypes.c_int(0)
        code = self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, index)
        if code != 0:
            self.clear_error()
            return None
        return int(value.value)

    def capability(self, device: torch.device) -> HostCapability:
        """Probes the device's attributes; never raises."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return NullRegistrar().capability(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if self._lib is None:
            integrated = bool(getattr(props, "is_integrated", False))
            return HostCapability("cuda", False, False, False, integrated,
                                  "no shared libcudart loaded: a failed registration could not be cleared")
        integrated = self._attr(ATTR_INTEGRATED, index)
        supported = self._attr(ATTR_HOST_REGISTER_SUPPORTED, index)
        read_only = self._attr(ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, index)
        page_tables = self._attr(ATTR_PAGEABLE_USES_HOST_PAGE_TABLES, index)
        reason = "" if supported else "cudaDevAttrHostRegisterSupported is 0 on this device"
        return HostCapability("cuda", bool(supported), bool(read_only), bool(page_tables), bool(integrated), reason)

    def register(self, address: int, nbytes: int, flags: int) -> int:
        """cudaHostRegister; returns the cudaError_t code."""
        if self._lib is not None:
            return int(self._lib.cudaHostRegister(ctypes.c_void_p(address), nbytes, flags))
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))

    def unregister(self, address: int) -> int:
        """cudaHostUnregister; returns the cudaError_t code."""
        if self._lib is not None:
            return int(self._lib.cudaHostUnregister(ctypes.c_void_p(address)))
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def clear_error(self) -> int:
        """cudaGetLastError: returns and resets this thread's last error."""
        if self._lib is None:
            return 0
        return int(self._lib.cudaGetLastError())


def default_registrar(device: torch.device) -> Registrar:
    """The registrar for ``device``: CUDA's on a CUDA device, else a
    :class:`NullRegistrar`."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaRegistrar()
    return NullRegistrar()
