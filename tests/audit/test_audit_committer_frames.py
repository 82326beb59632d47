"""The shared committer's framing: frames are read with as few reads as possible, a partial frame
never holds up the serving thread, and requests are checked for what keeps the log verifiable.

Before, the server read each frame with two blocking reads (header, then body, 5 s timeout): a
same-user peer that sent half a frame stalled every other process's append for 5 s, and a client
needed two reads per reply.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from securetrain.audit import committer
from securetrain.audit.errors import AuditError, AuditEventError
from securetrain.audit.keys import create_signing_key
from securetrain.audit.log import AuditLog

pytestmark = pytest.mark.skipif(not committer.supported(), reason="abstract Unix sockets are Linux-only")


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


class _Chunks:
    """A socket stand-in whose ``recv`` returns the given chunks, then end of stream."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.reads = 0

    def recv(self, _n: int) -> bytes:
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""


def test_two_frames_in_one_read_are_both_delivered_in_order() -> None:
    # A reply and the bye that follows it at shutdown can arrive in one read.
    stream = _Chunks(_frame({"entries": []}) + _frame(committer.BYE))
    reader = committer.FrameReader()
    assert reader.read(stream) == {"entries": []}  # type: ignore[arg-type]
    assert reader.read(stream) == committer.BYE  # type: ignore[arg-type]
    assert stream.reads == 1
    assert reader.read(stream) is None  # type: ignore[arg-type]


def test_a_frame_split_anywhere_is_reassembled() -> None:
    data = _frame({"who": ["a", "b", "c"], "events": [["x", "y", "success", "{}"]]})
    for cut in range(1, len(data)):
        stream = _Chunks(data[:cut], data[cut:])
        assert committer.FrameReader().read(stream)["who"] == ["a", "b", "c"]  # type: ignore[arg-type,index]


def test_an_oversized_or_malformed_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="too large"):
        committer.FrameReader().read(_Chunks(struct.pack("!I", committer.MAX_FRAME + 1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        committer.FrameReader().read(_Chunks(struct.pack("!I", 3) + b"{{{"))  # type: ignore[arg-type]
    # End of stream inside a frame is end of stream, not a frame.
    assert committer.FrameReader().read(_Chunks(_frame({"a": 1})[:-1])) is None  # type: ignore[arg-type]


@pytest.fixture
def serving_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    key = tmp_path / "audit-key.pem"
    create_signing_key(key)
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", str(key))
    log = AuditLog(f"sqlite:///{tmp_path / 'audit.db'}", checkpoint_every=None)
    log.record("test.start", "serving")
    assert log._server is not None and log._commit_address is not None
    yield log
    log.close()


def _connect(address: str) -> tuple[socket.socket, committer.FrameReader]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(address)
    reader = committer.FrameReader()
    assert reader.read(sock) == committer.HELLO
    return sock, reader


def _request(log: AuditLog, resource: str, details_json: str = '{"n":1}') -> dict[str, Any]:
    return {"who": [log.actor, log.hostname, log.mac], "events": [["test.event", resource, "success", details_json]]}


def test_a_peer_stalled_mid_frame_does_not_hold_up_other_appends(serving_log: AuditLog) -> None:
    address = serving_log._commit_address
    assert address is not None
    stalled, _ = _connect(address)
    stalled.sendall(struct.pack("!I", 200) + b'{"who":')  # half a frame, then nothing
    time.sleep(0.2)  # the server has seen it
    client = committer.CommitClient(address, timeout=30)
    t0 = time.monotonic()
    reply = client.call(_request(serving_log, "after-stall"))
    elapsed = time.monotonic() - t0
    assert "entries" in reply, reply
    assert elapsed < 2.0, f"an append waited {elapsed:.1f} s behind a stalled peer"
    # The stalled peer finishes its frame later and is served like any other.
    rest = json.dumps(_request(serving_log, "stalled")).encode()
    stalled.sendall(rest[len(b'{"who":'):].ljust(200 - len(b'{"who":')))
    reply2 = committer.FrameReader().read(stalled)
    assert isinstance(reply2, dict) and "entries" in reply2, reply2
    client.close()
    stalled.close()
    assert [e.resource for e in serving_log.entries()] == ["serving", "after-stall", "stalled"]
    assert serving_log.verify().ok


def test_two_requests_in_one_write_are_both_answered(serving_log: AuditLog) -> None:
    address = serving_log._commit_address
    assert address is not None
    sock, reader = _connect(address)
    sock.sendall(_frame(_request(serving_log, "one")) + _frame(_request(serving_log, "two")))
    first, second = reader.read(sock), reader.read(sock)
    assert [r["entries"][0][0] for r in (first, second)] == [1, 2]
    sock.close()
    assert serving_log.verify().ok


@pytest.mark.parametrize("details_json, problem", [
    ('{"a":2,"b":1}', None),
    ('{"b":1,"a":2}', "canonical"),  # valid, but the sender would hash other bytes than those stored
    ('{"a":1.5}', "canonical"),  # the rules store a float as its text: rewritten, so refused
    ("[1,2]", "mapping"),
    ('{"password":"x"}', "secret"),
    ('{"a":' + "[" * 20 + "]" * 20 + "}", "deeper"),
    ("not json", "not JSON"),
])
def test_details_are_checked_by_the_local_rules_and_never_rewritten(serving_log: AuditLog, details_json: str,
                                                                     problem: str | None) -> None:
    """A request's details pass the same rules as a local append's, and must already be in the form
    those rules give (what the sender hashed): before, a float or unsorted keys were rewritten and
    stored, and the sender then refused the entry it got back as one that did not hash."""
    address = serving_log._commit_address
    assert address is not None
    sock, reader = _connect(address)
    sock.sendall(_frame(_request(serving_log, "r", details_json)))
    reply = reader.read(sock)
    sock.close()
    if problem is None:
        assert "entries" in reply
    else:
        assert reply.get("error", {}).get("kind") == "AuditEventError", reply
        assert problem in reply["error"]["message"]
        assert [e.resource for e in serving_log.entries()] == ["serving"]
    assert serving_log.verify().ok


def test_a_request_with_a_bad_identity_or_event_is_refused(serving_log: AuditLog) -> None:
    address = serving_log._commit_address
    assert address is not None
    for request in (
        {"who": ["a\x00", "h", "m"], "events": [["x.y", "r", "success", "{}"]]},
        {"who": [["a"], "h", "m"], "events": [["x.y", "r", "success", "{}"]]},  # not text: never hashed
        {"who": ["a", "h", "m"], "events": [["Not An Action", "r", "success", "{}"]]},
        {"who": ["a", "h", "m"], "events": [["x.y", "", "success", "{}"]]},
        {"who": ["a", "h", "m"], "events": [["x.y", "r", "success", {}]]},
        {"who": ["a", "h", "m"], "events": []},
    ):
        sock, reader = _connect(address)
        sock.sendall(_frame(request))
        reply = reader.read(sock)
        sock.close()
        assert committer.error_from_reply(reply["error"]).__class__ in {AuditEventError, AuditError}, reply
    assert [e.resource for e in serving_log.entries()] == ["serving"]
