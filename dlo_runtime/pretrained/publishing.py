"""Publication after a cold :func:`~dlo_runtime.pretrained.from_pretrained`:
the runtime tensors handed to :mod:`dlo_runtime.background`, and the
progress line it may print.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from torch import nn

from dlo_runtime.pretrained.contract import PretrainedContract
from dlo_runtime.pretrained.skeleton import publish_groups
from dlo_runtime.restore import tensor_slots


def publish_in_background(model: nn.Module, contract: PretrainedContract, identity: Any, socket: str,
                          report: Any, progress: bool | Callable[[int, int], None]) -> Any:
    """Starts the publication of a preferred miss on its own thread
    (:mod:`dlo_runtime.background`); the start returns without waiting.
    ``identity`` may be the future of one whose sources are still being
    hashed: the thread waits for it, and ``report.key`` is set then. The
    writing begins after the model's first output (its first forward
    returns; ``wait_published`` and ``close(publication="wait")`` start it
    at once; at most :data:`~dlo_runtime.background.FIRST_OUTPUT_WAIT_S`).
    ``report`` (the start's :class:`~dlo_runtime.pretrained.PretrainedReport`):
    ``publish`` says ``running`` until it ends, then holds its report;
    ``seconds["publish"]`` its seconds; the trail its outcome. Returns the
    :class:`~dlo_runtime.background.BackgroundPublication`."""
    from dlo_runtime.background import RUNNING, BackgroundPublication

    # On a CUDA device the backend moved the non-block tensors there:
    # publication takes host bytes (these small copies are its own; the
    # streamed blocks stay on the host and are read in place).
    tensors = {s.name: s.tensor.detach() if s.tensor.device.type == "cpu" else s.tensor.detach().cpu()
               for s in tensor_slots(model).slots}
    show = (progress if callable(progress) else
            progress_printer(f"hwr: publishing {contract.name}") if progress else None)

    def done(result: dict[str, Any]) -> None:
        if not report.key and result.get("key"):
            report.key = result["key"]  # a deferred identity, completed on the publication's thread
        report.publish = result
        report.seconds["publish"] = result["seconds"]
        # After `publish_scheduled` (_step): what became of it, never "published" before it is.
        report.trail.append(result["state"] if result["ok"] else f"publish_failed: {result['error']}")

    first_output = threading.Event()
    pub = BackgroundPublication(socket, identity, tensors, blocks=publish_groups(model, contract.blocks(model)),
                                progress=show, on_done=done, start_after=first_output)
    _on_first_output(model, first_output)
    report.publish = {"state": RUNNING, "ok": False, "key": pub.key}
    return pub


def _on_first_output(model: nn.Module, event: threading.Event) -> None:
    """Sets ``event`` when the model's first forward returns (a hook on
    the root module that removes itself): the first output comes before
    the publication's first byte."""
    handle: list[Any] = []

    def fired(_module: nn.Module, _args: Any, _output: Any) -> None:
        event.set()
        handle.pop().remove()

    handle.append(model.register_forward_hook(fired))


def progress_printer(what: str) -> Callable[[int, int], None]:
    """A progress callback printing ``what`` at each quarter to stderr."""
    last = [-1]

    def show(done: int, total: int) -> None:
        step = 100 * done // max(total, 1) // 25 * 25
        if step > last[0]:
            last[0] = step
            print(f"{what} {step:3d}%  ({done >> 20} / {total >> 20} MiB)", file=sys.stderr, flush=True)

    return show


__all__ = ["progress_printer", "publish_in_background"]
