"""Transport v2: per-segment authentication, configured caps, nothing allocated before authentication."""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import pytest
import torch

from securetrain.crypto import transport as T
from securetrain.crypto.errors import (
    CryptoError,
    LimitExceededError,
    MessageAuthError,
    ReplayError,
    TrailingDataError,
    TruncatedError,
)

GiB = 1 << 30


@pytest.fixture()
def parties():
    alice, bob = T.TransportIdentity.generate("alice"), T.TransportIdentity.generate("bob")
    return alice, bob


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(300, 7), "b": torch.arange(40, dtype=torch.int64), "empty": torch.empty(0, 3),
            "h": torch.randn(9).to(torch.bfloat16)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stream_round_trip_over_a_socket(parties) -> None:
    alice, bob = parties
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes(), segment_size=256)
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    state = _state()
    a, b = socket.socketpair()
    with a, b:
        sent = [sealer.send(a, state, {"round": str(i)}) for i in range(3)]
        for i in range(3):
            opened = opener.recv(b)
            assert opened is not None
            got, meta = opened.tensors, opened.metadata
            assert _same(got, state) and meta == {"round": str(i)}
        a.shutdown(socket.SHUT_WR)
        assert opener.recv(b) is None
    assert sent[0] == len(sealer.seal(state, {"round": "0"}))
    msg = sealer.seal(state)
    assert msg[4] == 2 and b"empty" not in msg  # names travel encrypted
    assert _same(opener.open(msg), state)


def test_every_segment_is_authenticated(parties) -> None:
    alice, bob = parties
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes(), segment_size=64)
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    msg = sealer.seal({"w": torch.randn(64)})  # header region + 4 tensor segments
    hdr = T._parse(msg)[5] + 16  # header + header tag
    for at in range(hdr, len(msg), 7):
        bad = bytearray(msg)
        bad[at] ^= 1
        with pytest.raises(MessageAuthError, match="segment"):
            opener.open(bytes(bad))
    seg = 64 + 16
    tensor_at = len(msg) - 4 * seg  # the tensor's 256 bytes are the last 4 segments
    swapped = bytearray(msg)
    swapped[tensor_at:tensor_at + seg], swapped[tensor_at + seg:tensor_at + 2 * seg] = (
        msg[tensor_at + seg:tensor_at + 2 * seg], msg[tensor_at:tensor_at + seg])
    with pytest.raises(MessageAuthError):
        opener.open(bytes(swapped))
    with pytest.raises(TruncatedError):
        opener.open(msg[:-1])
    with pytest.raises(TrailingDataError):
        opener.open(msg + b"\0")
    opener.open(msg)  # the failed attempts did not consume the counter


def _hostile_header(sender: str, recipient: str, total: int, *, tag: bytes = bytes(16), counter: int = 1) -> bytes:
    ids = bytes([len(sender)]) + sender.encode() + bytes([len(recipient)]) + recipient.encode()
    return (b"STTM\x02" + ids + bytes(16)
            + struct.pack(">QQIQI", counter, int(time.time() * 1000), 1 << 20, total, 4096) + tag)


def test_unauthenticated_2gib_header_allocates_nothing(parties) -> None:
    """The review's case: a header announcing 2 GiB made the receiver allocate it (236 -> 2,284 MiB)."""
    alice, bob = parties
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()}, limits=T.TransportLimits(max_message_bytes=4 * GiB))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_hostile_header("alice", "bob", 2 * GiB) + b"\0" * 4096)
        tracemalloc.start()
        try:
            with pytest.raises(MessageAuthError, match="header"):
                opener.recv(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 256 << 10, f"{peak} bytes traced before authentication"


def test_authenticated_oversized_message_is_refused_by_the_cap(parties) -> None:
    alice, bob = parties
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes())
    small = T.TensorOpener(bob, {"alice": alice.public_bytes()}, limits=T.TransportLimits(max_message_bytes=1000))
    with pytest.raises(LimitExceededError, match="1000-byte limit"):
        small.open(sealer.seal({"w": torch.zeros(1000)}))


def test_cap_from_the_environment(parties, monkeypatch: pytest.MonkeyPatch) -> None:
    alice, bob = parties
    monkeypatch.setenv("SECURETRAIN_TRANSPORT_MAX_BYTES", "2000")
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    assert opener.limits.max_message_bytes == 2000
    with pytest.raises(LimitExceededError):
        opener.open(T.TensorSealer(alice, "bob", bob.public_bytes()).seal({"w": torch.zeros(1000)}))
    monkeypatch.setenv("SECURETRAIN_TRANSPORT_MAX_BYTES", "lots")
    with pytest.raises(LimitExceededError):
        T.TensorOpener(bob, {})


def test_authenticated_peer_that_stops_costs_only_what_arrived(parties) -> None:
    """An authentic header declaring a big tensor, then silence: memory follows the arriving segments."""
    alice, bob = parties
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes(), segment_size=1 << 16)
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()}, limits=T.TransportLimits(max_message_bytes=4 * GiB))
    msg = sealer.seal({"w": torch.zeros(64 << 20, dtype=torch.uint8)})  # 64 MiB declared
    a, b = socket.socketpair()
    with b:
        def feed() -> None:
            with a:
                a.sendall(msg[:256 << 10])  # header + ~250 KiB, then the peer goes away
        t = threading.Thread(target=feed)
        t.start()
        tracemalloc.start()
        try:
            with pytest.raises(TruncatedError):
                opener.recv(b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        t.join()
    assert peak < 1 << 20, f"{peak} bytes traced"


def test_v1_frame_announcing_2gib_grows_with_arrivals_only() -> None:
    a, b = socket.socketpair()
    with b:
        def feed() -> None:
            with a:
                a.sendall((2 * GiB).to_bytes(8, "big") + b"x" * (1 << 20))
        t = threading.Thread(target=feed)
        t.start()
        tracemalloc.start()
        try:
            with pytest.raises(TruncatedError):
                T.recv_frame(b, max_bytes=4 * GiB)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        t.join()
    assert peak < 8 << 20, f"{peak} bytes traced for 1 MiB that arrived"


def test_rss_stays_flat_for_a_hostile_2gib_header(parties) -> None:
    """The same with RSS (what the review measured): no growth near the announced size."""
    import resource

    alice, bob = parties
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()}, limits=T.TransportLimits(max_message_bytes=4 * GiB))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(5):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(_hostile_header("alice", "bob", 2 * GiB))
            with pytest.raises(MessageAuthError):
                opener.recv(b)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10, f"peak RSS grew by {grown_kib} KiB"


def test_low_order_and_malformed_peer_keys_are_typed(parties) -> None:
    alice, bob = parties
    for bad in (bytes(32), bytes([1]) + bytes(31), b"short"):
        with pytest.raises(MessageAuthError):
            T.TensorSealer(alice, "bob", bad)
    opener = T.TensorOpener(bob, {"alice": bytes(32)})
    msg = T.TensorSealer(alice, "bob", bob.public_bytes()).seal({"x": torch.ones(1)})
    with pytest.raises(MessageAuthError, match="low order"):
        opener.open(msg)
    with pytest.raises(CryptoError):
        T.TransportIdentity.from_private_bytes("x", b"short")


def test_replay_of_a_streamed_message_is_refused(parties) -> None:
    alice, bob = parties
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes())
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    msg = sealer.seal({"x": torch.ones(3)})
    opener.open(msg)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(msg)
        with pytest.raises(ReplayError):
            opener.recv(b)


def test_v1_messages_still_open(parties) -> None:
    alice, bob = parties
    old = T.TensorSealer(alice, "bob", bob.public_bytes(), version=1)
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    msg = old.seal({"x": torch.arange(4)})
    assert msg[4] == 1 and torch.equal(opener.open(msg)["x"], torch.arange(4))
