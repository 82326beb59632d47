"""Shared rich console and progress-bar factory, so every command looks the same."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console()
err_console = Console(stderr=True)


def progress_bar(*, transient: bool = False, disable: bool = False) -> Progress:
    """A progress bar for long work: ``with progress_bar() as p: task = p.add_task("x", total=n)``."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=err_console,
        transient=transient,
        disable=disable,
    )
