"""Encrypted-checkpoint throughput and memory, as ratios against baselines measured in the same run.

    python benchmarks/checkpoint_crypto.py [--quick] [--size-mib N]

1. Raw AES-256-GCM (``cryptography`` AESGCM.encrypt_into on 1 MiB segments, in memory) vs the
   securetrain container's encrypt/decrypt streams (in memory, output discarded).
2. Plain safetensors save_file/load_file vs EncryptedCheckpointStore save/load (same state dict,
   same disk, both fsync'd the way a real save would be).
3. Peak RSS (VmHWM, falling back to ru_maxrss; one fresh subprocess per case) for a state dict of --size-mib (1 GiB by
   default, 128 MiB with --quick), reported as overhead over the tensors' own size.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import best_of  # benchmarks/ is on sys.path when run as a script

SEG = 1 << 20


class Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        return len(b)


def throughput(size: int, repeat: int) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from securetrain.crypto import _container as S
    from securetrain.crypto.keys import LocalKeyring

    data = bytearray(os.urandom(size))
    view = memoryview(data)
    aead = AESGCM(os.urandom(32))
    out = bytearray(SEG + 16)
    nonce = os.urandom(12)

    def raw_encrypt() -> None:
        for off in range(0, size, SEG):
            chunk = view[off:off + SEG]
            aead.encrypt_into(nonce, chunk, b"", memoryview(out)[: len(chunk) + 16])

    ring = LocalKeyring.create("bench")
    blob = S.encrypt_bytes(bytes(data), ring)

    plain_src, blob_src = io.BytesIO(bytes(data)), io.BytesIO(blob)  # built once: no page faults in timing

    def st_encrypt() -> None:
        plain_src.seek(0)
        S.encrypt_stream(plain_src, Sink(), ring, length=size)  # type: ignore[arg-type]

    def st_decrypt() -> None:
        blob_src.seek(0)
        S.decrypt_stream(blob_src, Sink(), ring)  # type: ignore[arg-type]

    gb = size / 1e9
    t_raw = best_of(raw_encrypt, repeat)
    t_enc = best_of(st_encrypt, repeat)
    t_dec = best_of(st_decrypt, repeat)
    print(f"[throughput] {size >> 20} MiB in memory, 1 MiB segments, best of {repeat}")
    print(f"  raw AESGCM.encrypt_into : {gb / t_raw:6.2f} GB/s   (baseline 1.00x)")
    print(f"  securetrain encrypt     : {gb / t_enc:6.2f} GB/s   ({t_raw / t_enc:.2f}x of raw)")
    print(f"  securetrain decrypt     : {gb / t_dec:6.2f} GB/s   ({t_raw / t_dec:.2f}x of raw)")


def checkpoint_times(size: int, repeat: int) -> None:
    import safetensors.torch
    import torch

    from securetrain.crypto.checkpoint import EncryptedCheckpointStore
    from securetrain.crypto.keys import LocalKeyring

    n = size // 4
    state = {f"layer{i}.weight": torch.randn(n // 8) for i in range(8)}
    ring = LocalKeyring.create("bench")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        plain = Path(tmp) / "plain.safetensors"

        def st_save() -> None:
            safetensors.torch.save_file(state, plain)
            with open(plain, "rb") as f:
                os.fsync(f.fileno())

        store = EncryptedCheckpointStore(Path(tmp) / "enc", ring)  # default: one SHA-256 pass, off-thread
        slow = EncryptedCheckpointStore(Path(tmp) / "enc", ring, digest=True)  # + tensor digest pre-pass
        noverify = EncryptedCheckpointStore(Path(tmp) / "enc", ring, verify_sha256=False)
        t_ss = best_of(st_save, repeat)
        def st_load() -> None:  # load_file maps lazily; touch every tensor so the bytes are really read
            for t in safetensors.torch.load_file(plain).values():
                t.sum()

        t_sl = best_of(st_load, repeat)
        # materialized baseline: read the file and build owned tensors (what we must do after decrypting)
        t_sb = best_of(lambda: safetensors.torch.load(plain.read_bytes()), repeat)
        t_es = best_of(lambda: store.save(1, state, {}), repeat)
        t_fs = best_of(lambda: slow.save(1, state, {}), repeat)
        store.save(1, state, {})
        t_el = best_of(lambda: store.load(), repeat)  # sidecar sha256 verified in the same pass
        t_fl = best_of(lambda: noverify.load(), repeat)  # AEAD only
    print(f"[checkpoint] {size >> 20} MiB fp32 state dict on disk, best of {repeat}")
    print(f"  safetensors save_file+fsync    : {t_ss:6.3f} s  (baseline)")
    print(f"  encrypted save (default)       : {t_es:6.3f} s  ({t_es / t_ss:.2f}x; target <= 1.20x)")
    print(f"  encrypted save (+tensor digest): {t_fs:6.3f} s  ({t_fs / t_ss:.2f}x)")
    print(f"  safetensors load_file+touch    : {t_sl:6.3f} s  (baseline; mmap of a page-cached file)")
    print(f"  safetensors load(read_bytes()) : {t_sb:6.3f} s  (baseline; owned tensors)")
    print(f"  encrypted load() (+sha256)     : {t_el:6.3f} s  ({t_el / t_sl:.2f}x mmap, {t_el / t_sb:.2f}x owned)")
    print(f"  encrypted load() (AEAD only)   : {t_fl:6.3f} s  ({t_fl / t_sl:.2f}x mmap, {t_fl / t_sb:.2f}x owned)")


RSS_CHILD = r"""
import json, os, resource, sys, torch
import safetensors.torch
from securetrain.crypto.keys import LocalKeyring, SecretKey
from securetrain.crypto.checkpoint import EncryptedCheckpointStore

mode, size, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ring = LocalKeyring([SecretKey("bench", bytes(32))], "bench")
store = EncryptedCheckpointStore(os.path.join(tmp, "enc"), ring)
if mode.endswith("save") or mode == "with-state":
    state = {f"layer{i}.weight": torch.ones(size // 32) for i in range(8)}
if mode == "safetensors.save":
    blob = safetensors.torch.save(state)
elif mode == "securetrain.save":
    store.save(1, state, {})
elif mode == "safetensors.load":
    loaded = safetensors.torch.load_file(os.path.join(tmp, "plain.safetensors"))
    total = sum(float(t.sum()) for t in loaded.values())  # touch every page
elif mode == "securetrain.load":
    loaded = store.load().tensors
# VmHWM is this process image's own high-water mark; ru_maxrss would also include the parent's
# RSS, which Linux carries across fork+exec into the child's rusage.
hwm = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
except OSError:
    pass
print(json.dumps({"maxrss_kib": hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def peak_rss(size: int) -> None:
    import safetensors.torch
    import torch

    from securetrain.crypto.checkpoint import EncryptedCheckpointStore
    from securetrain.crypto.keys import LocalKeyring, SecretKey

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        state = {f"layer{i}.weight": torch.ones(size // 32) for i in range(8)}
        safetensors.torch.save_file(state, Path(tmp) / "plain.safetensors")
        ring = LocalKeyring([SecretKey("bench", bytes(32))], "bench")
        EncryptedCheckpointStore(Path(tmp) / "enc", ring).save(1, state, {})
        del state
        rss = {}
        for mode in ("empty", "with-state", "safetensors.save", "securetrain.save", "safetensors.load",
                     "securetrain.load"):
            proc = subprocess.run([sys.executable, "-c", RSS_CHILD, mode, str(size), tmp], capture_output=True,
                                  text=True)
            if proc.returncode:
                sys.exit(f"RSS case {mode} failed:\n{proc.stderr[-3000:]}")
            out = proc.stdout
            rss[mode] = json.loads(out.strip().splitlines()[-1])["maxrss_kib"] * 1024
    mib = 1 << 20
    print(f"[peak RSS] {size >> 20} MiB state dict, fresh subprocess per case (VmHWM)")
    print(f"  interpreter + imports       : {rss['empty'] / mib:7.0f} MiB")
    print(f"  + state dict                : {rss['with-state'] / mib:7.0f} MiB  (baseline for saves)")
    for mode in ("safetensors.save", "securetrain.save"):
        extra = rss[mode] - rss["with-state"]
        print(f"  {mode:<27} : {rss[mode] / mib:7.0f} MiB  (+{extra / mib:.0f} MiB over baseline = "
              f"{extra / size:.2f}x payload)")
    for mode in ("safetensors.load", "securetrain.load"):
        extra = rss[mode] - rss["empty"]
        print(f"  {mode:<27} : {rss[mode] / mib:7.0f} MiB  (+{extra / mib:.0f} MiB over interpreter = "
              f"{extra / size:.2f}x payload)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, < 60 s")
    parser.add_argument("--size-mib", type=int, default=None, help="state dict size for the RSS test")
    args = parser.parse_args()
    tput = (64 if args.quick else 512) << 20
    ckpt = (64 if args.quick else 256) << 20
    rss = (args.size_mib or (128 if args.quick else 1024)) << 20
    repeat = 3 if args.quick else 5
    throughput(tput, repeat)
    checkpoint_times(ckpt, repeat)
    peak_rss(rss)


if __name__ == "__main__":
    main()
