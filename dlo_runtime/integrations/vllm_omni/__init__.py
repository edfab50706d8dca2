"""HWR as vLLM-Omni's Host Weight Store.

vLLM-Omni (``vllm-omni`` 0.30.0) resolves final-layout host weights through
its own ``HostWeightRuntime``, whose store is a two-method Protocol
(``lookup``, ``get_or_build``) returning leases of its own class. This
package implements that store on the HWR client, so the node daemon holds
the artifacts, workers take HWR leases and vLLM-Omni's restorer binds its
parameters to views of HWR's mapping:

- :func:`install` — one call: vLLM-Omni's runtime builds the HWR store
  (pinned to :data:`SUPPORTED_VERSIONS`); ``HWR_VLLM_OMNI=1`` does the same
  in every process vLLM-Omni starts (:func:`plugin`).
- :class:`~dlo_runtime.integrations.vllm_omni.store.HwrHostWeightStore` —
  the store (:mod:`.store`, :mod:`.build`), its records in HWR's identity
  and annotations (:mod:`.records`), its leases (:mod:`.leases`), the
  writer its producers write into (:mod:`.writer`).

Importing this package imports neither vLLM-Omni nor the store; the
submodules import ``vllm_omni.host_weight_runtime``.
"""

from dlo_runtime.integrations.vllm_omni.installer import (
    ENV_SWITCH,
    SUPPORTED_VERSIONS,
    check_version,
    install,
    installed,
    plugin,
    uninstall,
)

__all__ = ["ENV_SWITCH", "SUPPORTED_VERSIONS", "check_version", "install", "installed", "plugin", "uninstall"]
