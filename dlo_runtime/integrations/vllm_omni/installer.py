"""Turning it on: vLLM-Omni's runtime builds the HWR store instead of its
filesystem store.

vLLM-Omni 0.30.0 has no setting for its store: ``HostWeightRuntime.from_config``
imports ``FilesystemHostWeightStore`` from
``vllm_omni.host_weight_runtime.filesystem`` at call time and builds it with
``(domain, capacity, integrity, wait=...)``. :func:`install` replaces that
attribute with a subclass of
:class:`~dlo_runtime.integrations.vllm_omni.store.HwrHostWeightStore`
bound to the daemon's sockets; :func:`uninstall` puts the original back.
Because it replaces a name inside vLLM-Omni, it is pinned to the versions
it was tested with (:data:`SUPPORTED_VERSIONS`) and refuses any other with
a clear error. The upstream proposal that makes the patch unnecessary (a
``store_backend`` field and an entry-point group) is in
docs/vllm-omni.md, "Upstream proposal".

vLLM-Omni runs its diffusion workers in processes of their own, so a call
in the launching process is not enough for ``vllm serve``: the package
registers :func:`plugin` in vLLM-Omni's ``vllm_omni.general_plugins``
entry-point group, which vLLM-Omni runs in every process it starts. The
plugin installs the store only where ``HWR_VLLM_OMNI=1`` is set (read when
vLLM-Omni calls it, never at import), with ``HWR_SOCKET`` /
``HWR_ADMIN_SOCKET`` as the sockets.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from typing import Any

from hwr_client.core.errors import FailedPrecondition

log = logging.getLogger(__name__)

#: vLLM-Omni versions whose ``from_config`` this patch was tested against.
SUPPORTED_VERSIONS = ("0.30.0",)
#: The module whose attribute the runtime reads at call time, and the attribute.
PATCHED_MODULE = "vllm_omni.host_weight_runtime.filesystem"
PATCHED_NAME = "FilesystemHostWeightStore"
#: The environment switch :func:`plugin` reads.
ENV_SWITCH = "HWR_VLLM_OMNI"

_lock = threading.Lock()
_original: Any = None


def install(*, socket: str | None = None, admin_socket: str | None = None) -> type:
    """Makes vLLM-Omni's ``HostWeightRuntime.from_config`` build the HWR
    store in this process. Idempotent: a second call rebinds the sockets.

    Args:
        socket: the daemon's runtime socket (None: ``HWR_SOCKET`` or the
            daemon's default, when the first call dials).
        admin_socket: its admin socket, for the store's ``cleanup`` only.

    Returns:
        The store class the runtime now builds.

    Raises:
        FailedPrecondition: vLLM-Omni is not installed, or its version is
            not one of :data:`SUPPORTED_VERSIONS`, or its runtime module no
            longer has the attribute this patch replaces.

    Example:
        >>> from dlo_runtime.integrations import vllm_omni          # doctest: +SKIP
        >>> vllm_omni.install(socket="/run/hwr/hwr.sock")           # doctest: +SKIP
    """
    check_version()
    from dlo_runtime.integrations.vllm_omni.store import HwrHostWeightStore, StoreSettings

    module = importlib.import_module(PATCHED_MODULE)
    global _original
    with _lock:
        current = getattr(module, PATCHED_NAME, None)
        if current is None:
            raise FailedPrecondition(f"{PATCHED_MODULE}.{PATCHED_NAME} does not exist in this vLLM-Omni; the "
                                     "HWR store cannot replace it")
        if _original is None:
            _original = current
        bound = type("HwrHostWeightStore", (HwrHostWeightStore,),
                     {"settings": StoreSettings(socket=socket, admin_socket=admin_socket),
                      "__module__": HwrHostWeightStore.__module__,
                      "__doc__": HwrHostWeightStore.__doc__})
        setattr(module, PATCHED_NAME, bound)
    log.info("vLLM-Omni Host Weight Runtime: stores are now HWR stores on %s", socket or "the default socket")
    return bound


def uninstall() -> None:
    """Puts vLLM-Omni's filesystem store back (nothing when not installed)."""
    global _original
    with _lock:
        if _original is None:
            return
        setattr(importlib.import_module(PATCHED_MODULE), PATCHED_NAME, _original)
        _original = None


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return _original is not None


def check_version() -> str:
    """The installed vLLM-Omni version, if this patch supports it.

    Raises:
        FailedPrecondition: not installed, or another version.
    """
    try:
        version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        raise FailedPrecondition("vllm-omni is not installed; pip install vllm-omni==0.30.0") from None
    if version not in SUPPORTED_VERSIONS:
        raise FailedPrecondition(
            f"vllm-omni {version} is installed; the HWR store replaces a name inside vLLM-Omni's runtime and is "
            f"tested only with {', '.join(SUPPORTED_VERSIONS)}. Install a supported version, or use a vLLM-Omni "
            "that reads the store backend from its config (the upstream proposal in HWR's docs/vllm-omni.md)")
    return version


def plugin() -> None:
    """vLLM-Omni's general-plugin hook (entry point ``hwr`` in the group
    ``vllm_omni.general_plugins``), run in every vLLM-Omni process:
    installs the store where ``HWR_VLLM_OMNI=1``, else does nothing.

    Raises:
        FailedPrecondition: switched on for an unsupported vLLM-Omni
            version (a process must not run on the filesystem store
            while its operator believes it runs on HWR).
    """
    # Read here, when vLLM-Omni calls the hook in a starting process (the
    # entry point is this package's CLI-like boundary), never at import.
    if os.environ.get(ENV_SWITCH, "") not in ("1", "true", "yes"):
        return
    install(socket=os.environ.get("HWR_SOCKET") or None, admin_socket=os.environ.get("HWR_ADMIN_SOCKET") or None)


__all__ = ["ENV_SWITCH", "SUPPORTED_VERSIONS", "check_version", "install", "installed", "plugin", "uninstall"]
