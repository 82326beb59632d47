"""The secrets a run needs, and where they come from.

Production: the keyring passphrase arrives in ``SECURETRAIN_KEYRING_PASSPHRASE`` (or the KEK in
``SECURETRAIN_KEK``, or Vault), the de-identification secret in ``SECURETRAIN_DEID_KEY``; nothing
secret is ever written by the pipeline. Demo (``secrets.create_demo_secrets: true``): missing secrets
are generated into ``<run_dir>/keys/`` with mode 0600 so the demo runs on a fresh machine — that
folder must then be protected like any key store.

Secrets never leave this object as text: ``repr`` shows only ids.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from securetrain.crypto.keys import (
    ENV_KEK,
    ENV_KEYRING,
    ENV_PASSPHRASE,
    ENV_VAULT_KEY,
    KeyProvider,
    LocalKeyring,
    provider_from_env,
)
from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.dicom.errors import DeidKeyError
from securetrain.masking.dicom.keys import ENV_KEY as ENV_DEID_KEY
from securetrain.masking.dicom.keys import DeidKeys, parse_key_text
from securetrain.pipeline.config import PipelineConfig

AUDIT_KEY_FILE = "audit-signing.pem"
KEYRING_FILE = "keyring.json"
PASSPHRASE_FILE = "keyring.passphrase"
DEID_KEY_FILE = "deid.key"
#: Worded so that the log redaction (``name: value`` looks like a secret) leaves it readable.
DEMO_SECRETS_HINT = "for a throw-away demo, turn on secrets.create_demo_secrets in the config"
#: The tabular masking key (``securetrain mask``, and the pipeline's tabular task).
ENV_MASK_KEY = "SECURETRAIN_MASK_KEY"
#: The public demo de-identification key (``secrets.demo_deid_key: fixed``): published here, so it
#: protects nothing; it only makes a demo's pseudonyms and patient split repeat run to run.
DEMO_DEID_KEY_HEX = hashlib.sha256(b"securetrain public demo de-identification key: synthetic data only").hexdigest()


@dataclass
class RunSecrets:
    keyring: KeyProvider
    keyring_path: Path | None
    deid_keys: DeidKeys
    deid_secret: bytes = field(repr=False)

    def __repr__(self) -> str:
        kid = self.keyring.current_key_id()
        return f"RunSecrets(kek={kid!r}, deid_key_id={self.deid_keys.key_id!r})"


def keys_dir(config: PipelineConfig) -> Path:
    return config.secrets.dir or (config.run_dir / "keys")


def _read_private(path: Path) -> bytes:
    if path.stat().st_mode & 0o077:
        from securetrain.crypto.errors import KeyringError

        raise KeyringError(f"{path} is readable by group/others", hint=f"chmod 600 {path}")
    return path.read_bytes()


def run_audit_key_path(config: PipelineConfig) -> Path:
    """The run's audit signing key: ``audit.signing_key``, else ``$SECURETRAIN_AUDIT_KEY``, else
    ``<keys dir>/audit-signing.pem``."""
    explicit = config.audit.signing_key or os.environ.get("SECURETRAIN_AUDIT_KEY")
    return Path(explicit) if explicit else keys_dir(config) / AUDIT_KEY_FILE


def _create_demo_signing_keys(config: PipelineConfig) -> None:
    """Demo set-up: the audit and provenance signing keys under the run's keys folder, if missing.

    The only place a run creates signing keys, and only at the default paths: a key the operator
    named (config or environment) that does not exist is an error, never replaced by a new one.
    """
    import logging

    from securetrain.audit.keys import load_or_create_signing_key
    from securetrain.release.provenance import signing_key_path

    for path, default in ((run_audit_key_path(config), keys_dir(config) / AUDIT_KEY_FILE),
                          (signing_key_path(config), keys_dir(config) / "provenance-signing.pem")):
        if path == default and not path.exists():
            load_or_create_signing_key(path)  # race-free: ranks starting together load one key
            logging.getLogger(__name__).info("demo secrets: created signing key %s", path.name)


def check_provenance_key(config: PipelineConfig) -> None:
    """With ``release.provenance`` (the default), the provenance signing key must load now, before any
    work: the key is needed only at the end of the run, after training, so without this check a
    production run without it trained for nothing. Called where a run starts (library and flow), after
    :func:`load_run_secrets` (which made a demo's key), not by every reader of the run's secrets (a
    release export on an approver's host needs no signing key)."""
    if not config.release.provenance:
        return
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.keys import load_signing_key
    from securetrain.pipeline.errors import SigningKeyError
    from securetrain.release.provenance import signing_key_path

    path = signing_key_path(config)
    public = path.with_name(path.name.removesuffix(".pem") + ".pub.pem")
    if not path.exists():
        raise SigningKeyError(
            f"provenance signing key not found: {path} (release.provenance is on)",
            hint=f"create it once with `securetrain release keygen {path} {public}` (or point "
            "SECURETRAIN_PROVENANCE_KEY at your existing key), or set release.provenance: false",
        )
    try:
        load_signing_key(path)
    except AuditConfigError as exc:  # unsafe mode, not a PEM, not Ed25519: the same checks, its own name
        raise SigningKeyError(exc.args[0].replace("audit signing key", "provenance signing key"),
                              hint=exc.hint) from None


def run_keyring_path(config: PipelineConfig) -> Path | None:
    """Where the run's KEK keyring lives; ``None`` when an env KEK or Vault holds the KEK."""
    if os.environ.get(ENV_KEYRING):
        return Path(os.environ[ENV_KEYRING])
    if os.environ.get(ENV_VAULT_KEY) or os.environ.get(ENV_KEK):
        return None
    return keys_dir(config) / KEYRING_FILE


#: Keyrings this process already opened: every stage (and Prefect task) resolves the run's secrets
#: itself, and each open is a deliberately slow scrypt (~0.1 s). Keyed by the file's identity and
#: a hash of the passphrase, so a replaced or rotated keyring file, or another passphrase, opens anew.
_KEYRINGS: dict[tuple[str, int, int, int, bytes], LocalKeyring] = {}


def _load_keyring_once(path: Path, passphrase: str | None) -> LocalKeyring:
    try:
        st = path.stat()
    except OSError:
        return LocalKeyring.load(path, passphrase=passphrase)  # reports the missing file its own way
    key = (str(path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size,
           hashlib.sha256((passphrase or "").encode()).digest())
    if key not in _KEYRINGS:
        _KEYRINGS.clear()  # one run's keyring at a time: nothing piles up in a long-lived worker
        _KEYRINGS[key] = LocalKeyring.load(path, passphrase=passphrase)
    return _KEYRINGS[key]


def load_run_secrets(config: PipelineConfig) -> RunSecrets:
    """Resolve (or, in demo mode, create) the run's KEK keyring and de-identification secret."""
    from securetrain.secretenv import resolve_secret_files

    resolve_secret_files()  # SECURETRAIN_<X>_FILE (Compose secrets) -> SECURETRAIN_<X>
    folder = keys_dir(config)
    demo = config.secrets.create_demo_secrets
    if demo:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    # Key-encryption keys: env / Vault via provider_from_env, or the run's keyring file.
    passphrase_file = folder / PASSPHRASE_FILE
    passphrase: str | None
    if demo and not os.environ.get(ENV_PASSPHRASE):
        if not passphrase_file.exists():
            atomic_write_bytes(passphrase_file, secrets.token_urlsafe(32).encode())
        passphrase = _read_private(passphrase_file).decode().strip()
    else:
        passphrase = os.environ.get(ENV_PASSPHRASE)
    keyring_path = run_keyring_path(config)
    if keyring_path is None or os.environ.get(ENV_KEYRING):
        # An operator-provided key source (keyring file, Vault transit, env KEK) always wins.
        keyring: KeyProvider = provider_from_env()
    else:
        if demo and not keyring_path.exists():
            LocalKeyring.create().save(keyring_path, passphrase=passphrase)
        keyring = _load_keyring_once(keyring_path, passphrase)

    # De-identification secret (HMAC keys for UIDs, dates, pseudonyms derive from it).
    deid_file = folder / DEID_KEY_FILE
    if os.environ.get(ENV_DEID_KEY):
        deid_secret = parse_key_text(os.environ[ENV_DEID_KEY].encode(), what=ENV_DEID_KEY, hex_only=True)
    elif config.task.kind in ("tabular-classification", "tabular-regression") and os.environ.get(ENV_MASK_KEY):
        # A table needs only its masking key (read by the task itself); the run's other keyed values
        # (the pseudonym-map key, the secret's id in result.json) derive from it, never the key itself.
        from securetrain.keytext import decode_key
        from securetrain.masking.tabular.errors import MaskKeyError

        mask_key = decode_key(os.environ[ENV_MASK_KEY], what=ENV_MASK_KEY, error=MaskKeyError)
        deid_secret = hmac.new(mask_key, b"securetrain/pipeline/tabular-run-secret", hashlib.sha256).digest()
    elif demo:
        if not deid_file.exists():
            fixed = config.secrets.demo_deid_key == "fixed"
            atomic_write_bytes(deid_file, (DEMO_DEID_KEY_HEX if fixed else secrets.token_hex(32)).encode())
        deid_secret = parse_key_text(_read_private(deid_file), what=str(deid_file))
    elif config.task.kind in ("tabular-classification", "tabular-regression"):
        raise DeidKeyError(
            f"no masking key for this tabular run (set {ENV_MASK_KEY} to the masking key, 64 hex chars, or "
            f"{ENV_DEID_KEY} to derive it from)",
            hint=DEMO_SECRETS_HINT,
        )
    else:
        raise DeidKeyError(
            f"no de-identification key (set {ENV_DEID_KEY}, 64 hex chars)",
            hint=DEMO_SECRETS_HINT,
        )
    if demo:
        _create_demo_signing_keys(config)
    return RunSecrets(keyring, keyring_path, DeidKeys.from_secret(deid_secret), deid_secret)


def export_passphrase_for_children(config: PipelineConfig) -> None:
    """Demo only: make the generated keyring passphrase visible to Prefect task processes.

    The encrypted Prefect result serializer opens the keyring from the environment, never from its
    own (persisted) fields; in production the operator sets ``SECURETRAIN_KEYRING_PASSPHRASE``.
    """
    if config.secrets.create_demo_secrets and not os.environ.get(ENV_PASSPHRASE):
        passphrase_file = keys_dir(config) / PASSPHRASE_FILE
        if passphrase_file.exists():
            os.environ[ENV_PASSPHRASE] = _read_private(passphrase_file).decode().strip()
