"""Optional MLflow tracking (``tracking.mlflow_uri``; install the ``[mlflow]`` extra).

Logged: the config digest, model target and parameter count, class names, the training loss
curve, validation metrics per epoch, HE results and the audit root — numbers and digests only;
no data, no PHI, no key material. ``result.json`` and ``report.html`` are attached as artifacts.
"""

from __future__ import annotations

from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.errors import PipelineError
from securetrain.pipeline.results import PipelineResult


def log_to_mlflow(config: PipelineConfig, result: PipelineResult) -> str:
    """Log one run; returns the MLflow run id."""
    try:
        import mlflow
    except ImportError:
        raise PipelineError("tracking.mlflow_uri is set but mlflow is not installed",
                            hint="pip install 'securetrain[mlflow]' or remove tracking.mlflow_uri") from None
    t = result.training
    if not config.tracking.mlflow_uri:
        raise PipelineError("tracking.mlflow_uri is not set", hint="set it, or do not call log_to_mlflow")
    mlflow.set_tracking_uri(config.tracking.mlflow_uri)
    client = mlflow.tracking.MlflowClient()
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        # Artifacts next to the runs, not in whatever directory the process happens to run in.
        location = config.tracking.artifact_location or (config.output_dir / "mlflow-artifacts").resolve().as_uri()
        experiment_id = client.create_experiment(config.tracking.experiment, artifact_location=location)
    else:
        experiment_id = experiment.experiment_id
    with mlflow.start_run(run_name=config.name, experiment_id=experiment_id) as run:
        mlflow.set_tag("securetrain.run_dir", str(result.run_dir))
        mlflow.log_params({
            "task": result.task, "model_target": t.model_target, "parameters": t.parameters,
            "classes": ",".join(t.class_names), "config_sha256": result.config_sha256 or "",
            "epochs": config.training.epochs, "batch_size": config.training.batch_size, "lr": config.training.lr,
            "scheduler": config.training.scheduler.name,
        })
        for step, loss in t.curve:
            mlflow.log_metric("train_loss", loss, step=step)
        for step, lr in t.lr_curve:
            mlflow.log_metric("lr", lr, step=step)
        for v in t.validation:
            for key in ("loss", "accuracy", "auc"):
                value = v.get(key)
                if isinstance(value, (int, float)):
                    mlflow.log_metric(f"val_{key}", float(value), step=int(v["step"]))
        if t.best:
            mlflow.log_metric(f"best_{t.best['metric']}", float(t.best["value"]))
        if result.he:
            for key in ("max_abs_error", "encrypted_auc", "encrypted_accuracy", "prediction_agreement", "ms_per_sample"):
                value = getattr(result.he, key)
                if value is not None:
                    mlflow.log_metric(f"he_{key}", float(value))
        if result.audit:
            mlflow.set_tag("audit_root", result.audit.root_hash)
        for artifact in (result.result_json, result.report_html):
            if artifact is not None and artifact.is_file():
                mlflow.log_artifact(str(artifact))
        return run.info.run_id
