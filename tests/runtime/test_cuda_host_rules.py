"""The CUDA host seam's rules that need no GPU: which runtime is bound,
which device a call lands in, the flags, the rule for GPUs without
read-only registration and the probe matrix's decision (issue 23,
findings 1, 10 and 12). CUDA itself is reached only through fakes here;
tests/runtime/test_dlo_cuda.py runs the same paths on a GPU."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from dlo_runtime import cuda_host
from dlo_runtime.cuda_host import (
    HOST_REGISTER_DEFAULT, HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, MADV_POPULATE_WRITE,
    HostCapability, choose_cudart, prefault,
)
from dlo_runtime.transports import REGISTERED, STAGING, probe_decision, registration_decline_reason, registration_flags
from hwr_client.mapping import PAGE_SIZE

X86 = HostCapability("cuda", True, False, False, False)  # an x86 discrete GPU: attribute 113 = 0
GRACE = HostCapability("cuda", True, True, True, False)


def test_torchs_cuda13_runtime_wheel_dir_is_preferred():
    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    dirs = cuda_host._torch_lib_dirs()
    assert os.path.join(site, "nvidia", "cu13", "lib") in dirs
    cu13 = os.path.join(site, "nvidia", "cu13", "lib", "libcudart.so.13")
    assert choose_cudart(["/usr/local/cuda/lib64/libcudart.so.13", cu13], dirs) == cu13


def test_flags_are_portable_and_read_only_only_where_supported_and_never_for_writable_memory():
    assert registration_flags(GRACE) == HOST_REGISTER_READ_ONLY | HOST_REGISTER_PORTABLE
    assert registration_flags(X86) == HOST_REGISTER_DEFAULT | HOST_REGISTER_PORTABLE
    assert registration_flags(GRACE, writable=True) == HOST_REGISTER_PORTABLE


def test_x86_declines_the_read_only_mapping_but_pins_its_own_buffers():
    assert "read-only host registration unsupported" in registration_decline_reason(X86)
    assert registration_decline_reason(X86, writable=True) == ""
    assert registration_decline_reason(HostCapability("cuda", False, False, False, False, "no"), writable=True)


def _row(mapping, flag, code):
    return {"mapping": mapping, "flag": flag, "state": "cold", "code": code}


def test_probe_decision_follows_the_matrix():
    b300 = [_row("file_ro", "read_only", 801), _row("file_ro", "default", 1), _row("anon", "default", 0),
            _row("tmpfs_rw", "default", 0)]
    d = probe_decision(b300)
    assert d["transport"] == STAGING and "are pinned" in d["why"]
    assert probe_decision(b300 + [_row("file_ro", "read_only", 0)])["flags"] == "read_only"
    d = probe_decision([_row("file_ro", "read_only", 801), _row("file_ro", "default", 0)])
    assert d["transport"] == REGISTERED and d["flags"] == "default"
    assert "stay pageable" in probe_decision([_row("anon", "default", 2)])["why"]


def test_prefault_for_write_populates_writable_memory():
    seen = []

    def fake(address, nbytes, advice):
        seen.append(advice)
        return 0

    assert prefault(PAGE_SIZE * 64, 8 * PAGE_SIZE, madvise=fake, write=True) == "populate_write"
    assert set(seen) == {MADV_POPULATE_WRITE}
    old = prefault(PAGE_SIZE * 64, PAGE_SIZE, write=True,
                   madvise=lambda a, n, adv: errno.EINVAL if adv == MADV_POPULATE_WRITE else 0)
    assert old == "willneed"


class _FakeLib:
    """libcudart through ctypes: attributes by (attr, device), and an order log."""

    def __init__(self, order, attrs):
        self.order, self.attrs = order, attrs

    def cudaFree(self, ptr):
        self.order.append("cudaFree")
        return 0

    def cudaDeviceGetAttribute(self, out, attr, device):
        self.order.append(("attr", attr, device))
        out._obj.value = self.attrs.get((attr, device), 0)
        return 0

    def cudaHostRegister(self, ptr, n, flags):
        self.order.append(("cudaHostRegister", flags))
        return 0

    def cudaGetLastError(self):
        return 0


def test_capability_probes_the_device_asked_and_moves_nothing(monkeypatch):
    order: list = []

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            order.append(("enter", self.index))

        def __exit__(self, *exc):
            order.append(("exit", self.index))

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"is_integrated": False})())
    reg = cuda_host.CudaRegistrar(torch.device("cuda", 3), maps_text="")
    reg._lib = _FakeLib(order, {(cuda_host.ATTR_HOST_REGISTER_SUPPORTED, 5): 1})
    cap = reg.capability(torch.device("cuda", 5))
    assert cap.host_register_supported and not cap.read_only_supported
    assert order[0] == ("enter", 5) and all(o[2] == 5 for o in order if o[0] == "attr")
    order.clear()
    assert reg.register(0x10000, PAGE_SIZE, HOST_REGISTER_PORTABLE) == 0
    assert order == [("enter", 3), "cudaFree", ("cudaHostRegister", HOST_REGISTER_PORTABLE), ("exit", 3)]


def test_fake_lib_writes_through_byref():
    # The fake above sets values the way the real runtime does: through the pointer.
    value = ctypes.c_int(0)
    _FakeLib([], {(1, 0): 7}).cudaDeviceGetAttribute(ctypes.byref(value), 1, 0)
    assert value.value == 7


@pytest.mark.parametrize("bits", range(16))
def test_writable_buffers_decline_only_for_policy_support_or_unified(bits):
    supported, read_only, page_tables, unified = (bool(bits >> i & 1) for i in range(4))
    cap = HostCapability("cuda", supported, read_only, page_tables, unified, "")
    assert bool(registration_decline_reason(cap, writable=True)) == (not supported or unified)
