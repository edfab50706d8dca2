"""fp8 *fnuz* (AMD's finite, no-negative-zero fp8): planned, published,
stored, leased and viewed with the dtype it was written with, under the
safetensors names (F8_E4M3FNUZ, F8_E5M2FNUZ) the safetensors library reads."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from hwr_client.core.identity import Identity
from hwr_client.core.layout import DTYPE_SIZES, check_dtype
from hwr_client.tensors import TORCH_DTYPES, dtype_name, read_safetensors, torch_dtype
from tests.conftest import SAMPLE_IDENTITY, identity

FNUZ = {"F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz}


def _fnuz_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "blocks.0.w_e4m3": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fnuz),
        "blocks.0.w_e5m2": torch.randn(8, 4, generator=g).to(torch.float8_e5m2fnuz),
        "blocks.0.scale": torch.tensor([0.25, 2.0]),
        "odd": torch.randn(3, generator=g).to(torch.float8_e4m3fnuz),  # 3 bytes: padding follows
    }


def test_tables_know_them():
    for name, dtype in FNUZ.items():
        assert check_dtype(name) == name and DTYPE_SIZES[name] == 1
        assert TORCH_DTYPES[name] is dtype and torch_dtype(name) is dtype and dtype_name(dtype) == name
        # The safetensors library's own name for the dtype.
        assert safetensors.torch._TYPES[name] is dtype  # type: ignore[attr-defined]
    for rep in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
        doc = dict(SAMPLE_IDENTITY, representation={"dtype": rep})
        assert Identity.from_dict(doc).document["representation"]["dtype"] == rep


def test_round_trip_through_the_daemon_bit_for_bit(daemon):
    tensors = _fnuz_tensors()
    client = daemon.client()
    report = client.publish(identity(t="fnuz"), tensors)
    dtypes = {t.name: t.dtype for t in report.manifest.tensors}
    assert dtypes["blocks.0.w_e4m3"] == "F8_E4M3FNUZ" and dtypes["blocks.0.w_e5m2"] == "F8_E5M2FNUZ"
    with client.acquire(report.key, verify="full") as lease:
        for storage in ("shared", "per-tensor"):
            views = lease.tensors(storage=storage)
            for name, t in tensors.items():
                assert views[name].dtype is t.dtype
                assert torch.equal(views[name].view(torch.uint8), t.view(torch.uint8)), (storage, name)
        # Each payload file is a safetensors file the library itself reads back, fnuz included.
        loaded = {}
        for path in lease.paths:
            loaded.update(safetensors.torch.load_file(path))
            loaded_ours = read_safetensors(path)
            assert all(loaded_ours[n].dtype is loaded[n].dtype for n in loaded_ours)
        for name, t in tensors.items():
            assert loaded[name].dtype is t.dtype and torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(FNUZ.values()))
def test_arithmetic_values_survive(daemon, dtype):
    # fnuz has no negative zero and one NaN pattern (0x80): the bytes, not
    # the float values, are what must survive.
    raw = torch.arange(256, dtype=torch.uint8).view(dtype)
    client = daemon.client()
    key = client.publish(identity(t=f"all-{dtype}"), {"all": raw}).key
    with client.acquire(key) as lease:
        assert torch.equal(lease.tensors()["all"].view(torch.uint8), torch.arange(256, dtype=torch.uint8))
