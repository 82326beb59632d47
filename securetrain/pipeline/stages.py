"""The pipeline's stages as plain functions (no Prefect): each is a Prefect task in ``flows/``.

Stages take the validated :class:`PipelineConfig` and small JSON-safe summaries, never secrets:
each stage resolves the run's secrets itself (:func:`load_run_secrets`), so no key material
appears in Prefect task parameters or results. Tensors passed between stages (the HE features)
travel in Prefect through the encrypted result serializer.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import ConfigError, SecureTrainError
from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.locate import find_project_file
from securetrain.pipeline.results import (
    AuditSummary,
    CheckpointSummary,
    DeidSummary,
    HESummary,
    TrainingSummary,
)
from securetrain.pipeline.secrets import RunSecrets

log = logging.getLogger("securetrain.pipeline")

#: Exit status of ``securetrain run``/``demo`` after a preemption (same as ``securetrain train``).
PREEMPTED_EXIT_CODE = 75


class PipelinePreempted(SecureTrainError):
    """Training stopped on SIGTERM after a clean checkpoint; rerunning resumes it."""


# --------------------------------------------------------------------------------- helpers
def _write_manifest(path: Path, rows: Sequence[tuple[str, int | None]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "label"])
    writer.writerows((p, "" if label is None else label) for p, label in rows)
    atomic_write_bytes(path, buffer.getvalue().encode(), mode=0o600)


def _progress(enabled: bool):  # noqa: ANN202 - rich Progress or a no-op stand-in
    from securetrain.cli.console import progress_bar

    return progress_bar(transient=True, disable=not enabled)


def _checkpoint_store(config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None):
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore

    return EncryptedCheckpointStore(
        config.run_dir / "checkpoints", secrets.keyring, keep_last=config.training.keep_last, audit=audit
    )


def _dicom_dataset(config: PipelineConfig, manifest: Path, secrets: RunSecrets, audit: AuditRecorder | None):
    from securetrain.devices import resolve_backend
    from securetrain.masking.dicom.dataset import DicomDataset

    return DicomDataset(
        manifest,
        config.data.policy,
        secrets.deid_secret,
        size=config.data.image_size,
        quarantine_dir=config.run_dir / "quarantine",
        audit=audit,
        pin_memory=resolve_backend(config.training.device).pin_memory,  # the backend's advice
    )


def _build_model(config: PipelineConfig):
    from securetrain.pipeline.models import SmallCNN

    torch.manual_seed(config.training.seed)
    return SmallCNN(channels=config.model.channels, hidden=config.model.hidden)


# --------------------------------------------------------------------------------- stages
def ingest(config: PipelineConfig) -> Path:
    """Locate the raw studies: the configured manifest, or a freshly generated synthetic set."""
    if config.data.source is not None:
        source = config.data.source
        if source.is_dir():
            raise ConfigError(
                f"data.source: {source} is a folder; training needs labels",
                hint="give a manifest CSV with path,label columns",
            )
        return source
    from securetrain.masking.dicom.synthetic import generate_study_set

    # SyntheticStudyConfig mirrors generate_study_set's keyword arguments one to one.
    return generate_study_set(config.run_dir / "raw", **config.data.synthetic.model_dump())


def deidentify(
    config: PipelineConfig,
    raw_manifest: Path,
    secrets: RunSecrets,
    audit: AuditRecorder | None = None,
    *,
    show_progress: bool = False,
) -> DeidSummary:
    """De-identify every study into ``<run_dir>/deid`` and split train/eval by patient pseudonym.

    Files with burned-in annotation are rejected and unreadable ones quarantined — both counted
    and audited, never passed on. Output names are sequence numbers (input names may carry PHI).
    The pseudonym map is exported AES-256-GCM encrypted for the data owner.
    """
    from securetrain.masking.dicom.dataset import read_manifest
    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.errors import BurnedInAnnotationError, DeidError
    from securetrain.masking.dicom.policy import load_policy

    recorder = audit or NullAuditRecorder()
    policy = load_policy(config.data.policy)
    deid = Deidentifier(policy, secrets.deid_keys, recorder, record_changes=False)
    out_dir = config.run_dir / "deid"
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    rows = read_manifest(raw_manifest)
    kept: list[tuple[str, int | None, str]] = []
    tags_changed = rejected = quarantined = 0
    with _progress(show_progress) as progress:
        task = progress.add_task("de-identify", total=len(rows), status="")
        for index, (path, label) in enumerate(rows):
            name = f"{index:06d}.dcm"
            try:
                report = deid.deidentify_file(path, out_dir / name)
            except BurnedInAnnotationError:
                rejected += 1
                recorder.record("deid.reject", f"input:{index}", outcome="refused", details={"reason": "burned_in_annotation"})
            except DeidError as exc:
                quarantined += 1
                recorder.record("deid.quarantine", f"input:{index}", outcome="refused", details={"reason": type(exc).__name__})
            else:
                tags_changed += report.tags_changed
                kept.append((name, label, report.patient_pseudonym or ""))
            progress.update(task, advance=1, status=f"{rejected} rejected")
    if not kept:
        raise SecureTrainError("no study survived de-identification", hint="check the policy and the input files")

    # Hold out whole patients (never images of one patient on both sides), chosen by a keyed order.
    patients = sorted({p for _, _, p in kept}, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    n_eval = max(1, round(len(patients) * config.data.eval_fraction)) if len(patients) > 1 else 0
    eval_patients = set(patients[:n_eval])
    _write_manifest(out_dir / "train.csv", [(n, lab) for n, lab, p in kept if p not in eval_patients])
    _write_manifest(out_dir / "eval.csv", [(n, lab) for n, lab, p in kept if p in eval_patients])
    mapping_key = hashlib.sha256(b"securetrain/pipeline/pseudonym-map\x00" + secrets.deid_secret).digest()
    deid.export_mapping(out_dir / "pseudonyms.enc", mapping_key)
    return DeidSummary(
        policy=policy.name,
        policy_version=str(policy.policy_version),
        files_in=len(rows),
        files_out=len(kept),
        tags_changed=tags_changed,
        rejected=rejected,
        quarantined=quarantined,
        output_dir=out_dir,
        manifest=out_dir / "train.csv",
    )


def train(
    config: PipelineConfig,
    deid: DeidSummary,
    secrets: RunSecrets,
    audit: AuditRecorder | None = None,
    *,
    callbacks: Sequence[Any] = (),
) -> TrainingSummary:
    """Train the CNN on the de-identified studies; checkpoints are encrypted under the run's KEK.

    Resumes from the latest checkpoint when one exists (so retrying this stage after a
    preemption continues rather than restarts). Raises :class:`PipelinePreempted` on SIGTERM.
    """
    from securetrain.devices import resolve_backend
    from securetrain.training.callbacks import MetricsHistory
    from securetrain.training.trainer import Trainer

    backend = resolve_backend(config.training.device)
    dataset = _dicom_dataset(config, deid.manifest, secrets, audit)
    if len(dataset) == 0:
        raise SecureTrainError("the training split is empty", hint="add patients or lower data.eval_fraction")
    training_config = config.training.model_copy(update={"output_dir": config.run_dir / "train"})
    history = MetricsHistory()
    model = _build_model(config)
    result = Trainer(
        model,
        dataset,
        training_config,
        store=_checkpoint_store(config, secrets, audit),
        callbacks=[history, *callbacks],
        audit=audit,
        backend=backend,
        run_id=config.name,
    ).fit()
    if result.reason == "preempted":
        raise PipelinePreempted(f"training preempted at step {result.steps}", hint="run the same command again to resume")
    store = _checkpoint_store(config, secrets, None)
    rates = [m.samples_per_s for m in history.history if m.samples_per_s > 0]
    return TrainingSummary(
        device=result.device,
        steps=result.steps,
        epochs_completed=result.epoch,
        final_loss=float(result.final_loss if result.final_loss is not None else float("nan")),
        samples_per_second=sum(rates) / len(rates) if rates else 0.0,
        curve=[(m.step, m.loss) for m in history.history],
        checkpoints=[
            CheckpointSummary(path=c.path, step=c.step, sha256=c.sha256, key_id=c.key_id) for c in store.list()
        ],
    )


def load_trained_model(config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None = None):
    """The CNN restored from the latest encrypted checkpoint (authenticated before use)."""
    loaded = _checkpoint_store(config, secrets, audit).load()
    model = _build_model(config)
    prefix = "model/"
    state = {k[len(prefix):]: v for k, v in loaded.tensors.items() if k.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model.eval()


def extract_features(
    config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None = None
) -> dict[str, torch.Tensor]:
    """Data-owner side: CNN trunk features of the held-out patients, plus the logistic head.

    Returns tensors only (``features``, ``labels``, ``head_weight``, ``head_bias``) so Prefect can
    store the result with the encrypted serializer.
    """
    from securetrain.pipeline.models import logistic_head

    model = load_trained_model(config, secrets, audit)
    manifest = config.run_dir / "deid" / "eval.csv"
    dataset = _dicom_dataset(config, manifest, secrets, audit)
    if len(dataset) == 0:
        raise SecureTrainError("the evaluation split is empty", hint="use more patients or raise data.eval_fraction")
    features, labels = [], []
    with torch.inference_mode():
        for batch in dataset.dataloader(batch_size=64):
            features.append(model.trunk(batch["pixels"]))
            labels.append(batch["label"])
    head = logistic_head(model)[0]
    return {
        "features": torch.cat(features),
        "labels": torch.cat(labels),
        "head_weight": head.weight.detach().clone(),
        "head_bias": head.bias.detach().clone(),
    }


def he_evaluate(
    config: PipelineConfig, features: dict[str, torch.Tensor], audit: AuditRecorder | None = None
) -> HESummary:
    """Evaluate the logistic head on CKKS-encrypted features (the evaluator sees no secret key)."""
    from torch import nn

    from securetrain.he import evaluate_encrypted

    weight, bias = features["head_weight"], features["head_bias"]
    head = nn.Linear(weight.shape[1], 1)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    report = evaluate_encrypted(
        nn.Sequential(head), features["features"], features["labels"], audit=audit, decimals=config.he.decimals
    )
    return HESummary(
        samples=report.n_samples,
        features=report.n_features,
        max_abs_error=report.max_abs_error,
        plaintext_auc=report.auc_plaintext,
        encrypted_auc=report.auc_encrypted,
        plaintext_accuracy=report.accuracy_plaintext,
        encrypted_accuracy=report.accuracy_encrypted,
        ms_per_sample=report.ms_per_sample_end_to_end,
        poly_modulus_degree=int(report.params["poly_modulus_degree"]),
        public_context_bytes=report.public_context_bytes,
    )


def seal_audit(config: PipelineConfig, audit_log: Any) -> AuditSummary:
    """Sign a checkpoint of the log, export it, and verify the export with the standalone verifier."""
    note_path = config.run_dir / "audit-checkpoint.note"  # the head an auditor keeps from the last run
    checkpoint = audit_log.checkpoint()
    export_dir = Path(audit_log.export(config.run_dir / "audit-export"))
    # Verify against the key we hold (not the export's own copy) and, when a previous run left one,
    # against its checkpoint: the log must have grown append-only since.
    public_key = config.run_dir / "audit-public-key.pem"
    atomic_write_bytes(public_key, audit_log.public_key_pem(), mode=0o644)
    verifier = find_project_file("audit/verify_audit.py", required=False)
    if verifier is not None:
        # -I: isolated mode, so the verifier cannot accidentally import securetrain.
        command = [sys.executable, "-I", str(verifier), str(export_dir), "--public-key", str(public_key)]
        if note_path.is_file():
            command += ["--trusted-checkpoint", str(note_path)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
        verified, output = proc.returncode == 0, (proc.stdout + proc.stderr).strip()
    else:
        trusted = [note_path.read_text()] if note_path.is_file() else []
        report = audit_log.verify(trusted_checkpoints=trusted)
        verified, output = report.ok, "standalone verifier not found; verified with securetrain.audit"
    if verified:  # never replace the held checkpoint with the head of a log that failed verification
        atomic_write_bytes(note_path, checkpoint.note.encode(), mode=0o644)
    return AuditSummary(
        url=str(audit_log.url),
        entries=checkpoint.tree_size,
        root_hash=checkpoint.root_hash.hex(),
        checkpoint_note=note_path,
        export_dir=export_dir,
        verified=verified,
        verifier_output=output[-4000:],
    )
