"""``run_pipeline``: the whole run as one library call, without Prefect."""

from __future__ import annotations

import os

from securetrain.pipeline import stages
from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.report import plot_training_curve, write_html_report
from securetrain.pipeline.results import PipelineResult
from securetrain.pipeline.secrets import keys_dir, load_run_secrets


def open_run_audit(config: PipelineConfig):
    """The run's audit log: SQLite under the run dir unless ``audit.url`` says otherwise.

    Signed checkpoints are also appended to an anchor file outside the database, so a rewritten or
    truncated database is caught by anyone holding that file.
    """
    from securetrain.audit.anchors import FileAnchor
    from securetrain.audit.log import AuditLog

    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    url = config.audit.url or os.environ.get("SECURETRAIN_AUDIT_URL") or str(run_dir / "audit.db")
    anchor = config.audit.anchor_file or (run_dir / "audit-anchors.notes")
    signing_key = (
        config.audit.signing_key or os.environ.get("SECURETRAIN_AUDIT_KEY") or (keys_dir(config) / "audit-signing.pem")
    )
    return AuditLog(url, signing_key=signing_key, origin=f"securetrain/{config.name}", anchors=[FileAnchor(anchor)])


def finish_report(result: PipelineResult) -> PipelineResult:
    """Draw the training curve and write the HTML report next to the run's outputs."""
    result.curve_png = plot_training_curve(result.training, result.run_dir / "training-curve.png")
    result.report_html = write_html_report(result, result.run_dir / "report.html")
    return result


def run_pipeline(config: PipelineConfig, *, show_progress: bool = False) -> PipelineResult:
    """ingest → de-identify → train (encrypted checkpoints) → HE evaluation → seal audit → report."""
    secrets = load_run_secrets(config)
    with open_run_audit(config) as audit:
        audit.record("pipeline.start", f"run:{config.name}", details={"config_sha256": config_digest(config)})
        raw = stages.ingest(config)
        deid = stages.deidentify(config, raw, secrets, audit, show_progress=show_progress)
        callbacks = []
        if show_progress:
            from securetrain.training.progress import RichProgressCallback

            callbacks.append(RichProgressCallback("train"))
        training = stages.train(config, deid, secrets, audit, callbacks=callbacks)
        he = None
        if config.he.enabled:
            features = stages.extract_features(config, secrets, audit)
            he = stages.he_evaluate(config, features, audit)
        audit.record("pipeline.stop", f"run:{config.name}", details={"steps": training.steps})
        sealed = stages.seal_audit(config, audit)
    result = PipelineResult(run_dir=config.run_dir, deid=deid, training=training, he=he, audit=sealed)
    return finish_report(result)


def config_digest(config: PipelineConfig) -> str:
    """SHA-256 of the canonical config JSON (safe to log: the config holds no secrets)."""
    import hashlib

    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()
