"""The client's half of the handoff transport (see ``rpc Publish`` in the
proto and :mod:`hwr_server.publish.handoff`): ask the daemon's handoff socket
for a staging file's descriptor, write the file's data region into it
straight from the tensors, close it.

The payload crosses from the tensors into the page cache once, by
``pwrite``; nothing is copied into messages. What the daemon publishes is
what it hashes in the sealed file, so nothing here is trusted by it.
"""

from __future__ import annotations

import array
import errno
import os
import socket as pysocket
from typing import Callable, Mapping

import torch

from hwr_client.core.defaults import HANDOFF_SOCKET_SUFFIX
from hwr_client.core.errors import (Aborted, FailedPrecondition, HwrError, Internal, InvalidArgument, NotFound,
                                    PermissionDenied, ResourceExhausted, Unavailable)
from hwr_client.core.layout import FileLayout
from hwr_client.tensors import iter_payload

#: Bytes handed to one pwrite at most: between two, a cancelled publication
#: stops and progress is counted.
WRITE_BYTES = 64 * 1024 * 1024
#: Seconds to wait for the daemon's answer on the handoff socket.
ANSWER_TIMEOUT_S = 30.0
_MAX_ANSWER = 2048
_ERRORS: dict[str, type[HwrError]] = {cls.code.name: cls for cls in (
    Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Unavailable)}


class HandoffUnavailable(Unavailable):
    """The handoff socket cannot be reached, before any byte of the file is
    written (retry-safe: nothing is published). The client asks for the
    handoff only where the socket is there and writable, so this is a race
    with a daemon going away, or a socket removed meanwhile."""


class Cancelled(Exception):
    """The caller's cancel event was set while a file was being written."""


def receive_descriptor(socket: str, token: str, index: int) -> int:
    """A write-only descriptor of staging file ``index`` of the publication
    whose handoff token is ``token``, from the daemon of ``socket``.

    Raises:
        HandoffUnavailable: the handoff socket cannot be reached.
        HwrError: the daemon refused (its class, its message).
    """
    conn = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    conn.settimeout(ANSWER_TIMEOUT_S)
    try:
        try:
            conn.connect(socket + HANDOFF_SOCKET_SUFFIX)
        except OSError as exc:
            raise HandoffUnavailable(f"{socket + HANDOFF_SOCKET_SUFFIX}: {exc.strerror or exc}") from None
        conn.sendall(f"{token} {index}\n".encode("ascii"))
        fds = array.array("i")
        data, ancdata, _flags, _ = conn.recvmsg(_MAX_ANSWER, pysocket.CMSG_SPACE(fds.itemsize))
        for level, kind, payload in ancdata:
            if level == pysocket.SOL_SOCKET and kind == pysocket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    except OSError as exc:
        raise Unavailable(f"handoff socket {socket + HANDOFF_SOCKET_SUFFIX}: {exc.strerror or exc}") from None
    finally:
        conn.close()
    if data.startswith(b"ok") and len(fds) == 1:
        return fds[0]
    for fd in fds:  # an answer that is not exactly one descriptor keeps none
        os.close(fd)
    text = data.decode("utf-8", "replace").strip()
    if text.startswith("error "):
        parts = text.split(" ", 2)  # "error", a status name, the daemon's message
        raise _ERRORS.get(parts[1], Internal)(parts[2] if len(parts) > 2 else text)
    raise Internal(f"handoff socket {socket + HANDOFF_SOCKET_SUFFIX}: unexpected answer {text[:200]!r} "
                   f"with {len(fds)} descriptors")


def write_file(fd: int, layout: FileLayout, tensors: Mapping[str, torch.Tensor], *,
               progress: Callable[[int], None] | None = None, cancelled: Callable[[], bool] = lambda: False) -> int:
    """Writes one staging file's data region (padding included) at its
    planned offsets through ``fd``; the daemon wrote the header. Does not
    close ``fd``.

    Args:
        progress: called with the bytes written so far, about every
            :data:`WRITE_BYTES`.
        cancelled: polled between writes; True stops with :class:`Cancelled`.

    Returns:
        Bytes written.

    Raises:
        ResourceExhausted: the disk is full. InvalidArgument: a tensor
            changed dtype or shape. Cancelled. OSError otherwise.
    """
    done = reported = 0
    for off, data in iter_payload(layout, tensors, WRITE_BYTES):
        view, at = memoryview(data), layout.data_start + off
        while view:
            try:
                n = os.pwrite(fd, view, at)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ResourceExhausted(f"staging file: the disk is full ({exc.strerror}); free space or "
                                            "run `hwr gc`") from None
                raise
            view, at, done = view[n:], at + n, done + n
        if done - reported >= WRITE_BYTES:
            if cancelled():
                raise Cancelled()
            if progress is not None:
                progress(done)
            reported = done
    return done


__all__ = ["HandoffUnavailable", "Cancelled", "WRITE_BYTES", "receive_descriptor", "write_file"]
