"""Root of the ``securetrain`` command.

Each capability owns its commands in ``securetrain/<capability>/cli.py`` and exposes
``register(app)``. Those modules import only typer/rich at import time so ``--help`` stays fast;
heavy libraries (torch, tenseal, prefect) are imported inside the commands.
"""

from __future__ import annotations

import importlib
import logging
import sys

import typer

from securetrain import __version__
from securetrain.cli.console import err_console
from securetrain.errors import SecureTrainError

CAPABILITY_CLIS = (
    "securetrain.devices.cli",
    "securetrain.training.cli",
    "securetrain.masking.dicom.cli",
    "securetrain.masking.tabular.cli",
    "securetrain.crypto.cli",
    "securetrain.audit.cli",
    "securetrain.he.cli",
    "securetrain.pipeline.cli",
    "securetrain.release.cli",
)

app = typer.Typer(
    name="securetrain",
    help="Compliant model training: de-identify, train, encrypt, evaluate under HE, audit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold keys or PHI
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"securetrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages (never secrets)."),
) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from securetrain.redaction import install_redaction
    from securetrain.secretenv import resolve_secret_files

    resolve_secret_files()  # SECURETRAIN_<X>_FILE (Compose secrets) -> SECURETRAIN_<X>
    install_redaction()  # second line of defence: nothing secret- or PHI-shaped reaches a log handler


for _module in CAPABILITY_CLIS:
    importlib.import_module(_module).register(app)


#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED_EXIT_CODE = 130


def main() -> None:
    """Console entry point: errors become one red line and exit code 2 (or the error's own
    ``exit_code``, e.g. 65 for :class:`~securetrain.masking.dicom.errors.RefusedFilesError`), not a traceback.

    Click/typer handle their own usage errors in standalone mode (one line, exit 2); everything
    securetrain raises on purpose is a :class:`SecureTrainError`; an :class:`OSError` (read-only
    output, full disk, a folder where a file was expected) becomes one line with a hint
    (:func:`securetrain.cli.oserrors.describe_os_error`). A Ctrl-C that reaches here (the second one
    during training, or one outside it) exits 130 without a traceback.
    """
    from rich.markup import escape

    from securetrain.cli.heap import freeze_long_lived, own_process

    own_process()
    try:
        app()
    except SecureTrainError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        # 2, or the error's own documented status (RefusedFilesError: 65, partial de-identification)
        code = getattr(exc, "exit_code", 2)
        sys.exit(code if isinstance(code, int) and code > 0 else 2)
    except OSError as exc:
        from securetrain.cli.oserrors import describe_os_error

        err_console.print(f"[bold red]error:[/] {escape(describe_os_error(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]", highlight=False)
        sys.exit(INTERRUPTED_EXIT_CODE)
    finally:
        # The interpreter's last collection at exit would walk every object once more (up to a
        # second after a pipeline run); frozen objects are still freed, only not searched for cycles.
        freeze_long_lived()
