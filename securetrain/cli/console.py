"""Shared rich console and progress-bar factory, so every command looks the same."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Console(Console):
    """A console whose messages never crash on data that looks like markup.

    Messages interpolate paths, column names and ids; one such as ``out[/x]`` is an unbalanced rich
    closing tag. Rather than fail a command whose work is done, print that message as plain text.
    """

    def print(self, *objects: Any, **kwargs: Any) -> None:
        try:
            super().print(*objects, **kwargs)
        except MarkupError:
            super().print(*objects, **{**kwargs, "markup": False})


console = _Console()
err_console = _Console(stderr=True)


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
