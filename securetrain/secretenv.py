"""Secrets from the environment, given directly or as a ``*_FILE`` path (Compose / Kubernetes secrets).

Docker Compose ``secrets:`` mount each secret as a file under ``/run/secrets/``; the convention of the
official images is a ``<NAME>_FILE`` variable naming that file. :func:`resolve_secret_files` turns
every ``SECURETRAIN_<X>_FILE`` into ``SECURETRAIN_<X>`` for this process (and the processes it
starts), so every reader of ``SECURETRAIN_<X>`` keeps working unchanged; it runs at the start of the
``securetrain`` command, of the Prefect flow and of :func:`securetrain.pipeline.load_run_secrets`.
Setting both ``<X>`` and ``<X>_FILE`` is an error (which one is meant is unclear). The value is the
file's content without its trailing newline; it is never printed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from securetrain.errors import ConfigError

PREFIX = "SECURETRAIN_"
SUFFIX = "_FILE"
#: Variables whose value may come from a file. Anything else named ``SECURETRAIN_*_FILE`` (for
#: example a path setting that merely ends in ``_FILE``) is left alone.
SECRET_VARIABLES = (
    "SECURETRAIN_KEYRING_PASSPHRASE",
    "SECURETRAIN_KEK",
    "SECURETRAIN_DEID_KEY",
    "SECURETRAIN_MASK_KEY",
    "SECURETRAIN_AUDIT_URL",
    "VAULT_TOKEN",
)
MAX_SECRET_BYTES = 64 * 1024


class SecretFileError(ConfigError):
    """A ``*_FILE`` secret variable names a file that cannot be used."""


def read_secret_file(variable: str, path: str) -> str:
    """The content of a secret file without its trailing newline (one-line errors, no content shown)."""
    file = Path(path)
    try:
        data = file.read_bytes()[: MAX_SECRET_BYTES + 1]
    except OSError as exc:
        raise SecretFileError(f"{variable}{SUFFIX}: cannot read {path}: {exc.strerror}",
                              hint="mount the secret (Compose `secrets:`) or fix the path") from None
    if len(data) > MAX_SECRET_BYTES:
        raise SecretFileError(f"{variable}{SUFFIX}: {path} is larger than {MAX_SECRET_BYTES} bytes",
                              hint="point it at the secret file itself")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretFileError(f"{variable}{SUFFIX}: {path} is not UTF-8 text", hint="store the secret as text") from None
    text = text.rstrip("\r\n")
    if not text:
        raise SecretFileError(f"{variable}{SUFFIX}: {path} is empty", hint="write the secret into it")
    return text


def secret_env(variable: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """``variable``'s value, or the content of the file ``variable_FILE`` names, or ``None``."""
    env = os.environ if environ is None else environ
    direct, file = env.get(variable), env.get(variable + SUFFIX)
    if direct and file:
        raise SecretFileError(f"both {variable} and {variable}{SUFFIX} are set", hint="set only one of them")
    if file:
        return read_secret_file(variable, file)
    return direct or None


def resolve_secret_files(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each secret variable from its ``*_FILE`` twin; return the names set (never values)."""
    env = os.environ if environ is None else environ
    resolved = []
    for variable in SECRET_VARIABLES:
        if env.get(variable + SUFFIX):
            value = secret_env(variable, env)
            assert value is not None
            env[variable] = value
            del env[variable + SUFFIX]  # resolved once; children see the plain variable
            resolved.append(variable)
    return resolved
