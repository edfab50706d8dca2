"""The hostile clients of the shared-node tests, as Python programs run as
uid ``nobody`` (:func:`tests.support.shared_node.popen_nobody`); shared by
tests/server/test_hostile_registration.py, test_hostile_uid_shares.py and
bench/hostile.py (its shared-node cases), so the bench sends exactly what
the tests send."""

from __future__ import annotations

import textwrap

# A registration attacker: one session; JSON commands on stdin, one JSON answer per line.
#   {"op": "admit", "nbytes": N, "wait_ms": W}  -> the reply's fields
#   {"op": "report", "rid": R, "nbytes": N}     -> {"known": ...}
#   {"op": "flood", "n": N, "wait_ms": W}       -> {"fired": N}, later {"results": [...]} once all answered
REGISTRATION_ATTACKER = textwrap.dedent("""
    import json, sys, threading, grpc, hwr_client
    from hwr_client.core._proto import hwr_pb2 as pb
    client = hwr_client.connect(sys.argv[1])
    session = client.session()
    sid, rt = session.session_id(), session.runtime
    def admit(nbytes, wait_ms):
        r = rt.AdmitRegistration(pb.AdmitRegistrationRequest(session_id=sid, nbytes=nbytes, wait_ms=wait_ms,
                                                             label="attacker"), timeout=120)
        return {"admitted": r.admitted, "rid": r.registration_id, "reason": r.reason, "detail": r.detail}
    def flood(n, wait_ms):
        out, lock = [], threading.Lock()
        def one():
            try:
                got = admit(4096, wait_ms)["reason"] or "admitted"
            except grpc.RpcError as e:
                got = e.code().name
            with lock:
                out.append(got)
        threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        print(json.dumps({"fired": n}), flush=True)
        for t in threads:
            t.join()
        print(json.dumps({"results": out}), flush=True)
    print(json.dumps({"uid": __import__("os").getuid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "admit":
            print(json.dumps(admit(cmd["nbytes"], cmd.get("wait_ms", 0))), flush=True)
        elif cmd["op"] == "report":
            r = rt.ReportRegistrationChunk(pb.ReportRegistrationChunkRequest(
                session_id=sid, registration_id=cmd["rid"], nbytes=cmd["nbytes"], seconds=0.001), timeout=30)
            print(json.dumps({"known": r.known}), flush=True)
        elif cmd["op"] == "flood":
            threading.Thread(target=flood, args=(cmd["n"], cmd["wait_ms"]), daemon=True).start()
""")


# Opens N Session streams (SessionOpen sent, then silent) with hwr_client's
# channel (its peer token names this pid and uid 65534); prints each outcome.
STREAM_HOG = textwrap.dedent("""
    import json, sys, threading, grpc
    from hwr_client.channel import open_channel
    from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
    stub = pb_grpc.RuntimeStub(open_channel(sys.argv[1]))
    hold = threading.Event()
    def requests():
        yield pb.SessionRequest(open=pb.SessionOpen(client_name="hog"))
        hold.wait()
    out, calls = [], []
    for _ in range(int(sys.argv[2])):
        call = stub.Session(requests(), timeout=300)
        calls.append(call)
        try:
            out.append("OPENED" if next(call).WhichOneof("kind") == "opened" else "?")
        except grpc.RpcError as e:
            out.append(e.code().name + ": " + (e.details() or ""))
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    hold.set()
    for c in calls:
        c.cancel()
""")

# One ordered publication of a 64 KiB tensor that sends one byte every half
# second once accepted; prints its final status. Plain protobuf: no torch.
TRICKLER = textwrap.dedent("""
    import json, sys, threading, time, grpc
    from hwr_client.channel import open_channel
    from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
    from hwr_client.core.identity import Identity
    doc = {"contract": {"name": "tiny-dit", "version": 1},
           "sources": [{"name": "model.safetensors", "content_id": "sha256:" + "ab" * 32}],
           "representation": {"dtype": "bfloat16"},
           "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
           "producer": {"id": "trickle", "version": "1"}, "extra": {"tag": sys.argv[2]}}
    plan = pb.PublishPlan(identity_json=Identity.from_dict(doc).to_json(), ordered=True, files=[
        pb.FilePlan(name="f", tensors=[pb.TensorPlan(name="w", dtype="U8", shape=[65536])])])
    stub = pb_grpc.RuntimeStub(open_channel(sys.argv[1]))
    accepted, stop = threading.Event(), threading.Event()
    def requests():
        yield pb.PublishRequest(plan=plan)
        accepted.wait()
        for i in range(120):
            if stop.wait(0.5):
                return
            yield pb.PublishRequest(chunk=pb.PayloadChunk(file_index=0, offset=i, data=b"\\0"))
    call = stub.Publish(requests(), timeout=120)
    print(json.dumps({"started": True}), flush=True)
    try:
        for event in call:
            if event.WhichOneof("kind") == "accepted":
                accepted.set()
        outcome = ["OK", ""]
    except grpc.RpcError as e:
        outcome = [e.code().name, e.details() or ""]
    stop.set()
    accepted.set()
    print(json.dumps(outcome), flush=True)
    sys.stdin.read()
""")
