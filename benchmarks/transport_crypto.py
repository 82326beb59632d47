"""Sealed tensor transport vs raw loopback bytes, measured in the same run.

    python benchmarks/transport_crypto.py [--quick] [--size-mib N] [--segment-kib K]

A sender *process* connects to this process over 127.0.0.1 TCP and sends the same state dict
(``--size-mib``, several fp32 tensors) ``repeat`` times per round:

* raw     : each tensor's bytes with ``sendall`` (no framing, no crypto); the receiver allocates
            fresh tensors and ``recv_into`` them - the floor any transport has to pay;
* sealed  : ``TensorSealer.send`` (transport v2: per-segment AES-256-GCM straight from tensor
            memory) and ``TensorOpener.recv`` (authenticated header, then each segment decrypted
            into a freshly allocated tensor);
* v1      : the pre-v2 path for reference: ``seal()`` (serialize, one GCM call) + ``send_frame`` /
            ``recv_frame`` + ``open()``.

Prints throughput and the ratio sealed/raw (target >= 0.8). The best of ``--rounds`` rounds counts
(the machine is shared; the best is the least noise-inflated); rounds alternate raw and sealed.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

SENDER = r"""
import socket, sys, torch
from securetrain.crypto import transport as T
port, size, repeat, seg = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
me = T.TransportIdentity.from_private_bytes("sender", bytes(range(1, 33)))
peer_pub = bytes.fromhex(sys.argv[5])
state = {f"t{i}": torch.randn(size // 32) for i in range(8)}
views = [t.view(torch.uint8).numpy() for t in state.values()]
sock = socket.create_connection(("127.0.0.1", port))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    mode = sock.recv(1)  # b"r" raw, b"s" sealed, b"v" v1 framed, b"" done
    if not mode:
        break
    sealer = T.TensorSealer(me, "receiver", peer_pub, segment_size=seg, version=1 if mode == b"v" else 2)
    for _ in range(repeat):
        if mode == b"r":
            for v in views:
                sock.sendall(v)
        elif mode == b"v":
            T.send_frame(sock, sealer.seal(state))
        else:
            sealer.send(sock, state)
sock.close()
"""


def run(size: int, repeat: int, seg: int, rounds: int) -> dict[str, float]:
    """Best time of raw and of sealed, rounds alternating between them (same noise for both)."""
    import torch

    from securetrain.crypto import transport as T

    me = T.TransportIdentity.from_private_bytes("receiver", bytes(range(33, 65)))
    sender_pub = T.TransportIdentity.from_private_bytes("sender", bytes(range(1, 33))).public_bytes()
    opener = T.TensorOpener(me, {"sender": sender_pub}, limits=T.TransportLimits(max_message_bytes=size * 2))
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(size), str(repeat), str(seg),
                              me.public_bytes().hex()])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    best = {"raw": float("inf"), "sealed": float("inf"), "v1": float("inf")}
    try:
        for _ in range(rounds):
            for mode in ("raw", "sealed", "v1"):
                t0 = time.perf_counter()
                conn.sendall(mode[:1].encode())
                for _ in range(repeat):
                    if mode == "raw":
                        for _ in range(8):
                            t = torch.empty(size // 32, dtype=torch.float32)
                            view = memoryview(t.view(torch.uint8).numpy())
                            got = 0
                            while got < len(view):
                                k = conn.recv_into(view[got:])
                                if not k:
                                    raise SystemExit("sender closed early")
                                got += k
                    elif mode == "v1":
                        frame = T.recv_frame(conn, max_bytes=size * 2)
                        assert frame is not None and len(opener.open(frame)) == 8
                    else:
                        result = opener.recv(conn)
                        assert result is not None and len(result.tensors) == 8
                best[mode] = min(best[mode], time.perf_counter() - t0)
    finally:
        conn.close()
        srv.close()
        child.wait(timeout=60)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size-mib", type=int, default=None)
    parser.add_argument("--segment-kib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    size = (args.size_mib or (32 if args.quick else 128)) << 20
    repeat = 2 if args.quick else 4
    rounds = args.rounds or (3 if args.quick else 5)
    seg = args.segment_kib << 10
    best = run(size, repeat, seg, rounds)
    t_raw, t_sealed, t_v1 = best["raw"], best["sealed"], best["v1"]
    gb = size * repeat / 1e9
    print(f"[transport] {size >> 20} MiB state dict x {repeat} over 127.0.0.1 TCP, sender in another process, "
          f"segments {args.segment_kib} KiB, best of {rounds}")
    print(f"  raw sendall/recv_into : {gb / t_raw:6.2f} GB/s   (baseline 1.00x)")
    print(f"  sealed send/recv (v2) : {gb / t_sealed:6.2f} GB/s   ({t_raw / t_sealed:.2f}x of raw; target >= 0.80x)")
    print(f"  v1 seal+frame+open    : {gb / t_v1:6.2f} GB/s   ({t_raw / t_v1:.2f}x of raw; the pre-v2 path)")


if __name__ == "__main__":
    main()
