"""``securetrain audit ...``: verify, show, export, prove, checkpoint, pubkey, keygen, rotate-key.

Only typer/rich/stdlib at import time; the log and SQLAlchemy load inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

audit_app = typer.Typer(help="Tamper-evident audit log: verify, inspect, export, prove.", no_args_is_help=True)

_DB = typer.Option(None, "--db", help="Database URL or SQLite path (default: $SECURETRAIN_AUDIT_URL or <data dir>/audit.db).")


_SIGNING_KEY = typer.Option(
    None, "--signing-key", envvar="SECURETRAIN_AUDIT_KEY",
    help="The log's Ed25519 signing key (PEM), e.g. runs/demo/keys/audit-signing.pem "
    "(default: $SECURETRAIN_AUDIT_KEY or <data dir>/audit_signing_key.pem).",
)


def _signing_key_path(signing_key: Optional[Path]) -> Path:
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.log import data_dir

    path = signing_key or data_dir() / "audit_signing_key.pem"
    if not path.is_file():
        # Never create a key here: a fresh key would "verify" nothing and sign a forged history.
        raise AuditConfigError(
            f"no audit signing key at {path}",
            hint="pass --signing-key (a pipeline run keeps it in <run_dir>/keys/audit-signing.pem) or --public-key",
        )
    return path


_SCHEMA = typer.Option(
    None, "--schema", envvar="SECURETRAIN_AUDIT_SCHEMA",
    help="PostgreSQL schema of the log (default securetrain_audit; ignored for SQLite).",
)

#: Exit status of ``audit verify`` when the log is self-consistent but was checked only against the
#: key shipped inside the export (anyone can rebuild and re-sign a forged export with a new key).
EXIT_UNTRUSTED = 3


def _open(db: Optional[str], signing_key: Optional[Path] = None, *, need_key: bool = False,  # noqa: ANN202
          schema: Optional[str] = None):
    from securetrain.audit.log import AuditLog

    key = _signing_key_path(signing_key) if need_key else signing_key
    # Reading commands never create an (empty, "valid") log.
    return AuditLog(db, create=False, signing_key=key, schema=schema)


def _read_keys(paths: list[Path]):  # noqa: ANN202
    """The trusted keys (several after a rotation: the verifier follows hand-overs from any of them)."""
    keys = [_read_key(p) for p in paths]
    return None if not keys else keys[0] if len(keys) == 1 else keys


def _read_key(public_key: Optional[Path]):  # noqa: ANN202
    if public_key is None:
        return None
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.keys import load_public_key_pem
    from securetrain.audit.note import parse_verifier_key

    try:
        raw = public_key.read_bytes()
    except OSError as exc:
        raise AuditConfigError(f"cannot read the public key {public_key}: {exc.strerror}") from None
    if b"BEGIN PUBLIC KEY" in raw:
        return load_public_key_pem(raw)
    try:
        return parse_verifier_key(raw.decode())[1]
    except (ValueError, UnicodeDecodeError) as exc:
        raise AuditConfigError(f"{public_key} is neither a PEM public key nor a verifier key: {exc}") from None


def _read_notes(paths: list[Path]) -> list[str]:
    """Each file may hold one note or many concatenated (an anchor file such as audit-anchors.notes)."""
    from securetrain.audit.errors import AuditConfigError

    blobs = []
    for path in paths:
        try:
            blobs.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise AuditConfigError(f"cannot read the checkpoint file {path}: {type(exc).__name__}") from None
    return blobs


def verify(
    db: Optional[str] = _DB,
    export: Optional[Path] = typer.Option(None, "--export", help="Verify an export directory instead of a database."),
    checkpoint: list[Path] = typer.Option(
        [], "--checkpoint", help="Checkpoint note(s) you kept earlier, or an anchor file of concatenated notes (repeatable)."),
    public_key: list[Path] = typer.Option(
        [], "--public-key", help="The log's public key you hold (PEM or verifier-key file); required with --export. "
        "Repeatable; checkpoints by later keys are accepted through the log's signed key hand-overs."),
    trust_embedded_key: bool = typer.Option(
        False, "--trust-embedded-key",
        help="With --export and no --public-key: accept the export's own key (proves self-consistency only)."),
    since_checkpoint: Optional[Path] = typer.Option(
        None, "--since-checkpoint",
        help="With --export: incremental check from this held checkpoint (or anchor file): only newer entries are parsed."),
    workers: Optional[int] = typer.Option(
        None, "--workers", min=1,
        help="With --export: processes checking entries (default: CPU count for 8 MiB of entries or more, else 1)."),
    signing_key: Optional[Path] = _SIGNING_KEY,
    schema: Optional[str] = _SCHEMA,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Recompute every hash, Merkle root and signature; exit 1 naming the first bad entry.

    Exit status: 0 verified, 1 verification failed, 2 unusable input, 3 export self-consistent
    but checked only against its own embedded key (UNTRUSTED; pass --public-key).
    """
    from securetrain.cli.console import console, err_console, progress_bar
    from securetrain.errors import SecureTrainError

    try:
        trusted = _read_notes(checkpoint)
        key = _read_keys(public_key)
        with progress_bar(transient=True) as bar:
            task = bar.add_task("verifying audit log", total=None, status="")

            def tick(n: int) -> None:
                bar.update(task, completed=n, status=f"{n} entries")

            if export is not None:
                from securetrain.audit.export import verify_export

                since = _read_notes([since_checkpoint])[0] if since_checkpoint is not None else None
                report = verify_export(export, public_key=key, trusted_notes=trusted, on_entry=tick,
                                       since_checkpoint=since, workers=workers)
            else:
                if since_checkpoint is not None:
                    from securetrain.audit.errors import AuditConfigError

                    raise AuditConfigError("--since-checkpoint needs --export (incremental database checks are not "
                                           "supported yet)", hint="export the log, then verify the export")
                with _open(db, signing_key, need_key=key is None, schema=schema) as log:
                    report = log.verify(trusted_checkpoints=trusted, public_key=key,
                                        on_entry=lambda n: tick(n) if n % 4096 == 0 else None)
    except SecureTrainError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    untrusted = not report.trusted and not trust_embedded_key
    if as_json:
        console.print_json(json.dumps(report.as_dict()))
    elif report.ok:
        what = "self-consistent (UNTRUSTED key)" if not report.trusted else "OK"
        console.print(f"[{'yellow' if not report.trusted else 'green'}]{what}[/] {report.entries} entries, "
                      f"{report.checkpoints_verified} checkpoints, {report.trusted_verified} trusted checkpoints "
                      f"verified; root {report.root_hash}")
    for warning in [] if as_json else report.warnings:  # --json: stdout is exactly one JSON document
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if not report.ok:
        if not as_json:
            err_console.print(f"[bold red]FAILED:[/] {report.error}", highlight=False)
        raise typer.Exit(1)
    if untrusted:
        if as_json:
            raise typer.Exit(EXIT_UNTRUSTED)
        err_console.print("[bold red]UNTRUSTED:[/] the export was checked only against the public key it ships with; "
                          "a forger re-signs with their own key. Pass --public-key with the key you hold "
                          "(or --trust-embedded-key to accept self-consistency only).", highlight=False)
        raise typer.Exit(EXIT_UNTRUSTED)


def show(db: Optional[str] = _DB, tail: int = typer.Option(20, "--tail", "-n", help="Show the last N entries."),
         schema: Optional[str] = _SCHEMA) -> None:
    """Print the newest entries as a table."""
    from rich.table import Table
    from rich.text import Text

    from securetrain.cli.console import console

    with _open(db, schema=schema) as log:
        entries = log.tail(tail)
    with_view = any(e.server_view is not None for e in entries)  # PostgreSQL: the server's view of the writer
    table = Table(title="audit log")
    columns = ["seq", "time (UTC)", "actor", "host", "action", "resource", "outcome", "details", "hash"]
    if with_view:
        columns[4:4] = ["server role@addr", "server time"]
    for col in columns:
        table.add_column(col, overflow="fold")
    for e in entries:
        cells = [str(e.seq), e.ts, e.actor, e.hostname, e.action, e.resource, e.outcome,
                 json.dumps(e.details, sort_keys=True)[:80], e.entry_hash[:12]]
        if with_view:
            view = e.server_view or {}
            cells[4:4] = [f"{view.get('role', '-')}@{view.get('addr') or 'local'}" if view else "-",
                          str(view.get("time", "-"))]
        # Text, not markup: entry fields are data (a resource such as "[/x]" must print as written).
        table.add_row(*(Text(str(c)) for c in cells))
    console.print(table)


def export(
    outdir: Path = typer.Argument(..., help="Directory to write the export to."), db: Optional[str] = _DB,
    signing_key: Optional[Path] = _SIGNING_KEY, schema: Optional[str] = _SCHEMA,
) -> None:
    """Write entries (exact hashed bytes), checkpoints, public key and manifest for offline audit."""
    from securetrain.cli.console import console

    with _open(db, signing_key, need_key=True, schema=schema) as log:
        out = log.export(outdir)
        latest = log.latest_checkpoint()  # export() signs a checkpoint first, so there is one
        size = latest.tree_size if latest is not None else 0
    console.print(f"exported {size} entries to {out}; verify with: python audit/verify_audit.py {out} "
                  "--vkey '<the verifier key you hold>'")


def prove(
    seq: Optional[int] = typer.Argument(None, help="Entry to prove (omit with --consistency)."), db: Optional[str] = _DB,
    size: Optional[int] = typer.Option(
        None, "--size", help="Tree size to prove against (default: the latest checkpoint's); the proof's "
                             "log_size is the log's own size."),
    consistency: Optional[int] = typer.Option(
        None, "--consistency", help="Print a consistency proof from this older tree size instead."),
    schema: Optional[str] = _SCHEMA,
) -> None:
    """Print an RFC 6962 inclusion proof for entry SEQ (or a consistency proof) as JSON, with the signed checkpoint
    and the key hand-overs that lead to its key.

    Check it offline with: python audit/verify_audit.py --proof FILE --vkey KEY.
    """
    from securetrain.audit.errors import AuditConfigError

    from securetrain.audit.merkle import NO_PROOF_FROM_EMPTY_TREE

    if (seq is None) == (consistency is None):
        raise AuditConfigError("give either SEQ (inclusion proof) or --consistency OLD_SIZE")
    if consistency is not None and consistency < 1:  # before the log is opened: nothing to look up
        raise AuditConfigError(f"--consistency {consistency}: {NO_PROOF_FROM_EMPTY_TREE}",
                               hint="--consistency OLD_SIZE must be at least 1: the size of a checkpoint you hold")
    with _open(db, schema=schema) as log:
        if size is None:
            cp = log.latest_checkpoint()
            size = cp.tree_size if cp is not None else log.size()
        if consistency is not None:
            proof = log.consistency_proof(consistency, size)
            target = proof["new_size"]
        else:
            proof = log.inclusion_proof(seq, size)
            target = proof["tree_size"]
        signed = [c for c in log.checkpoints() if c.tree_size == target]
        if signed:
            proof["checkpoint"] = signed[-1].note
        # After a key rotation the checkpoint is signed by a newer key: the hand-over notes (with
        # consistency proofs) let a verifier holding an older key follow the chain to it.
        proof["handovers"] = log.handover_proofs(target)
        # tree_size/new_size is the size proven against (--size, default the latest checkpoint); the
        # log may have grown past it. Informational: nothing in the proof depends on it.
        proof["log_size"] = log.size()
    typer.echo(json.dumps(proof, indent=2))


def checkpoint(db: Optional[str] = _DB, signing_key: Optional[Path] = _SIGNING_KEY,
               schema: Optional[str] = _SCHEMA) -> None:
    """Sign the current tree head now and print the checkpoint note (keep a copy elsewhere)."""
    with _open(db, signing_key, need_key=True, schema=schema) as log:
        typer.echo(log.checkpoint().note, nl=False)


def pubkey(
    db: Optional[str] = _DB, pem: bool = typer.Option(False, "--pem", help="Print PEM instead of a verifier key."),
    signing_key: Optional[Path] = _SIGNING_KEY, schema: Optional[str] = _SCHEMA,
) -> None:
    """Print the log's public key (verifier-key form by default)."""
    with _open(db, signing_key, need_key=True, schema=schema) as log:
        typer.echo(log.public_key_pem().decode() if pem else log.verifier_key())


def rotate_key(
    new_key: Path = typer.Option(..., "--new-key", help="The new Ed25519 private key (PEM, from 'securetrain audit "
                                 "keygen --out NEW.pem')."),
    db: Optional[str] = _DB, signing_key: Optional[Path] = _SIGNING_KEY, schema: Optional[str] = _SCHEMA,
) -> None:
    """Hand the log over to a new signing key with a note signed by the old and the new key.

    Signs a last checkpoint with the current key, records an audit.key_rotated entry holding the
    hand-over note (size, root, old and new verifier keys), then signs with the new key. Afterwards
    every writer must use the new key: the old one refuses to sign. Prints the hand-over note.
    """
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.keys import load_signing_key

    if not new_key.is_file():
        raise AuditConfigError(f"no key at {new_key}", hint=f"create it with 'securetrain audit keygen --out {new_key}'")
    key = load_signing_key(new_key)
    with _open(db, signing_key, need_key=True, schema=schema) as log:
        handover = log.rotate_key(key)
    typer.echo(handover.note, nl=False)
    typer.echo(f"handed over at tree size {handover.tree_size}; new verifier key: {handover.new_vkey}\n"
               f"point SECURETRAIN_AUDIT_KEY (or --signing-key) at {new_key} on every writer; give auditors the "
               "new verifier key (the export's handovers.notes links it to the old one)", err=True)


def keygen(
    out: Optional[Path] = typer.Option(
        None, "--out", envvar="SECURETRAIN_AUDIT_KEY",
        help="Where to write the new Ed25519 private key (PEM, 0600); must not exist "
        "(default: $SECURETRAIN_AUDIT_KEY or <data dir>/audit_signing_key.pem)."),
) -> None:
    """Create the audit log's signing key (the only way one is created), and its public key next to it."""
    from securetrain.audit.keys import create_signing_key, default_origin, public_key_pem
    from securetrain.audit.log import data_dir
    from securetrain.audit.note import verifier_key
    from securetrain.io.atomic import atomic_write_bytes

    path = out or data_dir() / "audit_signing_key.pem"
    key = create_signing_key(path)
    pem = public_key_pem(key.public_key())
    public = path.with_name(path.name.removesuffix(".pem") + ".pub.pem")
    atomic_write_bytes(public, pem, mode=0o644)
    typer.echo(f"wrote {path} (private, 0600: keep it on the writer hosts only) and {public}")
    typer.echo(f"verifier key (give it to your auditors): {verifier_key(default_origin(key.public_key()), key.public_key())}")


for _fn in (verify, show, export, prove, checkpoint, pubkey, keygen):
    audit_app.command(_fn.__name__)(_fn)
audit_app.command("rotate-key")(rotate_key)


def register(app: typer.Typer) -> None:
    app.add_typer(audit_app, name="audit")
