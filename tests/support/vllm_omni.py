"""vLLM-Omni for the adapter's tests: its host-weight subpackages from the
installed ``vllm-omni`` wheel (``.ci/setup`` installs it ``--no-deps``),
plus small producers and identities of our own.

The wheel's package ``__init__`` imports vLLM, which the tests do not
install; its ``host_weight_runtime`` and diffusion ``host_weights``
subpackages import no vLLM. :func:`load` therefore registers a bare parent
module for ``vllm_omni`` whose ``__path__`` is the installed package
directory, so ``import vllm_omni.host_weight_runtime`` loads the real
subpackage code from the wheel (vLLM-Omni's own boundary test,
``test_package_source_keeps_the_neutral_dependency_boundary``, is what
guarantees those subpackages stay vLLM-free).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

import pytest
import torch

VLLM_OMNI_VERSION = "0.30.0"


def load() -> types.ModuleType:
    """``vllm_omni.host_weight_runtime`` from the installed wheel (see the
    module doc); skips the calling test when vllm-omni is not installed."""
    if "vllm_omni" not in sys.modules:
        spec = importlib.util.find_spec("vllm_omni")
        if spec is None or spec.origin is None:
            pytest.skip(f"vllm-omni=={VLLM_OMNI_VERSION} is not installed (.ci/setup installs it --no-deps)")
        if importlib.util.find_spec("vllm") is None:
            parent = types.ModuleType("vllm_omni")
            parent.__path__ = [os.path.dirname(spec.origin)]
            parent.__file__ = spec.origin
            sys.modules["vllm_omni"] = parent
    import vllm_omni.host_weight_runtime as hwr_api

    return hwr_api


def load_offloader_module(name: str) -> types.ModuleType:
    """``vllm_omni.diffusion.offloader.<name>`` from the wheel. The
    offloader package's ``__init__`` imports vLLM; the registration modules
    it holds do not, so the package is registered bare, as :func:`load` does
    for ``vllm_omni``."""
    load()
    package = "vllm_omni.diffusion.offloader"
    if package not in sys.modules and importlib.util.find_spec("vllm") is None:
        import vllm_omni.diffusion

        stub = types.ModuleType(package)
        stub.__path__ = [os.path.join(os.path.dirname(vllm_omni.diffusion.__file__), "offloader")]
        sys.modules[package] = stub
    return importlib.import_module(f"{package}.{name}")


def identity(api: Any, *, name: str = "t", dtype: str = "torch.bfloat16", tp: tuple[int, int] = (0, 1),
             schema: str = "test-producer-v1", restorer: str = "test-restorer-v1") -> Any:
    """A vLLM-Omni artifact identity; ``name`` makes it unique per test."""
    return api.WeightArtifactIdentity(
        schema_version=1,
        source=api.WeightSourceIdentity(f"test-org/{name}", "rev-1", "source-sha256-of-" + name),
        component=api.ComponentIdentity("transformer", "diffusion.dit"),
        representation=api.WeightRepresentation("runtime", dtype),
        layout=api.RuntimeWeightLayout("final", tensor_parallel_size=tp[1], tensor_parallel_rank=tp[0]),
        adaptation=api.AdaptationIdentity(),
        producer=api.ProducerIdentity("test.producer", "1", "impl-sha", schema, restorer),
    )


def weights(seed: int = 0, blocks: int = 2) -> dict[str, torch.Tensor]:
    """A small model's final tensors: blocks, a norm, an fp32 scale buffer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(blocks):
        out[f"blocks.{i}.attn.weight"] = torch.randn(8, 4, generator=g).to(torch.bfloat16)
        out[f"blocks.{i}.attn.bias"] = torch.randn(8, generator=g).to(torch.bfloat16)
    out["norm.weight"] = torch.randn(4, generator=g)
    out["scale"] = torch.tensor(2.5)
    return out


class Producer:
    """A vLLM-Omni producer writing ``tensors`` into files of ``per_file``
    tensors each (``scale`` is a buffer), counting its calls.

    Args:
        api: ``vllm_omni.host_weight_runtime``.
        ident: the identity it declares.
        tensors: name -> tensor.
        phase: ``"pre"`` (PRE_LOAD_SAFE) or ``"post"`` (POST_LOAD_ONLY).
        rows: write each 2-D tensor in row chunks, unordered, last rows first.
        before: called with the writer before anything is written.
    """

    def __init__(self, api: Any, ident: Any, tensors: dict[str, torch.Tensor], *, per_file: int = 3,
                 phase: str = "pre", rows: bool = False, before: Any = None,
                 metadata: dict[str, Any] | None = None):
        self.api, self.tensors, self.per_file, self.rows, self.before = api, tensors, per_file, rows, before
        self.metadata = metadata if metadata is not None else {"policy": "test", "ratio": 0.5}
        self.calls = 0
        lookup = api.LookupPhase.PRE_LOAD_SAFE if phase == "pre" else api.LookupPhase.POST_LOAD_ONLY
        self._spec = api.WeightProductionSpec(producer_id=ident.producer.producer_id, outputs=(ident,),
                                              source_mode=api.ProductionSourceMode.FINALIZED_MODEL,
                                              lookup_phase=lookup)
        self.ident = ident

    @property
    def spec(self) -> Any:
        return self._spec

    def write_spec(self, name: str) -> Any:
        t = self.tensors[name]
        kind = self.api.TensorKind.BUFFER if name == "scale" else self.api.TensorKind.PARAMETER
        return self.api.TensorWriteSpec(name, tuple(t.shape), t.dtype, kind=kind,
                                        role="persistent_buffer" if name == "scale" else "weight")

    def produce(self, writer: Any) -> Any:
        self.calls += 1
        if self.before is not None:
            self.before(writer)
        names = sorted(self.tensors)
        for i in range(0, len(names), self.per_file):
            chunk = names[i:i + self.per_file]
            specs = tuple(self.write_spec(n) for n in chunk)
            with writer.open_tensor_file(f"model-{i // self.per_file:05d}.safetensors", specs,
                                         ordered=not self.rows) as out:
                for n in chunk:
                    t = self.tensors[n]
                    if self.rows and t.dim() == 2:
                        half = t.shape[0] // 2
                        out.write_rows(n, half, t[half:])
                        out.write_rows(n, 0, t[:half])
                    else:
                        out.write_tensor(n, t)
        producer = self.ident.producer
        return self.api.ProductionMetadata(producer_schema=producer.manifest_schema,
                                           restorer_schema=producer.restorer_schema,
                                           format_metadata=self.api.CanonicalJson.from_value(self.metadata))


def runtime_config(api: Any, root: str, *, mode: str = "preferred", timeout_s: float = 30.0, **policies: Any) -> Any:
    """A ``HostWeightRuntimeConfig`` with ``root`` as the domain root."""
    from pathlib import Path

    return api.HostWeightRuntimeConfig(
        mode=api.RuntimeMode(mode),
        domain=api.StorageDomainPolicy(root=Path(root)),
        wait=api.WaitPolicy(coordination_timeout_seconds=timeout_s),
        **policies,
    )
