"""A Hugging Face hub id where a local directory was expected.

HWR reads local directories only and never downloads (the identity is the
bytes on this node's disk). A user who passes ``black-forest-labs/FLUX.1-dev``
as the libraries allow gets, instead of a bare "no such directory", the
reason and the folder to pass: the snapshot in the local hub cache when it is
there, else how to get it.

The cache layout is huggingface_hub's: ``<cache>/models--ORG--NAME/`` with
``refs/main`` naming the revision and ``snapshots/<revision>/`` the files,
where ``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``. The
environment is read when an error is built, never at import (huggingface_hub
is not imported: its constants are read at its import).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from hwr_client.core.errors import NotFound

#: huggingface_hub's repo id: ``name`` or ``org/name`` of word characters,
#: dots and dashes.
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The hub cache folder huggingface_hub would use (see the module doc)."""
    env = os.environ if environ is None else environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return os.path.expanduser(env[var])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                              "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def looks_like_hub_id(path: str) -> bool:
    """Whether a path that does not exist reads as a hub id (``org/name``)."""
    return (bool(_REPO_ID.match(path)) and not path.startswith(".") and ".." not in path
            and not os.path.exists(path))


def hub_snapshot(repo_id: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The local snapshot folder of model ``repo_id``: the revision
    ``refs/main`` names, else the newest snapshot; None when the cache has
    none."""
    folder = os.path.join(hub_cache_dir(environ), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(folder, "snapshots")
    try:
        with open(os.path.join(folder, "refs", "main")) as f:
            main = f.read().strip()
    except OSError:
        main = ""
    if main and "/" not in main and os.path.isdir(os.path.join(snapshots, main)):
        return os.path.join(snapshots, main)
    try:
        revisions = [os.path.join(snapshots, r) for r in os.listdir(snapshots)]
    except OSError:
        return None
    revisions = [r for r in revisions if os.path.isdir(r)]
    return max(revisions, key=os.path.getmtime) if revisions else None


def missing_directory(path: str, what: str, *, environ: Mapping[str, str] | None = None) -> NotFound:
    """The NotFound for ``path`` (a ``what``: "model directory", "pipeline
    directory") that is not a directory, naming the hub snapshot to pass
    instead when ``path`` reads as a hub id."""
    if not looks_like_hub_id(path):
        return NotFound(f"{what} {path}: no such directory")
    local = "HWR loads local directories only and never downloads"
    snapshot = hub_snapshot(path, environ)
    if snapshot is not None:
        return NotFound(f"{what} {path}: no such directory. {local}; this hub id is in the local hub cache: "
                        f"pass its snapshot {snapshot}")
    cache = hub_cache_dir(environ)
    return NotFound(f"{what} {path}: no such directory. {local}; if it is a Hugging Face hub id, download it "
                    f"first (`hf download {path}`, or huggingface_hub.snapshot_download) and pass the folder it "
                    f"prints, {cache}/models--{path.replace('/', '--')}/snapshots/<revision>")
