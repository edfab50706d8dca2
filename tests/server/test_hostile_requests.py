"""Hardening, the request part: bytes that are not a valid request message
and free-text fields with a NUL byte, against one REAL daemon.

Invalid UTF-8 is sent as raw bytes on a generic channel (identity
serializers): the generated stubs could not even build such a message.
Each case must answer INVALID_ARGUMENT naming the rpc or the field, never
INTERNAL, and leave the daemon serving.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.plan import to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity
from tests.support.daemon import cleanup, make_daemon
from tests.support.raw_publish import COMMIT, chunks, raw_publish

StatusCode = grpc.StatusCode
#: A string of two bytes that are not UTF-8 (0xff never occurs in UTF-8).
BAD_UTF8 = b"\xff\xfe"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("requests")).start()
    yield d
    cleanup(d)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (string or message), payload < 128 bytes."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _status(err: grpc.RpcError) -> tuple[StatusCode, str]:
    return err.code(), err.details() or ""


def _serving(daemon) -> None:
    with daemon.client() as client:
        client.call(client.admin.GetStats, pb.GetStatsRequest())


def test_invalid_utf8_in_a_unary_request_is_invalid_argument(served):
    with grpc.insecure_channel(f"unix:{served.socket}") as channel:
        lookup = channel.unary_unary("/hwr.v1.Runtime/Lookup")  # identity (de)serializers: raw bytes
        with pytest.raises(grpc.RpcError) as exc:
            lookup(_field(1, BAD_UTF8), timeout=15)
    code, details = _status(exc.value)
    assert code == StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("Lookup:") and "LookupRequest" in details and "UTF-8" in details, details
    _serving(served)


@pytest.mark.parametrize("rpc, request_bytes", [
    # SessionRequest.open (1) = SessionOpen{client_name (2) = BAD}
    ("Session", _field(1, _field(2, BAD_UTF8))),
    # PublishRequest.plan (1) = PublishPlan{identity_json (1) = BAD}
    ("Publish", _field(1, _field(1, BAD_UTF8))),
], ids=["Session", "Publish"])
def test_invalid_utf8_in_a_stream_message_is_invalid_argument(served, rpc, request_bytes):
    with grpc.insecure_channel(f"unix:{served.socket}") as channel:
        stream = channel.stream_stream(f"/hwr.v1.Runtime/{rpc}")
        with pytest.raises(grpc.RpcError) as exc:
            for _ in stream(iter([request_bytes]), timeout=15):
                pass
    code, details = _status(exc.value)
    assert code == StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"{rpc}:") and "UTF-8" in details, details
    assert os.listdir(os.path.join(served.root, "staging")) == []
    _serving(served)


def test_nul_in_a_publish_file_label_is_refused_naming_the_field(served):
    tensors = {"w": torch.zeros(4)}
    plan = build_plan(identity(t="nul-label"), tensors)
    msg = to_proto(plan)
    msg.files[0].name = "blocks\x00-00.safetensors"
    with served.client() as client:
        code, details = raw_publish(client, [pb.PublishRequest(plan=msg), *chunks(plan, tensors, 4096), COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "files[0].name" in details and "NUL" in details, details
    assert os.listdir(os.path.join(served.root, "artifacts")) == []
    assert os.listdir(os.path.join(served.root, "staging")) == []


def test_nul_in_a_block_prefix_is_refused_naming_the_field(served):
    tensors = {"blocks.0.w": torch.zeros(4)}
    plan = build_plan(identity(t="nul-prefix"), tensors)
    msg = to_proto(plan)
    assert len(msg.blocks) == 1  # build_plan derived the block from the name
    msg.blocks[0].prefix += "\x00"
    with served.client() as client:
        code, details = raw_publish(client, [pb.PublishRequest(plan=msg), COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "blocks[0].prefix" in details and "NUL" in details, details


def test_nul_in_a_session_client_name_is_refused_naming_the_field(served):
    with served.client() as client, pytest.raises(grpc.RpcError) as exc:
        opened = pb.SessionRequest(open=pb.SessionOpen(pid=os.getpid(), client_name="worker\x00-3"))
        for _ in client.runtime.Session(iter([opened]), timeout=15):
            pass
    code, details = _status(exc.value)
    assert code == StatusCode.INVALID_ARGUMENT and "client_name" in details and "NUL" in details, details


def test_nul_in_a_registration_label_is_refused_naming_the_field(served):
    with served.client() as client, pytest.raises(grpc.RpcError) as exc:
        client.runtime.AdmitRegistration(
            pb.AdmitRegistrationRequest(session_id="s", nbytes=1, label="blocks-00\x00"), timeout=15)
    code, details = _status(exc.value)
    assert code == StatusCode.INVALID_ARGUMENT and "AdmitRegistration: label" in details, details
