"""The pipeline's stages as plain functions (no Prefect): each is a Prefect task in ``flows/``.

ingest -> prepare (de-identify DICOM / mask a table / a custom task's prepare, then split by
patient or entity) -> train (the configured model, validation every epoch, encrypted checkpoints)
-> extract features (data owner) -> HE evaluation -> seal the audit log.

Stages take the validated :class:`PipelineConfig` and small JSON-safe summaries, never secrets:
each stage resolves the run's secrets itself (:func:`load_run_secrets`), so no key material
appears in Prefect task parameters or results. Tensors passed between stages (the HE features)
travel in Prefect through the encrypted result serializer.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import ConfigError
from securetrain.pipeline.errors import PREEMPTED_EXIT_CODE, PipelineError, PipelinePreempted
from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.config import REGRESSION_METRICS, TABULAR_KINDS, PipelineConfig
from securetrain.pipeline.locate import find_project_file
from securetrain.pipeline.results import (
    AuditSummary,
    CheckpointSummary,
    DeidSummary,
    HESummary,
    PreparedData,
    TrainingSummary,
)
from securetrain.pipeline.secrets import RunSecrets
from securetrain.pipeline.tasks.base import TaskContext, TaskData, resolve_task

log = logging.getLogger("securetrain.pipeline")

#: Metrics the built-in tasks' validation reports that can select the best checkpoint.
CLASSIFICATION_METRICS = ("loss", "accuracy", "auc")



# --------------------------------------------------------------------------------- helpers
def run_checkpoint_store(config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None, *, best: bool = False):
    """The run's encrypted checkpoint store (``best``: the one holding the best validation's weights)."""
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore

    if best:  # the best validation's weights: kept apart so rotation never drops them
        return EncryptedCheckpointStore(config.run_dir / "checkpoints" / "best", secrets.keyring, keep_last=1, audit=audit)
    return EncryptedCheckpointStore(
        config.run_dir / "checkpoints", secrets.keyring, keep_last=config.training.keep_last, audit=audit
    )


def _summary(info: Any) -> CheckpointSummary:
    return CheckpointSummary(path=info.path, step=info.step, sha256=info.sha256, key_id=info.key_id)


def task_datasets(config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None = None) -> tuple[Any, TaskData]:
    """The configured task and its train/eval datasets (built from the prepared, protected data)."""
    task = resolve_task(config)
    data = task.build_datasets(TaskContext(config, secrets, audit or NullAuditRecorder()))
    if not isinstance(data, TaskData):
        raise PipelineError(f"{type(task).__name__}.build_datasets returned {type(data).__name__}, not TaskData",
                               hint="see docs/tasks.md")
    if data.kind not in ("classification", "regression"):
        raise PipelineError(f"{type(task).__name__}.build_datasets returned TaskData(kind={data.kind!r})",
                            hint="kind is 'classification' (the default) or 'regression'")
    if data.regression:
        if data.class_names:
            raise PipelineError("a regression task's TaskData has class_names",
                                hint="leave class_names unset for kind='regression'")
        return task, data
    if data.class_names is None:
        raise PipelineError(f"{type(task).__name__}.build_datasets returned TaskData without class_names",
                            hint="give the class names in id order, or kind='regression' for a numeric target")
    if data.num_classes < 2:
        raise PipelineError(f"the task has {data.num_classes} class(es); classification needs at least 2",
                               hint="check the labels (data.label_column) or data.classes")
    return task, data


def build_task_model(config: PipelineConfig, data: TaskData):
    """The configured model for the task: ``num_classes`` (classification), or ``num_outputs=1`` and
    ``num_classes=1`` (regression: a model sized by ``num_classes`` gets one output all the same)."""
    from securetrain.pipeline.models import build_model

    facts: dict[str, Any] = {"num_classes": data.num_outputs}
    if data.regression:
        facts["num_outputs"] = 1
    return build_model(config.model.target, config.model.kwargs, base_dir=config.base_dir, seed=config.training.seed,
                       **{**facts, **data.model_facts})


def regression_validation(config: PipelineConfig, data: TaskData, task: Any = None) -> PipelineConfig:
    """A custom regression task's defaults (the built-in task gets them when the config loads):
    ``rmse`` selects the best checkpoint unless ``training.validation.metric`` was set."""
    if not data.regression:
        return config
    validation = config.training.validation
    if getattr(task, "metrics", None) is None and validation.metric not in REGRESSION_METRICS:
        raise ConfigError(f"training.validation.metric: {validation.metric!r} is not a validation metric of a "
                          "regression task", hint=f"use one of {', '.join(REGRESSION_METRICS)}")
    if validation.metric == "loss" and "metric" not in validation.model_fields_set:
        validation = validation.model_copy(update={"metric": "rmse"})
        return config.model_copy(update={"training": config.training.model_copy(update={"validation": validation})})
    return config


def _first_batch(dataset: Any) -> Any:
    from torch.utils.data import DataLoader

    return next(iter(DataLoader(dataset, batch_size=2, shuffle=False)))


def _predict_fn(task: Any):  # noqa: ANN202 - (model, batch) -> (outputs, targets)
    from securetrain.training.batches import default_predict

    return getattr(task, "predict", None) or default_predict


# --------------------------------------------------------------------------------- stages
def preflight(config: PipelineConfig) -> None:
    """Resolve the model (and a custom task) target now, so a typo fails before any data is touched."""
    from securetrain.pipeline.models import resolve_model_factory

    resolve_model_factory(config.model.target, base_dir=config.base_dir)
    task = resolve_task(config) if config.task.kind == "custom" else None
    metric = config.training.validation.metric
    known = {"tabular-regression": REGRESSION_METRICS, "custom": (*CLASSIFICATION_METRICS, *REGRESSION_METRICS)}.get(
        config.task.kind, CLASSIFICATION_METRICS)
    if getattr(task, "metrics", None) is None and metric not in known:
        raise ConfigError(f"training.validation.metric: {metric!r} is not a validation metric of this task",
                          hint=f"use one of {', '.join(known)}")


def ingest(config: PipelineConfig) -> Path | None:
    """Locate the raw data: the configured source, or freshly generated synthetic data."""
    kind = config.task.kind
    if kind in TABULAR_KINDS:
        from securetrain.pipeline.tasks.tabular import TabularClassification

        return TabularClassification().ingest(config)
    if kind == "custom":
        return config.data.source  # a custom task reads what it needs itself
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
    shard_map: Any = None,
) -> DeidSummary:
    """DICOM: de-identify every study and split train/eval by patient pseudonym (see tasks.dicom)."""
    from securetrain.pipeline.tasks.dicom import deidentify as _deidentify

    return _deidentify(config, raw_manifest, secrets, audit, show_progress=show_progress, shard_map=shard_map)


def prepare(
    config: PipelineConfig,
    raw: Path | None,
    secrets: RunSecrets,
    audit: AuditRecorder | None = None,
    *,
    show_progress: bool = False,
    fresh_shards: Collection[int] | None = None,
) -> PreparedData:
    """Protect and split the raw data the task's way (de-identify, mask, or the custom task's prepare).

    ``fresh_shards``: de-identification shards a task runner has just completed (the flow runs them
    first); their recorded results are merged here instead of running them again."""
    kind = config.task.kind
    if kind == "dicom-classification":
        assert raw is not None
        shard_map = None
        if fresh_shards is not None:
            from securetrain.pipeline.tasks.dicom_shards import prefetched_map

            shard_map = prefetched_map(config.run_dir / "deid", Path(config.data.policy or ""), secrets.deid_secret,
                                       fresh=set(fresh_shards))
        deid = deidentify(config, raw, secrets, audit, show_progress=show_progress, shard_map=shard_map)
        _warn_untrained_classes(deid.class_names, deid.train_class_counts, deid.eval_class_counts)
        return PreparedData(task=kind, deid=deid)
    ctx = TaskContext(config, secrets, audit or NullAuditRecorder())
    task = resolve_task(config)
    if kind in TABULAR_KINDS:
        assert raw is not None
        masking = task.prepare(ctx, raw)
        _warn_untrained_classes(masking.class_names, masking.train_class_counts, masking.eval_class_counts)
        return PreparedData(task=kind, masking=masking)
    hook = getattr(task, "prepare", None)
    details = hook(ctx) if callable(hook) else None
    return PreparedData(task=config.task.target or kind, details=dict(details or {}))


def _warn_untrained_classes(names: Sequence[str], train_counts: Sequence[int], eval_counts: Sequence[int]) -> None:
    """A class the training split never shows (listed in ``data.classes``, or all its rows held out
    with their entities) cannot be learned; the run goes on, but says so."""
    missing = [i for i, n in enumerate(train_counts) if n == 0 and i < len(names)]
    if not missing:
        return
    listed = ", ".join(f"{names[i]!r} ({eval_counts[i] if i < len(eval_counts) else 0} held out)" for i in missing[:10])
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    log.warning("%d of %d class(es) have no training rows, so the model cannot learn them: %s%s. Check the labels "
                "and data.classes, add data for them, or hold out fewer entities (data.eval_fraction)",
                len(missing), len(names), listed, more)


def train(
    config: PipelineConfig,
    prepared: PreparedData | DeidSummary | None,
    secrets: RunSecrets,
    audit: AuditRecorder | None = None,
    *,
    callbacks: Sequence[Any] = (),
    log_line: Callable[[str], None] | None = None,
) -> TrainingSummary:
    """Train the configured model on the task's data; checkpoints are encrypted under the run's KEK.

    The model's output shape is checked on one real batch first. Validation runs every epoch on the
    held-out split; the best weights (by ``training.validation.metric``) go to an encrypted store of
    their own. Resumes from the latest checkpoint when one exists (so retrying this stage after a
    preemption continues rather than restarts). Raises :class:`PipelinePreempted` on SIGTERM.

    With ``training.nproc_per_node``/``nnodes`` above one, the stage launches torchrun and streams
    its output to ``log_line`` (see :mod:`securetrain.pipeline.launch`).
    """
    from securetrain.pipeline.launch import launch_training, needs_launch

    if needs_launch(config):
        return launch_training(config, prepared, log_line=log_line)
    from securetrain.devices import resolve_backend
    from securetrain.pipeline.models import check_model_output, parameter_count
    from securetrain.training.callbacks import MetricsHistory
    from securetrain.training.trainer import Trainer

    if config.training.privacy is not None:
        from securetrain.release.privacy import DPTrainer as Trainer  # type: ignore[assignment]

    from securetrain.training.distributed import from_env

    _, local_rank, world = from_env()
    backend = resolve_backend(config.training.device, index=local_rank if world > 1 else None)
    task, data = task_datasets(config, secrets, audit)
    config = regression_validation(config, data, task)  # a custom regression task's defaults / HE refusal
    if len(data.train) == 0:
        raise PipelineError("the training split is empty", hint="add patients or lower data.eval_fraction")
    if data.inputs.get("converted_to_grey"):
        log.warning("%s colour input file(s) converted to one grey channel (data.color_mode: %s); "
                    "data.color_mode: rgb trains on three channels", data.inputs["converted_to_grey"],
                    data.inputs.get("requested"))
    model = build_task_model(config, data)
    check_model_output(model, _first_batch(data.train), data.num_outputs, target=config.model.target,
                       predict=_predict_fn(task), regression=data.regression)
    if config.he.enabled:
        from securetrain.pipeline.models import last_linear

        last_linear(model)  # HE scores a linear head: refuse a model without one before training
        if config.he.scope == "model":  # asked for the whole model: refuse one HE cannot take, before training
            _check_whole_model_before_training(model, _first_batch(data.train))
    training_config = config.training.model_copy(update={"output_dir": config.run_dir / "train"})
    history = MetricsHistory()
    loss_fn, metrics_fn = getattr(task, "loss", None), getattr(task, "metrics", None)
    scaling = None
    if data.regression:  # MSE on one output per sample, and regression metrics whatever the targets' values
        resuming = run_checkpoint_store(config, secrets, None).latest() is not None
        loss_fn, metrics_fn, scaling = _regression_objective(config, data, loss_fn, metrics_fn, resuming=resuming)
    result = Trainer(
        model,
        data.train,
        training_config,
        loss_fn=loss_fn,
        eval_data=data.eval if len(data.eval) else None,
        metrics_fn=metrics_fn,
        predict_fn=getattr(task, "predict", None),
        store=run_checkpoint_store(config, secrets, audit),
        best_store=run_checkpoint_store(config, secrets, audit, best=True),
        callbacks=[history, *callbacks],
        audit=audit,
        backend=backend,
        run_id=config.name,
        data_digest=data.data_digest,
    ).fit()
    if result.reason == "preempted":
        what = "interrupted" if result.exit_code != PREEMPTED_EXIT_CODE else "preempted"
        raise PipelinePreempted(f"training {what} at step {result.steps} (checkpoint written)",
                                hint="run the same command again to resume", exit_code=result.exit_code,
                                steps=result.steps)
    store = run_checkpoint_store(config, secrets, None)
    best_store = run_checkpoint_store(config, secrets, None, best=True)
    best_info = best_store.latest()
    from securetrain.pipeline.report import undefined_metric_text

    undefined = undefined_metric_text(config.training.validation.metric, _json_safe(result.validation),
                                      result.best)
    if undefined:
        log.warning("%s", undefined)
    rates = [m.samples_per_s for m in history.history if m.samples_per_s > 0]
    inputs = dict(data.inputs)
    from securetrain.pipeline.tasks.dicom import dropped_at_load

    dropped = dropped_at_load(data.train, data.eval)
    if dropped:  # never silent: these files were in the index but left out of every batch
        inputs["dropped_at_load"] = len(dropped)
        log.warning("%d file(s) dropped while loading (they failed after the index was built and were left out of "
                    "every batch): %s%s", len(dropped), "; ".join(dropped[:10]),
                    f"; and {len(dropped) - 10} more" if len(dropped) > 10 else "")
    return TrainingSummary(
        device=result.device,
        steps=result.steps,
        epochs_completed=result.epoch,
        final_loss=float(result.final_loss if result.final_loss is not None else float("nan")),
        samples_per_second=sum(rates) / len(rates) if rates else 0.0,
        curve=[(m.step, m.loss) for m in history.history],
        lr_curve=[(m.step, m.lr) for m in history.history],
        checkpoints=[_summary(c) for c in store.list()],
        reason=result.reason,
        model_target=config.model.target,
        parameters=parameter_count(model),
        class_names=list(data.class_names or []),
        task_kind=data.kind,
        target_scaling=scaling.to_dict() if scaling is not None else None,
        inputs=_json_safe(inputs),
        validation=[_json_safe(v) for v in result.validation],
        best=_json_safe(result.best) if result.best else None,
        validation_metric=config.training.validation.metric,
        best_checkpoint=_summary(best_info) if best_info else None,
        world_size=result.world_size,
        strategy=config.training.strategy if result.world_size > 1 else "single",
        profile_trace=result.profile_trace,
        memory=_json_safe(result.memory),
        privacy=_json_safe(result.privacy) if result.privacy else None,
        resumed_from=result.resumed_from,
    )


def _regression_objective(config: PipelineConfig, data: TaskData, loss_fn: Any, metrics_fn: Any, *,
                          resuming: bool = False) -> tuple[Any, Any, Any]:
    """Loss, metrics and target scaling of a regression task. Without a task ``loss`` and with
    ``data.target_scaling: standard``, MSE on targets standardised by the training split's mean and
    std, the metrics getting predictions restored to the target's units; a task's own loss works on
    the targets as they are (it defines their scale), so nothing is scaled. A resumed run keeps the
    scaling its checkpoints were trained with (the run's saved one, or none), whatever the config
    says now: continuing raw-target weights on standardised targets (or the reverse) would undo them."""
    from torch import nn

    from securetrain.pipeline.target_scaling import (
        MetricsInTargetUnits,
        StandardisedMSE,
        fit_target_scaling,
        load_target_scaling,
        save_target_scaling,
    )
    from securetrain.training.validation import regression_metrics

    metrics_fn = metrics_fn or regression_metrics
    if loss_fn is not None:
        save_target_scaling(config.run_dir, None)
        return loss_fn, metrics_fn, None
    wanted = config.data.target_scaling == "standard"
    saved = load_target_scaling(config.run_dir) if resuming else None
    if resuming and wanted != (saved is not None):
        log.warning("data.target_scaling is %r but this run's checkpoints were trained %s; resuming keeps that "
                    "(start a new run to change it)", config.data.target_scaling,
                    "on standardised targets" if saved else "on the raw targets")
    if (resuming and saved is None) or (not resuming and not wanted):
        save_target_scaling(config.run_dir, None)
        return nn.MSELoss(), metrics_fn, None
    scaling = saved or fit_target_scaling(data.train)
    save_target_scaling(config.run_dir, scaling)
    log.info("regression targets standardised for training: mean %.6g, std %.6g (%d training samples); "
             "metrics and predictions are restored to the target's units", scaling.mean, scaling.std, scaling.samples)
    return StandardisedMSE(scaling), MetricsInTargetUnits(metrics_fn, scaling), scaling


def _json_safe(value: Any) -> Any:
    """Metrics as JSON: NaN/inf become None (JSON has no NaN), tensors/numpy become numbers."""
    import math

    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def load_trained_model(config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None = None,
                       data: TaskData | None = None, *, which: str = "last"):
    """The model restored from the latest (``which="best"``: the best validation's) encrypted
    checkpoint, authenticated before use, in the architecture that was trained: a DP-SGD run's
    checkpoint records the layers Opacus replaced (BatchNorm -> GroupNorm) and the model is rebuilt
    fixed the same way. Loading is strict; weights that do not fit raise :class:`ModelArchitectureError`."""
    store = run_checkpoint_store(config, secrets, audit, best=which == "best")
    if which == "best" and store.latest() is None:
        store = run_checkpoint_store(config, secrets, audit)  # no validation ran: the last weights
    loaded = store.load()
    tensors = loaded.tensors
    from securetrain.training import sharded

    if loaded.metadata.get("securetrain.train.format") == sharded.MANIFEST_FORMAT:
        tensors = sharded.assemble_full(store, loaded)  # FSDP: every rank's shard, each verified
    if data is None:
        _, data = task_datasets(config, secrets, None)
    model = _trained_architecture(config, build_task_model(config, data), loaded.metadata)
    from securetrain.training.errors import ModelArchitectureError
    from securetrain.training.state import state_mismatch, to_model_names

    prefix = "model/"
    # Either form of names: a model built compiled (torch.compile) loads the plain names too.
    state = to_model_names(model.state_dict(), {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    mismatch = state_mismatch(model.state_dict(), state)
    if mismatch is not None:
        raise ModelArchitectureError(
            f"{loaded.info.path.name} does not fit the model {config.model.target!r} builds ({mismatch})",
            hint="build the model that was trained (same model.target code, model.kwargs and task data)")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _trained_architecture(config: PipelineConfig, model: torch.nn.Module, metadata: Any) -> torch.nn.Module:
    """``model`` as it was trained: the checkpoint's record of a DP run's fix decides, whatever the
    config says now; a DP checkpoint from before the record was fixed if the config fixes models."""
    from securetrain.training.architecture import read_model_fix

    recorded = read_model_fix(metadata)
    privacy = config.training.privacy
    if recorded is None and not (privacy is not None and privacy.fix_model):
        return model
    from securetrain.release.privacy import fixed_for_dp, rebuild_trained_architecture

    return rebuild_trained_architecture(model, recorded) if recorded is not None else fixed_for_dp(model)[0]


def _he_scope(config: PipelineConfig) -> str:
    if config.he.scope != "auto":
        return config.he.scope
    return "model" if config.task.kind in TABULAR_KINDS else "head"


def _as_chain(model: torch.nn.Module, sample: torch.Tensor) -> torch.nn.Sequential | None:
    """The model as a plain chain of its leaf layers, if that chain computes exactly the model."""
    from torch import nn

    leaves = [m for m in model.modules() if not list(m.children())]
    if not leaves:
        return None
    chain = nn.Sequential(*leaves)
    with torch.no_grad():
        try:
            same = torch.allclose(chain(sample), model(sample), atol=1e-5, rtol=1e-4)
        except Exception:  # noqa: BLE001 - a layer that cannot run in a chain: not chain-shaped
            return None
    return chain if same else None


def extract_features(
    config: PipelineConfig, secrets: RunSecrets, audit: AuditRecorder | None = None
) -> dict[str, torch.Tensor]:
    """Data-owner side: the held-out inputs for HE scoring, plus the layers to evaluate.

    Always: the model up to its last linear layer runs in plaintext where the data is; the result
    holds those ``features`` and the head (``head_weight``, ``head_bias``). ``model`` scope (tabular
    MLP / logistic models) adds the encoded rows themselves (``model_inputs``) and the whole model as
    the tensors of its layer chain (``layer_kinds``, ``layer/<i>/<name>``), so the HE stage can fall
    back to the head when HE cannot evaluate a layer. Tensors only, so Prefect stores the result
    with the encrypted serializer.
    """
    from torch.utils.data import DataLoader

    from securetrain.pipeline.models import head_and_features, linear_bias
    from securetrain.training.batches import split_batch

    task, data = task_datasets(config, secrets, audit)
    if len(data.eval) == 0:
        raise PipelineError("the evaluation split is empty", hint="use more patients or raise data.eval_fraction")
    model = load_trained_model(config, secrets, audit, data, which=config.he.checkpoint)
    loader = DataLoader(data.eval, batch_size=64, shuffle=False)
    head, features, labels = head_and_features(model, loader, _predict_fn(task))
    out = {
        "features": features,
        "labels": labels,
        "head_weight": head.weight.detach().clone(),
        "head_bias": linear_bias(head).clone(),
    }
    if data.regression:  # the model outputs standardised values unless trained with target_scaling: none
        from securetrain.pipeline.target_scaling import load_target_scaling

        scaling = load_target_scaling(config.run_dir)
        out["target_mean"] = torch.tensor(scaling.mean if scaling else 0.0, dtype=torch.float64)
        out["target_std"] = torch.tensor(scaling.std if scaling else 1.0, dtype=torch.float64)
    if _he_scope(config) == "model":
        with torch.no_grad():
            inputs = torch.cat([split_batch(b)[0].flatten(1).float() for b in loader])
            try:
                carried: dict[str, torch.Tensor] | None = check_whole_model(model, inputs[:8])
            except PipelineError as exc:
                if config.he.scope == "model":
                    raise
                log.warning("HE evaluates the model's last linear layer instead of the whole model: %s", exc.args[0])
                carried = None
            if carried is not None:
                approximated = _approximated_activations(_chain_from_tensors(carried))
                if config.he.scope == "auto" and approximated:
                    # CKKS has no ReLU/sigmoid: hidden activations would be polynomials, and an MLP's
                    # encrypted accuracy then differs from the model's (measured: 3-class loans table,
                    # 0.465 encrypted vs 0.525 plaintext). Exact by default: the last linear layer.
                    log.info("HE scope auto: the model's hidden %s would be approximated under encryption; "
                             "evaluating its last linear layer exactly (he.scope: model evaluates the whole "
                             "model with polynomial activations)", ", ".join(sorted(set(approximated))))
                else:
                    out.update(carried, model_inputs=inputs)
    return out


#: Activations CKKS can only approximate by polynomials when they sit between linear layers.
_APPROXIMATED = frozenset({"ReLU", "Sigmoid", "Tanh", "GELU", "SiLU"})
_NO_OPS = frozenset({"Identity", "Dropout", "Flatten"})


def _approximated_activations(chain: torch.nn.Sequential) -> list[str]:
    """The chain's activations HE would evaluate as polynomials: every one but a final sigmoid
    (which the data owner applies exactly after decryption) and trailing no-op layers."""
    kinds = [type(layer).__name__ for layer in chain]
    while kinds and kinds[-1] in _NO_OPS:
        kinds.pop()
    if kinds and kinds[-1] == "Sigmoid":
        kinds.pop()
    return [k for k in kinds if k in _APPROXIMATED]


#: Layers the whole-model HE scope can carry between stages as tensors (kinds by name, no pickle).
_CHAIN_LAYERS = ("Linear", "BatchNorm1d", "ReLU", "Sigmoid", "Tanh", "GELU", "SiLU", "Flatten", "Identity", "Dropout")


def _check_whole_model_before_training(model: torch.nn.Module, batch: Any) -> None:
    """:func:`check_whole_model` on the untrained model and one training batch (whether a model is a
    chain of layers HE can evaluate does not depend on its weights): eval mode, no gradients, RNG
    streams and buffers restored, so training is unchanged."""
    from securetrain.training.batches import split_batch
    from securetrain.training.state import buffers_kept

    inputs = split_batch(batch)[0]
    if not isinstance(inputs, torch.Tensor):
        return  # not one tensor per sample: the HE stage says so with its own error
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), buffers_kept(model):
            check_whole_model(model, inputs.flatten(1).float()[:8])
    finally:
        model.train(was_training)


def check_whole_model(model: torch.nn.Module, sample: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` as a layer chain the HE stage can evaluate whole (``he.scope: model``),
    or :class:`PipelineError` saying why it cannot: the layers HE has no form for (by path and
    class), or a forward that is not its layers applied in module order."""
    chain = _as_chain(model, sample)
    carried = _chain_to_tensors(chain) if chain is not None else None
    # Only if the rebuilt chain computes exactly what the trained model computes.
    if carried is not None and torch.allclose(_chain_from_tensors(carried)(sample), model(sample), atol=1e-5):
        return carried
    leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
    unsupported = [f"{name or '<model>'!r} ({type(m).__name__})" for name, m in leaves
                   if type(m).__name__ not in _CHAIN_LAYERS]
    if unsupported:
        more = f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else ""
        reason = f"HE cannot evaluate its layer(s) {', '.join(unsupported[:5])}{more}"
    else:
        reason = ("its forward is not its layers applied one after another in module order (e.g. a skip "
                  "connection, a dict or tuple output, an operation outside a layer)")
    raise PipelineError(f"the model cannot be evaluated whole under encryption (he.scope: model): {reason}; "
                        f"supported: a plain chain of {', '.join(_CHAIN_LAYERS)} layers",
                        hint="use he.scope: head (the last linear layer on encrypted features) or auto")


def _chain_to_tensors(chain: torch.nn.Sequential) -> dict[str, torch.Tensor] | None:
    import json

    kinds = [type(layer).__name__ for layer in chain]
    if any(k not in _CHAIN_LAYERS for k in kinds):
        return None
    out = {f"layer/{i}/{k}": v.detach().clone() for i, layer in enumerate(chain) for k, v in layer.state_dict().items()}
    out["layer_kinds"] = torch.tensor(list(json.dumps(kinds).encode()), dtype=torch.uint8)
    return out


def _chain_from_tensors(features: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """Rebuild the whole-model chain from ``layer_kinds`` + ``layer/<i>/<param>`` tensors."""
    import json

    from torch import nn

    kinds = json.loads(bytes(features["layer_kinds"].tolist()).decode())
    layers: list[nn.Module] = []
    for i, kind in enumerate(kinds):
        if kind not in _CHAIN_LAYERS:
            raise PipelineError(f"HE scope 'model' cannot carry a {kind} layer", hint="set he.scope: head")
        params = {k.split("/", 2)[2]: v for k, v in features.items() if k.startswith(f"layer/{i}/")}
        if kind == "Linear":
            layer: nn.Module = nn.Linear(params["weight"].shape[1], params["weight"].shape[0], bias="bias" in params)
        elif kind == "BatchNorm1d":
            layer = nn.BatchNorm1d(params["weight"].shape[0])
        else:
            layer = getattr(nn, kind)()
        layer.load_state_dict(params)
        layers.append(layer)
    return nn.Sequential(*layers).eval()


def he_evaluate(
    config: PipelineConfig, features: dict[str, torch.Tensor], audit: AuditRecorder | None = None
) -> HESummary:
    """Evaluate the head (or the whole tabular model) on CKKS-encrypted inputs (no secret key at the evaluator).

    Two classes: one logistic score (logit of class 1 minus class 0). More: one encrypted score per
    class, arg-maxed by the data owner after decryption.
    """
    from torch import nn

    from securetrain.he import evaluate_encrypted
    from securetrain.pipeline.models import he_head

    from securetrain.he import HEModelError

    head = he_head(features["head_weight"], features["head_bias"])
    regression = "target_std" in features
    labels: torch.Tensor | None = features["labels"]
    targets: torch.Tensor | None = None
    std = 1.0
    if regression:  # real-valued targets, standardised as the model's outputs are (errors scaled back below)
        mean, std = float(features["target_mean"]), float(features["target_std"])
        labels, targets = None, (features["labels"].double().reshape(-1) - mean) / std
    report = None
    if "layer_kinds" in features:
        scope, model = "model", _he_model_from_chain(features)
        try:
            report = evaluate_encrypted(
                model, features["model_inputs"], labels, targets=targets, audit=audit, decimals=config.he.decimals
            )
        except HEModelError as exc:
            if config.he.scope == "model":
                raise
            # (checked before any encryption) a layer HE cannot evaluate: score the linear head instead
            log.warning("HE cannot evaluate the whole model (%s); evaluating its last linear layer", exc)
    if report is None:
        scope, model = "head", head
        report = evaluate_encrypted(
            model, features["features"], labels, targets=targets, audit=audit, decimals=config.he.decimals
        )
    out_features = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features

    def units(value: float | None) -> float | None:  # regression: standardised errors -> the target's units
        return None if value is None else value * std

    return HESummary(
        samples=report.n_samples,
        features=report.n_features,
        max_abs_error=report.max_abs_error * std,
        plaintext_auc=report.auc_plaintext,
        encrypted_auc=report.auc_encrypted,
        plaintext_accuracy=report.accuracy_plaintext,
        encrypted_accuracy=report.accuracy_encrypted,
        ms_per_sample=report.ms_per_sample_end_to_end,
        poly_modulus_degree=int(report.params["poly_modulus_degree"]),
        public_context_bytes=report.public_context_bytes,
        scope=scope,
        outputs=out_features,
        max_abs_error_vs_plan=units(getattr(report, "max_abs_error_vs_plan", None)),
        approximation_error=units(getattr(report, "approximation_error_vs_exact", None)),
        out_of_interval_fraction=getattr(report, "out_of_interval_fraction", None),
        packed=getattr(report, "packed", None),
        # a decision threshold (0 on a logit) means nothing for a regression value
        prediction_agreement=None if regression else getattr(report, "prediction_agreement", None),
        task_kind="regression" if regression else "classification",
        rmse_encrypted=units(getattr(report, "rmse_encrypted", None)),
        rmse_plaintext=units(getattr(report, "rmse_plaintext", None)),
        mae_encrypted=units(getattr(report, "mae_encrypted", None)),
        mae_plaintext=units(getattr(report, "mae_plaintext", None)),
        rmse_vs_plaintext=units(getattr(report, "rmse_vs_exact", None)) if regression else None,
    )


def _he_model_from_chain(features: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """The whole model for HE; with two classes its last linear layer becomes one logistic unit."""
    from torch import nn

    from securetrain.pipeline.models import he_head, linear_bias

    layers = list(_chain_from_tensors(features))
    last = max(i for i, m in enumerate(layers) if isinstance(m, nn.Linear))
    head = cast(nn.Linear, layers[last])  # the isinstance check above picked it
    if head.out_features == 2:
        layers[last] = he_head(head.weight.detach(), linear_bias(head))[0]
    return nn.Sequential(*layers).eval()


def seal_audit(config: PipelineConfig, audit_log: Any) -> AuditSummary:
    """Sign a checkpoint of the log, export it, and verify the export with the standalone verifier."""
    from securetrain.redaction import mask_url

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
        url=mask_url(str(audit_log.url)),  # printed, reported, stored by Prefect: never the password
        entries=checkpoint.tree_size,
        root_hash=checkpoint.root_hash.hex(),
        checkpoint_note=note_path,
        export_dir=export_dir,
        verified=verified,
        verifier_output=output[-4000:],
    )
