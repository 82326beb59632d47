"""`securetrain checkpoint ...` / `securetrain keys ...` through typer's runner."""

from __future__ import annotations

import io
import json
import os

import pytest
import typer
from typer.testing import CliRunner

from securetrain.crypto import _container as S
from securetrain.crypto import cli as crypto_cli
from securetrain.crypto.errors import HeaderAuthError, KeyNotFoundError, KeyringPermissionError, SegmentAuthError
from securetrain.crypto.keys import LocalKeyring

PASS = "cli passphrase 123"


@pytest.fixture()
def app() -> typer.Typer:
    root = typer.Typer()

    @root.callback()
    def _cb() -> None:  # force sub-command mode
        pass

    crypto_cli.register(root)
    return root


@pytest.fixture()
def env(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    monkeypatch.delenv("SECURETRAIN_KEK", raising=False)
    monkeypatch.setattr("securetrain.crypto.keys.SCRYPT_DEFAULT_LOG2_N", 10)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(app: typer.Typer, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(args), catch_exceptions=True)


def test_keys_and_checkpoint_workflow(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    r = run(app, "keys", "init", "--keyring", str(kr), "--key-id", "k1")
    assert r.exit_code == 0, r.output
    assert (kr.stat().st_mode & 0o777) == 0o600
    material = LocalKeyring.load(kr).keys()[0].material()
    assert run(app, "keys", "init", "--keyring", str(kr)).exception is not None  # no silent overwrite

    plain = env / "weights.bin"
    data = os.urandom(3 * 65536 + 17)
    plain.write_bytes(data)
    r = run(app, "checkpoint", "encrypt", str(plain), "w.stenc", "-k", str(kr), "--segment-size", "65536")
    assert r.exit_code == 0, r.output
    r = run(app, "checkpoint", "inspect", "w.stenc", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["segment_size"] == 65536 and info["segments"] == 4 and info["keys"][0]["key_id"] == "k1"
    assert material.hex() not in r.output
    assert run(app, "checkpoint", "verify", "w.stenc", "-k", str(kr)).exit_code == 0

    before = (env / "w.stenc").read_bytes()
    r = run(app, "keys", "rotate", "-k", str(kr), "--key-id", "k2", "--rewrap", str(env), "--remove-old")
    assert r.exit_code == 0, r.output
    after = (env / "w.stenc").read_bytes()
    assert before[-1000:] == after[-1000:] and S.inspect_file(env / "w.stenc").key_ids == ["k2"]
    r = run(app, "keys", "list", "-k", str(kr))
    assert "k2" in r.output and "k1" not in r.output and material.hex() not in r.output

    r = run(app, "checkpoint", "decrypt", "w.stenc", "out.bin", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert (env / "out.bin").read_bytes() == data


def test_verify_and_decrypt_fail_closed(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    blob = bytearray(S.encrypt_bytes(os.urandom(5000), ring, segment_size=1024))
    blob[-100] ^= 1
    (env / "bad.stenc").write_bytes(bytes(blob))
    r = run(app, "checkpoint", "verify", "bad.stenc", "-k", str(kr))
    assert isinstance(r.exception, SegmentAuthError)
    r = run(app, "checkpoint", "decrypt", "bad.stenc", "out.bin", "-k", str(kr))
    assert isinstance(r.exception, SegmentAuthError)
    assert not (env / "out.bin").exists(), "no partial plaintext on failure"
    assert not [p for p in env.iterdir() if p.name.endswith(".tmp")]
    blob[20] ^= 1
    (env / "bad.stenc").write_bytes(bytes(blob))
    assert isinstance(run(app, "checkpoint", "verify", "bad.stenc", "-k", str(kr)).exception, HeaderAuthError)


def test_cli_refuses_unsafe_keyring_and_unknown_key(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    other = env / "other.json"
    assert run(app, "keys", "init", "-k", str(other)).exit_code == 0
    (env / "p").write_bytes(b"x" * 10)
    assert run(app, "checkpoint", "encrypt", "p", "c.stenc", "-k", str(kr)).exit_code == 0
    assert isinstance(run(app, "checkpoint", "verify", "c.stenc", "-k", str(other)).exception, KeyNotFoundError)
    os.chmod(kr, 0o644)
    assert isinstance(run(app, "keys", "list", "-k", str(kr)).exception, KeyringPermissionError)


def test_help_is_cheap() -> None:
    import subprocess
    import sys

    code = ("import sys, typer; from securetrain.crypto import cli; "
            "bad = [m for m in ('torch', 'cryptography', 'prefect', 'safetensors') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_signatures_and_os_errors_are_typed(app: typer.Typer, env, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from securetrain.crypto.errors import CryptoError, SignatureError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    writer = Ed25519PrivateKey.generate()
    pub = writer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    (env / "s.stenc").write_bytes(S.encrypt_bytes(b"signed payload", ring, signer=writer))
    (env / "u.stenc").write_bytes(S.encrypt_bytes(b"unsigned payload", ring))
    assert run(app, "checkpoint", "verify", "s.stenc", "-k", str(kr), "--signer-key", pub).exit_code == 0
    r = run(app, "checkpoint", "verify", "u.stenc", "-k", str(kr), "--signer-key", pub)
    assert isinstance(r.exception, SignatureError)
    r = run(app, "checkpoint", "decrypt", "u.stenc", "out.bin", "-k", str(kr), "--signer-key", pub)
    assert isinstance(r.exception, SignatureError) and not (env / "out.bin").exists()
    assert isinstance(run(app, "checkpoint", "verify", "s.stenc", "-k", str(kr), "--signer-key", "zz").exception,
                      SignatureError)
    info = json.loads(run(app, "checkpoint", "inspect", "s.stenc", "--json").output)
    assert info["signed"] is True and info["format_version"] == 2
    (env / "ro").mkdir()
    os.chmod(env / "ro", 0o500)
    try:
        r = run(app, "checkpoint", "decrypt", "s.stenc", str(env / "ro" / "x" / "out.bin"), "-k", str(kr))
        if os.geteuid() != 0:  # root may write anyway
            assert isinstance(r.exception, CryptoError), r.exception
    finally:
        os.chmod(env / "ro", 0o700)
    r = run(app, "checkpoint", "decrypt", "s.stenc", str(env / "s.stenc" / "out.bin"), "-k", str(kr))
    assert isinstance(r.exception, CryptoError), r.exception  # parent is a file: ENOTDIR, typed


@pytest.mark.parametrize("command", ["encrypt", "decrypt"])
def test_output_that_is_a_directory_is_refused_up_front_naming_it(app: typer.Typer, env, command: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """OUT an existing directory: one typed error naming OUT (not an internal temp name), before any work,
    nothing left in or next to it. Both the O_TMPFILE and the named-temp writer."""
    from securetrain.crypto import private_file
    from securetrain.crypto.errors import CryptoError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    (env / "plain.bin").write_bytes(os.urandom(1000))
    assert run(app, "checkpoint", "encrypt", "plain.bin", "c.stenc", "-k", str(kr)).exit_code == 0
    source = "plain.bin" if command == "encrypt" else "c.stenc"
    streamed: list[str] = []
    monkeypatch.setattr(crypto_cli, "_run_stream", lambda *a, **k: streamed.append("x"))
    for use_tmpfile in (True, False):
        monkeypatch.setattr(private_file, "USE_O_TMPFILE", use_tmpfile)
        (env / "outdir").mkdir()
        before = sorted(p.name for p in env.iterdir())
        r = run(app, "checkpoint", command, source, "outdir", "-k", str(kr))
        assert isinstance(r.exception, CryptoError), (use_tmpfile, r.exception)
        assert "is a directory" in str(r.exception).lower() and "outdir" in str(r.exception), r.exception
        assert ".tmp" not in str(r.exception), r.exception
        assert not streamed, "refused only after the whole input was processed"
        assert sorted(p.name for p in env.iterdir()) == before and not any((env / "outdir").iterdir())
        (env / "outdir").rmdir()


def test_verify_several_files_checks_every_one_and_names_the_bad_ones(app: typer.Typer, env) -> None:
    """`checkpoint verify FILE…`: a bad file is named (the error used to say only "payload is N bytes
    shorter…", with no file), and the files after it are still verified; exit status 2, typed."""
    from securetrain.crypto.errors import TruncatedError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    good = S.encrypt_bytes(os.urandom(3000), ring, segment_size=1024)
    (env / "a.stenc").write_bytes(good)
    (env / "cut.stenc").write_bytes(good[:-500])
    (env / "flip.stenc").write_bytes(good[:-10] + bytes([good[-10] ^ 1]) + good[-9:])
    (env / "z.stenc").write_bytes(good)
    r = run(app, "checkpoint", "verify", "a.stenc", "cut.stenc", "z.stenc", "flip.stenc", "-k", str(kr))
    assert isinstance(r.exception, TruncatedError), r.exception  # the first failure's type
    assert "cut.stenc" in str(r.exception) and "2 of 4" in str(r.exception), r.exception
    out = " ".join(r.output.split())
    assert "OK a.stenc" in out and "OK z.stenc" in out, out  # verified after the bad one
    assert "FAILED cut.stenc" in out and "FAILED flip.stenc" in out, out
    r = run(app, "checkpoint", "verify", "cut.stenc", "-k", str(kr))
    assert isinstance(r.exception, TruncatedError) and str(r.exception).startswith("cut.stenc: "), r.exception


def _feed_fifo(path, data: bytes):  # type: ignore[no-untyped-def]
    """A FIFO at ``path`` and a thread writing ``data`` into it (it blocks until a reader opens it)."""
    import threading

    os.mkfifo(path)

    def write() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # the reader went away (a refused encrypt): nothing to deliver
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_encrypt_from_a_pipe_is_refused_clearly_without_length(app: typer.Typer, env) -> None:
    """Found by review: `cat x | securetrain checkpoint encrypt /dev/stdin ...` (or a FIFO) said only
    "source has more than the declared 0 bytes". The container declares the plaintext length in its
    header before the first segment, so a pipe needs --length; without it: one clear error, up front,
    before the pipe is read or the output created."""
    from securetrain.crypto.errors import CryptoError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    writer = _feed_fifo(env / "pipe", b"x" * 10)
    r = run(app, "checkpoint", "encrypt", "pipe", "c.stenc", "-k", str(kr))
    os.close(os.open(env / "pipe", os.O_RDONLY | os.O_NONBLOCK))  # lets the writer's open return
    writer.join(5)
    assert isinstance(r.exception, CryptoError), r.exception
    message = str(r.exception)
    assert "pipe" in message and "--length" in message and "declared 0 bytes" not in message, message
    assert not (env / "c.stenc").exists()


def test_encrypt_streams_from_a_pipe_with_length(app: typer.Typer, env) -> None:
    from securetrain.crypto.errors import LimitExceededError, TruncatedError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    data = os.urandom(3 * 1024 + 5)
    _feed_fifo(env / "pipe", data).join(0)
    r = run(app, "checkpoint", "encrypt", "pipe", "c.stenc", "-k", str(kr), "--length", str(len(data)),
            "--segment-size", "1024")
    assert r.exit_code == 0, r.output
    assert run(app, "checkpoint", "decrypt", "c.stenc", "out.bin", "-k", str(kr)).exit_code == 0
    assert (env / "out.bin").read_bytes() == data
    _feed_fifo(env / "cpipe", (env / "c.stenc").read_bytes())  # decrypt reads a pipe as it is
    r = run(app, "checkpoint", "decrypt", "cpipe", "out2.bin", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert (env / "out2.bin").read_bytes() == data
    # A pipe that delivers more or less than declared: typed, and no container is written.
    for declared, error in ((len(data) - 1, LimitExceededError), (len(data) + 1, TruncatedError)):
        os.unlink(env / "pipe")
        _feed_fifo(env / "pipe", data)
        r = run(app, "checkpoint", "encrypt", "pipe", "d.stenc", "-k", str(kr), "--length", str(declared))
        assert isinstance(r.exception, error), r.exception
        assert not (env / "d.stenc").exists()
    # A regular file with a --length that is not its size: refused before anything is written.
    (env / "plain.bin").write_bytes(data)
    r = run(app, "checkpoint", "encrypt", "plain.bin", "d.stenc", "-k", str(kr), "--length", "7")
    assert "--length" in str(r.exception) and not (env / "d.stenc").exists(), r.exception


def test_failed_keys_init_leaves_no_lock_file(app: typer.Typer, env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a failed `keys init` left an empty `<keyring>.lock` behind. The lock file a run
    created is removed when it is done (failed or not)."""
    from securetrain.crypto.errors import KeyringError

    kr = env / "keyring.json"
    lock = env / "keyring.json.lock"
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "short")  # refused inside the lock (save)
    r = run(app, "keys", "init", "-k", str(kr))
    assert isinstance(r.exception, KeyringError), r.exception
    assert not kr.exists() and not lock.exists()
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    assert not lock.exists()
    assert isinstance(run(app, "keys", "init", "-k", str(kr)).exception, KeyringError)  # exists, no --force
    assert not lock.exists()


def test_a_lock_file_left_behind_does_not_block_the_next_run(app: typer.Typer, env) -> None:
    """A lock file from elsewhere (an older version, a crash) is harmless: the next run takes the lock
    and leaves that file alone (it removes only a lock file it created)."""
    kr = env / "keyring.json"
    lock = env / "keyring.json.lock"
    lock.write_bytes(b"")
    os.chmod(lock, 0o400)  # even one this user cannot write
    r = run(app, "keys", "init", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert lock.exists() and kr.exists()
    assert run(app, "keys", "rotate", "-k", str(kr)).exit_code == 0
    assert lock.exists()


# -- `-`: the container (or, for encrypt, the plaintext) on stdin ---------------------------------


class _Pipe(io.RawIOBase):
    """A pipe's read end as the command sees it on stdin: not seekable, no size, short reads."""

    def __init__(self, data: bytes, chunk: int = 4093) -> None:
        super().__init__()
        self._data, self._pos, self._chunk = memoryview(data), 0, chunk
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        n = min(len(buffer), self._chunk, len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        self.consumed = self._pos
        return n


class _Terminal(_Pipe):
    def isatty(self) -> bool:
        return True


def invoke_with_stdin(app: typer.Typer, stdin: io.RawIOBase, *args: str):  # type: ignore[no-untyped-def]
    """``run`` with ``stdin`` as the binary stdin (typer's runner only takes bytes, as a seekable BytesIO)."""
    import typer.testing

    bytes_only = typer.testing.make_input_stream
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.testing, "make_input_stream",
                   lambda given, charset: given if isinstance(given, io.RawIOBase) else bytes_only(given, charset))
        return CliRunner().invoke(app, list(args), input=stdin, catch_exceptions=True)  # type: ignore[arg-type]


def run_stdin(app: typer.Typer, data: bytes, kind: str, *args: str):  # type: ignore[no-untyped-def]
    """``run`` with ``data`` on stdin: ``bytes`` (the runner's in-memory, seekable stream) or ``pipe``."""
    if kind == "bytes":
        return CliRunner().invoke(app, list(args), input=data, catch_exceptions=True)
    return invoke_with_stdin(app, _Pipe(data), *args)


STDIN_KINDS = ("bytes", "pipe")
SEG = 1024


def _container(ring: LocalKeyring, size: int = 5 * SEG + 100) -> tuple[bytes, bytes]:
    plain = os.urandom(size)
    return plain, S.encrypt_bytes(plain, ring, segment_size=SEG)


def _segment_at(blob: bytes, i: int) -> slice:
    start = S.read_header(io.BytesIO(blob)).header_length + i * (SEG + 16)
    return slice(start, start + SEG + 16)


def _attack(name: str, good: bytes) -> bytes:
    if name == "truncated":
        return good[:-500]
    if name == "cut_in_header":
        return good[:40]
    if name == "trailing_data":
        return good + b"\0" * 16
    if name == "tampered_segment":
        s = _segment_at(good, 2)
        return good[:s.start + 7] + bytes([good[s.start + 7] ^ 1]) + good[s.start + 8:]
    if name == "reordered_segments":
        one, two = _segment_at(good, 1), _segment_at(good, 2)
        return good[:one.start] + good[two] + good[one] + good[two.stop:]
    if name == "edited_header":
        return good[:70] + bytes([good[70] ^ 1]) + good[71:]
    if name == "empty":
        return b""
    if name == "not_a_container":
        return b"PK\x03\x04" + os.urandom(4000)  # e.g. a torch.save zip
    if name == "short_text":
        return b"hello\n"
    raise AssertionError(name)


def _outcome(r) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """What a user sees: the error type, or (for success) the output with the input's name taken out."""
    if r.exception is not None:
        assert r.exit_code != 0
        return type(r.exception).__name__, ""
    return "ok", " ".join(r.stdout.replace("c.stenc", "<stdin>").split())  # stderr: the progress bar


ATTACKS = ("truncated", "cut_in_header", "trailing_data", "tampered_segment", "reordered_segments",
           "edited_header", "empty", "not_a_container", "short_text", "wrong_key")


@pytest.mark.parametrize("attack", ("none", *ATTACKS))
def test_stdin_behaves_exactly_like_the_file(app: typer.Typer, env, attack: str) -> None:
    """`verify -`, `inspect -` and `decrypt - OUT` read the container from stdin (e.g. `aws s3 cp s3://.. - |`)
    and give what the same bytes in a file give: the same output (the name aside) or the same typed error,
    for a good container and for every attack; a failed decrypt leaves no OUT and no temp file."""
    kr, other = env / "keyring.json", env / "other.json"
    assert run(app, "keys", "init", "-k", str(kr), "--key-id", "k1").exit_code == 0
    assert run(app, "keys", "init", "-k", str(other), "--key-id", "k1").exit_code == 0  # same id, other key
    plain, good = _container(LocalKeyring.load(kr))
    blob = good if attack in ("none", "wrong_key") else _attack(attack, good)
    key = str(other if attack == "wrong_key" else kr)
    (env / "c.stenc").write_bytes(blob)
    for kind in STDIN_KINDS:
        for command in (["verify"], ["inspect"], ["inspect", "--json"], ["decrypt"]):
            key_args = [] if command[0] == "inspect" else ["-k", key]
            out = ["out.bin"] if command == ["decrypt"] else []
            from_file = run(app, "checkpoint", *command, "c.stenc", *out, *key_args)
            expected = _outcome(from_file)
            if command == ["decrypt"] and expected[0] == "ok":
                assert (env / "out.bin").read_bytes() == plain
                os.unlink(env / "out.bin")
            before = sorted(p.name for p in env.iterdir())
            r = run_stdin(app, blob, kind, "checkpoint", *command, "-", *out, *key_args)
            assert _outcome(r) == expected, (kind, command, r.output, r.exception)
            if command == ["decrypt"] and expected[0] == "ok":
                assert (env / "out.bin").read_bytes() == plain and (env / "out.bin").stat().st_mode & 0o777 == 0o600
                os.unlink(env / "out.bin")
            assert sorted(p.name for p in env.iterdir()) == before, (kind, command)  # nothing partial
    expected_errors = {"none": "ok", "truncated": "TruncatedError", "cut_in_header": "TruncatedError",
                       "trailing_data": "TrailingDataError", "tampered_segment": "SegmentAuthError",
                       "reordered_segments": "SegmentAuthError", "edited_header": "HeaderAuthError",
                       "empty": "TruncatedError", "not_a_container": "HeaderFormatError",
                       "short_text": "HeaderFormatError", "wrong_key": "WrongKeyError"}
    r = run_stdin(app, blob, "pipe", "checkpoint", "verify", "-", "-k", key)
    assert _outcome(r)[0] == expected_errors[attack], r.exception
    if attack != "none":
        assert str(r.exception).startswith("<stdin>: "), r.exception  # named like a file would be


def test_empty_or_foreign_input_says_so(app: typer.Typer, env) -> None:
    """`aws s3 cp` that failed pipes nothing; a plain file piped by mistake is not "cut short"."""
    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    r = run_stdin(app, b"", "pipe", "checkpoint", "verify", "-", "-k", str(kr))
    assert "empty" in str(r.exception), r.exception
    r = run_stdin(app, b"hello\n", "pipe", "checkpoint", "inspect", "-")
    assert "not a securetrain encrypted container" in str(r.exception), r.exception


def test_stdin_refusals_come_before_reading_it(app: typer.Typer, env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused up front, stdin untouched and nothing written: `-` twice, `-` as OUT (no file named "-";
    plaintext is never streamed), a terminal on stdin, a keyring passphrase that would have to come from
    the stdin that carries the container."""
    from securetrain.crypto.errors import CryptoError, KeyringError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    _, good = _container(LocalKeyring.load(kr))
    (env / "c.stenc").write_bytes(good)
    (env / "p.bin").write_bytes(b"x" * 10)
    before = sorted(p.name for p in env.iterdir())
    cases = [(["verify", "-", "-", "-k", str(kr)], "more than once"),
             (["decrypt", "c.stenc", "-", "-k", str(kr)], "stdout"),
             (["decrypt", "-", "-", "-k", str(kr)], "stdout"),
             (["encrypt", "p.bin", "-", "-k", str(kr)], "stdout"),
             (["verify", "-", "-k", str(kr)], "terminal"),
             (["inspect", "-"], "terminal"),
             (["decrypt", "-", "out.bin", "-k", str(kr)], "terminal"),
             (["encrypt", "-", "d.stenc", "-k", str(kr), "--length", "10"], "terminal")]
    for args, says in cases:
        stdin = (_Terminal if says == "terminal" else _Pipe)(good)
        r = invoke_with_stdin(app, stdin, "checkpoint", *args)
        assert isinstance(r.exception, CryptoError) and says in str(r.exception), (args, r.exception)
        assert stdin.consumed == 0 and sorted(p.name for p in env.iterdir()) == before, args
    monkeypatch.delenv("SECURETRAIN_KEYRING_PASSPHRASE")
    stdin = _Pipe(good)
    r = invoke_with_stdin(app, stdin, "checkpoint", "decrypt", "-", "out.bin", "-k", str(kr))
    assert isinstance(r.exception, KeyringError) and "SECURETRAIN_KEYRING_PASSPHRASE" in str(r.exception), r.exception
    assert stdin.consumed == 0 and not (env / "out.bin").exists()


def test_decrypt_from_stdin_is_audited_with_the_digest_of_what_was_read(app: typer.Typer, env) -> None:
    import hashlib

    from securetrain.audit.log import AuditLog

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    _, good = _container(LocalKeyring.load(kr))
    db = str(env / "audit.sqlite")
    assert run_stdin(app, good, "pipe", "checkpoint", "decrypt", "-", "out.bin", "-k", str(kr), "--audit-db", db).exit_code == 0
    bad = _attack("tampered_segment", good)
    r = run_stdin(app, bad, "pipe", "checkpoint", "decrypt", "-", "bad.bin", "-k", str(kr), "--audit-db", db)
    assert r.exception is not None and not (env / "bad.bin").exists()
    with AuditLog(db) as log:
        events = [e for e in log.entries() if e.action == "checkpoint.decrypt"]
    assert [(e.resource, e.outcome) for e in events] == [("<stdin>", "success"), ("<stdin>", "failure")], events
    assert events[0].details["ciphertext_sha256"] == hashlib.sha256(good).hexdigest()


@pytest.mark.parametrize("kind", STDIN_KINDS)
def test_encrypt_from_stdin_dash_needs_the_exact_length(app: typer.Typer, env, kind: str) -> None:
    """`... | securetrain checkpoint encrypt - OUT --length N`: streamed; no --length, or a stream shorter
    or longer than N: refused, typed, no OUT."""
    from securetrain.crypto.errors import CryptoError, LimitExceededError, TruncatedError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    data = os.urandom(3 * SEG + 5)
    r = run_stdin(app, data, kind, "checkpoint", "encrypt", "-", "c.stenc", "-k", str(kr), "--length",
                  str(len(data)), "--segment-size", str(SEG))
    assert r.exit_code == 0, (r.output, r.exception)
    assert S.decrypt_bytes((env / "c.stenc").read_bytes(), LocalKeyring.load(kr)) == data
    assert (env / "c.stenc").stat().st_mode & 0o777 == 0o600
    r = run_stdin(app, data, kind, "checkpoint", "encrypt", "-", "d.stenc", "-k", str(kr))
    assert type(r.exception) is CryptoError and "--length" in str(r.exception), r.exception
    for declared, error in ((len(data) - 1, LimitExceededError), (len(data) + 1, TruncatedError), (0, LimitExceededError)):
        r = run_stdin(app, data, kind, "checkpoint", "encrypt", "-", "d.stenc", "-k", str(kr), "--length",
                      str(declared))
        assert isinstance(r.exception, error), (declared, r.exception)
        assert not (env / "d.stenc").exists()
    r = run_stdin(app, b"", kind, "checkpoint", "encrypt", "-", "e.stenc", "-k", str(kr), "--length", "0")
    assert r.exit_code == 0 and S.decrypt_bytes((env / "e.stenc").read_bytes(), LocalKeyring.load(kr)) == b""


HWM_CHILD = ("import atexit, sys\n"
             "def hwm():\n"
             "    sys.stderr.write([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])\n"
             "atexit.register(hwm)\n"
             "from securetrain.cli.main import main; main()\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_a_real_pipe_is_streamed_and_fails_closed(env) -> None:
    """Through the installed entry point with a real pipe on stdin: a 32 MiB container is verified in
    bounded memory (not read whole), and a cut stream exits 2 with one error line and no OUT."""
    import subprocess
    import sys

    ring = LocalKeyring.create("k1")
    key_env = {**os.environ, "SECURETRAIN_KEK": ring.keys()[0].material().hex(), "SECURETRAIN_KEK_ID": "k1"}
    for name in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY"):
        key_env.pop(name, None)
    big = S.encrypt_bytes(os.urandom(32 << 20), ring)
    small = S.encrypt_bytes(b"x" * 10, ring)

    def cli(data: bytes, *args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run([sys.executable, "-c", HWM_CHILD, "checkpoint", *args], input=data,
                              capture_output=True, env=key_env, timeout=120)

    def hwm(proc: subprocess.CompletedProcess) -> int:  # type: ignore[type-arg]
        return int(proc.stderr.decode().split("VmHWM:")[1].split()[0]) * 1024

    base, streamed = cli(small, "verify", "-"), cli(big, "verify", "-")
    assert base.returncode == 0 and streamed.returncode == 0, streamed.stderr
    assert b"OK <stdin>: 32 segments" in streamed.stdout, streamed.stdout
    assert hwm(streamed) - hwm(base) < 16 << 20, (hwm(base), hwm(streamed))  # a few segments, not 32 MiB
    cut = cli(big[:-(5 << 20)], "decrypt", "-", str(env / "out.bin"))
    assert cut.returncode == 2 and not (env / "out.bin").exists(), cut.stderr
    errors = [ln for ln in cut.stderr.decode().splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: input ends inside segment"), cut.stderr
    assert list(env.iterdir()) == []  # no temp file either
