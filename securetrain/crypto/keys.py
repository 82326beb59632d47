"""Key-encryption keys (KEKs) and the providers that wrap data keys with them.

Envelope encryption: every container has its own random 256-bit data key; a :class:`KeyProvider`
wraps it under a long-lived KEK and the wrapped bytes go into the container header. Providers:

* :class:`LocalKeyring` - KEKs in a passphrase-protected keyring file (scrypt + AES-256-GCM, mode 0600);
  wraps with AES-256-KW (RFC 3394).
* :class:`EnvKeyProvider` - one KEK from ``SECURETRAIN_KEK`` (hex or base64) / ``SECURETRAIN_KEK_ID``.
* :class:`securetrain.crypto.vault.VaultTransitProvider` - HashiCorp Vault transit (opaque wrapping).

Key bytes never appear in ``repr``/``str``, exceptions, logs or audit events: only key ids and
fingerprints (a domain-separated SHA-256 of the key, truncated to 8 bytes).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NoReturn, Protocol, runtime_checkable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from securetrain.crypto import vault as _vault
from securetrain.crypto._container import WRAP_AES256_KW
from securetrain.crypto.errors import KeyNotFoundError, KeyringError, KeyringPermissionError, WrongKeyError
from securetrain.io.atomic import atomic_write_bytes

KEY_BYTES = 32
FINGERPRINT_BYTES = 8
KEY_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}")  # use with fullmatch()

# Stanza wrap algorithms (container header field ``wrap_alg``): WRAP_AES256_KW, WRAP_OPAQUE (_container.wrap_algs).

ENV_KEK = "SECURETRAIN_KEK"
ENV_KEK_ID = "SECURETRAIN_KEK_ID"
ENV_PASSPHRASE = "SECURETRAIN_KEYRING_PASSPHRASE"
ENV_KEYRING = "SECURETRAIN_KEYRING"
ENV_VAULT_KEY = "SECURETRAIN_VAULT_TRANSIT_KEY"
ENV_VAULT_MOUNT = "SECURETRAIN_VAULT_MOUNT"

KEYRING_FORMAT = "securetrain-keyring"
KEYRING_VERSION = 1
SCRYPT_DEFAULT_LOG2_N = 15  # 32 MiB, ~0.1 s: a keyring is opened once per process
SCRYPT_MIN_LOG2_N = 10


def validate_key_id(key_id: str) -> str:
    if not isinstance(key_id, str) or not KEY_ID_RE.fullmatch(key_id):  # fullmatch: "$" accepts a final "\n"
        raise KeyringError(
            f"invalid key id {key_id!r}",
            hint="use 1-128 characters from A-Z a-z 0-9 . _ : / @ - starting with a letter or digit",
        )
    return key_id


def fingerprint(material: bytes) -> bytes:
    """8-byte public identifier of a key; one-way and domain separated, safe to log and store."""
    return hashlib.sha256(b"securetrain kek fingerprint v1\x00" + material).digest()[:FINGERPRINT_BYTES]


class SecretKey:
    """A 256-bit key with an id. Its bytes are reachable only through :meth:`material`.

    ``repr``/``str`` show the id and fingerprint; pickling is refused so a key can never end up in
    a Prefect result, a multiprocessing queue or a log record by accident.
    """

    __slots__ = ("_material", "created", "key_id")

    def __init__(self, key_id: str, material: bytes, *, created: float | None = None) -> None:
        if len(material) != KEY_BYTES:
            raise KeyringError(f"key {key_id!r} must be {KEY_BYTES} bytes, got {len(material)}")
        self.key_id = validate_key_id(key_id)
        self._material = bytes(material)
        self.created = time.time() if created is None else float(created)

    @classmethod
    def generate(cls, key_id: str) -> SecretKey:
        return cls(key_id, secrets.token_bytes(KEY_BYTES))

    def material(self) -> bytes:
        return self._material

    @property
    def fingerprint(self) -> str:
        return fingerprint(self._material).hex()

    def __repr__(self) -> str:
        return f"SecretKey(key_id={self.key_id!r}, fingerprint={self.fingerprint})"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("SecretKey objects cannot be pickled (key material must not leave the process)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKey) and secrets.compare_digest(self._material, other._material)

    def __hash__(self) -> int:
        return hash(self.key_id)


@runtime_checkable
class KeyProvider(Protocol):
    """Wraps/unwraps per-file data keys under a KEK named by ``key_id``.

    Implementations raise :class:`KeyNotFoundError` for an unknown key id and
    :class:`WrongKeyError` when ``wrapped`` does not open under that key.
    Optional attributes used by the container: ``wrap_alg`` (int, default ``WRAP_OPAQUE``) and
    ``fingerprint_of(key_id) -> bytes | None``.
    """

    def wrap(self, key_id: str, data_key: bytes) -> bytes: ...

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes: ...

    def current_key_id(self) -> str: ...


class _LocalKeysMixin:
    """AES-KW wrapping shared by the keyring and the env provider."""

    wrap_alg = WRAP_AES256_KW
    _keys: dict[str, SecretKey]

    def _key(self, key_id: str) -> SecretKey:
        try:
            return self._keys[key_id]
        except KeyError:
            raise KeyNotFoundError(
                f"key {key_id!r} is not available (have: {', '.join(sorted(self._keys)) or 'none'})",
                hint="use the keyring that encrypted the file, or re-wrap it with `securetrain keys rotate`",
            ) from None

    def wrap(self, key_id: str, data_key: bytes) -> bytes:
        return aes_key_wrap(self._key(key_id).material(), data_key)

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        key = self._key(key_id)
        try:
            return aes_key_unwrap(key.material(), wrapped)
        except (InvalidUnwrap, ValueError):
            raise WrongKeyError(
                f"data key does not unwrap under key {key_id!r} (fingerprint {key.fingerprint})",
                hint="the keyring holds a different key under this id",
            ) from None

    def fingerprint_of(self, key_id: str) -> bytes | None:
        key = self._keys.get(key_id)
        return None if key is None else fingerprint(key.material())

    def key_ids(self) -> list[str]:
        return sorted(self._keys)


class EnvKeyProvider(_LocalKeysMixin):
    """One KEK from the environment: ``SECURETRAIN_KEK`` (64 hex chars or base64) and ``SECURETRAIN_KEK_ID``."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_KEK)
        if not raw:
            raise KeyringError(f"{ENV_KEK} is not set", hint=f"export {ENV_KEK}=<64 hex chars> and {ENV_KEK_ID}=<id>")
        material = _decode_key_text(raw.strip())
        key_id = env.get(ENV_KEK_ID, "env-kek")
        self._keys = {key_id: SecretKey(key_id, material)}
        self._current = key_id

    def current_key_id(self) -> str:
        return self._current

    def __repr__(self) -> str:
        return f"EnvKeyProvider(key_id={self._current!r})"


def _decode_key_text(raw: str) -> bytes:
    candidates: list[bytes] = []
    if re.fullmatch(r"[0-9a-fA-F]{64}", raw):
        candidates.append(bytes.fromhex(raw))
    else:
        try:
            candidates.append(base64.b64decode(raw, validate=True))
        except (binascii.Error, ValueError):
            pass
        try:
            candidates.append(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        except (binascii.Error, ValueError):
            pass
    for candidate in candidates:
        if len(candidate) == KEY_BYTES:
            return candidate
    # Never echo the value: it is (almost) a key.
    raise KeyringError(f"{ENV_KEK} must encode exactly 32 bytes as hex (64 chars) or base64")


class LocalKeyring(_LocalKeysMixin):
    """KEKs in a keyring file encrypted under a passphrase.

    File: JSON ``{"format", "version", "kdf": {"name": "scrypt", "log2_n", "r", "p", "salt"},
    "nonce", "ciphertext"}``; ``ciphertext`` = AES-256-GCM(scrypt(passphrase), nonce, keys JSON,
    aad = canonical JSON of format/version/kdf). The file must be mode 0600 (no group/other bits).
    """

    def __init__(
        self,
        keys: Iterable[SecretKey] = (),
        current: str | None = None,
        *,
        path: Path | None = None,
    ) -> None:
        self._keys = {k.key_id: k for k in keys}
        self._current = current
        self.path = path
        if current is not None and current not in self._keys:
            raise KeyringError(f"current key {current!r} is not in the keyring")

    # -- key management -------------------------------------------------------------------
    @classmethod
    def create(cls, key_id: str | None = None) -> LocalKeyring:
        ring = cls()
        ring.add(SecretKey.generate(key_id or _new_key_id()), make_current=True)
        return ring

    def add(self, key: SecretKey, *, make_current: bool = False) -> None:
        if key.key_id in self._keys:
            raise KeyringError(f"key id {key.key_id!r} already exists in the keyring")
        self._keys[key.key_id] = key
        if make_current or self._current is None:
            self._current = key.key_id

    def rotate(self, key_id: str | None = None) -> SecretKey:
        """Add a fresh KEK and make it current; old keys stay until removed (to re-wrap with)."""
        key = SecretKey.generate(key_id or _new_key_id())
        self.add(key, make_current=True)
        return key

    def remove(self, key_id: str) -> None:
        self._key(key_id)
        if key_id == self._current:
            raise KeyringError(f"cannot remove the current key {key_id!r}", hint="rotate first")
        del self._keys[key_id]

    def get(self, key_id: str) -> SecretKey | None:
        return self._keys.get(key_id)

    def put(self, key: SecretKey) -> None:
        """Add ``key`` without touching the current key (escrow, restore); same id + same bytes is a no-op."""
        held = self._keys.get(key.key_id)
        if held is not None and held != key:
            raise KeyringError(f"a different key with id {key.key_id!r} is already in the keyring")
        self._keys[key.key_id] = key

    def pop(self, key_id: str) -> SecretKey:
        """Remove and return ``key_id`` even if it is current (escrow bookkeeping)."""
        key = self._key(key_id)
        del self._keys[key_id]
        if self._current == key_id:
            self._current = None
        return key

    def current_key_id(self) -> str:
        if self._current is None:
            raise KeyringError("the keyring is empty", hint="run `securetrain keys init`")
        return self._current

    def keys(self) -> list[SecretKey]:
        return [self._keys[k] for k in sorted(self._keys, key=lambda k: self._keys[k].created)]

    def __repr__(self) -> str:
        return f"LocalKeyring(current={self._current!r}, keys={self.key_ids()!r})"

    # -- file I/O -----------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str] | None = None, passphrase: str | None = None,
             *, log2_n: int | None = None) -> Path:
        target = Path(path) if path is not None else self.path
        if target is None:
            raise KeyringError("no keyring path given")
        try:  # as load() refuses them: never replace a symlink (or write through it), never a directory
            st = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) \
                else "not a regular file"
            raise KeyringError(f"keyring path {target} is {what}; refusing to replace it",
                               hint="give the keyring file's own path (keyrings are never symlinks)")
        secret = _passphrase(passphrase)
        kdf = {"name": "scrypt", "log2_n": SCRYPT_DEFAULT_LOG2_N if log2_n is None else log2_n, "r": 8, "p": 1,
               "salt": base64.b64encode(secrets.token_bytes(16)).decode()}
        body = json.dumps({
            "current": self._current,
            "keys": [{"id": k.key_id, "created": k.created, "key": base64.b64encode(k.material()).decode()}
                     for k in self.keys()],
        }).encode()
        nonce = secrets.token_bytes(12)
        aad = _keyring_aad(kdf)
        ciphertext = AESGCM(_derive(secret, kdf)).encrypt(nonce, body, aad)
        doc = {"format": KEYRING_FORMAT, "version": KEYRING_VERSION, "kdf": kdf,
               "nonce": base64.b64encode(nonce).decode(), "ciphertext": base64.b64encode(ciphertext).decode()}
        atomic_write_bytes(target, (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)
        self.path = target
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, passphrase: str | None = None) -> LocalKeyring:
        target = Path(path or os.environ.get(ENV_KEYRING, ""))
        if not str(path or os.environ.get(ENV_KEYRING, "")):
            raise KeyringError("no keyring path given", hint=f"pass --keyring or set {ENV_KEYRING}")
        try:
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise KeyringError(f"keyring not found: {target}", hint="run `securetrain keys init`") from None
        except OSError as exc:
            raise KeyringError(f"cannot open keyring {target}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise KeyringError(f"keyring {target} is not a regular file",
                               hint="pass the keyring file itself, not a directory")
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            if st.st_mode & 0o077:
                raise KeyringPermissionError(
                    f"keyring {target} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):04o})",
                    hint=f"chmod 600 {target}",
                )
            if st.st_uid != os.getuid():
                raise KeyringPermissionError(f"keyring {target} is owned by another user (uid {st.st_uid})")
            raw = handle.read(1 << 20)
        try:
            doc = json.loads(raw)
            if doc.get("format") != KEYRING_FORMAT or doc.get("version") != KEYRING_VERSION:
                raise ValueError("not a securetrain keyring v1")
            kdf = doc["kdf"]
            if kdf.get("name") != "scrypt" or not (SCRYPT_MIN_LOG2_N <= int(kdf["log2_n"]) <= 22):
                raise ValueError("unsupported kdf parameters")
            nonce = base64.b64decode(doc["nonce"])
            ciphertext = base64.b64decode(doc["ciphertext"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KeyringError(f"keyring {target} is malformed: {exc}") from None
        try:
            body = AESGCM(_derive(_passphrase(passphrase), kdf)).decrypt(nonce, ciphertext, _keyring_aad(kdf))
        except InvalidTag:
            raise KeyringError(f"cannot open keyring {target}: wrong passphrase or the file was modified") from None
        try:
            data = json.loads(body)
            keys = [SecretKey(k["id"], base64.b64decode(k["key"], validate=True), created=k["created"])
                    for k in data["keys"]]
        except (ValueError, KeyError, TypeError):
            raise KeyringError(f"keyring {target} body is malformed") from None
        return cls(keys, data.get("current"), path=target)


@contextlib.contextmanager
def keyring_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive advisory lock (``<keyring>.lock``) for load-modify-save of a keyring.

    Without it two concurrent rotations could each save a keyring missing the other's new key,
    orphaning every file re-wrapped under the lost key.

    The lock file is removed by the run that created it, when it is done (failed or not), so a
    failed ``keys init`` leaves nothing behind; a lock file that was already there (another
    version's, a crash's) is used and left alone, and being read-only does not stop it (a read-only
    descriptor locks as well).
    """
    import fcntl  # POSIX only; imported here so the module still imports elsewhere

    lock_path = Path(f"{path}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd, created = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            try:
                fd, created = os.open(lock_path, os.O_RDONLY), False
            except FileNotFoundError:  # its creator removed it just now: create one
                continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        # The creator removes the file while it still holds the lock: a waiter that opened that
        # file gets a lock nobody else will ask for, so it starts again on the current file.
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    try:
        yield
    finally:
        if created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _new_key_id() -> str:
    return f"kek-{time.strftime('%Y%m%d', time.gmtime())}-{secrets.token_hex(4)}"


def _passphrase(passphrase: str | None) -> bytes:
    value = passphrase if passphrase is not None else os.environ.get(ENV_PASSPHRASE)
    if not value:
        raise KeyringError("no keyring passphrase", hint=f"set {ENV_PASSPHRASE} or pass a passphrase")
    if len(value) < 8:
        raise KeyringError("keyring passphrase must be at least 8 characters")
    return value.encode()


def _keyring_aad(kdf: Mapping[str, object]) -> bytes:
    return json.dumps({"format": KEYRING_FORMAT, "version": KEYRING_VERSION, "kdf": kdf},
                      sort_keys=True, separators=(",", ":")).encode()


def _derive(secret: bytes, kdf: Mapping[str, object]) -> bytes:
    params = {k: int(str(kdf[k])) for k in ("log2_n", "r", "p")}
    salt = base64.b64decode(str(kdf["salt"]))
    return Scrypt(salt=salt, length=32, n=1 << params["log2_n"], r=params["r"], p=params["p"]).derive(secret)


def provider_from_env(keyring: str | os.PathLike[str] | None = None) -> KeyProvider:
    """The default provider, first match wins:

    1. a keyring file (``keyring`` or ``SECURETRAIN_KEYRING``; passphrase ``SECURETRAIN_KEYRING_PASSPHRASE``),
    2. Vault transit key ``SECURETRAIN_VAULT_TRANSIT_KEY`` (mount ``SECURETRAIN_VAULT_MOUNT``, default
       ``transit``; server and token from hvac's usual ``VAULT_ADDR`` / ``VAULT_TOKEN``),
    3. ``SECURETRAIN_KEK`` (+ ``SECURETRAIN_KEK_ID``).
    """
    if keyring is not None or os.environ.get(ENV_KEYRING):
        return LocalKeyring.load(keyring)
    if os.environ.get(ENV_VAULT_KEY):
        return _vault.VaultTransitProvider(os.environ[ENV_VAULT_KEY], mount_point=os.environ.get(ENV_VAULT_MOUNT, "transit"))
    if os.environ.get(ENV_KEK):
        return EnvKeyProvider()
    raise KeyringError("no key source configured",
                       hint=f"pass --keyring, or set {ENV_KEYRING} (+{ENV_PASSPHRASE}), {ENV_VAULT_KEY} or {ENV_KEK}")
