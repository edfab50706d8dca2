"""Integrations: HWR underneath other inference engines' own runtimes.

Each subpackage adapts one engine's storage seam to the HWR client and is
imported only by a user who asks for it (nothing here is imported by
``dlo_runtime`` itself). :mod:`dlo_runtime.integrations.vllm_omni` makes the
node daemon vLLM-Omni's Host Weight Store.
"""
