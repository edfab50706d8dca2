"""Whether a model goes through HWR at all, decided before any daemon call,
and how a start that does not says so.

The seed's eligibility rule: what HWR cannot represent is decided before
constructing a client, hashing a source or probing the daemon, and keeps
the ordinary loader. Here that loader is the library's own
``from_pretrained``, so ``mode="preferred"`` is never worse than the
library: it loads what the library loads, logs ONE WARNING naming the
reason, and its report says so (``outcome`` ``DISABLED``: HWR was never
touched; ``notes`` and ``host_plan_reason`` name the reason).
``mode="required"`` fails with that reason instead.

Not eligible (each named in the report):

- a class with its own loader (``from_pretrained`` or
  ``_load_pretrained_model`` overridden below the library's base class):
  its rules are code HWR cannot follow;
- a ``quantization_config`` in ``config.json``: the library quantizes
  while loading;
- a directory layout HWR does not read (:attr:`ModelFiles.unsupported`);
- what the key plan refuses (:mod:`dlo_runtime.pretrained.keys`: freshly
  initialized tensors, byte-changing converters, ambiguous or untied keys);
- no block stack to stream (the artifact is laid out by blocks).

A daemon that is not there is not an eligibility question (the model could
go through HWR) but it is decided before any work too
(:func:`daemon_absent`): preferred loads with the library at once, without
hashing the checkpoint for an identity nobody can serve
(``CANONICAL_FALLBACK``, ONE WARNING "no HWR daemon at <socket>: is `hwr
serve` running? loading without HWR", the same note in the report);
required raises Unavailable naming the socket.
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
from typing import Any, Protocol

from hwr_client.core.errors import FailedPrecondition
from hwr_client.resolve import Mode

from dlo_runtime.pretrained.files import ModelFiles, import_library
from dlo_runtime.pretrained.keys import KeyPlan

log = logging.getLogger(__name__)

#: Bound on the daemon probe's connect (a listening socket answers at once).
_PROBE_TIMEOUT_S = 1.0


class Candidate(Protocol):
    """What the decision needs of a contract
    (:class:`~dlo_runtime.pretrained.contract.PretrainedContract`)."""

    name: str
    files: ModelFiles

    def ineligible(self) -> list[str]: ...

    def block_count(self) -> int: ...

    def check_keys(self) -> None: ...


def decide(contract: Candidate, *, mode: Mode, host_plan: str) -> str:
    """The reason ``contract`` cannot go through HWR ("": it can), before
    any daemon call.

    Raises:
        FailedPrecondition: not eligible in required mode or with
            ``host_plan="checkpoint-mmap"`` (naming why), or a shape
            mismatch in any mode (the library refuses it too).
    """
    reasons = contract.ineligible()
    if not reasons and mode is not Mode.DISABLED and host_plan != "checkpoint-mmap":
        reasons = no_block_reason(contract.name, contract.block_count())
    if reasons and (mode is Mode.REQUIRED or host_plan == "checkpoint-mmap"):
        raise FailedPrecondition(f"{contract.files.directory}: {contract.name} cannot load through HWR "
                                 f"(mode={mode.value}, host_plan={host_plan}): " + "; ".join(reasons))
    if not reasons:
        contract.check_keys()
    return "; ".join(reasons)


def class_reasons(files: ModelFiles, cls: Any) -> list[str]:
    """Why ``cls`` loading ``files`` cannot go through HWR, from the class
    and the config alone (no weight read)."""
    reasons = [files.unsupported] if files.unsupported else []
    if files.config.get("quantization_config"):
        reasons.append(f"{files.config_path} has a quantization_config: the library quantizes while loading")
    lib = import_library(files.library)
    base = getattr(lib, "ModelMixin" if files.library == "diffusers" else "PreTrainedModel", None)
    if base is not None and isinstance(cls, type) and issubclass(cls, base):
        for attr in ("from_pretrained", "_load_pretrained_model"):
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if owner is not None and owner is not base and issubclass(owner, base):
                reasons.append(f"{owner.__name__} overrides {attr} (a custom loader HWR cannot follow)")
    return reasons


def no_block_reason(what: str, nblocks: int) -> list[str]:
    """The reason when no block stack was found ([] when one was)."""
    if nblocks:
        return []
    return [f"{what}: no block stack found to stream (an artifact is laid out by blocks); pass blocks=[...] "
            "module names"]


def direct_map_refusal(files: ModelFiles, keys: KeyPlan) -> str:
    """Why the checkpoint-mmap host plan cannot even be considered ("": it
    can): it maps safetensors byte ranges under their own names."""
    if files.format != "safetensors":
        return f"checkpoint-mmap maps safetensors; {files.weights[0]} is a {files.format} file"
    if keys.renamed:
        first = keys.renamed[0]
        return (f"checkpoint-mmap maps tensors under their checkpoint names; {len(keys.renamed)} key(s) are "
                f"renamed on load (e.g. {first[0]!r} -> {first[1]!r})")
    return ""


def unused_keys_note(what: str, keys: KeyPlan) -> list[str]:
    """The note (and the WARNING the library logs too) for checkpoint keys
    that fill nothing and that no ignore rule of the library covers."""
    if not keys.unused:
        return []
    note = (f"{len(keys.unused)} checkpoint key(s) fill no tensor of {what} and were not loaded, as the library "
            f"does not load them: {list(keys.unused[:5])}")
    log.warning("from_pretrained %s: %s", what, note)
    return [note]


def fallback_note(reason: str) -> str:
    """The report note of an ineligible start."""
    return f"not eligible for HWR: {reason}; loaded with the library's own from_pretrained"


def warn_fallback(what: str, reason: str) -> str:
    """Logs the ONE warning of an ineligible preferred start; returns its note."""
    note = fallback_note(reason)
    log.warning("from_pretrained %s: %s", what, note)
    return note


def no_daemon_message(socket: str) -> str:
    """The words of a start with no daemon (warning, note, required error)."""
    return f"no HWR daemon at {socket}: is `hwr serve` running? loading without HWR"


def daemon_absent(socket: str) -> bool:
    """True when nothing listens on ``socket`` (no such file, or a stale
    one that refuses connections). One ``connect`` and a close: the kernel
    answers it from the listen backlog, so a busy daemon counts as there.
    A path that cannot be probed (e.g. permission denied) counts as there:
    the resolve that follows reports what is wrong with it."""
    if not os.path.exists(socket):
        return True
    conn = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    conn.settimeout(_PROBE_TIMEOUT_S)
    try:
        conn.connect(socket)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        conn.close()
    return False
