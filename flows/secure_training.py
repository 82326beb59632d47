"""The ``secure_training`` Prefect flow: the pipeline's stages as tasks.

All logic lives in :mod:`securetrain.pipeline.stages`; this module only adds orchestration:
retries where a retry is safe, the encrypted result serializer for tensors, JSON (never pickle)
for everything else, redacted logs and run artifacts. Parameters are a config *path* and
non-secret overrides; tasks resolve secrets themselves, so no key material enters Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from securetrain.pipeline import stages
from securetrain.pipeline.config import PipelineConfig, load_pipeline_config
from securetrain.pipeline.prefect_tuning import plain_json_parameters, skip_heartbeat_join
from securetrain.pipeline.report import markdown_summary
from securetrain.pipeline.results import AuditSummary, HESummary, PipelineResult, PreparedData, TrainingSummary
from securetrain.pipeline.runner import assemble_result, config_digest, finish_report, open_run_audit, sign_provenance
from securetrain.pipeline.secrets import (
    check_provenance_key,
    export_passphrase_for_children,
    load_run_secrets,
    run_keyring_path,
)
from securetrain.pipeline.task_runners import build_task_runner
from securetrain.pipeline.tasks.dicom_shards import ShardSpec, plan_shards, run_shard
from securetrain.redaction import install_redaction
from securetrain.secretenv import resolve_secret_files

# Heartbeats stay on; a run just no longer ends with up to 1 s of waiting for their thread.
skip_heartbeat_join()


def _tensor_serializer(config: PipelineConfig):
    """Encrypt under the run's KEK source: its keyring file, or (path None) the env / Vault provider."""
    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    keyring_path = run_keyring_path(config)  # a path only: no need to decrypt the keyring here
    return EncryptedTensorSerializer(keyring_path=str(keyring_path) if keyring_path else None)


def _not_preempted(task: Any, task_run: Any, state: Any) -> bool:
    """Retry transient failures, but not a preemption: that process is being shut down."""
    try:
        state.result()
    except stages.PipelinePreempted:
        return False
    except Exception:
        return True
    return False


@task(name="ingest", retries=2, retry_delay_seconds=2, result_serializer="json")
def ingest_task(config: PipelineConfig) -> str | None:
    raw = stages.ingest(config)
    return None if raw is None else str(raw)


# One shard of de-identification on the configured task runner (threads, Dask, Ray). Outputs are
# written atomically and keyed, so a retry (or a rerun) redoes or skips the shard with identical bytes.
# Only counts come back: the shard's mapping and audit events stay in its encrypted result file.
@task(name="deid-shard", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, result_serializer="json")
def deid_shard_task(config: PipelineConfig, shard: ShardSpec) -> dict[str, Any]:
    assert config.data.policy is not None
    result = run_shard(shard, config.run_dir / "deid", config.data.policy, load_run_secrets(config).deid_secret)
    return {"index": result.index, "files": len(result.rows), "resumed": result.resumed}


def deidentify_on_task_runner(config: PipelineConfig, raw: str | None) -> list[int] | None:
    """Run the de-identification shards on ``execution.task_runner``; None when it is ``serial``."""
    runner = build_task_runner(config.execution)
    if runner is None or raw is None or config.task.kind != "dicom-classification":
        return None
    from securetrain.pipeline.tasks.dicom import read_labelled_manifest

    rows = read_labelled_manifest(Path(raw), config.data.label_column)
    shards = plan_shards([path for path, _ in rows], config.execution.shard_size)
    (config.run_dir / "deid").mkdir(parents=True, exist_ok=True, mode=0o700)
    with runner:
        futures = [runner.submit(deid_shard_task, parameters={"config": config, "shard": s}) for s in shards]
        outcomes = [f.result() for f in futures]
    get_run_logger().info("de-identified %d shard(s) on the %s task runner (%d skipped: already done)",
                          len(outcomes), config.execution.task_runner, sum(o["resumed"] for o in outcomes))
    return [o["index"] for o in outcomes if not o["resumed"]]


def _not_refused(task: Any, task_run: Any, state: Any) -> bool:
    """Retry transient failures, but not refused input files: a retry would refuse them again
    (the run fails with RefusedFilesError, exit 65, naming the report)."""
    from securetrain.masking.dicom.errors import RefusedFilesError

    try:
        state.result()
    except RefusedFilesError:
        return False
    except Exception:
        return True
    return False


# De-identification / masking write atomically and are deterministic for a key: safe to retry.
@task(name="prepare-data", retries=2, retry_delay_seconds=2, retry_condition_fn=_not_refused, cache_policy=NO_CACHE,
      result_serializer="json")
def prepare_task(config: PipelineConfig, raw: str | None, fresh_shards: list[int] | None = None) -> PreparedData:
    with open_run_audit(config) as audit:
        return stages.prepare(config, Path(raw) if raw else None, load_run_secrets(config), audit,
                              fresh_shards=fresh_shards)


# Training resumes from its latest encrypted checkpoint, so a retry continues rather than restarts.
@task(name="train", retries=1, retry_condition_fn=_not_preempted, cache_policy=NO_CACHE, result_serializer="json")
def train_task(config: PipelineConfig, prepared: PreparedData) -> TrainingSummary:
    logger = get_run_logger()
    with open_run_audit(config) as audit:
        # More than one process: torchrun's output is streamed into this task's log line by line.
        summary = stages.train(config, prepared, load_run_secrets(config), audit, log_line=logger.info)
    logger.info("trained %d steps on %s (world size %d), final loss %.3g", summary.steps, summary.device,
                summary.world_size, summary.final_loss)
    return summary


# Persisted on purpose, under a per-flow-run storage key (a retry of he-evaluate reuses it; a new
# run recomputes): tensor results at rest are AEAD-encrypted, never pickled.
@task(name="extract-features", retries=1, persist_result=True, result_storage_key="securetrain-features-{flow_run.id}")
def extract_features_task(config: PipelineConfig) -> dict[str, Any]:
    with open_run_audit(config) as audit:
        return stages.extract_features(config, load_run_secrets(config), audit)


@task(name="he-evaluate", retries=1, cache_policy=NO_CACHE, result_serializer="json")
def he_evaluate_task(config: PipelineConfig, features: dict[str, Any]) -> HESummary:
    with open_run_audit(config) as audit:
        return stages.he_evaluate(config, features, audit)


# Sealing appends a checkpoint: not retried, so a failure is visible rather than papered over.
@task(name="sign-provenance", cache_policy=NO_CACHE, result_serializer="json")
def sign_provenance_task(config: PipelineConfig, prepared: PreparedData, training: TrainingSummary) -> dict | None:
    with open_run_audit(config) as audit:
        return sign_provenance(config, audit, prepared, training, load_run_secrets(config))


@task(name="seal-audit", cache_policy=NO_CACHE, result_serializer="json")
def seal_audit_task(config: PipelineConfig, steps: int) -> AuditSummary:
    with open_run_audit(config) as audit:
        audit.record("pipeline.stop", f"run:{config.name}", details={"steps": steps})
        return stages.seal_audit(config, audit)


@task(name="release", cache_policy=NO_CACHE, result_serializer="json")
def release_task(config: PipelineConfig) -> dict[str, Any]:
    from securetrain.release.gate import release_step

    return release_step(config)


def await_release_approval(config: PipelineConfig, outcome: dict[str, Any]) -> None:
    """Stop at "awaiting approval": suspend a deployed run (it exits and is rescheduled on resume),
    pause an in-process one (it blocks until resumed); a timeout fails the run."""
    from prefect.context import get_run_context
    from prefect.flow_runs import pause_flow_run, suspend_flow_run

    get_run_logger().warning(
        "awaiting approval: %s. Approve with 'securetrain release approve %s --key APPROVER.pem', then resume "
        "this flow run.", "; ".join(outcome["failures"]), config.run_dir)
    flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    timeout = config.release.approval_timeout_s
    if flow_run is not None and flow_run.deployment_id is not None:
        suspend_flow_run(timeout=timeout)
    else:
        pause_flow_run(timeout=timeout, poll_interval=5)


def release_with_approval(config: PipelineConfig) -> dict[str, Any]:
    outcome = release_task(config)
    while outcome["status"] == "awaiting_approval":
        await_release_approval(config, outcome)
        outcome = release_task(config)
    if outcome["status"] == "refused":
        get_run_logger().error("release refused: %s", "; ".join(outcome["failures"]))
    return outcome


def publish_artifacts(result: PipelineResult) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(markdown_summary(result), key="securetrain-run", description="securetrain run summary")
    if result.deid:
        d = result.deid
        create_table_artifact(
            [{"files_in": d.files_in, "files_out": d.files_out, "tags_changed": d.tags_changed,
              "rejected": d.rejected, "quarantined": d.quarantined, "policy": f"{d.policy} v{d.policy_version}",
              "refusal_report": str(d.refusal_report or ""), "quarantine_accepted": d.partial_accepted}],
            key="securetrain-deid", description="de-identification counts",
        )
    if result.masking:
        m = result.masking
        create_table_artifact(
            [{"rows": m.rows_in, "train_rows": m.train_rows, "eval_rows": m.eval_rows,
              "train_entities": m.train_entities, "eval_entities": m.eval_entities,
              "policy": f"{m.policy} v{m.policy_version}", "key_id": m.key_id}],
            key="securetrain-masking", description="tabular masking and entity split",
        )
    if result.training.validation:
        create_table_artifact(
            [{k: v.get(k) for k in ("epoch", "step", "loss", "accuracy", "auc")} for v in result.training.validation],
            key="securetrain-validation", description="validation metrics per epoch",
        )
    create_table_artifact(
        [{"step": step, "loss": round(loss, 6)} for step, loss in result.training.curve],
        key="securetrain-training-curve", description="training loss per logged step",
    )
    create_table_artifact(
        [{"step": c.step, "file": c.path.name, "key_id": c.key_id, "sha256": c.sha256} for c in result.training.checkpoints],
        key="securetrain-checkpoints", description="encrypted checkpoints",
    )
    if result.audit:
        a = result.audit
        create_table_artifact(
            [{"entries": a.entries, "root_hash": a.root_hash, "verified": a.verified, "checkpoint": str(a.checkpoint_note)}],
            key="securetrain-audit-head", description="audit log head after sealing",
        )


@flow(name="secure_training", result_serializer="json", log_prints=False)
def secure_training(config_path: str | None = None, overrides: dict[str, Any] | None = None,
                    new_run: bool = False) -> dict[str, Any]:
    """ingest → prepare (de-identify / mask, split) → train → (HE evaluation) → seal audit log → report.

    ``new_run`` (schedules set it): this run gets its own folder ``<name>-<UTC time>-<flow run id>``
    instead of resuming the config's folder, and its report lists inputs new since the previous run."""
    from securetrain.pipeline.runinfo import StageClock

    clock = StageClock()
    resolve_secret_files()  # SECURETRAIN_<X>_FILE (Compose secrets) on the worker
    install_redaction()
    logger = get_run_logger()
    config = load_pipeline_config(config_path, data=overrides)
    if new_run:
        from securetrain.pipeline.runinfo import flow_run_id
        from securetrain.pipeline.schedule import scheduled_run_config

        config = scheduled_run_config(config, flow_run_id=flow_run_id())
        logger.info("scheduled run %s (series %s)", config.name, config.series)
    from securetrain.pipeline.runlock import run_folder_lock

    with run_folder_lock(config.run_dir):  # one run at a time per folder, whatever the schedule does
        return _run_locked(config, clock, logger)


# Its parameters are a path, a dict of overrides and a flag: stored as they are, without FastAPI.
plain_json_parameters(secure_training)


def _run_locked(config: PipelineConfig, clock: Any, logger: Any) -> dict[str, Any]:
    stages.preflight(config)  # a bad model/task target fails before any work
    load_run_secrets(config)  # fail fast (and create demo secrets) before any work
    check_provenance_key(config)  # needed only at the end: checked now, not after training
    export_passphrase_for_children(config)  # after creation: the serializer reads it from the env
    with open_run_audit(config) as audit:
        audit.record("pipeline.start", f"run:{config.name}", details={"config_sha256": config_digest(config)})
    with clock.stage("ingest"):
        raw = ingest_task(config)
    with clock.stage("prepare-data"):
        fresh_shards = deidentify_on_task_runner(config, raw)
        prepared = prepare_task(config, raw, fresh_shards)
    if prepared.deid:
        d = prepared.deid
        if d.refusal_report:  # rejected files, or quarantined ones data.allow_quarantine accepted
            logger.warning("de-identified %d/%d files: %d rejected, %d quarantined (%s); report: %s", d.files_out,
                           d.files_in, d.rejected, d.quarantined,
                           "quarantined files accepted by data.allow_quarantine" if d.partial_accepted
                           else "rejected by the policy", d.refusal_report)
        else:
            logger.info("de-identified %d/%d files", d.files_out, d.files_in)
    if prepared.masking:
        m = prepared.masking
        logger.info("masked %d rows; split %d/%d entities", m.rows_in, m.train_entities, m.eval_entities)
    with clock.stage("train"):
        training = train_task(config, prepared)
    he = None
    if config.he.enabled:
        with clock.stage("extract-features"):
            features = extract_features_task.with_options(result_serializer=_tensor_serializer(config))(config)
        with clock.stage("he-evaluate"):
            he = he_evaluate_task(config, features)
    with clock.stage("sign-provenance"):
        provenance = sign_provenance_task(config, prepared, training)
    with clock.stage("seal-audit"):
        sealed = seal_audit_task(config, training.steps)
    used = config.execution.task_runner if fresh_shards is not None else "serial"
    result = finish_report(assemble_result(config, prepared, training, he, sealed, provenance, task_runner=used),
                           config, clock=clock)
    publish_artifacts(result)
    logger.info("report: %s", result.report_html)
    summary = result.model_dump(mode="json")
    if config.release.await_approval:
        summary["release"] = release_with_approval(config)
    return summary


if __name__ == "__main__":
    import sys

    print(secure_training(sys.argv[1] if len(sys.argv) > 1 else None))
