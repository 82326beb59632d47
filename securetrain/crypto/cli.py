"""``securetrain checkpoint ...`` and ``securetrain keys ...``.

Only typer/rich/stdlib at import time (fast ``--help``); crypto modules load inside the commands.
Nothing here prints key material: key ids and fingerprints only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Optional

import typer
from rich.markup import escape

from securetrain.audit.cli_support import AUDIT_DB_OPTION
from securetrain.cli.console import console, progress_bar
from securetrain.io.tapped import TappedReader

checkpoint_app = typer.Typer(help="Encrypt, decrypt, inspect and verify AEAD checkpoint containers.",
                             no_args_is_help=True)
keys_app = typer.Typer(help="Manage the local keyring of key-encryption keys (KEKs).", no_args_is_help=True)

KeyringOpt = typer.Option(None, "--keyring", "-k", envvar="SECURETRAIN_KEYRING",
                          help="Keyring file (passphrase from SECURETRAIN_KEYRING_PASSPHRASE); "
                               "without it SECURETRAIN_KEK is used.")


def _provider(keyring: Path | None) -> Any:
    from securetrain.crypto.keys import LocalKeyring, provider_from_env

    if keyring is not None:
        return LocalKeyring.load(keyring, _passphrase_existing())
    return provider_from_env(None)


def _run_stream(label: str, path: Path, body: Any) -> Any:
    size = path.stat().st_size
    with progress_bar() as bar, open(path, "rb") as raw:
        task = bar.add_task(label, total=size, status="")
        result = body(TappedReader(raw, lambda chunk: bar.advance(task, len(chunk))))
        bar.update(task, completed=size, status="ok")
    return result


@checkpoint_app.command("encrypt")
def encrypt_cmd(
    source: Path = typer.Argument(..., exists=True, dir_okay=False, help="Plaintext file (e.g. .safetensors)."),
    output: Path = typer.Argument(..., help="Encrypted container to write (atomically)."),
    keyring: Path | None = KeyringOpt,
    key_id: str | None = typer.Option(None, help="KEK id to wrap with (default: the current key)."),
    segment_size: int = typer.Option(1 << 20, help="Plaintext bytes per AES-GCM segment."),
) -> None:
    """Encrypt any file into the streaming AEAD container."""
    from securetrain.crypto.stream import encrypt_stream
    from securetrain.io.atomic import atomic_writer

    provider = _provider(keyring)
    with atomic_writer(output) as out:
        header = _run_stream("encrypt", source, lambda src: encrypt_stream(
            src, out, provider, length=source.stat().st_size, segment_size=segment_size, key_id=key_id))
    console.print(f"wrote {output} ({header.total_length} bytes, key {header.key_ids[0]})")


@checkpoint_app.command("decrypt")
def decrypt_cmd(
    source: Path = typer.Argument(..., exists=True, dir_okay=False),
    output: Path = typer.Argument(..., help="Plaintext file to write (only if every segment verifies)."),
    keyring: Path | None = KeyringOpt,
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Decrypt a container; the output appears only after the whole file authenticated."""
    import hashlib

    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.stream import decrypt_stream
    from securetrain.io.atomic import atomic_writer

    provider = _provider(keyring)
    with command_recorder(audit_db) as audit:
        try:
            with atomic_writer(output) as out:
                header = _run_stream("decrypt", source, lambda src: decrypt_stream(src, out, provider))
        except Exception as exc:
            audit.record("checkpoint.decrypt", source.name, outcome="failure", details={"error": type(exc).__name__})
            raise
        # Decrypting a checkpoint puts model weights in plaintext on disk: always worth a record.
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        audit.record("checkpoint.decrypt", source.name, details={
            "key_ids": [s.key_id for s in header.stanzas], "ciphertext_sha256": digest,
            "plaintext_bytes": header.plaintext_length})
    console.print(f"wrote {output} ({header.plaintext_length} bytes)")


@checkpoint_app.command("inspect")
def inspect_cmd(
    path: Path = typer.Argument(..., exists=True, dir_okay=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the header (no key needed, nothing authenticated, no secrets shown)."""
    from securetrain.crypto.stream import inspect_file

    info = inspect_file(path).describe()
    info["file_bytes"] = path.stat().st_size
    if as_json:
        console.print_json(json.dumps(info))
        return
    for key, value in info.items():
        if key == "keys":
            for k in value:  # type: ignore[attr-defined]
                console.print(f"key: {k['key_id']} ({k['wrap']}, KEK fingerprint {k['kek_fingerprint']})",
                              markup=False, highlight=False)
        else:
            console.print(f"{key}: {value}", markup=False, highlight=False)


@checkpoint_app.command("verify")
def verify_cmd(
    paths: list[Path] = typer.Argument(..., exists=True, dir_okay=False),
    keyring: Path | None = KeyringOpt,
) -> None:
    """Authenticate the header and every segment without writing any plaintext."""
    from securetrain.crypto.stream import verify_stream

    provider = _provider(keyring)
    for path in paths:
        header = _run_stream(f"verify {path.name}", path, lambda src: verify_stream(src, provider))
        console.print(f"[green]OK[/] {escape(str(path))}: {header.segment_count} segments, "
                      f"key {escape(header.key_ids[0])}")


# -- keys ------------------------------------------------------------------------------------


def _require_terminal() -> None:
    """No terminal (a script, cron, CI): say which variable to set instead of prompting."""
    import sys

    if not sys.stdin.isatty():
        from securetrain.crypto.errors import KeyringError

        raise KeyringError("no terminal to ask for the keyring passphrase",
                           hint="set SECURETRAIN_KEYRING_PASSPHRASE (or SECURETRAIN_KEYRING_PASSPHRASE_FILE)")


def _passphrase_for_new() -> str:
    value = os.environ.get("SECURETRAIN_KEYRING_PASSPHRASE")
    if value:
        return value
    _require_terminal()
    return str(typer.prompt("New keyring passphrase", hide_input=True, confirmation_prompt=True))


def _passphrase_existing() -> str | None:
    if os.environ.get("SECURETRAIN_KEYRING_PASSPHRASE"):
        return None  # keys.py reads it
    _require_terminal()
    return str(typer.prompt("Keyring passphrase", hide_input=True))


KeyringReq = typer.Option(..., "--keyring", "-k", envvar="SECURETRAIN_KEYRING", help="Keyring file.")


@keys_app.command("init")
def keys_init(
    keyring: Path = KeyringReq,
    key_id: str | None = typer.Option(None, help="Id of the first KEK (default: kek-<date>-<random>)."),
    force: bool = typer.Option(False, help="Overwrite an existing keyring (its keys are lost!)."),
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Create a keyring (mode 0600) holding one fresh 256-bit KEK."""
    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.errors import KeyringError
    from securetrain.crypto.keys import LocalKeyring, keyring_lock

    passphrase = _passphrase_for_new()
    with keyring_lock(keyring):
        if keyring.exists() and not force:
            raise KeyringError(f"{keyring} already exists", hint="use --force to replace it (its keys are lost)")
        ring = LocalKeyring.create(key_id)
        ring.save(keyring, passphrase)
    key = ring.keys()[0]
    with command_recorder(audit_db) as audit:
        audit.record("key.create", f"keyring:{keyring.name}", details={
            "key_id": key.key_id, "key_fingerprint": key.fingerprint, "replaced_existing": force})
    console.print(f"created {keyring} with key {key.key_id} (fingerprint {key.fingerprint})")


def _containers(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.stenc") if q.is_file())
        elif p.is_file():
            found.append(p)
    return found


@keys_app.command("rotate")
def keys_rotate(
    keyring: Path = KeyringReq,
    rewrap: list[Path] = typer.Option([], "--rewrap", help="Containers or directories (*.stenc) to re-wrap."),
    new_key_id: str | None = typer.Option(None, "--key-id", help="Id of the new KEK."),
    remove_old: bool = typer.Option(False, help="Drop the previous keys once every re-wrap succeeded."),
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Create a new current KEK and re-wrap containers' data keys (payloads are not re-encrypted)."""
    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.keys import LocalKeyring, keyring_lock
    from securetrain.crypto.stream import rewrap_file

    passphrase = _passphrase_existing()
    files = _containers(rewrap)
    with keyring_lock(keyring), command_recorder(audit_db) as audit:  # lock held: no concurrent rotation
        ring = LocalKeyring.load(keyring, passphrase)
        old_ids = ring.key_ids()
        key = ring.rotate(new_key_id)
        ring.save(keyring, passphrase)  # the new key is durable before any file depends on it
        console.print(f"new current key {key.key_id} (fingerprint {key.fingerprint})")
        with progress_bar() as bar:
            task = bar.add_task("re-wrap", total=len(files), status="")
            for path in files:
                rewrap_file(path, ring, audit=audit)
                bar.update(task, advance=1, status=path.name)
        if remove_old:
            for kid in old_ids:
                ring.remove(kid)
            ring.save(keyring, passphrase)
            console.print(f"removed {len(old_ids)} old key(s)")
        audit.record("key.rotate", f"keyring:{keyring.name}", details={
            "new_key_id": key.key_id, "key_fingerprint": key.fingerprint, "previous_key_ids": old_ids,
            "rewrapped": len(files), "removed_old": remove_old})
    console.print(f"re-wrapped {len(files)} file(s)")


@keys_app.command("list")
def keys_list(keyring: Path = KeyringReq) -> None:
    """List key ids, fingerprints and creation times (never key bytes)."""
    import time

    from rich.table import Table

    from securetrain.crypto.keys import LocalKeyring

    ring = LocalKeyring.load(keyring, _passphrase_existing())
    table = Table("key id", "fingerprint", "created (UTC)", "current")
    for key in ring.keys():
        table.add_row(key.key_id, key.fingerprint, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(key.created)),
                      "*" if key.key_id == ring.current_key_id() else "")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(checkpoint_app, name="checkpoint")
    app.add_typer(keys_app, name="keys")
