"""``python -m securetrain``: the CLI."""

from securetrain.cli.main import main

main()
