"""The durability order, seen from outside: the real daemon runs under
strace during ONE publication, ordered (hashed while written, background
fsyncs) and unordered (chunks at offsets, hashed by read-back at commit),
and the trace must show

    fsync of every payload file  <  fsync of blobs/  <  fsync of manifest.json
    <  rename into artifacts/  <  fsync of artifacts/  <  the reply on the socket

where "A < B" means A returned before B was entered. ``strace -y`` names the
path behind each fd. And a failed fsync (EIO injected by strace into the
running daemon) fails the commit with nothing visible. Skipped only where
ptrace is not permitted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess

import pytest

from hwr_client.core.errors import HwrError, NotFound
from hwr_client.core.identity import Identity
from tests.conftest import identity, sample_tensors
from tests.support.daemon import cleanup, make_daemon

SYSCALLS = "fsync,fdatasync,rename,renameat,renameat2,sendmsg,sendto,write,writev"
_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")
_FULL = re.compile(r"^(\w+)\((.*)\) += (-?\d+|\?).*<(\d+\.\d+)>$")
_START = re.compile(r"^(\w+)\((.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*) += (-?\d+|\?).*<(\d+\.\d+)>$")


@dataclasses.dataclass(frozen=True)
class Call:
    """One traced syscall: name, entry and return (Unix seconds), arguments."""

    name: str
    begin: float
    end: float
    args: str
    result: str


def parse(path: str) -> list[Call]:
    """strace -f -ttt -T output -> calls, joining <unfinished>/<resumed> pairs."""
    calls, pending = [], {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            pid, ts, rest = m.group(1), float(m.group(2)), m.group(3)
            if (s := _START.match(rest)) is not None:
                pending[pid] = (s.group(1), ts, s.group(2))
            elif (r := _RESUMED.match(rest)) is not None and pid in pending:
                name, begin, args = pending.pop(pid)
                calls.append(Call(name, begin, begin + float(r.group(4)), args + r.group(2), r.group(3)))
            elif (c := _FULL.match(rest)) is not None:
                calls.append(Call(c.group(1), ts, ts + float(c.group(4)), c.group(2), c.group(3)))
    return sorted(calls, key=lambda c: c.begin)


def _ptrace_refused() -> str:
    probe = subprocess.run(["strace", "-f", "-o", os.devnull, "true"], capture_output=True, text=True, timeout=60)
    return "" if probe.returncode == 0 else probe.stderr.strip() or f"strace exited {probe.returncode}"


@pytest.fixture
def traced(tmp_path):
    """A daemon started under strace; yields (daemon, trace path)."""
    if shutil.which("strace") is None:
        pytest.fail("strace is not installed; .ci/setup installs it (Debian package strace)")
    refused = _ptrace_refused()
    if refused:
        pytest.skip(f"ptrace is not permitted here: {refused}")
    trace = str(tmp_path / "strace.txt")
    d = make_daemon(tmp_path)
    plain = d.command()
    d.command = lambda: [  # type: ignore[method-assign]
        "strace", "-f", "-ttt", "-T", "-y", "-s", "1000000", "--seccomp-bpf",
        "-e", f"trace={SYSCALLS}", "-o", trace, *plain,
    ]
    d.start()
    yield d, trace
    cleanup(d)


def _stop_traced(d) -> None:
    """SIGTERM to the daemon itself (strace's child); strace exits after it,
    with every line written."""
    with open(f"/proc/{d.proc.pid}/task/{d.proc.pid}/children") as f:
        child = int(f.read().split()[0])
    os.kill(child, signal.SIGTERM)
    d.proc.wait(60)


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_publication_is_durable_before_the_reply(traced, ordered):
    d, trace = traced
    tensors = sample_tensors(blocks=3)
    with d.client() as c:
        report = c.publish(identity(t="strace"), tensors, ordered=ordered, file_target_bytes=1)
    _stop_traced(d)
    key = Identity.from_dict(identity(t="strace")).key
    assert report.key == key and len(report.manifest.files) >= 3
    root = os.path.realpath(d.root)
    calls = [c for c in parse(trace) if c.result != "-1"]
    fsyncs = [c for c in calls if c.name in ("fsync", "fdatasync")]

    def fsync_of(pattern: str) -> list[Call]:
        return [c for c in fsyncs if re.search(pattern, c.args)]

    staging = re.escape(os.path.join(root, "staging")) + r"/[0-9a-f]+"
    payload = [fsync_of(rf"<{staging}/{i:05d}\.safetensors>") for i in range(len(report.manifest.files))]
    assert all(payload), f"a payload file was never fsynced: {[len(p) for p in payload]}"
    blobs = fsync_of(rf"<{re.escape(os.path.join(root, 'blobs', 'sha256'))}>")
    manifest = fsync_of(rf"<{staging}/artifact/manifest\.json>")
    renames = [c for c in calls if c.name.startswith("rename") and f'/artifacts/{key}"' in c.args]
    artifacts = fsync_of(rf"<{re.escape(os.path.join(root, 'artifacts'))}>")
    digest = report.manifest.content_digest.split(":")[-1]
    replies = [c for c in calls if c.name in ("sendmsg", "sendto", "write", "writev")
               and re.match(r"\d+<(UNIX|socket)", c.args) and digest in c.args]
    counts = {"manifest.json fsyncs": len(manifest), "renames into artifacts/": len(renames),
              "blobs/ fsyncs": len(blobs), "artifacts/ fsyncs": len(artifacts), "replies": len(replies)}
    assert counts["manifest.json fsyncs"] == 1 and counts["renames into artifacts/"] == 1, counts
    assert all(counts.values()), f"missing from the trace: {counts}"
    rename = renames[0]
    blobs_sync = max((c for c in blobs if c.begin < manifest[0].begin), key=lambda c: c.begin, default=blobs[0])
    artifacts_sync = min((c for c in artifacts if c.begin > rename.begin), key=lambda c: c.begin,
                         default=artifacts[-1])
    reply = replies[0]  # the first time the socket carries this manifest
    chain = [
        ("last payload fsync", max((c for p in payload for c in p), key=lambda c: c.end)),
        ("fsync of blobs/", blobs_sync),
        ("fsync of manifest.json", manifest[0]),
        ("rename into artifacts/", rename),
        ("fsync of artifacts/", artifacts_sync),
        ("the reply", reply),
    ]
    for (what_a, a), (what_b, b) in zip(chain, chain[1:]):
        assert a.end <= b.begin, f"{what_a} (returned {a.end:.6f}) does not precede {what_b} (entered {b.begin:.6f})"


def _attach_injecting_eio(pid: int, trace: str) -> subprocess.Popen:
    """strace attached to every thread of the running daemon ``pid``, making
    each fsync and fdatasync fail with EIO; returns once all are attached."""
    tracer = subprocess.Popen(["strace", "-f", "-ttt", "-T", "-y", "-p", str(pid), "-e", "trace=fsync,fdatasync",
                               "-e", "inject=fsync,fdatasync:error=EIO", "-o", trace],
                              stderr=subprocess.PIPE, text=True)
    assert tracer.stderr is not None
    # "strace: Process N attached with T threads": printed once all are.
    line = tracer.stderr.readline()
    assert "attached" in line, f"strace did not attach ({tracer.poll()}): {line}"
    return tracer


def test_a_failed_fsync_fails_the_commit_and_leaves_nothing_visible(tmp_path):
    if shutil.which("strace") is None:
        pytest.fail("strace is not installed; .ci/setup installs it (Debian package strace)")
    refused = _ptrace_refused()
    if refused:
        pytest.skip(f"ptrace is not permitted here: {refused}")
    d = make_daemon(tmp_path).start()
    trace = str(tmp_path / "strace.txt")
    doc = identity(t="fsync-eio")
    key = Identity.from_dict(doc).key
    try:
        tracer = _attach_injecting_eio(d.proc.pid, trace)
        try:
            with d.client() as c, pytest.raises(HwrError) as exc:
                c.publish(doc, sample_tensors(blocks=3), ordered=True, file_target_bytes=1)
        finally:
            tracer.send_signal(signal.SIGINT)  # detaches; the daemon runs on untraced
            tracer.wait(60)
        # The failure was an injected payload fsync (strace marks it), and the
        # error says so rather than succeeding.
        injected = [c for c in parse(trace) if "INJECTED" in c.args or c.result == "-1"]
        assert any(re.search(r"/staging/[0-9a-f]+/\d{5}\.safetensors>", c.args) for c in injected), injected[:3]
        assert "fsync" in str(exc.value).lower() or "input/output error" in str(exc.value).lower(), exc.value
        # Nothing visible: no artifact, no staging, no blob left behind.
        with d.client() as c:
            with pytest.raises(NotFound):
                c.lookup(key)
        assert os.listdir(os.path.join(d.root, "artifacts")) == []
        assert os.listdir(os.path.join(d.root, "staging")) == []
        assert os.listdir(os.path.join(d.root, "blobs", "sha256")) == []
        # Once the disk answers again, the same publication commits.
        with d.client() as c:
            assert c.publish(doc, sample_tensors(blocks=3), ordered=True, file_target_bytes=1).key == key
    finally:
        cleanup(d)
