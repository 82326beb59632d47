"""``securetrain devices``: what compute backends this machine offers and what ``auto`` picks."""

from __future__ import annotations

import json

import typer


def _fmt_bytes(n: object) -> str:
    if not isinstance(n, int):
        return str(n)
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def devices(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
) -> None:
    """List device backends: availability, torch device, autocast dtype, collective backend, memory."""
    from securetrain.devices.registry import all_backends, resolve_backend

    auto = resolve_backend("auto")
    rows = [b.describe() for b in all_backends()]
    if as_json:
        payload = {"auto": auto.name, "backends": [r.as_dict() | {"auto": r.name == auto.name} for r in rows]}
        typer.echo(json.dumps(payload, indent=2, sort_keys=True))
        return

    from rich.table import Table

    from securetrain.cli.console import console

    table = Table(title="securetrain device backends")
    for col in ("backend", "available", "device", "autocast", "collective", "batch ×", "memory"):
        table.add_column(col)
    for r in rows:
        mem = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in r.memory.items()) or "-"
        name = f"[bold green]{r.name} *[/]" if r.name == auto.name else r.name
        avail = "[green]yes[/]" if r.available else "[dim]no[/]"
        table.add_row(
            name, avail, r.device or "-", r.autocast_dtype or ("fp32" if r.available else "-"),
            r.collective_backend or "-", str(r.batch_multiple), mem,
        )
    console.print(table)
    console.print(f"[bold green]*[/] auto resolves to [bold]{auto.name}[/] ({auto.device()})")
    for r in rows:
        if not r.available:
            console.print(f"[dim]{r.name}: {r.reason}[/]", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("devices")(devices)
