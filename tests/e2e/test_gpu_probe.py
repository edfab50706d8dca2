"""bench/gpu/probe.py's matrix on CPU, against a registrar that does what
the NVIDIA kernel module does (os-mlock.c): without the read-only flag it
pins for WRITE, which a mapping without write permission refuses; the
read-only flag itself is refused where the device does not support it
(an x86 discrete GPU). Real files, real mappings, real page residency; only
the H2D copy is stubbed (it needs a GPU)."""

from __future__ import annotations

import mmap

import pytest

from bench.gpu import probe
from dlo_runtime.cuda_host import HOST_REGISTER_READ_ONLY

INVALID_VALUE, NOT_SUPPORTED = 1, 801


class DriverLike:
    """register() as the driver decides it, from the mapping's permissions
    in /proc/self/maps (the mapping the address lies in)."""

    def __init__(self, *, read_only_supported: bool):
        self.read_only_supported = read_only_supported
        self.registered: dict[int, int] = {}
        self.cleared = 0

    @staticmethod
    def _perms(address: int) -> str:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return line.split()[1]
        raise AssertionError(f"{address:#x} is not mapped")

    def register(self, address, nbytes, flags):
        if flags & HOST_REGISTER_READ_ONLY:
            if not self.read_only_supported:
                return NOT_SUPPORTED
        elif "w" not in self._perms(address):
            return INVALID_VALUE  # pin_user_pages(FOLL_WRITE) on a read-only mapping
        self.registered[address] = nbytes
        return 0

    def unregister(self, address):
        del self.registered[address]
        return 0

    def clear_error(self):
        self.cleared += 1
        return 0


def _stub_copy(mm, nbytes):
    return {"h2d_gbps": 0.0, "h2d_bytes_equal": True}


@pytest.mark.parametrize("read_only_supported", [False, True])
def test_the_matrix_decides_staging_on_x86_and_read_only_where_supported(tmp_path, read_only_supported):
    reg = DriverLike(read_only_supported=read_only_supported)
    shm = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()  # a writable directory stands in for /dev/shm
    rows = probe.matrix(reg, str, 64 * mmap.PAGESIZE, str(tmp_path), shm, copy=_stub_copy)
    assert len(rows) == 16 and reg.registered == {}
    by = {(r["mapping"], r["flag"], r["state"]): r for r in rows}
    ro = 0 if read_only_supported else NOT_SUPPORTED
    for state in ("cold", "prefaulted"):
        assert by[("file_ro", "default", state)]["code"] == INVALID_VALUE
        assert by[("file_ro", "read_only", state)]["code"] == ro
        assert by[("file_rw", "default", state)]["code"] == 0
        assert by[("anon", "default", state)]["code"] == 0
    ok = [r for r in rows if r["code"] == 0]
    assert all("dirty_delta_over_registered" in r and r["h2d_bytes_equal"] for r in ok)
    assert all("writeback_s" in r for r in ok if r["mapping"].startswith("file"))
    assert reg.cleared == len(rows) - len(ok)  # every failure's error cleared
    # Anonymous memory is cold (never touched) before the cold row and
    # resident after pre-faulting for write.
    assert by[("anon", "default", "cold")]["resident_before"] == 0.0
    if by[("anon", "default", "prefaulted")]["resident_before"] != 1.0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): pre-faulting fell back to read-ahead")
    decision = probe.probe_decision(rows)
    assert decision["transport"] == ("registered" if read_only_supported else "staging")
    assert read_only_supported or "are pinned" in decision["why"]
