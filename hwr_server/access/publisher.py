"""Who published an artifact: the daemon's record, kept next to its manifest.

Every commit (a publication, a pull) writes ``artifacts/<key>/publisher.json``
in the same durable step as ``manifest.json`` (:func:`hwr_server.store.commit.publish`,
step 3), so the record appears with the artifact at the publish point and
never without it. What it says comes from the daemon, never from the
client: the publishing process's ``(pid, uid)`` proven by the peer
credentials handshake (:mod:`hwr_server.access.peers`), its program name
read from ``/proc`` at the commit, or for a pull the registry reference and
the trusted key whose signature verified it. :mod:`hwr_server.access.trust`
decides from it who may take the artifact.

An artifact without a record was published before the daemon kept them:
its publisher is ``unrecorded`` (uid unknown). A record that cannot be read
or parsed counts as the same, with the reason logged: the manifest is not
at fault, so the artifact is not quarantined, only trusted by nobody (see
``ServerConfig.trust_unrecorded_publishers``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_server.access.files import Untrusted, read_stored
from hwr_server.access.peers import Peer

log = logging.getLogger(__name__)

#: The record's file name inside artifacts/<key>/.
PUBLISHER_FILE = "publisher.json"
FORMAT = "hwr-publisher"
FORMAT_VERSION = 1
#: The largest record read back, bytes (one is ~300 bytes).
MAX_RECORD_BYTES = 64 * 1024
#: Longest program name kept (the kernel's comm is at most 15 bytes).
_MAX_PROGRAM = 64
_VIAS = ("publish", "pull", "unrecorded")


@dataclasses.dataclass(frozen=True)
class Publisher:
    """Who put one artifact into the store.

    Attributes:
        via: "publish", "pull", or "unrecorded" (no record: uid unknown).
        uid: the publishing process's uid; None when unknown (an anonymous
            peer, or unrecorded).
        pid: its pid (the daemon's own for a pull); None when unknown.
        program: its name (``/proc/<pid>/comm`` at the commit), "" if unknown.
        unix: Unix seconds of the commit, 0 if unknown.
        id: the publication or pull id: unique per commit, so two records
            are equal only if they describe the same commit.
        source: a pull's ``host/repository@sha256:<digest>``.
        signer: a pull's verifying key id (``SHA256:…``), "" if unsigned.
    """

    via: str
    uid: int | None = None
    pid: int | None = None
    program: str = ""
    unix: int = 0
    id: str = ""
    source: str = ""
    signer: str = ""

    def describe(self) -> str:
        """One line for people and error messages."""
        if self.via == "unrecorded":
            return "an unrecorded publisher (published before the daemon recorded publishers)"
        if self.via == "pull":
            signed = f"signed by {self.signer}" if self.signer else "unsigned"
            return f"the daemon (pulled from {self.source}, {signed})"
        who = "an anonymous process" if self.uid is None else f"uid {self.uid}"
        detail = ", ".join(x for x in (f"pid {self.pid}" if self.pid else "", self.program) if x)
        return f"{who} ({detail})" if detail else who

    def to_proto(self) -> pb.Publisher:
        return pb.Publisher(via=self.via, uid=self.uid or 0, uid_known=self.uid is not None, pid=self.pid or 0,
                            program=self.program, published_unix=self.unix, source=self.source,
                            signer=self.signer, text=self.describe())

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        return (json.dumps(doc, sort_keys=True) + "\n").encode("utf-8")


UNRECORDED = Publisher("unrecorded")


def program_of(pid: int | None) -> str:
    """The process's name from ``/proc/<pid>/comm`` (bounded, printable
    only), "" when it cannot be read (the process is gone, or elsewhere)."""
    if not pid:
        return ""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            raw = f.read(_MAX_PROGRAM)
    except OSError:
        return ""
    return "".join(c for c in raw.decode("utf-8", "replace").strip() if c.isprintable())


def published_by(peer: Peer, commit_id: str) -> Publisher:
    """The record of a publication by ``peer`` (the kernel-checked caller)."""
    return Publisher("publish", peer.uid, peer.pid, program_of(peer.pid), int(time.time()), commit_id)


def pulled(commit_id: str, *, source: str, signer: str) -> Publisher:
    """The record of a pull: published by the daemon itself."""
    return Publisher("pull", os.geteuid(), os.getpid(), program_of(os.getpid()), int(time.time()), commit_id,
                     source, signer)


def parse(raw: bytes, *, what: str) -> Publisher:
    """A record's bytes, checked field by field.

    Raises:
        ValueError: naming ``what`` and the field that is wrong.
    """
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{what}: not an {FORMAT} v{FORMAT_VERSION} document")
    uid, pid, unix = doc.get("uid"), doc.get("pid"), doc.get("unix", -1)
    texts = [doc.get(k) for k in ("via", "program", "id", "source", "signer")]
    ok = (all(v is None or (type(v) is int and v >= 0) for v in (uid, pid)) and isinstance(unix, int)
          and all(isinstance(t, str) and "\x00" not in t for t in texts) and texts[0] in _VIAS)
    if not ok:
        raise ValueError(f"{what}: a field has the wrong type or value")
    via, program, commit_id, source, signer = (str(t) for t in texts)
    return Publisher(via, uid, pid, program, unix, commit_id, source, signer)


def read(artifact_dir: str, *, key: str) -> Publisher:
    """The record of the artifact in ``artifact_dir``; :data:`UNRECORDED`
    when it has none or it cannot be trusted (logged)."""
    what = f"artifact {key[:12]} {PUBLISHER_FILE}"
    try:
        # read_stored: no link followed, no FIFO, the daemon's own file, bounded.
        return parse(read_stored(os.path.join(artifact_dir, PUBLISHER_FILE), what=what, limit=MAX_RECORD_BYTES),
                     what=what)
    except FileNotFoundError:
        return UNRECORDED
    except (Untrusted, ValueError, UnicodeDecodeError) as exc:
        log.warning("%s: %s; its publisher counts as unrecorded", what, exc)
        return UNRECORDED


__all__ = ["MAX_RECORD_BYTES", "PUBLISHER_FILE", "Publisher", "UNRECORDED", "parse", "program_of", "published_by",
           "pulled", "read"]
