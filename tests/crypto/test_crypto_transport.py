"""Sealed tensor messages: replay/reorder/impersonation, socket + torch.distributed, Prefect serializer."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from securetrain.crypto import transport as T
from securetrain.crypto.errors import (
    HeaderFormatError,
    KeyNotFoundError,
    KeyringError,
    LimitExceededError,
    MessageAuthError,
    ReplayError,
    TruncatedError,
    WrongKeyError,
)
from securetrain.errors import SecureTrainError


@pytest.fixture()
def parties():
    alice, bob = T.TransportIdentity.generate("alice"), T.TransportIdentity.generate("bob")
    sealer = T.TensorSealer(alice, "bob", bob.public_bytes())
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes()})
    return alice, bob, sealer, opener


def tensors(i: int = 0) -> dict[str, torch.Tensor]:
    return {"grad": torch.full((4, 3), float(i)), "bf": torch.arange(5).to(torch.bfloat16),
            "step": torch.tensor([i], dtype=torch.int64)}


def test_round_trip_and_metadata(parties) -> None:
    _, _, sealer, opener = parties
    msg = T.seal(tensors(1), sealer, {"round": "1"})
    opened = opener.open_with_metadata(msg)
    got, meta = opened.tensors, opened.metadata
    assert isinstance(opened, T.OpenedMessage) and meta == {"round": "1"} and "grad" not in repr(opened)
    for k, v in tensors(1).items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype
    assert b"grad" not in msg[60:], "tensor names travel encrypted"


def test_replay_of_an_evicted_session_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer opening many sessions must not make the receiver forget another peer's replay state."""
    alice, bob, mallory = (T.TransportIdentity.generate(n) for n in ("alice", "bob", "mallory"))
    opener = T.TensorOpener(bob, {"alice": alice.public_bytes(), "mallory": mallory.public_bytes()}, max_sessions=2)
    now = [1_000_000.0]
    monkeypatch.setattr(T.time, "time", lambda: now[0])
    captured = T.TensorSealer(alice, "bob", bob.public_bytes()).seal(tensors(1))
    opener.open(captured)
    for _ in range(3):  # evicts alice's session
        now[0] += 1
        opener.open(T.TensorSealer(mallory, "bob", bob.public_bytes()).seal(tensors(2)))
    with pytest.raises(ReplayError, match="possible replay"):
        opener.open(captured)
    now[0] += 1  # a genuinely new session from alice is still accepted
    assert torch.equal(opener.open(T.TensorSealer(alice, "bob", bob.public_bytes()).seal(tensors(3)))["grad"],
                       tensors(3)["grad"])


def test_replay_and_reorder_rejected(parties) -> None:
    _, _, sealer, opener = parties
    m1, m2, m3 = (sealer.seal(tensors(i)) for i in range(3))
    assert torch.equal(T.open(m1, opener)["grad"], tensors(0)["grad"])
    with pytest.raises(ReplayError, match="replayed"):
        opener.open(m1)
    assert torch.equal(opener.open(m3)["grad"], tensors(2)["grad"])
    with pytest.raises(ReplayError, match="out of order"):
        opener.open(m2)  # older than the last accepted


def test_new_session_after_restart_is_independent(parties) -> None:
    alice, bob, sealer, opener = parties
    opener.open(sealer.seal(tensors()))
    restarted = T.TensorSealer(alice, "bob", bob.public_bytes())  # counter restarts at 1
    assert restarted.session_id != sealer.session_id
    a, b = sealer.seal(tensors()), restarted.seal(tensors())
    assert a[-40:] != b[-40:]
    opener.open(b)
    opener.open(a)


def test_tampering_every_region(parties) -> None:
    _, _, sealer, opener = parties
    msg = sealer.seal(tensors())
    for at in range(4, len(msg), max(1, len(msg) // 97)):
        bad = bytearray(msg)
        bad[at] ^= 0x01
        with pytest.raises((MessageAuthError, ReplayError, KeyNotFoundError, TruncatedError, HeaderFormatError)):
            opener.open(bytes(bad))
    opener.open(msg)  # failed attempts did not poison the replay state


def test_truncated_and_garbage(parties) -> None:
    _, _, sealer, opener = parties
    msg = sealer.seal(tensors())
    for cut in (0, 3, 10, 40, len(msg) - 1):
        with pytest.raises((TruncatedError, HeaderFormatError, MessageAuthError)):
            opener.open(msg[:cut])
    with pytest.raises(HeaderFormatError):
        opener.open(b"GARBAGE" * 10)


def test_impersonation_and_misdelivery(parties) -> None:
    alice, bob, _, opener = parties
    mallory = T.TransportIdentity.generate("alice")  # claims alice's id with her own key
    forged = T.TensorSealer(mallory, "bob", bob.public_bytes()).seal(tensors())
    with pytest.raises(MessageAuthError):
        opener.open(forged)
    carol = T.TransportIdentity.generate("carol")
    to_carol = T.TensorSealer(alice, "carol", carol.public_bytes()).seal(tensors())
    with pytest.raises(ReplayError, match="addressed to 'carol'"):
        opener.open(to_carol)
    stranger = T.TransportIdentity.generate("eve")
    with pytest.raises(KeyNotFoundError):
        opener.open(T.TensorSealer(stranger, "bob", bob.public_bytes()).seal(tensors()))


def test_expired_message(parties) -> None:
    alice, bob, sealer, _ = parties
    msg = sealer.seal(tensors())
    strict = T.TensorOpener(bob, {"alice": alice.public_bytes()}, max_age_s=0.001)
    time.sleep(0.01)
    with pytest.raises(ReplayError, match="window"):
        strict.open(msg)


def test_identity_hides_private_key() -> None:
    ident = T.TransportIdentity.generate("node-1")
    priv = ident.private_bytes()
    assert priv.hex() not in repr(ident) and priv.hex() not in str(ident)
    with pytest.raises(TypeError):
        pickle.dumps(ident)
    same = T.TransportIdentity.from_private_bytes("node-1", priv)
    assert same.public_bytes() == ident.public_bytes()


def test_framing_limits() -> None:
    a, b = socket.socketpair()
    with a, b:
        T.send_frame(a, b"hello")
        T.send_frame(a, b"")
        assert T.recv_frame(b) == b"hello" and T.recv_frame(b) == b""
        T.send_frame(a, b"x" * 100)
        with pytest.raises(LimitExceededError):
            T.recv_frame(b, max_bytes=10)
    a, b = socket.socketpair()
    with b:
        a.sendall((1000).to_bytes(8, "big") + b"short")
        a.close()
        with pytest.raises(TruncatedError):
            T.recv_frame(b)
    a, b = socket.socketpair()
    with b:
        a.close()
        assert T.recv_frame(b) is None


PEER = textwrap.dedent("""
    import socket, sys, torch
    from securetrain.crypto import transport as T
    me = T.TransportIdentity.from_private_bytes("worker", bytes.fromhex(sys.argv[2]))
    server_pub = bytes.fromhex(sys.argv[3])
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    opener = T.TensorOpener(me, {"server": server_pub})
    sealer = T.TensorSealer(me, "server", server_pub)
    while True:
        frame = T.recv_frame(sock)
        if frame is None:
            break
        got = opener.open(frame)
        T.send_frame(sock, sealer.seal({"doubled": got["x"] * 2}))
""")


def test_two_process_exchange_over_loopback_tcp() -> None:
    server, worker = T.TransportIdentity.generate("server"), T.TransportIdentity.generate("worker")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(port), worker.private_bytes().hex(),
                             server.public_bytes().hex()])
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()
        conn.settimeout(60)
        sealer = T.TensorSealer(server, "worker", worker.public_bytes())
        opener = T.TensorOpener(server, {"worker": worker.public_bytes()})
        with conn:
            for _ in range(3):
                x = torch.randn(64, 32)
                T.send_frame(conn, sealer.seal({"x": x}))
                reply = T.recv_frame(conn)
                assert reply is not None
                assert torch.equal(opener.open(reply)["doubled"], x * 2)
            # an on-path replay of an earlier message makes the peer fail closed
            old = sealer.seal({"x": torch.ones(1)})
            T.send_frame(conn, old)
            assert T.recv_frame(conn) is not None
            T.send_frame(conn, old)
            assert T.recv_frame(conn) is None, "peer must refuse the replay and drop the connection"
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
        listener.close()


DIST = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from securetrain.crypto import transport as T
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
    keys = {r: T.TransportIdentity.from_private_bytes(f"rank{r}", bytes.fromhex(sys.argv[3 + r])) for r in (0, 1)}
    me, peer = keys[rank], keys[1 - rank]
    if rank == 0:
        msg = T.TensorSealer(me, peer.party_id, peer.public_bytes()).seal({"w": torch.arange(10.0)})
        T.dist_send_bytes(msg, dst=1)
    else:
        got = T.TensorOpener(me, {peer.party_id: peer.public_bytes()}).open(T.dist_recv_bytes(src=0))
        assert torch.equal(got["w"], torch.arange(10.0)), got
        print("dist-ok", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torch_distributed_send_recv() -> None:
    keys = [T.TransportIdentity.generate(f"rank{r}").private_bytes().hex() for r in (0, 1)]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = str(s.getsockname()[1])
    s.close()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", DIST, str(r), port, *keys], env=env, stdout=subprocess.PIPE)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert b"dist-ok" in outs[1]


# -- Prefect result serializer ---------------------------------------------------------------------

@pytest.fixture()
def env_kek(monkeypatch: pytest.MonkeyPatch) -> bytes:
    kek = os.urandom(32)
    monkeypatch.setenv("SECURETRAIN_KEK", kek.hex())
    monkeypatch.setenv("SECURETRAIN_KEK_ID", "prefect-kek")
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    return kek


def test_prefect_serializer_round_trip(env_kek: bytes) -> None:
    from prefect.serializers import Serializer

    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    ser = Serializer(type="securetrain-encrypted")  # how Prefect rebuilds it from stored result metadata
    assert isinstance(ser, EncryptedTensorSerializer)
    result = {"state": {"w": torch.randn(3, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
              "metrics": [0.5, ("auc", 0.91)], "step": 10, "note": None, "$t": "not-a-tensor"}
    blob = ser.dumps(result)
    assert b"metrics" not in blob and b"auc" not in blob
    back = EncryptedTensorSerializer().loads(blob)
    assert torch.equal(back["state"]["w"], result["state"]["w"])
    assert back["state"]["b"].dtype == torch.bfloat16
    assert back["metrics"] == [0.5, ("auc", 0.91)] and back["step"] == 10 and back["$t"] == "not-a-tensor"
    dumped = repr(ser.model_dump()) + ser.model_dump_json()
    assert env_kek.hex() not in dumped and "SECURETRAIN_KEK" not in dumped


def test_prefect_serializer_persists_through_a_prefect_result_store(env_kek: bytes, tmp_path) -> None:
    """The real path: Prefect wraps the serialized bytes in a JSON result record on disk."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore

    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path)), serializer=EncryptedTensorSerializer())
    secret_tensor = torch.full((64,), 1234.5678)
    record = store.create_result_record({"features": secret_tensor}, key="features")
    store.persist_result_record(record)
    on_disk = (tmp_path / "features").read_bytes()
    assert b"securetrain-encrypted" in on_disk  # the record names the serializer ...
    assert secret_tensor.numpy().tobytes()[:16] not in on_disk  # ... but holds no plaintext tensor bytes
    assert b"features" not in on_disk.split(b'"result"')[1]  # nor the object tree
    back = store.read("features")
    assert torch.equal(back.result["features"], secret_tensor)


def test_prefect_serializer_fails_closed(env_kek: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    ser = EncryptedTensorSerializer()
    good = ser.dumps({"x": torch.ones(2)})
    blob = bytearray(good)
    with pytest.raises(SecureTrainError, match="without pickle"):
        ser.dumps({"obj": object()})
    blob[-3] ^= 1
    with pytest.raises(SecureTrainError):
        ser.loads(bytes(blob))
    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    with pytest.raises(WrongKeyError):  # same key id, different KEK
        ser.loads(good)
    monkeypatch.delenv("SECURETRAIN_KEK")
    with pytest.raises(KeyringError, match="no key source"):
        ser.dumps(1)


def test_concurrent_sealing_never_reuses_a_counter(parties) -> None:
    import threading

    _, _, sealer, opener = parties
    out: list[bytes] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(50):
            m = sealer.seal({"x": torch.ones(1)})
            with lock:
                out.append(m)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counters = sorted(T._parse(m)[3] for m in out)
    assert counters == list(range(1, 201)), "every message needs a distinct counter (= GCM nonce)"


def test_prefect_serializer_with_keyring_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.crypto.keys import LocalKeyring
    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "serializer-pass")
    monkeypatch.delenv("SECURETRAIN_KEK", raising=False)
    path = tmp_path / "kr.json"
    LocalKeyring.create("pf-1").save(path, log2_n=10)
    ser = EncryptedTensorSerializer(keyring_path=str(path))
    blob = ser.dumps({"w": torch.arange(3)})
    assert torch.equal(ser.loads(blob)["w"], torch.arange(3))
    os.chmod(path, 0o644)  # cache must not hide a permission problem
    with pytest.raises(KeyringError):
        ser.loads(blob)


def test_concurrent_opening_accepts_a_message_once(parties) -> None:
    import threading

    _, _, sealer, opener = parties
    msg = sealer.seal({"x": torch.ones(1000)})
    results: list[str] = []
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        try:
            opener.open(msg)
            results.append("ok")
        except ReplayError:
            results.append("replay")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["ok"] + ["replay"] * 7
