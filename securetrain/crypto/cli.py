"""``securetrain checkpoint ...`` and ``securetrain keys ...``.

Only typer/rich/stdlib at import time (fast ``--help``); crypto modules load inside the commands.
Nothing here prints key material: key ids and fingerprints only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, cast

import typer
from rich.markup import escape

from securetrain.audit.cli_support import AUDIT_DB_OPTION
from securetrain.cli.console import console, progress_bar
from securetrain.io.tapped import TappedReader

checkpoint_app = typer.Typer(help="Encrypt, decrypt, inspect and verify AEAD checkpoint containers.",
                             no_args_is_help=True)
keys_app = typer.Typer(help="Manage the local keyring of key-encryption keys (KEKs).", no_args_is_help=True)

KeyringOpt = typer.Option(None, "--keyring", "-k", envvar="SECURETRAIN_KEYRING",
                          help="Keyring file (passphrase from SECURETRAIN_KEYRING_PASSPHRASE); without it "
                               "Vault transit (SECURETRAIN_VAULT_TRANSIT_KEY), else SECURETRAIN_KEK is used.")


def _typed_io(fn: Any) -> Any:
    """OS errors (unwritable output directory, file vanished, disk full) become one typed error line."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            from securetrain.crypto.errors import CryptoError

            where = f": {exc.filename}" if exc.filename else ""
            raise CryptoError(f"{exc.strerror or exc}{where}") from None

    return wrapper


SignerOpt = typer.Option([], "--signer-key", help="Require a container signature by this Ed25519 public key "
                                                   "(64 hex chars, raw); repeatable.")


def _verify_keys(hex_keys: list[str]) -> list[Any]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from securetrain.crypto.errors import SignatureError

    keys = []
    for value in hex_keys:
        try:
            keys.append(Ed25519PublicKey.from_public_bytes(bytes.fromhex(value.strip())))
        except ValueError:
            raise SignatureError("--signer-key must be a raw Ed25519 public key as 64 hex characters") from None
    return keys


def _provider(keyring: Path | None) -> Any:
    from securetrain.crypto.keys import LocalKeyring, provider_from_env

    if keyring is not None:
        return LocalKeyring.load(keyring, _passphrase_existing())
    return provider_from_env(None)


def _run_stream(label: str, path: Path, body: Any, on_data: Any = None, *, size: int | None = None) -> Any:
    """``body`` on ``path`` (``-``: stdin) opened for reading, with a progress bar over ``size`` bytes
    (default: what is left of a regular file; a pipe's is unknown)."""
    with progress_bar() as bar, _open_source(path) as raw:
        if size is None:
            size = _regular_size(raw)
        task = bar.add_task(label, total=size, status="")

        def tap(chunk: Any) -> None:
            bar.advance(task, len(chunk))
            if on_data is not None:
                on_data(chunk)

        result = body(TappedReader(raw, tap))
        bar.update(task, completed=size, status="ok")  # None (a pipe's unknown size) leaves it as counted
    return result


# -- `-`: stdin as the input ---------------------------------------------------------------------
# Everything read from stdin is streamed (the container is authenticated one segment at a time),
# never buffered whole; inspect counts the bytes after the header in 1 MiB reads.

STDIN = "-"
STDIN_NAME = "<stdin>"  # how messages and the audit log name it


def _is_stdin(path: Path) -> bool:
    return str(path) == STDIN


def _label(path: Path) -> str:
    return STDIN_NAME if _is_stdin(path) else str(path)


def _stdin() -> io.BufferedReader:
    """The binary stdin that ``-`` names; a terminal is refused (the command would wait for typed bytes)."""
    import sys

    from securetrain.crypto.errors import CryptoError

    stream = cast(io.BufferedReader, sys.stdin.buffer)  # what CPython gives (typeshed says BinaryIO)
    if stream.isatty():
        raise CryptoError("`-` reads stdin, and stdin is a terminal: pipe or redirect the input into it",
                          hint="e.g. aws s3 cp s3://bucket/ckpt.stenc - | securetrain checkpoint verify -, "
                               "or securetrain checkpoint verify - < ckpt.stenc")
    return stream


@contextlib.contextmanager
def _open_source(path: Path) -> Iterator[io.BufferedReader]:
    if _is_stdin(path):
        yield _stdin()  # not closed: it is the process's
        return
    with open(path, "rb") as raw:
        yield raw


def _regular_size(stream: io.BufferedReader) -> int | None:
    """Bytes left in ``stream`` if it is a regular file (a path, or stdin redirected from one); None
    for a pipe, FIFO, device or in-memory stream, whose size is not known in advance."""
    import stat

    try:
        st = os.fstat(stream.fileno())
        return st.st_size - stream.tell() if stat.S_ISREG(st.st_mode) else None
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def _check_stdio(sources: list[Path], output: Path | None = None, *, what: str = "") -> None:
    """Refusals that need no key, made before stdin is read, a key opened or anything written."""
    from securetrain.crypto.errors import CryptoError

    if output is not None and _is_stdin(output):
        raise CryptoError(f"OUT `-` (stdout) is not supported: {what}",
                          hint="write a file and read or copy that (a file really named '-': pass its absolute "
                               "path)")
    if sum(_is_stdin(p) for p in sources) > 1:
        raise CryptoError("`-` (stdin) is given more than once; stdin can be read only once")
    if any(_is_stdin(p) for p in sources):
        _stdin()


def _count_rest(src: io.BufferedReader) -> int:
    """The bytes left in ``src``: a regular file's remaining size, else counted in bounded reads (a pipe)."""
    size = _regular_size(src)
    if size is not None:
        return size
    total = 0
    while chunk := src.read(1 << 20):
        total += len(chunk)
    return total


def _existing_or_stdin(value: Any) -> Any:
    """``exists=True`` for input paths, except ``-`` (stdin). Not typer's ``allow_dash``: typer 0.29
    compares the already-converted ``Path`` with ``"-"``, so it never matches a ``Path`` argument."""
    for path in value if isinstance(value, list) else [value]:
        if not _is_stdin(path) and not os.path.exists(path):
            raise typer.BadParameter(f"file {str(path)!r} does not exist.")
    return value


def _is_regular(path: Path) -> bool:
    import stat

    return stat.S_ISREG(path.stat().st_mode)


def _plaintext_length(source: Path, declared: int | None) -> int:
    """How many bytes ``encrypt`` reads from ``source``: a regular file's size (``--length``, if
    given, must be it); a pipe, FIFO or device has no size, so ``--length`` must say it, because the
    container declares the plaintext length in its header, before the first segment."""
    from securetrain.crypto.errors import CryptoError

    if _is_stdin(source):
        size = _regular_size(_stdin())  # stdin redirected from a file (`- < FILE`) has one
    else:
        size = source.stat().st_size if _is_regular(source) else None
    if size is not None:
        if declared is not None and declared != size:
            raise CryptoError(f"--length {declared} is not the size of {_label(source)} ({size} bytes)",
                              hint="leave --length out for a regular file")
        return size
    if declared is None:
        raise CryptoError(
            f"cannot encrypt {_label(source)}: it is a pipe, FIFO or device, whose size is not known in advance, "
            "and the container declares the plaintext length in its header before the first segment",
            hint="pass --length N with the exact number of bytes it will deliver (e.g. --length $(stat -c %s FILE) "
                 "for cat FILE | ...), or encrypt a regular file")
    return declared


@checkpoint_app.command("encrypt")
@_typed_io
def encrypt_cmd(
    source: Path = typer.Argument(..., dir_okay=False, callback=_existing_or_stdin,
                                  help="Plaintext file (e.g. .safetensors), or a pipe/FIFO or - (stdin) with "
                                       "--length."),
    output: Path = typer.Argument(..., help="Encrypted container to write (atomically)."),
    keyring: Path | None = KeyringOpt,
    key_id: str | None = typer.Option(None, help="KEK id to wrap with (default: the current key)."),
    segment_size: int = typer.Option(1 << 20, help="Plaintext bytes per AES-GCM segment."),
    length: int | None = typer.Option(
        None, "--length", min=0,
        help="Exact plaintext bytes a pipe or FIFO source delivers (required for one: the container header "
             "declares the length up front); a regular file's size otherwise. More or fewer bytes: refused, "
             "nothing written."),
) -> None:
    """Encrypt any file (or a pipe of known length, streamed) into the streaming AEAD container."""
    from securetrain.crypto._container import encrypt_stream
    from securetrain.crypto.private_file import private_writer

    _check_stdio([source], output, what="the container is written atomically to a file")
    size = _plaintext_length(source, length)  # before any key is opened or output created
    provider = _provider(keyring)
    with private_writer(output) as out:
        header = _run_stream("encrypt", source, lambda src: encrypt_stream(
            src, out, provider, length=size, segment_size=segment_size, key_id=key_id), size=size)
    console.print(f"wrote {output} ({header.total_length} bytes, key {header.key_ids[0]})")


@checkpoint_app.command("decrypt")
@_typed_io
def decrypt_cmd(
    source: Path = typer.Argument(..., dir_okay=False, callback=_existing_or_stdin,
                                  help="Container file, or - to read it from stdin (streamed)."),
    output: Path = typer.Argument(..., help="Plaintext file to write (only if every segment verifies)."),
    keyring: Path | None = KeyringOpt,
    signer_key: list[str] = SignerOpt,
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Decrypt a container; the output appears only after the whole file authenticated.

    The plaintext is written to an anonymous file (O_TMPFILE) that gets its name only at the end,
    so a killed decrypt leaves nothing; the ciphertext is hashed as it is decrypted (bounded memory).
    """
    import hashlib

    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto._container import decrypt_stream
    from securetrain.crypto.private_file import private_writer, sweep_stale_temps

    _check_stdio([source], output, what="plaintext is released only once every segment verified, so it is "
                                        "written to a file that appears only then; a stream reader would see "
                                        "unverified data before a failure")
    provider = _provider(keyring)
    verify_keys = _verify_keys(signer_key)
    sweep_stale_temps(output.parent, prefix=output.name)  # a SIGKILLed earlier decrypt's temp (no O_TMPFILE)
    sha = hashlib.sha256()
    target = STDIN_NAME if _is_stdin(source) else source.name
    with command_recorder(audit_db) as audit:
        try:
            with private_writer(output) as out:
                header = _run_stream("decrypt", source, lambda src: decrypt_stream(src, out, provider,
                                                                             verify_keys=verify_keys),
                                     on_data=sha.update)
        except Exception as exc:
            audit.record("checkpoint.decrypt", target, outcome="failure", details={"error": type(exc).__name__})
            raise
        # Decrypting a checkpoint puts model weights in plaintext on disk: always worth a record.
        # The digest is of the bytes that were actually authenticated and decrypted.
        digest = sha.hexdigest()
        audit.record("checkpoint.decrypt", target, details={
            "key_ids": [s.key_id for s in header.stanzas], "ciphertext_sha256": digest,
            "plaintext_bytes": header.plaintext_length})
    console.print(f"wrote {output} ({header.plaintext_length} bytes)")


@checkpoint_app.command("inspect")
@_typed_io
def inspect_cmd(
    path: Path = typer.Argument(..., dir_okay=False, callback=_existing_or_stdin,
                                help="Container file, or - to read it from stdin (read to the end to count it)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the header (no key needed, nothing authenticated, no secrets shown)."""
    from securetrain.crypto._container import inspect_file, read_header

    _check_stdio([path])
    if _is_stdin(path):
        # A pipe has no size: count the rest (bounded reads) so file_bytes is what the file would show,
        # and so the writer (e.g. aws s3 cp) is not cut off with a broken pipe.
        src = _stdin()
        header = read_header(src)
        file_bytes = header.header_length + _count_rest(src)
    else:
        header = inspect_file(path)
        file_bytes = path.stat().st_size
    info = header.describe()
    info["file_bytes"] = file_bytes
    if as_json:
        console.print_json(json.dumps(info))
        return
    for key, value in info.items():
        if key == "keys" and isinstance(value, list):
            for k in value:
                console.print(f"key: {k['key_id']} ({k['wrap']}, KEK fingerprint {k['kek_fingerprint']})",
                              markup=False, highlight=False)
        else:
            console.print(f"{key}: {value}", markup=False, highlight=False)


@checkpoint_app.command("verify")
@_typed_io
def verify_cmd(
    paths: list[Path] = typer.Argument(..., dir_okay=False, callback=_existing_or_stdin,
                                       help="Container files; - reads one from stdin (streamed)."),
    keyring: Path | None = KeyringOpt,
    signer_key: list[str] = SignerOpt,
) -> None:
    """Authenticate the header and every segment (and the signature) without writing any plaintext.

    Every file is checked, also after a bad one; each bad file is named, and the exit status is 2
    (the first failure's error) if any failed.
    """
    from securetrain.cli.console import err_console
    from securetrain.crypto._container import verify_stream
    from securetrain.crypto.errors import CryptoError

    _check_stdio(paths)
    provider = _provider(keyring)
    verify_keys = _verify_keys(signer_key)
    failures: list[tuple[Path, CryptoError]] = []
    for path in paths:
        name = _label(path)
        try:
            header = _run_stream(f"verify {STDIN_NAME if _is_stdin(path) else path.name}", path,
                                 lambda src: verify_stream(src, provider, verify_keys=verify_keys))
        except CryptoError as exc:
            failures.append((path, exc))
            if len(paths) > 1:
                err_console.print(f"[red]FAILED[/] {escape(name)}: {escape(str(exc))}", highlight=False,
                                  soft_wrap=True)
            continue
        console.print(f"[green]OK[/] {escape(name)}: {header.segment_count} segments, "
                      f"key {escape(header.key_ids[0])}")
    if failures:
        path, first = failures[0]
        prefix = f"{_label(path)}: " if len(paths) == 1 else \
            f"{len(failures)} of {len(paths)} files failed verification; first {_label(path)}: "
        first.args = (prefix + str(first.args[0] if first.args else ""), *first.args[1:])
        raise first


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
@_typed_io
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


@keys_app.command("rotate")
@_typed_io
def keys_rotate(
    keyring: Path = KeyringReq,
    rewrap: list[Path] = typer.Option([], "--rewrap", help="Containers or directories (*.stenc) to re-wrap."),
    new_key_id: str | None = typer.Option(None, "--key-id", help="Id of the new KEK."),
    remove_old: bool = typer.Option(False, help="Move the previous keys to the escrow file once every container "
                                                "under --rewrap is re-wrapped and none still uses them."),
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Create a new current KEK and re-wrap containers' data keys (payloads are not re-encrypted).

    Refused before any change: a --rewrap path that does not exist, --rewrap paths with no
    containers, --remove-old without --rewrap. Removed keys go to <keyring>.escrow until purged.
    """
    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.rotation import find_containers, rotate_keyring

    passphrase = _passphrase_existing()
    total = len(find_containers([p for p in rewrap if p.exists()]))
    with command_recorder(audit_db) as audit, progress_bar() as bar:
        task = bar.add_task("re-wrap", total=total, status="")
        result = rotate_keyring(keyring, passphrase, rewrap=rewrap, new_key_id=new_key_id, remove_old=remove_old,
                                audit=audit, on_file=lambda p: bar.update(task, advance=1, status=p.name))
    key = result.new_key
    console.print(f"new current key {key.key_id} (fingerprint {key.fingerprint})", markup=False, highlight=False)
    console.print(f"re-wrapped {len(result.rewrapped)} file(s)")
    if result.removed:
        console.print(f"removed {len(result.removed)} old key(s) from the keyring; kept in {result.escrow} "
                      "until `securetrain keys escrow purge`", markup=False, highlight=False)


escrow_app = typer.Typer(help="Keys removed by rotation, kept encrypted in <keyring>.escrow until purged.",
                         no_args_is_help=True)
keys_app.add_typer(escrow_app, name="escrow")


@escrow_app.command("list")
@_typed_io
def escrow_list_cmd(keyring: Path = KeyringReq) -> None:
    """List escrowed key ids and fingerprints (never key bytes)."""
    from securetrain.crypto.rotation import escrow_list, escrow_path

    keys = escrow_list(keyring, _passphrase_existing())
    if not keys:
        console.print(f"no escrowed keys ({escrow_path(keyring)} does not exist)", markup=False, highlight=False)
    for key in keys:
        console.print(f"{key.key_id}  fingerprint {key.fingerprint}", markup=False, highlight=False)


@escrow_app.command("purge")
@_typed_io
def escrow_purge_cmd(
    keyring: Path = KeyringReq,
    key_id: list[str] = typer.Option([], "--key-id", help="Escrowed key to destroy (repeatable)."),
    purge_all: bool = typer.Option(False, "--all", help="Destroy every escrowed key."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Destroy escrowed keys for good: containers still wrapped under them become undecryptable."""
    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.rotation import purge_escrow

    passphrase = _passphrase_existing()
    if not yes:
        typer.confirm("Destroy the escrowed key(s)? Files still wrapped under them become undecryptable", abort=True)
    with command_recorder(audit_db) as audit:
        purged = purge_escrow(keyring, passphrase, key_ids=key_id, purge_all=purge_all, audit=audit)
    console.print(f"purged {len(purged)} key(s): {', '.join(purged)}", markup=False, highlight=False)


@escrow_app.command("restore")
@_typed_io
def escrow_restore_cmd(
    keyring: Path = KeyringReq,
    key_id: str = typer.Option(..., "--key-id", help="Escrowed key to put back into the keyring."),
    audit_db: Optional[str] = AUDIT_DB_OPTION,
) -> None:
    """Move an escrowed key back into the keyring (the current key stays current)."""
    from securetrain.audit.cli_support import command_recorder
    from securetrain.crypto.rotation import restore_from_escrow

    passphrase = _passphrase_existing()
    with command_recorder(audit_db) as audit:
        key = restore_from_escrow(keyring, key_id, passphrase, audit=audit)
    console.print(f"restored {key.key_id} (fingerprint {key.fingerprint})", markup=False, highlight=False)


@keys_app.command("list")
@_typed_io
def keys_list(keyring: Path = KeyringReq) -> None:
    """List key ids, fingerprints and creation times (never key bytes)."""
    import time

    from rich.table import Table

    from securetrain.crypto.keys import LocalKeyring

    ring = LocalKeyring.load(keyring, _passphrase_existing())
    table = Table("key id", "fingerprint", "created (UTC)", "current")
    for key in ring.keys():  # noqa: SIM118 (LocalKeyring.keys() is a method, not a dict)
        table.add_row(key.key_id, key.fingerprint, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(key.created)),
                      "*" if key.key_id == ring.current_key_id() else "")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(checkpoint_app, name="checkpoint")
    app.add_typer(keys_app, name="keys")
