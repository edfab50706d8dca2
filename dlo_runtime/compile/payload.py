"""A compile artifact's payload: cache files as uint8 tensors.

Each captured file of the inductor cache folder is one 1-D ``uint8``
tensor named ``f:`` + its path with ``:`` between components
(``f:fxgraph:32:f32jw…:efkrn…``; a tensor name may not hold ``/``). The
name is in the artifact's content digest with the bytes' SHA-256, so the
binding of a path to its bytes is as protected as the bytes: nothing can
put one entry's bytes under another entry's name without breaking the
digest. torch's portable "mega-cache" (``torch.compiler.save_cache_artifacts()``)
rides along as the tensor :data:`MEGA`.

Restoring (:func:`restore_lease`) checks every name before writing any
byte (components of :data:`~dlo_runtime.compile.folder.COMPONENT`, no
``..``, at most :data:`~dlo_runtime.compile.folder.MAX_DEPTH` deep,
``uint8`` and 1-D, bounded count and bytes), then writes the files
(:func:`dlo_runtime.compile.folder.restore`), then hands the mega-cache to
torch after checking its entry keys the same way (torch joins them into
paths). No pickle is read here; what torch unpickles later it reads from
its own cache folder, as it would after compiling itself.

Trust: the bytes are code torch runs (pickled graphs, generated Python,
shared objects). What makes them safe to restore is who published them,
not their form: the lease is granted only for artifacts whose publisher
the daemon's trust policy accepts for this worker (its own uid, root, the
daemon, configured trusted publishers; a pull needs a trusted signature
when keys are configured), and the worker re-hashes every byte against
the manifest before writing (``verify="full"``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Mapping

import torch

from hwr_client.core.errors import FailedPrecondition
from hwr_client.core.manifest import Manifest

from dlo_runtime.compile import folder as cache_folder
from dlo_runtime.compile.folder import Capture

log = logging.getLogger(__name__)

ENTRY_PREFIX = "f:"
#: The tensor that holds torch's portable mega-cache bytes.
MEGA = "torch-mega-cache"
_MEGA_KEY = re.compile(r"[A-Za-z0-9_.+=/-]{1,512}\Z")


def entry_name(parts: tuple[str, ...]) -> str:
    """The tensor name of the cache file at ``parts``."""
    return ENTRY_PREFIX + ":".join(parts)


def parts_of(name: str, *, what: str) -> tuple[str, ...]:
    """The path components of entry ``name``.

    Raises:
        FailedPrecondition: not an entry name, or a component that is not a
            plain cache name (an artifact no HWR producer would write).
    """
    if not name.startswith(ENTRY_PREFIX):
        raise FailedPrecondition(f"{what}: tensor {name[:80]!r} is not a cache entry (expected {ENTRY_PREFIX!r}...)")
    parts = tuple(name[len(ENTRY_PREFIX):].split(":"))
    if len(parts) > cache_folder.MAX_DEPTH + 1 or not all(cache_folder.check_component(p) for p in parts):
        raise FailedPrecondition(f"{what}: entry {name[:80]!r} is not a safe cache path (components of "
                                 f"{cache_folder.COMPONENT.pattern}, at most {cache_folder.MAX_DEPTH + 1} deep)")
    if parts[0] in cache_folder.SKIPPED_TOP:
        raise FailedPrecondition(f"{what}: entry {name[:80]!r} is under {parts[0]}/, which no artifact holds")
    return parts


def to_tensors(captured: Capture, mega: bytes | None) -> dict[str, torch.Tensor]:
    """The payload tensors of a capture (uint8 views of the bytes, no copy)."""
    out = {entry_name(parts): _bytes_tensor(data) for parts, data in captured.files}
    if mega:
        out[MEGA] = _bytes_tensor(mega)
    return out


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer wants a writable buffer; a bytearray is one copy of a few MiB.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restore wrote: files (and bytes) new in the folder, files
    already there, mega-cache entries handed to torch."""

    files: int
    bytes: int
    present: int
    mega_entries: int


def check_manifest(manifest: Manifest) -> list[tuple[str, tuple[str, ...]]]:
    """(tensor name, path) of every cache entry, all checked before any write.

    Raises:
        FailedPrecondition: a name, dtype, shape, count or size that no HWR
            producer writes (module doc).
    """
    what = f"compile artifact {manifest.key[:12]}"
    if len(manifest.tensors) > cache_folder.MAX_FILES + 1:
        raise FailedPrecondition(f"{what}: {len(manifest.tensors)} entries exceeds {cache_folder.MAX_FILES}")
    if sum(t.nbytes for t in manifest.tensors) > cache_folder.MAX_BYTES:
        raise FailedPrecondition(f"{what}: more than {cache_folder.MAX_BYTES} bytes of cache entries")
    out = []
    seen: set[tuple[str, ...]] = set()
    for t in manifest.tensors:
        if t.dtype != "U8" or len(t.shape) != 1:
            raise FailedPrecondition(f"{what}: tensor {t.name[:80]!r} is {t.dtype} {list(t.shape)}, expected 1-D U8")
        if t.name == MEGA:
            continue
        parts = parts_of(t.name, what=what)
        if any(parts[:i] in seen for i in range(1, len(parts))):
            raise FailedPrecondition(f"{what}: entry {t.name[:80]!r} lies below another entry's file")
        seen.add(parts)
        out.append((t.name, parts))
    dirs = {parts[:i] for parts in seen for i in range(1, len(parts))}
    if seen & dirs:
        raise FailedPrecondition(f"{what}: an entry is both a file and a folder")
    return out


def restore_lease(lease: Any, folder: str) -> Restored:
    """Writes a leased compile artifact's entries into ``folder``, then loads
    its mega-cache (module doc). The lease was verified by the caller.

    Raises:
        FailedPrecondition: a hostile or conflicting entry (nothing of the
            artifact is used then; entries already written are valid cache
            files, named by torch's hashes of their content).
    """
    entries = check_manifest(lease.manifest)
    tensors = lease.tensors(storage="per-tensor")
    files = ((parts, memoryview(tensors[name].numpy())) for name, parts in entries)
    written, nbytes, present = cache_folder.restore(folder, files)
    mega = tensors.get(MEGA)
    loaded = load_mega(bytes(memoryview(mega.numpy())), what=f"compile artifact {lease.key[:12]}") \
        if mega is not None and mega.numel() else 0
    return Restored(written, nbytes, present, loaded)


def load_mega(data: bytes, *, what: str) -> int:
    """Hands torch's mega-cache bytes to torch after checking each entry's
    key (torch joins keys into paths below its cache folder); returns the
    entries loaded, 0 when this torch cannot read them (the folder entries
    already serve; the mega-cache is the portable complement).

    Raises:
        FailedPrecondition: an entry key that could leave the folder.
    """
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return 0
    artifacts = CacheArtifactManager.deserialize(data)
    if not artifacts:
        log.info("%s: torch could not read its mega-cache (another torch?); the cache entries serve alone", what)
        return 0
    for kind, items in artifacts.items():
        for item in items:
            key = str(item.key)
            if not _MEGA_KEY.match(key) or ".." in key or key.startswith("/"):
                raise FailedPrecondition(f"{what}: mega-cache {kind} entry key {key[:80]!r} is not a plain cache "
                                         "name; nothing of it is loaded")
    return sum(len(v) for v in CacheArtifactManager.populate_caches(artifacts).artifacts.values())


def summary(tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(cache files, bytes) of a payload."""
    files = [t for n, t in tensors.items() if n != MEGA]
    return len(files), sum(t.numel() for t in tensors.values())


__all__ = ["ENTRY_PREFIX", "MEGA", "Restored", "check_manifest", "entry_name", "load_mega", "parts_of",
           "restore_lease", "summary", "to_tensors"]
