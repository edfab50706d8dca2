"""The torch-free shared core of HWR: what the daemon, the client and the
runtime all need, and nothing that would make the daemon pay for torch or
the client.

- :mod:`~hwr_client.core.errors`: the one error hierarchy and its gRPC codes.
- :mod:`~hwr_client.core.identity`: identities and their keys.
- :mod:`~hwr_client.core.layout`: dtypes, tensor-name rules, the aligned
  safetensors layout, the strict header parser.
- :mod:`~hwr_client.core.plan`: publication plans and their one check.
- :mod:`~hwr_client.core.manifest`: the artifact manifest and its builder.
- :mod:`~hwr_client.core.digests`: content ids of canonical files.
- :mod:`~hwr_client.core.defaults`: paths, message limits, sizes.
- :mod:`~hwr_client.core._proto`: the generated gRPC stubs.

Rule (tested): nothing under ``hwr_client.core`` imports torch, or any
``hwr_client`` module outside the core.
"""
