"""The streaming AEAD container: round trips, limits, the test vector and every tamper case."""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import struct

import pytest

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.crypto import _container as S
from securetrain.crypto.errors import (
    HeaderAuthError,
    HeaderFormatError,
    KeyNotFoundError,
    LimitExceededError,
    SegmentAuthError,
    TrailingDataError,
    TruncatedError,
    WrongKeyError,
)
from securetrain.crypto.keys import LocalKeyring, SecretKey
from securetrain.errors import IntegrityError

SEG = 64
TAG = 16


class Pipe(io.RawIOBase):
    """A non-seekable source (like a socket or pipe) that also returns short reads."""

    def __init__(self, data: bytes, chunk: int = 7) -> None:
        self._b = io.BytesIO(data)
        self._chunk = chunk

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        view = memoryview(b)[: self._chunk]
        return self._b.readinto(view)


@pytest.fixture(scope="module")
def ring() -> LocalKeyring:
    return LocalKeyring([SecretKey("kek-a", os.urandom(32))], "kek-a")


def enc(data: bytes, ring: LocalKeyring, seg: int = SEG, **kw: object) -> bytes:
    return S.encrypt_bytes(data, ring, segment_size=seg, **kw)


def layout(blob: bytes) -> tuple[S.Header, list[tuple[int, int]]]:
    """Header and the (start, end) of each ciphertext segment."""
    h = S.read_header(io.BytesIO(blob))
    spans, pos = [], h.header_length
    left = h.plaintext_length
    for i in range(h.segment_count):
        n = min(left, h.segment_size) if i < h.segment_count - 1 else left
        spans.append((pos, pos + n + TAG))
        pos += n + TAG
        left -= n
    assert pos == len(blob)
    return h, spans


def flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


def collect(blob: bytes, ring: LocalKeyring, *, seekable: bool = True) -> tuple[bytes, Exception | None]:
    """Decrypt, returning what reached the destination before any error."""
    out = io.BytesIO()
    src = io.BytesIO(blob) if seekable else Pipe(blob)
    try:
        S.decrypt_stream(src, out, ring)  # type: ignore[arg-type]
    except IntegrityError as exc:
        return out.getvalue(), exc
    return out.getvalue(), None


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, SEG - 1, SEG, SEG + 1, 3 * SEG, 3 * SEG + 5, 1000])
def test_round_trip_sizes(ring: LocalKeyring, size: int) -> None:
    data = os.urandom(size)
    blob = enc(data, ring)
    h, spans = layout(blob)
    assert h.segment_count == max(1, -(-size // SEG))
    assert len(blob) == h.header_length + size + TAG * h.segment_count
    assert S.decrypt_bytes(blob, ring) == data
    got, err = collect(blob, ring, seekable=False)
    assert err is None and got == data


def test_exact_multiple_has_full_final_segment(ring: LocalKeyring) -> None:
    blob = enc(b"x" * (2 * SEG), ring)
    _, spans = layout(blob)
    assert [e - s for s, e in spans] == [SEG + TAG, SEG + TAG]


def test_default_segment_is_1mib_and_large_stream_round_trips(ring: LocalKeyring, tmp_path) -> None:
    data = os.urandom(3 * (1 << 20) + 12345)
    src, dst, back = tmp_path / "p", tmp_path / "c", tmp_path / "b"
    src.write_bytes(data)
    h = S.encrypt_file(src, dst, ring)
    assert h.segment_size == 1 << 20 and h.segment_count == 4
    assert (dst.stat().st_mode & 0o777) == 0o600
    audit = MemoryAuditRecorder()
    S.decrypt_file(dst, back, ring, audit=audit)
    assert back.read_bytes() == data
    assert audit.events[0]["action"] == "container.decrypt" and audit.events[0]["details"]["key_id"] == "kek-a"
    broken = tmp_path / "broken"
    broken.write_bytes(flip(dst.read_bytes(), 500))
    with pytest.raises(SegmentAuthError):
        S.decrypt_file(broken, tmp_path / "never", ring, audit=audit)
    assert not (tmp_path / "never").exists()
    assert audit.events[-1]["outcome"] == "failure"


def test_writer_accepts_arbitrary_write_sizes(ring: LocalKeyring) -> None:
    data = os.urandom(10 * SEG + 3)
    out = io.BytesIO()
    w = S.EncryptingWriter(out, ring, len(data), segment_size=SEG)
    pos = 0
    for step in [1, 63, 64, 65, 200, 3, 128]:
        w.write(memoryview(data)[pos:pos + step])
        pos += step
    w.write(data[pos:])
    w.close()
    assert S.decrypt_bytes(out.getvalue(), ring) == data


def test_writer_refuses_wrong_length(ring: LocalKeyring) -> None:
    w = S.EncryptingWriter(io.BytesIO(), ring, 10, segment_size=SEG)
    w.write(b"12345")
    with pytest.raises(TruncatedError):
        w.close()
    with pytest.raises(LimitExceededError):
        S.EncryptingWriter(io.BytesIO(), ring, 3, segment_size=SEG).write(b"1234")


def test_fresh_randomness_per_file(ring: LocalKeyring) -> None:
    a, b = enc(b"same", ring), enc(b"same", ring)
    ha, hb = S.read_header(io.BytesIO(a)), S.read_header(io.BytesIO(b))
    assert ha.salt != hb.salt and ha.nonce_prefix != hb.nonce_prefix and a[-20:] != b[-20:]


def test_associated_data_is_bound(ring: LocalKeyring) -> None:
    blob = enc(b"payload", ring, associated_data=b"ctx-1")
    assert S.decrypt_bytes(blob, ring, associated_data=b"ctx-1") == b"payload"
    with pytest.raises(SegmentAuthError):
        S.decrypt_bytes(blob, ring, associated_data=b"ctx-2")


# -- NIST / counter limits ----------------------------------------------------------------------

def test_segment_counter_overflow_raises(ring: LocalKeyring) -> None:
    with pytest.raises(LimitExceededError, match="2\\^32"):
        S.EncryptingWriter(io.BytesIO(), ring, (1 << 32) * 16 + 1, segment_size=16)
    S.EncryptingWriter(io.BytesIO(), ring, (1 << 32) * 16, segment_size=16)  # exactly 2^32 segments is fine


def test_gcm_limit_constant() -> None:
    assert S.GCM_MAX_PLAINTEXT_BYTES == (2**39 - 256) // 8
    assert S.MAX_SEGMENT_SIZE + 0 <= S.GCM_MAX_PLAINTEXT_BYTES
    with pytest.raises(LimitExceededError):
        S.EncryptingWriter(io.BytesIO(), LocalKeyring.create("k"), 1, segment_size=S.MAX_SEGMENT_SIZE + 1)


def test_header_declaring_too_many_segments_is_refused(ring: LocalKeyring) -> None:
    blob = bytearray(enc(b"abc", ring, seg=16))
    struct.pack_into(">Q", blob, 14, (1 << 32) * 16 + 1)
    with pytest.raises(HeaderFormatError):
        S.decrypt_bytes(bytes(blob), ring)


# -- the documented test vector --------------------------------------------------------------

VECTOR_KEK = bytes(range(32))
VECTOR_DATA_KEY = bytes([0x11]) * 32
VECTOR_SALT = bytes(range(32, 64))
VECTOR_PREFIX = bytes.fromhex("a0a1a2a3a4a5a6")
VECTOR_PLAINTEXT = b"securetrain test vector: 40 bytes long!!"
VECTOR_HEX = (
    "895354454e430d0a0101000000100000000000000028202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "a0a1a2a3a4a5a60108746573742d6b656b01512e918b222230e20028801b521d957e5a3602bd18a3b11512cc9fb0822dd0d3496912"
    "3da8b1dab7e8072a5be56ec9b7f4c908e8f51c7c3652915ac7127cad4707a5307ff1776fa5cc7fb4b77d791e7c013731d869788d3c"
    "30476db1b8465750d6fafadcaca2d3c45ce69968641e3e78f448dfb5142d0951b65185cadc68f84016d99b791c3cd157f16083e98a"
    "bdeeec3883295677041bd19e118418253540a1bb151fc856f9a2526f54f3326578a7e0a40d52b422e6e1fb66befb869f5fea48fb4e"
    "63453ca4bb37a82f"
)


VECTOR_CONTEXT = b'{"step":7,"store":"test-store"}'
VECTOR_SIGNER_SEED = bytes(range(64, 96))
VECTOR_V2_HEX = (
    "895354454e430d0a0201000000100000000000000028202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "a0a1a2a3a4a5a601001f7b2273746570223a372c2273746f7265223a22746573742d73746f7265227d0108746573742d6b656b01512e"
    "918b222230e20028801b521d957e5a3602bd18a3b11512cc9fb0822dd0d34969123da8b1dab7e8072a5be56ec9b7f4c908e8f51c7c36"
    "52915ac7127cad4707a5307ff1776fa5cc7fb4b77d791e7c013700165b0f142ebb9660e144022a3c27e3ec94e245b6e9eac3a333a9d1"
    "d015afdfdfb5142d0951b65185cadc68f84016d9d9e71185f3272065eaa84f7f728dc1a4295677041bd19e118418253540a1bb155d56"
    "5b408022be519a73a0ba3b815d2a52b422e6e1fb66beb91892e6c8382a4b0a04f9662756510818380a74234dadad0e9275f9fcfd8e9b"
    "46f8e1eca3f2319f508e057aaec8176b5c4b19cad1d45cbc8b10ebafe86e6091cc823ca0e66b2ef1e30073490aaa8d6dbbc32164356a"
    "3b0a"
)


def _vector_ring() -> LocalKeyring:
    return LocalKeyring([SecretKey("test-kek", VECTOR_KEK, created=0)], "test-kek")


def test_vector_byte_for_byte() -> None:
    """The v1 vector: files written before v2 stay readable; the writer can still produce v1 for tests."""
    out = io.BytesIO()
    w = S.EncryptingWriter(out, _vector_ring(), len(VECTOR_PLAINTEXT), segment_size=16,
                           _fixed_randomness=(VECTOR_DATA_KEY, VECTOR_SALT, VECTOR_PREFIX), _version=1)
    w.write(VECTOR_PLAINTEXT)
    w.close()
    assert out.getvalue().hex() == VECTOR_HEX
    assert S.decrypt_bytes(bytes.fromhex(VECTOR_HEX), _vector_ring()) == VECTOR_PLAINTEXT


def test_vector_independent_decoder() -> None:
    """Decode the vector with nothing but the spec in docs/checkpoint-format.md and `cryptography`."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.hazmat.primitives.keywrap import aes_key_unwrap

    blob = bytes.fromhex(VECTOR_HEX)
    fixed = blob[:61]
    magic, version, alg, seg, length, salt, prefix = struct.unpack(">8sBBIQ32s7s", fixed)
    assert (magic, version, alg, seg, length) == (b"\x89STENC\r\n", 1, 1, 16, 40)
    pos = 61
    count = blob[pos]
    pos += 1
    assert count == 1
    klen = blob[pos]
    key_id = blob[pos + 1:pos + 1 + klen].decode()
    pos += 1 + klen
    wrap_alg, fp = blob[pos], blob[pos + 1:pos + 9]
    (wlen,) = struct.unpack(">H", blob[pos + 9:pos + 11])
    wrapped = blob[pos + 11:pos + 11 + wlen]
    pos += 11 + wlen
    commitment, mac = blob[pos:pos + 32], blob[pos + 32:pos + 64]
    body_end = pos + 32
    pos += 64
    assert key_id == "test-kek" and wrap_alg == 1
    assert fp == hashlib.sha256(b"securetrain kek fingerprint v1\x00" + VECTOR_KEK).digest()[:8]
    dk = aes_key_unwrap(VECTOR_KEK, wrapped)

    def hk(label: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt, b"securetrain-stream-v1 " + label).derive(dk)

    assert hk(b"commitment") == commitment
    assert hmac.new(hk(b"header-mac"), blob[:body_end], hashlib.sha256).digest() == mac
    aad = hashlib.sha256(fixed + struct.pack(">Q", 0)).digest()
    aead, out, i = AESGCM(hk(b"payload")), b"", 0
    while pos < len(blob):
        n = min(seg, length - len(out))
        last = len(out) + n == length
        out += aead.decrypt(prefix + struct.pack(">IB", i, last), blob[pos:pos + n + 16], aad)
        pos += n + 16
        i += 1
    assert out == VECTOR_PLAINTEXT


def test_vector_v2_byte_for_byte() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signer = Ed25519PrivateKey.from_private_bytes(VECTOR_SIGNER_SEED)
    out = io.BytesIO()
    w = S.EncryptingWriter(out, _vector_ring(), len(VECTOR_PLAINTEXT), segment_size=16, context=VECTOR_CONTEXT,
                           signer=signer, _fixed_randomness=(VECTOR_DATA_KEY, VECTOR_SALT, VECTOR_PREFIX))
    w.write(VECTOR_PLAINTEXT)
    w.close()
    assert out.getvalue().hex() == VECTOR_V2_HEX
    blob = bytes.fromhex(VECTOR_V2_HEX)
    assert S.decrypt_bytes(blob, _vector_ring(), verify_keys=[signer.public_key()]) == VECTOR_PLAINTEXT
    h = S.read_header(io.BytesIO(blob))
    assert (h.version, h.flags, h.context, h.header_length, h.total_length) == (2, 1, VECTOR_CONTEXT, 220, 380)


def test_vector_v2_independent_decoder() -> None:
    """Decode and verify the v2 vector from docs/checkpoint-format.md alone."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.hazmat.primitives.keywrap import aes_key_unwrap
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    blob = bytes.fromhex(VECTOR_V2_HEX)
    magic, version, alg, seg, length, salt, prefix = struct.unpack(">8sBBIQ32s7s", blob[:61])
    flags, clen = struct.unpack(">BH", blob[61:64])
    assert (magic, version, alg, seg, length, flags) == (b"\x89STENC\r\n", 2, 1, 16, 40, 1)
    fixed = blob[:64 + clen]
    assert fixed[64:] == VECTOR_CONTEXT
    pos = 64 + clen
    assert blob[pos] == 1
    klen = blob[pos + 1]
    pos += 2 + klen
    (wlen,) = struct.unpack(">H", blob[pos + 9:pos + 11])
    wrapped = blob[pos + 11:pos + 11 + wlen]
    pos += 11 + wlen
    commitment, mac = blob[pos:pos + 32], blob[pos + 32:pos + 64]
    assert hmac.new(_hk(aes_key_unwrap(VECTOR_KEK, wrapped), salt, b"header-mac"), blob[:pos + 32],
                    hashlib.sha256).digest() == mac
    pos += 64
    dk = aes_key_unwrap(VECTOR_KEK, wrapped)
    assert _hk(dk, salt, b"commitment") == commitment
    n = max(1, -(-length // seg))
    seg_end = pos + length + 16 * n
    aead, out = AESGCM(_hk(dk, salt, b"payload")), b""
    aad = hashlib.sha256(fixed + struct.pack(">Q", 0)).digest()
    for i in range(n):
        size = min(seg, length - len(out))
        out += aead.decrypt(prefix + struct.pack(">IB", i, i == n - 1), blob[pos:pos + size + 16], aad)
        pos += size + 16
    assert out == VECTOR_PLAINTEXT and pos == seg_end and len(blob) == seg_end + 72
    public = Ed25519PrivateKey.from_private_bytes(VECTOR_SIGNER_SEED).public_key()
    raw_pub = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    fp, sig = blob[seg_end:seg_end + 8], blob[seg_end + 8:]
    assert fp == hashlib.sha256(b"securetrain signer fingerprint v1\x00" + raw_pub).digest()[:8]
    seg_sha = hashlib.sha256(blob[220:seg_end]).digest()
    public.verify(sig, b"securetrain-container-signature-v2\x00" + fixed + commitment + seg_sha)
    del hashes, HKDF


def _hk(dk: bytes, salt: bytes, label: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(hashes.SHA256(), 32, salt, b"securetrain-stream-v1 " + label).derive(dk)


# -- v2: context and signatures ----------------------------------------------------------------


def test_context_is_authenticated_and_bound_into_segments(ring: LocalKeyring) -> None:
    blob = S.encrypt_bytes(b"x" * 200, ring, segment_size=64, context=b"store=a;step=1")
    h = S.read_header(io.BytesIO(blob))
    assert h.context == b"store=a;step=1" and h.version == 2
    forged = bytearray(blob)
    forged[64 + 6] ^= 1  # inside the context
    with pytest.raises(HeaderAuthError):
        S.decrypt_bytes(bytes(forged), ring)


def test_signature_required_missing_unknown_and_forged(ring: LocalKeyring) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from securetrain.crypto.errors import SignatureError

    writer, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    data = os.urandom(500)
    signed = S.encrypt_bytes(data, ring, segment_size=64, signer=writer)
    assert S.decrypt_bytes(signed, ring, verify_keys=[other.public_key(), writer.public_key()]) == data
    assert S.decrypt_bytes(signed, ring) == data  # a reader without verify keys still reads it
    unsigned = S.encrypt_bytes(data, ring, segment_size=64)
    with pytest.raises(SignatureError, match="not signed"):
        S.decrypt_bytes(unsigned, ring, verify_keys=[writer.public_key()])
    with pytest.raises(SignatureError, match="unknown key"):
        S.decrypt_bytes(signed, ring, verify_keys=[other.public_key()])
    # Anyone holding the data key can re-encrypt different content under a valid header and MAC,
    # but cannot sign it: re-sign the original trailer onto new content -> refused.
    replaced = S.encrypt_bytes(os.urandom(500), ring, segment_size=64, signer=other)
    frank = replaced[:-72] + signed[-72:]
    with pytest.raises(SignatureError):
        S.decrypt_bytes(frank, ring, verify_keys=[writer.public_key()])
    bad = bytearray(signed)
    bad[-1] ^= 1
    out = io.BytesIO()
    with pytest.raises(SignatureError, match="does not verify"):
        S.decrypt_stream(io.BytesIO(bytes(bad)), out, ring, verify_keys=[writer.public_key()])
    with pytest.raises(TruncatedError):
        S.decrypt_bytes(signed[:-10], ring)
    with pytest.raises(TrailingDataError):
        S.decrypt_bytes(signed + b"x", ring)


def test_rewrap_keeps_signature_valid(tmp_path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ring = LocalKeyring.create("k-old")
    writer = Ed25519PrivateKey.generate()
    path = tmp_path / "s.stenc"
    path.write_bytes(S.encrypt_bytes(b"payload" * 100, ring, segment_size=64, signer=writer, context=b"ctx"))
    ring.rotate("k-new")
    S.rewrap_file(path, ring)
    assert S.inspect_file(path).key_ids == ["k-new"]
    assert S.decrypt_bytes(path.read_bytes(), ring, verify_keys=[writer.public_key()]) == b"payload" * 100


def test_v1_file_still_reads(ring: LocalKeyring) -> None:
    out = io.BytesIO()
    with S.EncryptingWriter(out, ring, 100, segment_size=64, _version=1) as w:
        w.write(b"v" * 100)
    assert S.read_header(io.BytesIO(out.getvalue())).version == 1
    assert S.decrypt_bytes(out.getvalue(), ring) == b"v" * 100


# -- tampering ---------------------------------------------------------------------------------

DATA = bytes(range(256)) * 1 + b"tail-bytes"  # 266 bytes -> segments of 64,64,64,64,10


@pytest.fixture()
def blob(ring: LocalKeyring) -> bytes:
    return enc(DATA, ring)


def test_every_header_byte_is_authenticated(ring: LocalKeyring, blob: bytes) -> None:
    h, _ = layout(blob)
    for at in range(h.header_length):
        got, err = collect(flip(blob, at), ring)
        assert isinstance(err, (HeaderAuthError, WrongKeyError, TruncatedError)), (at, err)
        assert got == b"", at


def test_header_region_errors(ring: LocalKeyring, blob: bytes) -> None:
    h, _ = layout(blob)
    with pytest.raises(HeaderFormatError, match="magic"):
        S.decrypt_bytes(flip(blob, 0), ring)
    with pytest.raises(HeaderFormatError, match="version"):
        S.decrypt_bytes(flip(blob, 8), ring)
    with pytest.raises(HeaderAuthError):  # segment size 64 -> 65: valid value, MAC catches it
        S.decrypt_bytes(flip(blob, 13), ring)
    with pytest.raises(HeaderAuthError):  # declared plaintext length
        S.decrypt_bytes(flip(blob, 21), ring)
    with pytest.raises(HeaderAuthError):  # nonce prefix
        S.decrypt_bytes(flip(blob, 56), ring)
    with pytest.raises(WrongKeyError, match="commitment"):  # salt: derived keys change
        S.decrypt_bytes(flip(blob, 30), ring)
    with pytest.raises(WrongKeyError):  # wrapped data key
        S.decrypt_bytes(flip(blob, h.header_length - 64 - 5), ring)
    with pytest.raises(WrongKeyError, match="commitment"):
        S.decrypt_bytes(flip(blob, h.header_length - 40), ring)
    with pytest.raises(HeaderAuthError, match="modified"):  # header MAC itself
        S.decrypt_bytes(flip(blob, h.header_length - 1), ring)


@pytest.mark.parametrize("seekable", [True, False])
def test_flip_in_each_segment_body_and_tag(ring: LocalKeyring, blob: bytes, seekable: bool) -> None:
    _, spans = layout(blob)
    for i, (s, e) in enumerate(spans):
        for at in (s, (s + e) // 2, e - TAG - 1, e - TAG, e - 1):  # body start/middle/end, tag start/end
            got, err = collect(flip(blob, at), ring, seekable=seekable)
            assert isinstance(err, SegmentAuthError), (i, at, err)
            assert f"segment {i} " in str(err)
            assert got == DATA[: i * SEG], "plaintext of the failing segment must never be released"


def test_drop_last_segment(ring: LocalKeyring, blob: bytes) -> None:
    _, spans = layout(blob)
    cut = blob[: spans[-1][0]]
    got, err = collect(cut, ring)
    assert isinstance(err, TruncatedError) and got == b""
    got, err = collect(cut, ring, seekable=False)
    assert isinstance(err, TruncatedError)
    assert got == DATA[: 4 * SEG]  # only fully verified segments, then the error


def test_truncated_mid_segment_and_mid_header(ring: LocalKeyring, blob: bytes) -> None:
    _, spans = layout(blob)
    for cut in (spans[2][0] + 5, len(blob) - 1, 10, 100):
        got, err = collect(blob[:cut], ring)
        assert isinstance(err, TruncatedError), cut
        assert got == b""
        _, err = collect(blob[:cut], ring, seekable=False)
        assert isinstance(err, TruncatedError), cut


def test_empty_file_and_garbage(ring: LocalKeyring) -> None:
    with pytest.raises(TruncatedError):
        S.decrypt_bytes(b"", ring)
    with pytest.raises(HeaderFormatError):
        S.decrypt_bytes(b"PK\x03\x04" + os.urandom(200), ring)


@pytest.mark.parametrize("seekable", [True, False])
def test_swap_two_segments(ring: LocalKeyring, blob: bytes, seekable: bool) -> None:
    _, sp = layout(blob)
    swapped = blob[: sp[1][0]] + blob[sp[2][0]:sp[2][1]] + blob[sp[1][0]:sp[1][1]] + blob[sp[3][0]:]
    got, err = collect(swapped, ring, seekable=seekable)
    assert isinstance(err, SegmentAuthError) and "segment 1 " in str(err)
    assert got == DATA[:SEG]


def test_duplicate_segment(ring: LocalKeyring, blob: bytes) -> None:
    _, sp = layout(blob)
    seg1 = blob[sp[1][0]:sp[1][1]]
    inserted = blob[: sp[2][0]] + seg1 + blob[sp[2][0]:]
    got, err = collect(inserted, ring)  # seekable: extra bytes noticed before any decryption
    assert isinstance(err, TrailingDataError) and got == b""
    got, err = collect(inserted, ring, seekable=False)
    assert isinstance(err, SegmentAuthError) and "segment 2 " in str(err)
    replaced = blob[: sp[2][0]] + seg1 + blob[sp[3][0]:]  # same length: counter in the nonce catches it
    got, err = collect(replaced, ring)
    assert isinstance(err, SegmentAuthError) and got == DATA[: 2 * SEG]


@pytest.mark.parametrize("seekable", [True, False])
def test_data_after_final_segment(ring: LocalKeyring, blob: bytes, seekable: bool) -> None:
    _, sp = layout(blob)
    for extra in (blob[sp[0][0]:sp[0][1]], blob[sp[-1][0]:], b"\x00", os.urandom(1000)):
        got, err = collect(blob + extra, ring, seekable=seekable)
        assert isinstance(err, TrailingDataError), err
        assert got == (b"" if seekable else DATA[: 4 * SEG]), "final segment released despite trailing data"


def test_segment_from_another_file_is_rejected(ring: LocalKeyring, blob: bytes) -> None:
    other = enc(DATA, ring)
    _, sp = layout(blob)
    _, so = layout(other)
    spliced = blob[: sp[1][0]] + other[so[1][0]:so[1][1]] + blob[sp[1][1]:]
    _, err = collect(spliced, ring)
    assert isinstance(err, SegmentAuthError)


def test_wrong_key_same_id(blob: bytes) -> None:
    impostor = LocalKeyring([SecretKey("kek-a", os.urandom(32))], "kek-a")
    got, err = collect(blob, impostor)
    assert isinstance(err, WrongKeyError) and not isinstance(err, KeyNotFoundError) and got == b""


def test_unknown_key_id(blob: bytes) -> None:
    with pytest.raises(KeyNotFoundError, match="kek-a"):
        S.decrypt_bytes(blob, LocalKeyring.create("other"))


def test_key_commitment_rejects_substituted_data_key(ring: LocalKeyring, blob: bytes) -> None:
    """An attacker who can wrap keys for us swaps in another data key and a matching header MAC.

    The commitment (derived from the *original* data key) no longer matches: refused up front.
    """
    h = S.read_header(io.BytesIO(blob))
    evil_dk = os.urandom(32)
    stanza = S.Stanza("kek-a", 1, h.stanzas[0].fingerprint, ring.wrap("kek-a", evil_dk))
    keys = S.derive_keys(evil_dk, h.salt)
    body = h.fixed + bytes([1]) + stanza.encode() + h.commitment
    forged = body + hmac.new(keys.mac_key, body, hashlib.sha256).digest() + blob[h.header_length:]
    got, err = collect(forged, ring)
    assert isinstance(err, WrongKeyError) and "commitment" in str(err) and got == b""


def test_inspect_needs_no_key_and_shows_no_secrets(ring: LocalKeyring, blob: bytes, tmp_path) -> None:
    p = tmp_path / "c.stenc"
    p.write_bytes(blob)
    info = S.inspect_file(p).describe()
    assert info["segment_size"] == SEG and info["plaintext_bytes"] == len(DATA)
    text = repr(info)
    h = S.read_header(io.BytesIO(blob))
    assert h.stanzas[0].wrapped.hex() not in text and h.commitment.hex() not in text


@pytest.mark.parametrize("chunk", [1, 7, SEG - 1, SEG, SEG + 1, 3 * SEG, 10_000])
def test_reader_readinto_any_chunking(ring: LocalKeyring, blob: bytes, chunk: int) -> None:
    reader = S.DecryptingReader(io.BytesIO(blob), ring)
    out = bytearray()
    buf = bytearray(chunk)
    while n := reader.readinto(buf):
        out += buf[:n]
    assert bytes(out) == DATA and reader.finished


def test_in_place_decrypt_wipes_caller_buffer_on_failure(ring: LocalKeyring, blob: bytes) -> None:
    _, spans = layout(blob)
    bad = flip(blob, spans[1][0] + 3)
    reader = S.DecryptingReader(io.BytesIO(bad), ring)
    buf = bytearray(b"\xaa" * (4 * SEG))
    with pytest.raises(SegmentAuthError):
        reader.readinto(buf)
    assert bytes(buf[:SEG]) == DATA[:SEG]  # segment 0 verified
    assert bytes(buf[SEG:2 * SEG]) == bytes(SEG), "unverified plaintext of segment 1 must be wiped"


def test_key_id_with_control_characters_is_refused(ring: LocalKeyring) -> None:
    blob = bytearray(enc(b"x", ring))
    blob[len(S.read_header(io.BytesIO(bytes(blob))).fixed) + 2] = 0x1B  # first key id byte -> ESC
    with pytest.raises(HeaderFormatError, match="key id"):
        S.read_header(io.BytesIO(bytes(blob)))


class _FlakySink(io.RawIOBase):
    """A non-blocking socket-like sink: the first segment write is accepted only partly."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.writes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        self.writes += 1
        if self.writes == 2:  # header went through; the first segment is cut after 10 bytes
            self.data += bytes(b)[:10]
            raise BlockingIOError(11, "would block", 10)
        self.data += bytes(b)
        return len(b)


def test_writer_is_unusable_after_a_failed_write(ring: LocalKeyring) -> None:
    # Retrying after a failed write would encrypt new plaintext under the same (key, nonce) as the
    # ciphertext already partly sent: GCM then leaks the XOR of the plaintexts and its auth key.
    sink = _FlakySink()
    w = S.EncryptingWriter(sink, ring, 2 * SEG, segment_size=SEG)
    with pytest.raises(BlockingIOError):
        w.write(b"A" * SEG)
    sent = len(sink.data)
    for retry in (lambda: w.write(b"B" * SEG), lambda: w.write(b"A" * SEG), lambda: w.fill_from(io.BytesIO(b"C" * SEG))):
        with pytest.raises(ValueError, match="failed"):
            retry()
    with pytest.raises(ValueError, match="failed"):
        w.close()
    assert len(sink.data) == sent  # nothing more was encrypted or emitted


def test_flipped_wrapped_len_is_typed_for_every_bit(ring: LocalKeyring) -> None:
    blob = enc(os.urandom(266), ring)
    h = S.read_header(io.BytesIO(blob))
    at = len(h.fixed) + 1 + 1 + len(h.stanzas[0].key_id) + 1 + 8  # count, id len, id, wrap_alg, fingerprint
    assert struct.unpack(">H", blob[at:at + 2])[0] == len(h.stanzas[0].wrapped)
    for bit in range(16):
        bad = bytearray(blob)
        bad[at + (1 - bit // 8)] ^= 1 << (bit % 8)
        got, err = collect(bytes(bad), ring)
        assert isinstance(err, (WrongKeyError, TruncatedError, HeaderFormatError)), (bit, err)
        assert got == b""


@pytest.mark.parametrize("length", [266, 256])  # short final segment / full final segment
def test_full_segment_copied_over_the_final_one(ring: LocalKeyring, length: int) -> None:
    blob = enc(os.urandom(length), ring)
    h = S.read_header(io.BytesIO(blob))
    full = blob[h.header_length:h.header_length + SEG + TAG]
    bad = blob[:h.header_length + (h.segment_count - 1) * (SEG + TAG)] + full
    with pytest.raises(TrailingDataError if length % SEG else SegmentAuthError):
        S.decrypt_bytes(bad, ring)
    with pytest.raises(SegmentAuthError):
        S.decrypt_stream(Pipe(bad), io.BytesIO(), ring)


def test_unknown_wrap_alg_is_refused(ring: LocalKeyring) -> None:
    blob = bytearray(enc(b"x", ring))
    h = S.read_header(io.BytesIO(bytes(blob)))
    blob[len(h.fixed) + 2 + len(h.stanzas[0].key_id)] = 7
    with pytest.raises(HeaderFormatError, match="wrap_alg"):
        S.decrypt_bytes(bytes(blob), ring)


def test_key_id_with_trailing_newline_is_refused(ring: LocalKeyring) -> None:
    blob = bytearray(enc(b"x", ring))
    h = S.read_header(io.BytesIO(bytes(blob)))
    kid_at = len(h.fixed) + 2
    blob[kid_at + len(h.stanzas[0].key_id) - 1] = 0x0A  # last key id byte -> "\n"
    with pytest.raises(HeaderFormatError, match="key id"):
        S.read_header(io.BytesIO(bytes(blob)))
