"""What this GPU machine lets host registration do: versions, the device's
capability row, and the probe matrix that decides (and documents) the
transport for GPUs without read-only registration (issue 23, finding 1).

    python bench/gpu/probe.py --out FILE [--gib 1] [--disk-dir DIR] [--tmpfs-dir /dev/shm]

Matrix: every mapping x flag x state, one ``cudaHostRegister`` each, of
``--gib`` bytes:

- mappings: ``file_ro`` (a disk file mapped ``PROT_READ``/``MAP_SHARED``:
  what a lease maps), ``file_rw`` (the same file opened read-write and
  mapped writable: the driver's pin-for-write path on a disk file, whose
  unregistration dirties every page, finding 9), ``tmpfs_rw`` (a writable
  shared tmpfs mapping) and ``anon`` (private anonymous memory: what the
  pinned staging slots register);
- flags: ``read_only`` (``cudaHostRegisterReadOnly | Portable``) and
  ``default`` (``Portable``);
- states: ``cold`` (file pages dropped from the page cache / memory never
  touched) and ``prefaulted`` (``MADV_POPULATE_READ/WRITE`` from threads).

Per row: the error code and its name, seconds and s/GiB of the call, the
fraction of pages resident before it (``cold`` is only cold if the kernel
dropped them: gVisor may not), the H2D GB/s of one copy out of the
registered range (and that its bytes arrived), unregistration seconds, and
/proc/meminfo ``Dirty`` right before registering and right after
unregistering (and, for disk files, the fsync that writes the dirtied pages
back). ``decision`` is :func:`dlo_runtime.transports.probe_decision` of the
rows; ``agrees`` says whether the code's rule for this device's capability
picks the same transport. Exit 0 when it agrees, 1 when not, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import mmap
import os
import platform
import sys
import tempfile
import time
import warnings
from typing import Any, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import save_result  # noqa: E402
from dlo_runtime.cuda_host import HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, CudaRegistrar, prefault  # noqa: E402
from dlo_runtime.transports import REGISTERED, STAGING, probe_decision, registration_decline_reason  # noqa: E402

GIB = 1024**3
PAGE = mmap.PAGESIZE
FLAGS = {"read_only": HOST_REGISTER_READ_ONLY | HOST_REGISTER_PORTABLE, "default": HOST_REGISTER_PORTABLE}
PACKAGES = ("torch", "grpcio", "grpcio-health-checking", "protobuf", "diffusers", "transformers", "safetensors",
            "numpy", "pytest", "xxhash")


def versions() -> dict[str, Any]:
    """Interpreter, packages, CUDA, driver, kernel."""
    pkgs = {}
    for name in PACKAGES:
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pkgs[name] = None
    driver = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
    except OSError:
        pass
    return {"python": sys.version.split()[0], "executable": sys.executable, "packages": pkgs,
            "torch_cuda": torch.version.cuda, "driver_api": driver.value, "kernel": platform.release(),
            "machine": platform.machine()}


def capability_row(reg: CudaRegistrar, index: int) -> dict[str, Any]:
    """The device's properties, the raw host-memory attributes, the
    capability the code derives and what the code decides from it."""
    props = torch.cuda.get_device_properties(index)
    cap = reg.capability(torch.device("cuda", index))
    flag = "read-only" if cap.read_only_supported else "default"
    return {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "total_memory_gib": round(props.total_memory / GIB, 1), "attributes": reg.raw_attributes(index),
            "capability": cap.__dict__,
            "lease_rule": registration_decline_reason(cap) or f"register ({flag} flag)",
            "own_buffers_rule": registration_decline_reason(cap, writable=True) or "register (default flag)"}


def meminfo_kib(field: str) -> int:
    """One /proc/meminfo field, KiB (-1 where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def resident_fraction(address: int, nbytes: int) -> float:
    """Fraction of the range's pages in memory (mincore); -1 if unknown."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(address), nbytes, vec) != 0:
        return -1.0
    return round(sum(v & 1 for v in vec) / pages, 4)


def write_file(path: str, nbytes: int) -> None:
    """``nbytes`` of incompressible data, fsync'ed (clean pages can be dropped)."""
    piece = os.urandom(64 * 2**20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(piece[: min(len(piece), left)])
        f.flush()
        os.fsync(f.fileno())  # clean pages only: DONTNEED can then drop them (a cold row)


@contextlib.contextmanager
def mapping(kind: str, state: str, nbytes: int, disk_file: str, tmpfs_dir: str) -> Iterator[tuple[Any, int]]:
    """(the mmap object, its address) of one row's fresh mapping."""
    fd, path, mm = -1, "", None
    try:
        if kind in ("file_ro", "file_rw"):
            fd = os.open(disk_file, os.O_RDONLY if kind == "file_ro" else os.O_RDWR)
            os.fsync(fd)  # a previous row's unregistration dirtied the pages: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: out of the page cache
            prot = mmap.PROT_READ if kind == "file_ro" else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        elif kind == "tmpfs_rw":
            fd, path = tempfile.mkstemp(prefix="hwr-probe-", dir=tmpfs_dir)
            os.ftruncate(fd, nbytes)  # sparse: no page exists until written (the cold row)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: torch warns; we only read it
            address = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        if state == "prefaulted":
            prefault(address, nbytes, write=kind != "file_ro")
        yield mm, address
    finally:
        if mm is not None:
            mm.close()
        if fd >= 0:
            os.close(fd)
        if path:
            os.unlink(path)


def h2d(mm: Any, nbytes: int) -> dict[str, Any]:
    """One asynchronous copy of the whole range into device memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = torch.frombuffer(mm, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(host, non_blocking=True)
        end.record(stream)
    end.synchronize()  # the copy must land before it is timed and compared
    ms = start.elapsed_time(end)
    same = bool(torch.equal(dst[: 2**20].cpu(), host[: 2**20]) and torch.equal(dst[-2**20:].cpu(), host[-2**20:]))
    del dst
    return {"h2d_gbps": round(nbytes / (ms / 1e3) / 1e9, 2), "h2d_bytes_equal": same}


def row(reg: Any, names: Any, kind: str, flag: str, state: str, nbytes: int, disk_file: str,
        tmpfs_dir: str, copy: Any = None) -> dict[str, Any]:
    """Registers one fresh mapping; measures (``copy``: the H2D check,
    :func:`h2d` by default); unregisters."""
    out: dict[str, Any] = {"mapping": kind, "flag": flag, "state": state, "gib": nbytes / GIB}
    with mapping(kind, state, nbytes, disk_file, tmpfs_dir) as (mm, address):
        out["resident_before"] = resident_fraction(address, nbytes)
        dirty0 = meminfo_kib("Dirty")
        t0 = time.perf_counter()
        code = reg.register(address, nbytes, FLAGS[flag])
        seconds = time.perf_counter() - t0
        out.update(code=code, error=names(code), register_s=round(seconds, 4),
                   register_s_per_gib=round(seconds * GIB / nbytes, 4))
        if code != 0:
            reg.clear_error()  # the next CUDA call must not see this row's error
            return out
        out.update((copy or h2d)(mm, nbytes))
        t0 = time.perf_counter()
        out["unregister_code"] = reg.unregister(address)
        out["unregister_s"] = round(time.perf_counter() - t0, 4)
        dirty1 = meminfo_kib("Dirty")
        out.update(dirty_before_kib=dirty0, dirty_after_unregister_kib=dirty1,
                   dirty_delta_over_registered=round((dirty1 - dirty0) * 1024 / nbytes, 3))
        if kind.startswith("file"):
            t0 = time.perf_counter()
            mm.flush()  # msync: the pages the driver dirtied go back to disk
            os.sync()
            out["writeback_s"] = round(time.perf_counter() - t0, 4)
    return out


def error_names(reg: CudaRegistrar) -> Any:
    """code -> cudaGetErrorName, through the runtime the registrar bound."""
    lib = reg.runtime_library()
    if lib is None:
        return lambda code: str(code)
    lib.cudaGetErrorName.restype = ctypes.c_char_p
    lib.cudaGetErrorName.argtypes = [ctypes.c_int]
    return lambda code: lib.cudaGetErrorName(code).decode()


def matrix(reg: Any, names: Any, nbytes: int, disk_dir: str, tmpfs_dir: str, copy: Any = None) -> list[dict]:
    """Every row, in order (tmpfs rows only where ``tmpfs_dir`` exists)."""
    disk_file = os.path.join(disk_dir, "hwr-probe-file.bin")
    rows = []
    try:
        write_file(disk_file, nbytes)
        kinds = ["file_ro", "file_rw"] + (["tmpfs_rw"] if os.path.isdir(tmpfs_dir) else []) + ["anon"]
        for kind in kinds:
            for flag in ("read_only", "default"):
                for state in ("cold", "prefaulted"):
                    rows.append(row(reg, names, kind, flag, state, nbytes, disk_file, tmpfs_dir, copy))
                    print(_line(rows[-1]), flush=True)
    finally:
        if os.path.exists(disk_file):
            os.unlink(disk_file)
    return rows


def run(gib: float, disk_dir: str, tmpfs_dir: str) -> dict[str, Any]:
    index = torch.cuda.current_device()
    reg = CudaRegistrar(torch.device("cuda", index))
    doc: dict[str, Any] = {"versions": versions(), "device": capability_row(reg, index),
                           "cudart": reg.runtime_path, "dirs": {"disk": disk_dir, "tmpfs": tmpfs_dir}}
    doc["rows"] = matrix(reg, error_names(reg), int(gib * GIB) // PAGE * PAGE, disk_dir, tmpfs_dir)
    doc["skipped"] = [] if os.path.isdir(tmpfs_dir) else [f"tmpfs_rw: no {tmpfs_dir}"]
    doc["decision"] = decision = probe_decision(doc["rows"])
    cap = reg.capability(torch.device("cuda", index))
    code = STAGING if registration_decline_reason(cap) else REGISTERED
    doc["code_rule"] = {"transport": code, "reason": registration_decline_reason(cap)}
    doc["agrees"] = code == decision["transport"] and (
        code == STAGING or decision["flags"] == ("read_only" if cap.read_only_supported else "default"))
    return doc


def _line(r: dict[str, Any]) -> str:
    s = f"{r['mapping']:9}{r['flag']:10}{r['state']:11}code {r['code']:4} {r['error']:34}{r['register_s_per_gib']:8.3f} s/GiB"
    if r["code"] == 0:
        s += (f"  H2D {r['h2d_gbps']:6.2f} GB/s  Dirty +{r['dirty_delta_over_registered']:.2f}x"
              + (f"  writeback {r['writeback_s']:.2f}s" if "writeback_s" in r else ""))
    return s + f"  (resident before {r['resident_before']})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes registered per row")
    ap.add_argument("--disk-dir", default=None, help="a disk filesystem (default: next to --out)")
    ap.add_argument("--tmpfs-dir", default="/dev/shm")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe: no CUDA device", file=sys.stderr)
        return 2
    disk_dir = args.disk_dir or os.path.dirname(os.path.abspath(args.out))
    doc = run(args.gib, disk_dir, args.tmpfs_dir)
    d = doc["device"]
    print(f"{d['name']} (sm {d['compute_capability']}, {d['total_memory_gib']} GiB): attributes {d['attributes']}")
    print(f"lease mappings: {d['lease_rule']}; own buffers: {d['own_buffers_rule']}")
    print(f"probe decision: {doc['decision']['transport']} ({doc['decision']['why']}); code rule: "
          f"{doc['code_rule']['transport']}; agrees: {doc['agrees']}")
    save_result(doc, args.out, indent=1)
    return 0 if doc["agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
