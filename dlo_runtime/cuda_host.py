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
- ``cudaFree(0)`` inside ``torch.cuda.device(index)`` before each call, so
  the device's primary context exists and is the one the call lands in;
- ``cudaGetLastError`` to clear the per-thread error a failed call leaves
  behind (otherwise the next kernel-launch check in torch raises it as if the
  kernel had failed).

The runtime library is the one already loaded into the process by torch
(found in ``/proc/self/maps`` by name pattern, torch's own copy preferred:
:func:`choose_cudart`), so the error state we clear is torch's. When
no shared ``libcudart`` is loaded (a static build), registration falls back to
``torch.cuda.cudart()`` for register/unregister and the probe reports that
errors cannot be cleared, which makes the registrar decline registration:
an error we cannot clear would poison the next unrelated CUDA call.

None of this code ran on a GPU while it was written (docs/gpu.md,
"What ran where"); it follows the CUDA runtime API reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import re
import threading
from typing import Callable, Iterator, Protocol, Sequence

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


#: A CUDA runtime shared object: ``libcudart.so``, ``libcudart.so.12``,
#: ``libcudart.so.12.4.127`` and the hashed copies wheels vendor
#: (``libcudart-<hash>.so.12``, auditwheel's renaming).
CUDART_NAME = re.compile(r"^libcudart(?:-[0-9A-Za-z]+)?\.so(?:\.\d+)*$")


def cudart_candidates(maps_text: str) -> list[str]:
    """Distinct paths of mapped CUDA runtimes in ``/proc/<pid>/maps`` text,
    in the order they first appear."""
    out: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue  # anonymous mapping: no path
        path = fields[5].strip()
        if CUDART_NAME.match(os.path.basename(path)) and path not in out:
            out.append(path)
    return out


def _torch_lib_dirs() -> list[str]:
    """Directories where torch's own libcudart lives: torch/lib (a bundled
    build) and the NVIDIA runtime wheels next to torch (pip builds):
    ``nvidia/cuda_runtime/lib`` (CUDA 12 wheels, ``nvidia-cuda-runtime-cu12``)
    and ``nvidia/cu13/lib`` (CUDA 13 wheels, ``nvidia-cuda-runtime`` 13.x,
    which torch 2.11+cu130 loads)."""
    root = os.path.dirname(os.path.abspath(torch.__file__))
    site = os.path.dirname(root)
    return [os.path.join(root, "lib"), os.path.join(site, "nvidia", "cuda_runtime"),
            os.path.join(site, "nvidia", "cu13", "lib")]


def choose_cudart(candidates: Sequence[str], preferred_dirs: Sequence[str]) -> str | None:
    """The runtime to bind: the first candidate under one of
    ``preferred_dirs`` (torch's copy, whose error state torch checks), else the
    first candidate, else None."""
    prefixes = [os.path.join(os.path.realpath(d), "") for d in preferred_dirs]
    for path in candidates:
        real = os.path.realpath(path)
        if any(real.startswith(p) or path.startswith(p) for p in prefixes):
            return path
    return candidates[0] if candidates else None


def _loaded_cudart_path(maps_text: str | None = None) -> str | None:
    """Path of the libcudart mapped into this process (torch's preferred);
    logs the choice and the other candidates."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return None
    candidates = cudart_candidates(maps_text)
    path = choose_cudart(candidates, _torch_lib_dirs())
    if path is not None:
        log.info("host registration binds libcudart at %s (candidates: %s)", path, ", ".join(candidates))
    return path


# --- pre-faulting --------------------------------------------------------------------------------

#: madvise advice values (linux/mman.h); MADV_POPULATE_READ/WRITE need Linux 5.14.
MADV_WILLNEED = 3
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
#: Threads that populate one range; cudaHostRegister faults single-threaded.
PREFAULT_THREADS = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

Madvise = Callable[[int, int, int], int]  # (address, nbytes, advice) -> 0 or an errno


def _libc_madvise() -> Madvise:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int

    def madvise(address: int, nbytes: int, advice: int) -> int:
        if fn(ctypes.c_void_p(address), nbytes, advice) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO

    return madvise


def prefault(address: int, nbytes: int, *, threads: int = PREFAULT_THREADS, madvise: Madvise | None = None,
             write: bool = False) -> str:
    """Faults a mapped range into memory before ``cudaHostRegister`` pins it.

    The driver pins with ``pin_user_pages`` single-threaded under the mmap
    lock, reading cold pages from disk inside the call (and holding driver
    locks other processes' CUDA calls wait on). Populating first, from
    ``threads`` threads over page-aligned slices, moves that I/O out of the
    call. ``MADV_POPULATE_READ`` (Linux >= 5.14) is tried first; where the
    kernel refuses it (EINVAL), ``MADV_WILLNEED`` starts asynchronous
    read-ahead instead. ``write``: the process's own writable memory
    (anonymous staging slots): ``MADV_POPULATE_WRITE`` allocates the pages,
    as the driver's pin for write would, one by one, under its locks.

    Returns:
        ``"populate_read"`` / ``"populate_write"``, ``"willneed"``, or
        ``"none: <reason>"`` when both failed (registration still works, only
        slower: never an error).
    """
    if nbytes <= 0:
        return "none: empty range"
    advise = madvise or _libc_madvise()
    pages = (nbytes + _PAGE - 1) // _PAGE
    n = max(1, min(threads, pages))
    per = (pages + n - 1) // n * _PAGE
    slices = [(address + off, min(per, nbytes - off)) for off in range(0, nbytes, per)]
    codes = [0] * len(slices)

    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ

    def work(i: int) -> None:
        codes[i] = advise(slices[i][0], slices[i][1], advice)

    workers = [threading.Thread(target=work, args=(i,), name=f"hwr-prefault-{i}") for i in range(1, len(slices))]
    for w in workers:
        w.start()
    work(0)
    for w in workers:
        w.join()  # every slice must be populated before the caller registers the range
    if all(c == 0 for c in codes):
        return "populate_write" if write else "populate_read"
    code = advise(address, nbytes, MADV_WILLNEED)
    if code == 0:
        return "willneed"
    first = next(c for c in codes if c)
    return f"none: madvise POPULATE_READ errno {first}, WILLNEED errno {code}"


class CudaRegistrar:
    """Registrar over the process's CUDA runtime (ctypes on libcudart).

    Every runtime call runs inside ``torch.cuda.device(index)`` of the
    registrar's device (given, else the current device at each call), with
    its primary context created first. Registrations are made portable
    (:func:`dlo_runtime.transports.registration_flags`), so every context
    sees them pinned; the device still decides which context owns the
    registration. :meth:`capability` probes the device it is asked about
    and changes nothing.
    """

    def __init__(self, device: torch.device | None = None, *, maps_text: str | None = None) -> None:
        self._lib: ctypes.CDLL | None = None
        self._index: int | None = device.index if device is not None and device.type == "cuda" else None
        path = self.runtime_path = _loaded_cudart_path(maps_text)
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
                lib.cudaFree.argtypes = [ctypes.c_void_p]
                lib.cudaFree.restype = ctypes.c_int
                self._lib = lib
            except (OSError, AttributeError) as exc:
                log.warning("libcudart at %s unusable for host registration: %s", path, exc)

    @contextlib.contextmanager
    def _in_device(self, index: int | None = None) -> Iterator[None]:
        """Runs the body with ``index`` (default: this registrar's device)
        current and its primary context created (torch.cuda.device sets the
        device; cudaFree(0) is the documented way to force context creation)."""
        if index is None:
            index = self._index if self._index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            if self._lib is not None and self._lib.cudaFree(None) != 0:
                self.clear_error()
            yield

    def _attr(self, attr: int, index: int) -> int | None:
        assert self._lib is not None
        value = ctypes.c_int(0)
        code = self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, index)
        if code != 0:
            self.clear_error()
            return None
        return int(value.value)

    def runtime_library(self) -> ctypes.CDLL | None:
        """The bound libcudart (None: none was found), for diagnostics."""
        return self._lib

    def raw_attributes(self, index: int) -> dict[str, int | None]:
        """The host-memory device attributes as the runtime reports them
        (None: the query failed), for the record of a GPU run."""
        if self._lib is None:
            return {}
        names = {"integrated": ATTR_INTEGRATED, "pageable_memory_access": ATTR_PAGEABLE_MEMORY_ACCESS,
                 "host_register_supported": ATTR_HOST_REGISTER_SUPPORTED,
                 "pageable_uses_host_page_tables": ATTR_PAGEABLE_USES_HOST_PAGE_TABLES,
                 "host_register_read_only_supported": ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED}
        with self._in_device(index):
            return {name: self._attr(attr, index) for name, attr in names.items()}

    def capability(self, device: torch.device) -> HostCapability:
        """Probes the device's attributes; never raises."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return NullRegistrar().capability(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if self._lib is None:
            on_die = bool(getattr(props, "is_integrated", False))
            return HostCapability("cuda", False, False, False, on_die,
                                  "no shared libcudart loaded: a failed registration could not be cleared")
        with self._in_device(index):
            integrated = self._attr(ATTR_INTEGRATED, index)
            supported = self._attr(ATTR_HOST_REGISTER_SUPPORTED, index)
            read_only = self._attr(ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, index)
            page_tables = self._attr(ATTR_PAGEABLE_USES_HOST_PAGE_TABLES, index)
        reason = "" if supported else "cudaDevAttrHostRegisterSupported is 0 on this device"
        return HostCapability("cuda", bool(supported), bool(read_only), bool(page_tables), bool(integrated), reason)

    def register(self, address: int, nbytes: int, flags: int) -> int:
        """cudaHostRegister in this registrar's device; returns the cudaError_t code."""
        with self._in_device():
            if self._lib is not None:
                return int(self._lib.cudaHostRegister(ctypes.c_void_p(address), nbytes, flags))
            return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))

    def unregister(self, address: int) -> int:
        """cudaHostUnregister in this registrar's device; returns the cudaError_t code."""
        with self._in_device():
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
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaRegistrar(device)
    return NullRegistrar()
