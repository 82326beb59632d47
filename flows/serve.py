"""Serve ``secure_training`` on a cron schedule from this process (no work pool needed).

    python flows/serve.py examples/demo.yaml --cron "0 2 * * *"

For work-pool based deployments see ``prefect.yaml`` and docs/operations.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.secure_training import secure_training  # noqa: E402

DEFAULT_CRON = "0 2 * * *"  # nightly, 02:00 UTC


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="pipeline config (YAML/TOML)")
    parser.add_argument("--cron", default=DEFAULT_CRON, help=f"cron schedule (default {DEFAULT_CRON!r}, UTC)")
    parser.add_argument("--name", default="secure-training-nightly")
    args = parser.parse_args(argv)
    secure_training.serve(
        name=args.name,
        cron=args.cron,
        limit=1,  # this process runs one flow run at a time ...
        global_limit=1,  # ... and the deployment allows one at a time anywhere (runs share GPUs and keys)
        # new_run: every scheduled run trains in its own folder on the data present then (not a
        # resume of the finished previous run), and reports the inputs new since that run.
        parameters={"config_path": str(Path(args.config).resolve()), "new_run": True},
        tags=["securetrain"],
        description="De-identify, train with encrypted checkpoints, HE-evaluate, seal the audit log.",
    )


if __name__ == "__main__":
    main()
