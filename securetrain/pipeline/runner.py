"""``run_pipeline``: the whole run as one library call, without Prefect."""

from __future__ import annotations

import os

from securetrain.pipeline import stages
from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.report import plot_training_curve, write_html_report
from securetrain.pipeline.results import PipelineResult
from securetrain.pipeline.secrets import (
    DEMO_DEID_KEY_HEX,
    check_provenance_key,
    keys_dir,
    load_run_secrets,
    run_audit_key_path,
)


def _stderr_line(line: str) -> None:
    """A line of the torchrun job's output, shown as it arrives (``--no-prefect``)."""
    import sys

    print(line, file=sys.stderr, flush=True)


def open_run_audit(config: PipelineConfig):
    """The run's audit log: SQLite under the run dir unless ``audit.url`` says otherwise.

    Signed checkpoints are also appended to an anchor file outside the database, so a rewritten or
    truncated database is caught by anyone holding that file.
    """
    from securetrain.audit.anchors import FileAnchor
    from securetrain.audit.log import AuditLog

    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    shared = config.audit.url or os.environ.get("SECURETRAIN_AUDIT_URL")
    url = shared or str(run_dir / "audit.db")
    anchor = config.audit.anchor_file or (run_dir / "audit-anchors.notes")
    signing_key = run_audit_key_path(config)
    # A log has one origin (verifiers refuse checkpoints naming two). The run's own log is named after
    # the run; a shared log (one database for many runs) keeps the origin it has (AuditLog takes it
    # from its checkpoints), so runs with different names can append to it.
    origin = config.audit.origin or (None if shared else f"securetrain/{config.name}")
    log = AuditLog(url, signing_key=signing_key, origin=origin, anchors=[FileAnchor(anchor)],
                   schema=config.audit.schema_name)  # AuditLog ignores it for SQLite
    if shared:  # another run's key on the same log: refused before this run records anything
        try:
            log.check_signing_key()
        except BaseException:
            log.close()
            raise
    return log


def finish_report(result: PipelineResult, config: PipelineConfig | None = None, *, clock=None) -> PipelineResult:  # noqa: ANN001
    """Draw the curves, write the HTML report and ``result.json``; log to MLflow when configured.

    ``clock`` (a :class:`~securetrain.pipeline.runinfo.StageClock`) adds version, source commit,
    Prefect flow run id, start/end time and per-stage timings."""
    if clock is not None:
        result.run = clock.info()
    if config is not None and config.series:
        from securetrain.pipeline.schedule import input_changes

        result.run.input_changes = input_changes(config)
    result.curve_png = plot_training_curve(result.training, result.run_dir / "training-curve.png")
    result.report_html = write_html_report(result, result.run_dir / "report.html")
    result.result_json = result.run_dir / "result.json"
    write_result_json(result)
    if config is not None and config.tracking.mlflow_uri:
        from securetrain.pipeline.tracking import log_to_mlflow

        log_to_mlflow(config, result)
    return result


def write_result_json(result: PipelineResult) -> None:
    """The whole :class:`PipelineResult` as JSON (atomic; counts, metrics, digests, paths: no PHI)."""
    from securetrain.io.atomic import atomic_write_bytes

    assert result.result_json is not None
    atomic_write_bytes(result.result_json, result.model_dump_json(indent=2).encode(), mode=0o644)


def run_pipeline(config: PipelineConfig, *, show_progress: bool = False) -> PipelineResult:
    """ingest → prepare (de-identify / mask, split) → train (encrypted checkpoints, validation)
    → HE evaluation → seal audit → report + result.json."""
    from securetrain.pipeline.runlock import run_folder_lock

    with run_folder_lock(config.run_dir):  # one run at a time per folder (schedules, manual runs)
        return _run_pipeline_locked(config, show_progress=show_progress)


def _run_pipeline_locked(config: PipelineConfig, *, show_progress: bool) -> PipelineResult:
    from securetrain.pipeline.runinfo import StageClock

    clock = StageClock()
    stages.preflight(config)
    secrets = load_run_secrets(config)
    check_provenance_key(config)
    with open_run_audit(config) as audit:
        audit.record("pipeline.start", f"run:{config.name}", details={
            "config_sha256": config_digest(config), "task": config.task.target or config.task.kind,
            "model_target": config.model.target,
        })
        with clock.stage("ingest"):
            raw = stages.ingest(config)
        with clock.stage("prepare-data"):
            prepared = stages.prepare(config, raw, secrets, audit, show_progress=show_progress)
        callbacks = []
        if show_progress:
            from securetrain.training.progress import RichProgressCallback

            callbacks.append(RichProgressCallback("train"))
        with clock.stage("train"):
            training = stages.train(config, prepared, secrets, audit, callbacks=callbacks,
                                    log_line=_stderr_line if show_progress else None)
        he = None
        if config.he.enabled:
            with clock.stage("extract-features"):
                features = stages.extract_features(config, secrets, audit)
            with clock.stage("he-evaluate"):
                he = stages.he_evaluate(config, features, audit)
        audit.record("pipeline.stop", f"run:{config.name}", details={"steps": training.steps})
        with clock.stage("sign-provenance"):
            provenance = sign_provenance(config, audit, prepared, training, secrets)
        with clock.stage("seal-audit"):
            sealed = stages.seal_audit(config, audit)
    result = assemble_result(config, prepared, training, he, sealed, provenance)
    return finish_report(result, config, clock=clock)


def sign_provenance(config: PipelineConfig, audit, prepared, training, secrets):  # noqa: ANN001, ANN201
    """The run's signed in-toto provenance (``release.provenance``; securetrain.release.provenance)."""
    if not config.release.provenance:
        return None
    from securetrain.release.provenance import sign_run_provenance

    return sign_run_provenance(config, audit, prepared, training, secrets)


def assemble_result(config: PipelineConfig, prepared, training, he, sealed, provenance=None, *,  # noqa: ANN001
                    task_runner: str = "serial") -> PipelineResult:
    """``task_runner``: the engine the de-identification shards ran on (``--no-prefect`` runs them serially)."""
    execution = {"task_runner": task_runner, "configured": config.execution.task_runner,
                 "n_workers": config.execution.n_workers if task_runner != "serial" else 1,
                 "shard_size": config.execution.shard_size, "cluster": bool(config.execution.address)}
    return PipelineResult(
        run_dir=config.run_dir, task=prepared.task, deid=prepared.deid, masking=prepared.masking,
        data_details=prepared.details, training=training, he=he, audit=sealed, config_sha256=config_digest(config),
        provenance=provenance, execution=execution, keys=key_fingerprints(config),
    )


def key_fingerprints(config: PipelineConfig) -> dict[str, str]:
    """Ids and fingerprints of the run's keys for the report: an auditor can tell which keys were
    used (and match them against a key inventory) without seeing any key. Best effort: the run has
    finished its work when this is called, so an unreadable key only leaves its entry out."""
    import hashlib

    from securetrain.audit.keys import load_signing_key, public_key_pem
    from securetrain.errors import SecureTrainError

    out: dict[str, str] = {}
    try:
        secrets = load_run_secrets(config)
        kek = secrets.keyring.current_key_id()
        out["kek_id"] = kek
        fingerprint_of = getattr(secrets.keyring, "fingerprint_of", None)
        fp = fingerprint_of(kek) if fingerprint_of else None
        if fp:
            out["kek_fingerprint"] = fp.hex()
        out["deid_key_id"] = secrets.deid_keys.key_id
        if secrets.deid_secret == bytes.fromhex(DEMO_DEID_KEY_HEX):
            # The published demo key protects nothing: say so wherever its id is shown.
            out["deid_key_note"] = "public demo key (demo only: synthetic data, protects nothing)"
    except (SecureTrainError, OSError):
        pass
    try:
        pem = public_key_pem(load_signing_key(run_audit_key_path(config)).public_key())
        out["audit_public_key_sha256"] = hashlib.sha256(pem).hexdigest()
    except (SecureTrainError, OSError):
        pass
    return out


def config_digest(config: PipelineConfig) -> str:
    """SHA-256 of the canonical config JSON (safe to log: the config holds no secrets)."""
    import hashlib

    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()
