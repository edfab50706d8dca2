"""Publication after a cold start runs in the background: the start returns
once the model is ready, the publication proves the tensors it read did not
change before it commits, and a worker that closes, exits or is killed
mid-publication leaves no staging and nothing visible; the next start then
publishes again. Real daemon, real diffusers class, real processes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytest.importorskip("diffusers")

import dlo_runtime  # noqa: E402
from dlo_runtime.background import ABANDONED, ABORTED, PUBLISHED, RUNNING  # noqa: E402
from hwr_client.core.errors import NotFound  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.handoff import wait_until  # noqa: E402
from tests.support.paths import REPO_DIR  # noqa: E402
from tests.support.real_models import output_of, save_model  # noqa: E402


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return save_model("flux", str(tmp_path_factory.mktemp("models") / "flux"))


@pytest.fixture
def hwrd(tmp_path):
    d = make_daemon(tmp_path).start()
    yield d
    cleanup(d)


class Gate:
    """A progress callback that holds the publication at its first report
    until ``open()``: the test acts while it is mid-flight."""

    def __init__(self):
        self.reached = threading.Event()
        self._go = threading.Event()

    def __call__(self, done: int, total: int) -> None:
        self.reached.set()
        self._go.wait(60)

    def open(self) -> None:
        self._go.set()


def staging(d) -> list[str]:
    return os.listdir(os.path.join(d.root, "staging"))


def nothing_published(d) -> None:
    assert os.listdir(os.path.join(d.root, "artifacts")) == []
    assert os.listdir(os.path.join(d.root, "blobs", "sha256")) == []


def cold_then_hit(d, flux, expected: torch.Tensor | None = None) -> None:
    """The next start misses, publishes (waited for), and the one after is a
    LOCAL_HIT whose output equals the cold one bit for bit."""
    with dlo_runtime.from_pretrained(flux, socket=d.socket, progress=False) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK"
        out = output_of(cold.model, "flux")
        assert cold.wait_published(60)["state"] == PUBLISHED
    with dlo_runtime.from_pretrained(flux, socket=d.socket, progress=False) as warm:
        assert warm.outcome == "LOCAL_HIT"
        assert torch.equal(output_of(warm.model, "flux"), out)
    if expected is not None:
        assert torch.equal(out, expected)


def test_the_start_returns_before_the_publication_and_the_next_start_is_a_bitwise_hit(hwrd, flux):
    gate = Gate()
    with dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=gate) as cold:
        # Nothing is written before the model's first output: the forward
        # has the cores to itself.
        assert cold.publication.state == RUNNING and not gate.reached.is_set() and not staging(hwrd)
        out = output_of(cold.model, "flux")
        assert gate.reached.wait(30)
        # The model serves while its publication is held mid-file.
        assert cold.publication.state == RUNNING and cold.report.publish["state"] == RUNNING
        assert "publish" not in cold.report.seconds
        assert torch.equal(output_of(cold.model, "flux"), out)
        assert staging(hwrd) and os.listdir(os.path.join(hwrd.root, "artifacts")) == []
        gate.open()
        result = cold.wait_published(60)
        assert result["state"] == PUBLISHED and result["ok"] and result["transport"] == "handoff"
        assert cold.report.publish == result and cold.report.seconds["publish"] == result["seconds"]
    with dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=False) as warm:
        assert warm.outcome == "LOCAL_HIT" and warm.report.bytes_materialized == 0
        assert torch.equal(output_of(warm.model, "flux"), out)


def test_a_tensor_changed_during_the_publication_aborts_it(hwrd, flux, caplog):
    gate = Gate()
    with caplog.at_level(logging.WARNING, logger="dlo_runtime.background"):
        with dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=gate) as cold:
            output_of(cold.model, "flux")  # the first output lets the publication begin
            assert gate.reached.wait(30)
            name, param = next((n, p) for n, p in cold.model.named_parameters() if n.startswith("transformer_blocks.1."))
            with torch.no_grad():
                param.add_(1)  # in place: the bytes the publication reads change
            gate.open()
            result = cold.wait_published(60)
    assert result["state"] == ABORTED and not result["ok"] and name in result["error"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]
    assert warnings and "changed after finalization" in warnings[0].getMessage()
    wait_until(lambda: not staging(hwrd))
    nothing_published(hwrd)
    with hwrd.client() as client, pytest.raises(NotFound):
        client.lookup(result["key"])
    cold_then_hit(hwrd, flux)


def test_close_abandons_a_publication_mid_flight_and_the_next_start_publishes_again(hwrd, flux):
    gate = Gate()
    cold = dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=gate)
    try:
        output_of(cold.model, "flux")  # the first output lets the publication begin
        assert gate.reached.wait(30) and staging(hwrd)
        pub = cold.publication
        threading.Timer(0.5, gate.open).start()  # the thread is parked in the callback: let it see the cancel
        cold.close(publication="abandon")
        assert pub.state == ABANDONED and not pub.report["ok"]
    finally:
        gate.open()
        cold.close()
    wait_until(lambda: not staging(hwrd))  # the cancelled call: the daemon drops the staging at once
    nothing_published(hwrd)
    cold_then_hit(hwrd, flux)


HELD_WORKER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    import dlo_runtime
    import dlo_runtime.background as background
    background.EXIT_WAIT_S = {exit_wait!r}
    held = threading.Event()

    def progress(done, total):
        print("publishing", done, flush=True)
        if {hold!r}:
            held.wait()  # never set: the publication stays mid-file

    loaded = dlo_runtime.from_pretrained({model!r}, socket={socket!r}, progress=progress)
    print("serving", loaded.outcome, flush=True)
    from tests.support.real_models import output_of
    output_of(loaded.model, "flux")  # the first output: the publication begins
    if {action!r} == "hang":
        time.sleep(600)
    loaded.close()  # the default: the publication goes on; exit bounds it
    print("closed", loaded.publication.state, flush=True)
""")


def held_worker(d, flux, action: str, *, hold: bool = True, exit_wait: float = 30.0) -> subprocess.Popen:
    code = HELD_WORKER.format(repo=REPO_DIR, model=flux, socket=d.socket, action=action, hold=hold,
                              exit_wait=exit_wait)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_worker_killed_mid_publication_leaves_no_staging(hwrd, flux):
    proc = held_worker(hwrd, flux, "hang")
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert any(line.startswith("publishing") for line in lines), lines
        assert staging(hwrd)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.stdout.close()
    wait_until(lambda: not staging(hwrd), timeout=30)  # the broken connection ends the publication
    nothing_published(hwrd)
    assert hwrd.proc.poll() is None
    cold_then_hit(hwrd, flux)


def test_interpreter_exit_bounds_a_running_publication_then_abandons_it(hwrd, flux):
    proc = held_worker(hwrd, flux, "exit", exit_wait=1.0)
    try:
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "closed running" in out  # close() returned at once: the default lets it go on
    assert time.monotonic() - t0 < 100
    wait_until(lambda: not staging(hwrd))
    nothing_published(hwrd)


def test_interpreter_exit_lets_a_publication_finish_within_the_bound(hwrd, flux):
    proc = held_worker(hwrd, flux, "exit", hold=False)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    with dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=False) as warm:
        assert warm.outcome == "LOCAL_HIT"


def test_a_second_start_in_the_process_waits_for_its_own_publication(hwrd, flux):
    gate = Gate()
    cold = dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=gate)
    try:
        output_of(cold.model, "flux")  # the first output lets the publication begin
        assert gate.reached.wait(30)
        threading.Timer(0.3, gate.open).start()
        with dlo_runtime.from_pretrained(flux, socket=hwrd.socket, progress=False) as again:
            assert again.outcome == "LOCAL_HIT"  # not a second canonical load racing the first publication
        assert cold.publication.state == PUBLISHED
    finally:
        gate.open()
        cold.close()


def test_the_reference_worker_publishes_in_the_background(hwrd, tmp_path):
    from dlo_runtime.models.tiny_dit import TinyDiTConfig, write_checkpoint
    from dlo_runtime.worker import WorkerOptions, start_worker

    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, TinyDiTConfig(hidden=32, depth=3, heads=4, image=8, freq_dim=16), seed=11)
    opts = WorkerOptions("tiny-dit", ckpt, "preferred", socket=hwrd.socket)
    worker = start_worker(opts)
    try:
        assert worker.report.outcome == "CANONICAL_FALLBACK"
        pub = worker.publish(background=True)
        assert worker.report.publish["state"] in (RUNNING, PUBLISHED)
        assert pub.wait_published(60)["state"] == PUBLISHED and worker.report.publish["ok"]
    finally:
        worker.close()
    again = start_worker(opts)
    try:
        assert again.report.outcome == "LOCAL_HIT"
    finally:
        again.close()
