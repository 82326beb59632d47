"""One rank of the pipeline's train stage, started by torchrun (see :mod:`securetrain.pipeline.launch`).

``python -m securetrain.pipeline.train_worker REQUEST.json`` (what the stage launches) or
``... train_worker --config CONFIG.yaml`` (what the other nodes of a multi-node job run, see
docs/operations.md). Secrets come from the environment / keys folder, exactly as for the stage
itself; argv carries only paths. Global rank 0 records audit events and writes the status file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from securetrain.io.atomic import atomic_write_bytes
from securetrain.training.callbacks import TrainerCallback
from securetrain.training.distributed import exit_process


class _LogLines(TrainerCallback):
    """Rank 0: one plain line per logged window (the stage streams them to its logger)."""

    def on_step(self, trainer: Any, m: Any) -> None:
        if trainer.is_main:
            total = f"/{m.total_steps}" if m.total_steps else ""
            print(f"[rank 0/{trainer.dist.world_size}] step {m.step}{total} loss {m.loss:.4g} "
                  f"{m.samples_per_s:.1f} samples/s", flush=True)

    def on_checkpoint(self, trainer: Any, info: Any) -> None:
        if info is not None and trainer.is_main:
            print(f"[rank 0/{trainer.dist.world_size}] checkpoint step {info.step}", flush=True)


def _load(argv: list[str]) -> tuple[Any, Any, Path | None]:
    from securetrain.pipeline.config import PipelineConfig, load_pipeline_config

    # The train stage reads the prepared data from the run directory (task_datasets), not from
    # the prepare stage's summary, so a rank needs only the config.
    if len(argv) == 2 and argv[0] == "--config":
        return load_pipeline_config(argv[1]), None, None
    if len(argv) != 1:
        raise SystemExit("usage: python -m securetrain.pipeline.train_worker (REQUEST.json | --config CONFIG)")
    request = json.loads(Path(argv[0]).read_text())
    return PipelineConfig.model_validate(request["config"]), None, Path(request["status"])


def main(argv: list[str] | None = None) -> int:
    from securetrain.audit.recorder import NullAuditRecorder
    from securetrain.errors import SecureTrainError
    from securetrain.pipeline import stages
    from securetrain.pipeline.runner import open_run_audit
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.redaction import install_redaction
    from securetrain.secretenv import resolve_secret_files

    resolve_secret_files()
    install_redaction()
    config, prepared, status_path = _load(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    main_rank = rank == 0

    def status(outcome: str, **fields: Any) -> None:
        if main_rank and status_path is not None:
            atomic_write_bytes(status_path, json.dumps({"outcome": outcome, **fields}).encode(), mode=0o600)

    try:
        secrets = load_run_secrets(config)
        audit_cm = open_run_audit(config) if main_rank else contextlib.nullcontext(NullAuditRecorder())
        with audit_cm as audit:
            summary = stages.train(config, prepared, secrets, audit, callbacks=[_LogLines()])
    except stages.PipelinePreempted as exc:
        status("preempted", exit_code=exc.exit_code, steps=exc.steps)
        # Launched by the stage: exit 0 so torchrun does not tear rank 0 down before its status is
        # written (the stage maps the status); launched by hand (--config): the usual 75 / 130.
        return 0 if status_path is not None else exc.exit_code
    except SecureTrainError as exc:
        status("error", error=f"{type(exc).__name__}: {exc}", hint=getattr(exc, "hint", None))
        raise
    except BaseException as exc:
        status("error", error=type(exc).__name__)
        raise
    status("completed", summary=summary.model_dump(mode="json"))
    return 0


def _run() -> NoReturn:
    try:
        code = main()
    except SystemExit as exc:  # usage errors: the usual status and message
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - printed as Python would, then the usual status 1
        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    _run()
