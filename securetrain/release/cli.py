"""``securetrain release ...``: approve, export (the gate), verify, prove, keygen.

Only typer/rich/stdlib at import time; the gate and the pipeline load inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

release_app = typer.Typer(help="Model release: signed provenance, approvals, the release gate.", no_args_is_help=True)

_POLICY = typer.Option(None, "--policy", help="Release policy (path or name; default: the run's release.policy, else policies/release.yaml).")


@release_app.command("approve")
def approve_cmd(
    run_dir: Path = typer.Argument(..., help="The run directory (holds release/provenance.dsse.json)."),
    key: Path = typer.Option(..., "--key", help="Your Ed25519 approver private key (PEM)."),
    policy: Optional[Path] = _POLICY,
) -> None:
    """Sign the run's current provenance and append the approval to the run's audit log."""
    from securetrain.cli.console import console
    from securetrain.release.gate import approve

    out = approve(run_dir, key, policy_path=policy)
    who = out["approver"] or "a key not named in the policy (it will not count)"
    console.print(f"approved statement {out['statement_sha256'][:16]}… as {who} (key {out['approver_keyid'][:16]}…)")


@release_app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="The run directory."),
    out: Path = typer.Argument(..., help="Where to write the deployable model (safetensors); must not exist."),
    policy: Optional[Path] = _POLICY,
) -> None:
    """Decrypt and write the model iff every release condition holds; else refuse and write nothing."""
    from securetrain.cli.console import console, err_console
    from securetrain.release.errors import ReleaseRefusedError
    from securetrain.release.gate import release

    try:
        result = release(run_dir, out, policy_path=policy)
    except ReleaseRefusedError as exc:
        err_console.print("[red]release refused[/red] (nothing written):", highlight=False)
        for failure in exc.failures:
            err_console.print(f"  - {failure}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"released {result['output']} (sha256 {result['model_sha256']}), approved by "
                  f"{', '.join(result['approvers']) or '-'}")


@release_app.command("prove")
def prove_cmd(
    run_dir: Path = typer.Argument(..., help="The run directory."),
    path: str = typer.Argument(..., help="A training file's path as listed in release/training-files.json."),
) -> None:
    """Print an RFC 6962 inclusion proof of one training file in the provenance's data Merkle root."""
    from securetrain.release.gate import prove_file

    typer.echo(json.dumps(prove_file(run_dir, path), indent=2))


@release_app.command("keygen")
def keygen_cmd(
    private: Path = typer.Argument(..., help="Where to write the new Ed25519 private key (PEM, 0600); must not exist."),
    public: Path = typer.Argument(..., help="Where to write its public key (PEM), for the release policy."),
) -> None:
    """Create an approver key pair."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from securetrain.errors import ConfigError
    from securetrain.io.atomic import atomic_write_bytes

    if private.exists() or public.exists():
        raise ConfigError(f"{private if private.exists() else public} already exists", hint="choose new paths")
    key = Ed25519PrivateKey.generate()
    atomic_write_bytes(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()), mode=0o600)
    atomic_write_bytes(public, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo), mode=0o644)
    typer.echo(f"wrote {private} (keep it private) and {public}")


def register(app: typer.Typer) -> None:
    app.add_typer(release_app, name="release")
