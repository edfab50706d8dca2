"""The hostile stream client and its bounds, shared by the stream tests and bench/hostile.py (moved from tests/server/test_hostile_streams.py)."""

from __future__ import annotations

import queue
import subprocess
import textwrap
import threading
import time

#: Lines read so far from each hostile process, by pid (readline's reader threads).
_LINES: dict[int, "queue.Queue[str]"] = {}
#: Bound on a unary call that must be served while streams misbehave. The old
#: daemon did not answer at all (DEADLINE_EXCEEDED); a served call takes
#: milliseconds.
CALL_BOUND_S = 5.0


def wait_for(pred, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def readline(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The child's next stdout line, or "" if none comes within ``timeout``
    (the old daemon's hang must fail the test, not stall it).

    A reader thread per child feeds a queue: select() on the pipe cannot
    see lines already sitting in the text wrapper's buffer (two lines that
    arrived in one read would make the second one look missing)."""
    lines = _LINES.get(proc.pid)
    if lines is None:
        lines = _LINES[proc.pid] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


# A process that holds 64 silent Session streams and 64 plan-only Publish
# streams on an anonymous channel; prints the outcomes when told.
HOSTILE = textwrap.dedent("""
    import json, sys, threading, grpc
    from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
    from hwr_client.core.plan import to_proto
    from hwr_client.tensors import build_plan
    from tests.conftest import identity, sample_tensors
    stub = pb_grpc.RuntimeStub(grpc.insecure_channel("unix:" + sys.argv[1]))
    never = threading.Event()
    def silent():
        never.wait()
        yield pb.SessionRequest()
    def plan_only(i):
        yield pb.PublishRequest(plan=to_proto(build_plan(identity(hostile=i), sample_tensors())))
        never.wait()
    calls = [stub.Session(silent()) for _ in range(64)] + [stub.Publish(plan_only(i)) for i in range(64)]
    outcomes, lock = [], threading.Lock()
    def watch(call):
        try:
            for _ in call:
                pass
            out = ["OK", ""]
        except grpc.RpcError as err:
            out = [err.code().name, err.details() or ""]
        with lock:
            outcomes.append(out)
    for call in calls:
        threading.Thread(target=watch, args=(call,), daemon=True).start()
    print("open", flush=True)
    for line in sys.stdin:
        with lock:
            print(json.dumps(outcomes), flush=True)
""")
