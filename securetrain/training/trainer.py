"""The training engine: configure a :class:`Trainer`, call :meth:`Trainer.fit`.

Per optimizer step it does what a careful hand-written loop does and nothing more: forward under
autocast, (scaled) backward, optional accumulation, unscale + clip, step, zero grads. The loss is
accumulated on the device and synced to the host only every ``log_every`` steps.

Per epoch (when ``eval_data`` is given): a validation pass on the held-out data (loss, accuracy,
macro AUC, per-class counts by default, or the task's ``metrics_fn``), best-checkpoint selection by
``config.validation.metric`` into ``best_store``, and early stopping after ``patience`` validations
without improvement. A learning-rate ``scheduler`` (built by name from ``config.scheduler`` or
passed in) is stepped after every optimizer step. Scheduler state, the best-metric tracker and any
callback with ``state_dict``/``load_state_dict`` are saved in every checkpoint (the extra-state
hook, :meth:`Trainer.extra_state`), so a resumed run continues them exactly.

The loop is a handful of named steps (:meth:`Trainer._train_epoch`, :meth:`Trainer._micro_step`,
:meth:`Trainer._optimizer_step`, :meth:`Trainer._end_epoch`, :meth:`Trainer._log_window`) with their
state on the object, so it reads top to bottom and subclasses can override one step.

Preemption: SIGTERM sets a flag; the current optimizer step finishes, a checkpoint is written and
:meth:`fit` returns with ``reason=StopReason.PREEMPTED`` (the CLI then exits with
:data:`PREEMPTED_EXIT_CODE`). Ctrl-C (SIGINT) does the same, and the exit status is then
:data:`INTERRUPTED_EXIT_CODE` (130, as a shell reports Ctrl-C); a second Ctrl-C aborts at once
(``KeyboardInterrupt``) without waiting for the step. Restarting with the same config resumes from that checkpoint and ends
with bit-identical weights to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import ConfigError
from securetrain.devices.backend import DeviceBackend
from securetrain.devices.registry import resolve_backend
from securetrain.training import sharded
from securetrain.training import state as st
from securetrain.training.batches import (  # noqa: F401 - also importable from here, as before
    INPUT_KEYS,
    TARGET_KEYS,
    batch_len,
    call_model,
    default_predict,
    split_batch,
    strip_compile,
    to_device,
)
from securetrain.training.architecture import describe_fix, read_model_fix
from securetrain.training.callbacks import StepMetrics, TrainerCallback
from securetrain.training.checkpoint_store import CheckpointInfo, CheckpointStore
from securetrain.training.config import TrainingConfig
from securetrain.training.constant_norm import constant_outputs, group_sizes, refuse_constant_norms, suspect_norms
from securetrain.training.data import EpochFeeder, dataset_labels
from securetrain.training.defaults import default_audit_log, default_checkpoint_store
from securetrain.training.distributed import DistContext, init_distributed
from securetrain.training.errors import ResumeMismatchError, TrainingError, UncheckpointableStateError
from securetrain.training.losses import (  # noqa: F401 - also importable from here, as before
    LossFn,
    WeightedCrossEntropy,
    check_loss,
    criterion_loss,
    cross_entropy_loss,
)
from securetrain.training.schedulers import build_scheduler
from securetrain.training.stop import StopReason
from securetrain.training.seeding import capture_rng_state, eval_look, restore_rng_state, seed_everything
from securetrain.training.validation import BestTracker, MetricsFn, PredictFn, collect_outputs, default_metrics, gather_outputs, plain_metrics

log = logging.getLogger("securetrain.training")

#: Exit status for "stopped by SIGTERM after a clean checkpoint; rerun to resume" (BSD EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75
#: Exit status for "stopped by Ctrl-C after a clean checkpoint; rerun to resume" (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
CHECKPOINT_FORMAT = "securetrain-train/1"
# Own metadata keys, distinct from the stores' (the encrypted store owns "securetrain.format").
TRAIN_FORMAT_KEY = "securetrain.train.format"
TRAIN_STATE_KEY = "securetrain.train.state"

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: ``factory(optimizer, total_steps, steps_per_epoch) -> LRScheduler`` (lengths in optimizer steps).
SchedulerFactory = Callable[[torch.optim.Optimizer, "int | None", "int | None"], torch.optim.lr_scheduler.LRScheduler]


def optimizer_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a ``closure`` argument (LBFGS, SAM-style optimizers)."""
    try:
        params = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # a builtin or C extension without a signature: assume the usual step()
        return False
    closure = params.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty and closure.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def batchnorm_layers(model: nn.Module, kinds: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,),
                     ) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of the model's BatchNorm layers (any of ``kinds``), paths as the model names
    them (``encoder.1.bn``), without torch.compile's ``_orig_mod.``."""
    return [(n, m) for n, m in strip_compile(model).named_modules() if isinstance(m, kinds)]


def describe_layers(layers: Sequence[tuple[str, nn.Module]], limit: int = 4) -> str:
    """``"1.1 (BatchNorm2d), head.bn (BatchNorm1d)"`` for error messages (the first ``limit``)."""
    text = ", ".join(f"{name or '<the model>'} ({type(m).__name__})" for name, m in layers[:limit])
    return text + (f", ... ({len(layers)} in all)" if len(layers) > limit else "")


def _is_empty(data: Any) -> bool:
    """True for a sized Dataset/DataLoader of no samples (an iterable without a length: unknown, False)."""
    try:
        return len(data) == 0
    except TypeError:
        return False


@dataclass(frozen=True)
class TrainResult:
    steps: int
    epoch: int
    final_loss: float | None
    reason: StopReason
    checkpoint: CheckpointInfo | None
    resumed_from: int | None
    device: str
    precision: str
    validation: tuple[dict[str, Any], ...] = ()  # one entry per validation: epoch, step, metrics
    best: dict[str, Any] | None = None  # metric, value, epoch, step, checkpoint (path) of the best validation
    stop_signal: int | None = None  # the signal that stopped a preempted run (SIGTERM, SIGINT) if any
    world_size: int = 1
    profile_trace: Path | None = None  # Chrome trace written for config.profile
    memory: dict[str, Any] = field(default_factory=dict)  # backend.memory_summary() at the end (main rank)
    privacy: dict[str, Any] | None = None  # DP-SGD runs: epsilon, delta, noise_multiplier, ... (securetrain.release.privacy)

    @property
    def exit_code(self) -> int:
        if self.reason != StopReason.PREEMPTED:
            return 0
        return INTERRUPTED_EXIT_CODE if self.stop_signal == signal.SIGINT else PREEMPTED_EXIT_CODE


@dataclass
class _Progress:
    step: int = 0
    epoch: int = 0
    position: int = 0  # micro-batches of `epoch` already consumed
    samples: int = 0  # samples seen by this rank


@dataclass
class _Window:
    """Loss and throughput accumulated since the last ``on_step`` (kept on the device)."""

    loss_sum: torch.Tensor
    micro_batches: int = 0
    samples: int = 0
    steps: int = 0
    started: float = 0.0


class Trainer:
    """Configure, don't rewrite: model + optimizer (or factory) + data + :class:`TrainingConfig`.

    ``train_data`` is a map-style ``Dataset`` (the engine builds a deterministic, resumable,
    rank-sharded DataLoader) or a ``DataLoader`` (its dataset, batch size, collate_fn and workers are
    kept; its sampler is replaced by the deterministic one, unless it uses a custom batch sampler or
    an IterableDataset, which are used as they are).

    ``eval_data`` (Dataset or DataLoader) is validated every ``config.validation.every_epochs``
    epochs: ``predict_fn(model, batch) -> (outputs, targets)`` per batch (default: ``model(x), y``),
    then ``metrics_fn(outputs, targets)`` (default :func:`classification_metrics`);
    ``best_store`` receives the model weights whenever the named metric improves (pass an
    encrypted store for sensitive models: the trainer never picks a plaintext one for you).
    ``scheduler`` is an ``LRScheduler`` on the optimizer you passed, or a
    :data:`SchedulerFactory`; default: built from ``config.scheduler``.
    """

    #: Stop reasons after which the held-out metrics are computed once more (if not already for this step).
    final_validation_reasons: tuple[StopReason, ...] = (StopReason.COMPLETED,)

    def __init__(
        self,
        model: nn.Module,
        train_data: Any,
        config: TrainingConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None = None,
        loss_fn: LossFn | nn.Module | None = None,
        eval_data: Any = None,
        metrics_fn: MetricsFn | None = None,
        predict_fn: PredictFn | None = None,
        store: CheckpointStore | None = None,
        best_store: CheckpointStore | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        audit: AuditRecorder | None = None,
        backend: DeviceBackend | None = None,
        run_id: str | None = None,
        data_digest: str | None = None,
    ) -> None:
        self.config = config or TrainingConfig()
        # Identifies the training data (e.g. a SHA-256 of what the task built); part of the resume
        # fingerprint, so checkpoints trained on other data of the same length are not resumed.
        self.data_digest = data_digest
        self.model = model
        self.train_data = train_data
        self.eval_data = eval_data
        if eval_data is not None and _is_empty(eval_data):
            raise TrainingError("eval_data is empty: there is nothing to validate on",
                                hint="pass held-out samples, or eval_data=None to train without validation")
        self._optimizer_arg = optimizer
        self._scheduler_arg = scheduler
        # A loss module (nn.CrossEntropyLoss(weight=w), nn.MSELoss(), nn.BCEWithLogitsLoss(pos_weight=...))
        # is applied to (model(x), y) and moved to the device with the model (class weights included).
        self.criterion: nn.Module | None = loss_fn if isinstance(loss_fn, nn.Module) else None
        if self.config.optimizer is not None and optimizer is not None:
            raise TrainingError("both training.optimizer and an optimizer argument are given",
                                hint="keep one: the argument (library) or training.optimizer (config)")
        if self.config.class_weights is not None and loss_fn is not None:
            raise TrainingError("training.class_weights weights the default cross-entropy loss, and this run passes "
                                "its own loss_fn", hint="put the weights in your loss (e.g. "
                                "loss_fn=nn.CrossEntropyLoss(weight=...)) or unset training.class_weights")
        if self.criterion is not None:
            self.loss_fn: LossFn = criterion_loss(self.criterion)
        else:
            self.loss_fn = cast("LossFn | None", loss_fn) or cross_entropy_loss
        self.metrics_fn: MetricsFn = metrics_fn or default_metrics
        self.predict_fn: PredictFn = predict_fn or default_predict
        # Secure by default: with no recorder given, $SECURETRAIN_AUDIT_URL (if set) records the run;
        # with no store given, checkpoints are encrypted whenever a key source is configured.
        self._owned_audit = default_audit_log() if audit is None else None
        audit = audit if audit is not None else self._owned_audit
        self.store: CheckpointStore = store or default_checkpoint_store(self.config, audit)
        self.best_store = best_store
        self.callbacks = list(callbacks)
        self.audit: AuditRecorder = audit or NullAuditRecorder()
        self._backend_arg = backend
        self.run_id = run_id or str(self.config.output_dir)
        self.backend: DeviceBackend | None = None
        self.dist = DistContext()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.device: torch.device | None = None
        self.progress = _Progress()
        v = self.config.validation
        self.tracker = BestTracker(v.metric, v.maximize, v.min_delta)
        self.best_checkpoint: CheckpointInfo | None = None
        self._stop_requested = False
        self._stop_signal: int | None = None
        self._early_stop = False
        self._last_loss: float | None = None
        self._total_steps: int | None = None
        self._per_epoch: int | None = None
        self._fingerprint_value: dict[str, Any] = {}
        self._saved_step: int | None = None
        self._saved_info: CheckpointInfo | None = None
        self._validated_step: int | None = None
        self._profile_trace: Path | None = None
        self._profiler: Any = None
        self._sharded = False
        self._state_checked_after_step = False
        self._probe_batchnorm = True  # check BatchNorm1d inputs on the first micro-batch (see _batchnorm_probe)
        self._plateau = False  # a ReduceLROnPlateau scheduler: stepped per validation, not per step
        self._closure = False  # optimizer.step(closure): micro-batches wait in _pending for the closure
        self._pending: list[Any] = []
        self.batch_size = self.config.batch_size
        self.num_workers = self.config.num_workers or 0

    # --- public helpers ------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def request_stop(self) -> None:
        """Ask the loop to stop after the current optimizer step (what SIGTERM does)."""
        self._stop_requested = True

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        """SIGTERM / first SIGINT: stop after this step; a second SIGINT aborts at once."""
        if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        if self._stop_signal is None:
            self._stop_signal = signum
        self.request_stop()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's module: without DDP and without a ``torch.compile`` wrapper (whose state names
        carry ``_orig_mod.``); checkpoints hold its names, validation runs it."""
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
        return strip_compile(model)

    @property
    def total_steps(self) -> int | None:
        return self._total_steps

    # --- extra state (saved in every checkpoint) ------------------------------------------
    def _stateful_callbacks(self) -> dict[str, Any]:
        return {
            f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(self.callbacks)
            if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None))
        }

    def extra_state(self) -> dict[str, Any]:
        """JSON-able state beyond model/optimizer/RNG; override (and :meth:`load_extra_state`) to add yours."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "tracker": self.tracker.state_dict(),
            "best_checkpoint": _info_to_json(self.best_checkpoint),
            "callbacks": {k: cb.state_dict() for k, cb in self._stateful_callbacks().items()},
            "early_stopped": self._early_stop,
            "validated_step": self._validated_step,
            "schedule_steps": self._schedule_steps(),
        }

    def _schedule_steps(self) -> int | None:
        """The run length a config-built cosine/onecycle schedule was planned for (None otherwise)."""
        planned = self._scheduler_arg is None and self.config.scheduler.name in ("cosine", "onecycle")
        return self._total_steps if planned else None

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if (state.get("scheduler") is None) != (self.scheduler is None):
            raise ResumeMismatchError(
                "the checkpoint and this run disagree on whether a learning-rate scheduler is used",
                hint="restore the original scheduler settings, use a fresh output_dir, or set resume=false",
            )
        saved_steps, steps = state.get("schedule_steps"), self._schedule_steps()
        if saved_steps is not None and steps is not None and saved_steps != steps:
            raise ResumeMismatchError(
                f"the checkpoint's {self.config.scheduler.name} learning-rate schedule is planned for {saved_steps} "
                f"optimizer steps and this run for {steps} (epochs or max_steps changed); resumed, the schedule would "
                "run past its end", hint="keep epochs/max_steps of that run, or train longer from a fresh output_dir "
                "(or with a schedule that does not depend on the run length: constant, step)")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.tracker.load_state_dict(state["tracker"])
        self.best_checkpoint = _info_from_json(state.get("best_checkpoint"))
        self._early_stop = bool(state.get("early_stopped", False))
        self._validated_step = state.get("validated_step")
        saved_callbacks = state.get("callbacks", {})
        for key, cb in self._stateful_callbacks().items():
            if key in saved_callbacks:
                cb.load_state_dict(saved_callbacks[key])

    # --- setup ---------------------------------------------------------------------------
    def _resolve_precision(self, backend: DeviceBackend) -> tuple[str, torch.dtype | None]:
        wanted = self.config.precision
        if wanted == "auto":
            dtype = backend.autocast_dtype
            return ({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32") if dtype else "fp32"), dtype
        if wanted != "fp32" and wanted not in backend.supported_precisions:
            raise TrainingError(
                f"precision {wanted} is not supported on {backend.name}",
                hint=f"use one of {', '.join(backend.supported_precisions)} or precision=auto",
            )
        return wanted, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(wanted)

    def _materialise_lazy(self, device: torch.device) -> None:
        """Lazy modules (``nn.LazyLinear``, ``LazyConv2d``) get their shapes from a first forward, which
        the optimizer needs before it can hold their parameters: run ``loss_fn`` once on the first
        training batch (eval mode, no grad, every RNG stream restored, so nothing else changes)."""
        from torch.nn.parameter import is_lazy
        from torch.utils.data import DataLoader, IterableDataset, default_collate

        model = strip_compile(self.model)  # materialised uncompiled: the compiled wrapper runs it after
        if not any(is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
            return
        assert self.backend is not None
        data = self.train_data
        if isinstance(data, DataLoader):
            batch = next(iter(data))
        elif isinstance(data, IterableDataset):
            batch = next(iter(DataLoader(data, batch_size=2)))
        else:
            batch = default_collate([data[i] for i in range(min(2, len(data)))])
        if device.type != "cpu":
            batch = to_device(batch, device, False)
        with eval_look(model, self.backend.device_type), torch.no_grad():
            self.loss_fn(model, batch)
        model.to(device)

    def _weighted_loss(self) -> LossFn:
        """The default loss with ``config.class_weights`` (counting the labels for 'balanced')."""
        spec = self.config.class_weights
        if spec != "balanced":
            return WeightedCrossEntropy(list(cast(list, spec)), None)
        try:
            labels = dataset_labels(self.train_data, lambda item: split_batch(item)[1])
        except (TypeError, TrainingError) as exc:
            raise TrainingError(f"training.class_weights: balanced needs the training labels, which this data does "
                                f"not give ({exc})", hint="give the weights as a list, one per class") from None
        if labels.numel() == 0 or bool((labels < 0).any()):
            raise TrainingError("training.class_weights: balanced needs class ids 0..C-1 in the training labels",
                                hint="give the weights as a list, one per class")
        counts = torch.bincount(labels)
        if self.is_main:
            log.info("class_weights balanced: class counts %s", counts.tolist())
        return WeightedCrossEntropy(None, counts)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        arg = self._optimizer_arg
        params = [p for p in self.model.parameters() if p.requires_grad]
        if arg is None and self.config.optimizer is not None:
            return _configured_optimizer(self.config, params)
        if arg is None:
            return torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        if isinstance(arg, torch.optim.Optimizer):
            return arg
        return arg(params)

    def _build_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        assert self.optimizer is not None
        arg = self._scheduler_arg
        if arg is None:
            return build_scheduler(self.config.scheduler, self.optimizer,
                                   total_steps=self._total_steps, steps_per_epoch=self._steps_per_epoch())
        if isinstance(arg, torch.optim.lr_scheduler.LRScheduler):
            if arg.optimizer is not self.optimizer:
                raise TrainingError("the scheduler drives a different optimizer than the trainer's",
                                    hint="pass the optimizer too, or a factory(optimizer, total_steps, steps_per_epoch)")
            return arg
        return arg(self.optimizer, self._total_steps, self._steps_per_epoch())

    def _make_feeder(self, backend: DeviceBackend, device: torch.device) -> EpochFeeder:
        """The epoch-wise batch source (a subclass may substitute one, e.g. Poisson sampling for DP)."""
        cfg = self.config
        return EpochFeeder(
            self.train_data, batch_size=self.batch_size, seed=cfg.seed, shuffle=cfg.shuffle, drop_last=cfg.drop_last,
            num_workers=self.num_workers, pin_memory=backend.pin_memory and device.type != "cpu",
            rank=self.dist.rank, world_size=self.dist.world_size, gather=self.dist.gather_objects,
        )

    def _wrap_distributed(self, device: torch.device) -> None:
        """Wrap the model for data parallelism (after resume; DP-SGD substitutes Opacus' wrapper)."""
        self.model = nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.config.find_unused_parameters,
        )

    def _steps_per_epoch(self) -> int | None:
        return None if self._per_epoch is None else -(-self._per_epoch // self.config.grad_accumulation)

    def _plan_length(self, feeder: EpochFeeder) -> None:
        cfg = self.config
        self._per_epoch = feeder.batches_in_epoch()
        total = cfg.max_steps
        per_epoch = self._steps_per_epoch()
        if per_epoch is not None and cfg.epochs is not None:
            by_epochs = cfg.epochs * per_epoch
            total = min(total, by_epochs) if total else by_epochs
        self._total_steps = total

    def _effective_batch_size(self, backend: DeviceBackend) -> int:
        """``batch_size`` rounded up to the backend's multiple (``batch_multiple: auto``), logged."""
        size = self.config.batch_size
        if self.config.batch_multiple == "off":
            return size
        rounded = backend.round_batch_size(size)
        if rounded != size and self.is_main:
            log.info("batch_size %d rounded up to %d (a multiple of %d, the %s backend's preferred size; "
                     "set training.batch_multiple: off to keep %d)", size, rounded, backend.batch_multiple,
                     backend.name, size)
        return rounded

    def _effective_num_workers(self, backend: DeviceBackend) -> int:
        """``num_workers`` as configured, else the backend's advice for this node's ranks."""
        if self.config.num_workers is not None:
            return self.config.num_workers
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return backend.loader_workers(per_node)

    def _fingerprint(self, world_size: int, precision: str, dataset_len: int | None) -> dict[str, Any]:
        c = self.config
        # What must match for a resumed run to replay the same sample order and numerics.
        return {
            "seed": c.seed,
            "batch_size": self.batch_size,
            "grad_accumulation": c.grad_accumulation,
            "world_size": world_size,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "precision": precision,
            "dataset_len": dataset_len,
        } | ({"data_digest": self.data_digest} if self.data_digest is not None else {})

    # --- checkpointing -------------------------------------------------------------------
    def _check_fsdp(self, precision: str) -> None:
        if precision == "fp16":
            raise TrainingError("strategy fsdp does not support precision fp16 (its GradScaler is not sharded)",
                                hint="use precision bf16 or fp32, or strategy ddp")
        if isinstance(self._optimizer_arg, torch.optim.Optimizer) and not sharded.is_fsdp(self.unwrapped_model):
            raise TrainingError("strategy fsdp replaces the model's parameters with shards, so an optimizer built "
                                "on the unsharded parameters cannot be used",
                                hint="pass an optimizer factory (params -> optimizer), or fully_shard the model yourself")

    def _train_state(self) -> dict[str, Any]:
        assert self.scaler is not None
        p = self.progress
        return {
            "step": p.step, "epoch": p.epoch, "position": p.position, "samples": p.samples,
            "last_loss": self._last_loss, "fingerprint": self._fingerprint_value,
            "scaler": self.scaler.state_dict(), "extra": self.extra_state(),
        }

    def _checkpoint_sharded(self) -> CheckpointInfo | None:
        """FSDP: every rank writes its own shard; rank 0 then the manifest binding them (see sharded)."""
        assert self.optimizer is not None and self.backend is not None
        p, rank, world = self.progress, self.dist.rank, self.dist.world_size
        tensors, layout, optim_meta = sharded.local_state(self.unwrapped_model, self.optimizer)
        rng_t, rng_m = capture_rng_state(self.backend.device_type)
        tensors.update({f"rng/{k}": v.cpu() for k, v in rng_t.items()})
        shard_state = {"rank": rank, "world_size": world, "step": p.step, "optimizer": optim_meta, "rng": rng_m}
        shard_info = sharded.shard_store(self.store, rank).save(
            p.step, tensors, {TRAIN_FORMAT_KEY: sharded.SHARD_FORMAT, sharded.SHARD_STATE_KEY: st.dumps(shard_state)})
        shard_infos = self.dist.gather_objects(shard_info)
        info: CheckpointInfo | None = None
        if self.is_main:
            meta = {TRAIN_FORMAT_KEY: sharded.MANIFEST_FORMAT, TRAIN_STATE_KEY: st.dumps(self._train_state()),
                    **sharded.manifest_metadata(shard_infos, self._store_directory(), world, layout),
                    **self.model_metadata()}
            info = self.store.save(p.step, {"manifest/world_size": torch.tensor([world], dtype=torch.int64)}, meta)
            for cb in self.callbacks:
                cb.on_checkpoint(self, info)
        self.dist.barrier()  # the manifest is durable before anyone goes on
        self._saved_step, self._saved_info = p.step, info
        return info

    def _checkpoint(self) -> CheckpointInfo | None:
        assert self.optimizer is not None and self.backend is not None and self.scaler is not None
        if self._sharded:
            return self._checkpoint_sharded()
        rng_t, rng_m = capture_rng_state(self.backend.device_type)
        # Every rank's RNG is saved so dropout etc. continue exactly on each rank after resume.
        all_rng = self.dist.gather_objects((rng_t, rng_m))
        info: CheckpointInfo | None = None
        if self.is_main:
            tensors = self._model_tensors()
            opt_t, opt_m = st.flatten_optimizer(self.optimizer.state_dict())
            tensors.update(opt_t)
            rng_meta = {}
            for rank, (rt, rm) in enumerate(all_rng):
                tensors.update({f"rng/{rank}/{k}": v.cpu() for k, v in rt.items()})
                rng_meta[str(rank)] = rm
            p = self.progress
            state = {
                "step": p.step, "epoch": p.epoch, "position": p.position, "samples": p.samples,
                "last_loss": self._last_loss, "fingerprint": self._fingerprint_value,
                "optimizer": opt_m, "scaler": self.scaler.state_dict(), "rng": rng_meta,
                "extra": self.extra_state(),
            }
            meta = {TRAIN_FORMAT_KEY: CHECKPOINT_FORMAT, TRAIN_STATE_KEY: st.dumps(state), **self.model_metadata()}
            # The store records checkpoint.write itself (it knows the key id and ciphertext digest).
            info = self.store.save(p.step, tensors, meta)
            for cb in self.callbacks:
                cb.on_checkpoint(self, info)
        self.dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is durable
        self._saved_step, self._saved_info = self.progress.step, info
        return info

    def model_metadata(self) -> dict[str, str]:
        """Metadata every checkpoint of the model carries about its architecture (none here; DP-SGD
        records the layers it replaced, :mod:`securetrain.training.architecture`)."""
        return {}

    def _check_architecture(self, metadata: Mapping[str, str], name: str) -> None:
        """Refuse a checkpoint trained on another architecture than this run trains (DP-SGD's fixed copy)."""
        recorded = read_model_fix(metadata)
        ours = read_model_fix(self.model_metadata())
        if recorded is None or recorded == ours:
            return  # a plain run's checkpoint (or a DP run's from before the record): the state check decides
        # Resumed without DP-SGD, the model released would not have the privacy its run claims.
        then = "a DP-SGD run (training.privacy)" + (
            f" that trained its model with {describe_fix(recorded)} (training.privacy.fix_model)" if recorded else "")
        now = "trains without DP-SGD" if ours is None else f"has {describe_fix(ours)}"
        raise ResumeMismatchError(
            f"cannot resume from {name}: it was written by {then}; this run {now}",
            hint="resume with the training.privacy settings and model that wrote it, use a fresh output_dir, "
                 "or set resume=false")

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        # Tied weights (one Parameter under two names) stay one tensor: written once, re-tied on load.
        # Names without torch.compile's "_orig_mod." (a compiled submodule's too): they load uncompiled.
        state = self.unwrapped_model.state_dict()
        return st.snapshot_tensors({f"model/{st.plain_name(k)}": v for k, v in state.items()})

    def _save_best(self, metrics: Mapping[str, Any]) -> None:
        """Weights of the best validation so far into ``best_store`` (main rank writes; under FSDP
        every rank takes part in gathering the full weights to rank 0's host memory)."""
        if self.best_store is None:
            return
        tensors = None
        if self._sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.unwrapped_model,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            tensors = st.snapshot_tensors({f"model/{st.plain_name(k)}": cast(torch.Tensor, v) for k, v in full.items()})
        if not self.is_main:
            return
        p = self.progress
        meta = {TRAIN_FORMAT_KEY: "securetrain-best/1",
                "securetrain.train.best": st.dumps({"metric": self.tracker.metric, "value": self.tracker.best,
                                                    "epoch": p.epoch, "step": p.step}),
                **self.model_metadata()}
        self.best_checkpoint = self.best_store.save(p.step, tensors if tensors is not None else self._model_tensors(), meta)

    def _resume(self) -> int | None:
        assert self.optimizer is not None and self.backend is not None and self.scaler is not None
        ckpt = None
        if self.is_main and hasattr(self.store, "load_newest_verified"):
            # Falls back past a damaged/substituted latest checkpoint (each skip is audited).
            ckpt = self.store.load_newest_verified()
            latest = ckpt.info if ckpt is not None else None
        else:
            latest = self.store.latest() if self.is_main else None
        latest = self.dist.broadcast_object(latest)
        if latest is None:
            return None
        if ckpt is None:
            ckpt = self.store.load(latest)
        fmt = ckpt.metadata.get(TRAIN_FORMAT_KEY)
        if (fmt == sharded.MANIFEST_FORMAT) != self._sharded and fmt in (sharded.MANIFEST_FORMAT, CHECKPOINT_FORMAT):
            written = "FSDP-sharded" if fmt == sharded.MANIFEST_FORMAT else "a full (single/DDP) checkpoint"
            now = "sharded (fsdp)" if self._sharded else f"not sharded ({self.dist.world_size} process(es), strategy {self.config.strategy})"
            raise ResumeMismatchError(
                f"cannot resume from {latest.path.name}: it is {written}, this run is {now}",
                hint="resume with the strategy and world size that wrote it, use a fresh output_dir, or set resume=false",
            )
        if fmt not in (CHECKPOINT_FORMAT, sharded.MANIFEST_FORMAT):
            raise ResumeMismatchError(
                f"{latest.path.name} is not a securetrain training checkpoint",
                hint="use a fresh output_dir or set resume=false",
            )
        self._check_architecture(ckpt.metadata, latest.path.name)
        saved = st.loads(ckpt.metadata[TRAIN_STATE_KEY])
        fingerprint = self._fingerprint_value
        # A checkpoint written without a data digest (library use, or before digests) is not held to one.
        diff = {k: (saved["fingerprint"].get(k), v) for k, v in fingerprint.items()
                if saved["fingerprint"].get(k) != v and (k != "data_digest" or k in saved["fingerprint"])}
        if "data_digest" in diff:
            was, now = diff["data_digest"]
            raise ResumeMismatchError(
                f"cannot resume from {latest.path.name}: the training data differ from the data its checkpoints "
                f"were trained on (digest {str(was)[:12]}… vs now {str(now)[:12]}…)",
                hint="train on changed data as a new run (a fresh output_dir; the pipeline: `securetrain run "
                     "--new-run` or another run name), or restore the data this run was trained on",
            )
        if diff:
            what = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ResumeMismatchError(
                f"cannot resume exactly from {latest.path.name}: {what}",
                hint="restore the original settings, use a fresh output_dir, or set resume=false",
            )
        if fmt == sharded.MANIFEST_FORMAT:
            self._resume_shard(ckpt)
        else:
            # Either form of names: with torch.compile's "_orig_mod." (written before) or without.
            model_sd = st.to_model_names(self.unwrapped_model.state_dict(), {
                k.removeprefix("model/"): v for k, v in ckpt.tensors.items() if k.startswith("model/")})
            _check_model_state(self.unwrapped_model, model_sd, latest.path.name)
            self.unwrapped_model.load_state_dict(model_sd, strict=True)
            # The hyperparameters this optimizer itself has (load_state_dict's __setstate__ may add
            # defaults its groups never had, e.g. LBFGS' "differentiable" in torch 2.13).
            wanted = set(self.optimizer.defaults)
            try:
                self.optimizer.load_state_dict(st.unflatten_optimizer(ckpt.tensors, saved["optimizer"]))
            except ValueError as exc:  # parameter groups of another size (e.g. a layer frozen since)
                raise ResumeMismatchError(
                    f"cannot resume from {latest.path.name}: the optimizer does not match the checkpoint's ({exc})",
                    hint="restore the trainable parameters and optimizer of that run, use a fresh output_dir, "
                         "or set resume=false",
                ) from None
            except KeyError as exc:  # another optimizer's per-parameter state (e.g. SGD's into Adam)
                lacking = [str(exc.args[0]) if exc.args else "?"]
            else:
                # Another optimizer's state (e.g. AdamW's into SGD) loads, then fails at the first step on
                # the hyperparameters its param groups lack (torch fills in those it added itself).
                lacking = sorted({k for g in self.optimizer.param_groups for k in wanted if k not in g})
            if lacking:
                raise ResumeMismatchError(
                    f"cannot resume from {latest.path.name}: its optimizer state is another optimizer's "
                    f"(this {type(self.optimizer).__name__} needs {', '.join(lacking)})",
                    hint="resume with the optimizer that wrote it, use a fresh output_dir, or set resume=false",
                )
            rank = str(self.dist.rank)
            prefix = f"rng/{rank}/"
            restore_rng_state(
                {k.removeprefix(prefix): v for k, v in ckpt.tensors.items() if k.startswith(prefix)},
                saved["rng"][rank],
                self.backend.device_type,
            )
        if saved["scaler"]:
            self.scaler.load_state_dict(saved["scaler"])
        self.load_extra_state(saved.get("extra") or {"scheduler": None, "tracker": self.tracker.state_dict()})
        self.progress = _Progress(saved["step"], saved["epoch"], saved["position"], saved["samples"])
        self._last_loss = saved["last_loss"]
        return int(saved["step"])

    def _store_directory(self) -> Path:
        """Sharded (FSDP) checkpoints name their per-rank files relative to the store's folder."""
        directory = getattr(self.store, "directory", None)
        if directory is None:
            raise ConfigError("sharded (FSDP) checkpoints need a checkpoint store with a directory",
                              hint="use EncryptedCheckpointStore or SafetensorsCheckpointStore")
        return Path(directory)

    def _resume_shard(self, manifest: Any) -> None:
        """FSDP: this rank's shard, verified against the manifest's digest, back into model and optimizer."""
        assert self.optimizer is not None and self.backend is not None
        world, infos = sharded.shard_infos(manifest.metadata, self._store_directory())
        if world != self.dist.world_size:
            raise ResumeMismatchError(
                f"{manifest.info.path.name} was written by {world} ranks; this run has {self.dist.world_size}",
                hint=f"resume on {world} processes (training.nproc_per_node x nnodes), or use a fresh output_dir")
        rank = self.dist.rank
        shard = sharded.shard_store(self.store, rank).load(infos[rank])
        state = st.loads(shard.metadata.get(sharded.SHARD_STATE_KEY, "null")) or {}
        if (state.get("rank"), state.get("world_size"), state.get("step")) != (rank, world, manifest.info.step):
            raise ResumeMismatchError(f"shard {infos[rank].path.name} does not belong to rank {rank} of step "
                                      f"{manifest.info.step} (world {world})", hint="the shard files were moved")
        sharded.load_local_state(self.unwrapped_model, self.optimizer, shard.tensors, state["optimizer"])
        restore_rng_state({k.removeprefix("rng/"): v for k, v in shard.tensors.items() if k.startswith("rng/")},
                          state["rng"], self.backend.device_type)

    # --- the run -------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.config
        backend = self._backend_arg
        if backend is None:
            from securetrain.training.distributed import from_env

            _, local_rank, world = from_env()
            backend = resolve_backend(cfg.device, index=local_rank if world > 1 else None)
        self.backend = backend
        self.dist = init_distributed(backend.collective_backend)
        clean = False
        try:
            device = backend.device()
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if backend.collective_backend != "gloo":
                self.dist.device = device
            result = self._fit(backend, device)
            clean = True
            return result
        finally:
            # Every rank, every path; the teardown barrier only after a normal end (see DistContext.close).
            self.dist.close(clean=clean)
            if self._owned_audit is not None:
                self._owned_audit.close()
                self._owned_audit = None

    def _fit(self, backend: DeviceBackend, device: torch.device) -> TrainResult:
        cfg = self.config
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        precision, self._amp_dtype = self._resolve_precision(backend)
        self.device = device
        self.batch_size = self._effective_batch_size(backend)  # the backend's advice (logged when it applies)
        self.num_workers = self._effective_num_workers(backend)
        seed_everything(cfg.seed + self.dist.rank)
        self.model.to(device)
        if self.criterion is not None:
            self.criterion.to(device)
        self._materialise_lazy(device)
        self._sharded = self.dist.enabled and (cfg.strategy == "fsdp" or sharded.is_fsdp(self.unwrapped_model))
        if self._sharded:
            self._check_fsdp(precision)
            # fully_shard works in place: a torch.compile wrapper then runs the sharded module
            # (compile over FSDP, the order torch documents).
            wrapped = sharded.wrap_fsdp(self.unwrapped_model, self.dist.world_size, device)
            self.model = wrapped if self.model is self.unwrapped_model else self.model
        if cfg.class_weights is not None:
            self.loss_fn = self._weighted_loss()
        self.optimizer = self._build_optimizer()
        self._closure = optimizer_needs_closure(self.optimizer) if cfg.closure is None else cfg.closure
        if self._closure and precision == "fp16":
            if cfg.precision != "auto":
                raise TrainingError(
                    f"precision fp16 needs a GradScaler, which cannot step an optimizer that takes a closure "
                    f"({type(self.optimizer).__name__})", hint="use precision bf16 or fp32")
            log.info("precision auto: fp32, not fp16 (fp16's GradScaler cannot step an optimizer that takes a closure)")
            precision, self._amp_dtype = "fp32", None
        self.scaler = torch.amp.GradScaler(device.type, init_scale=4096, enabled=precision == "fp16")
        self.feeder = self._make_feeder(backend, device)
        self._plan_length(self.feeder)
        self._refuse_constant_norms()
        self.scheduler = self._build_scheduler()
        self._plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if self._plateau and self.eval_data is None:
            raise TrainingError("ReduceLROnPlateau steps on a validation metric, and this run has no eval_data",
                                hint="pass eval_data (it is stepped with validation.metric after every validation), "
                                     "or use another scheduler")
        self._fingerprint_value = self._fingerprint(self.dist.world_size, precision, self.feeder.dataset_length)
        resumed_from = self._resume() if cfg.resume else None
        if self.dist.enabled and not self._sharded:
            self._wrap_distributed(device)
        if self.is_main:
            self.audit.record("training.start", self.run_id, details={
                "device": str(device), "backend": backend.name, "precision": precision,
                "world_size": self.dist.world_size, "seed": cfg.seed, "resumed_from_step": resumed_from,
                "strategy": ("fsdp" if self._sharded else "ddp") if self.dist.enabled else "single",
                "parameters": sum(p.numel() for p in self.unwrapped_model.parameters()),
                "scheduler": cfg.scheduler.name if self._scheduler_arg is None else type(self.scheduler).__name__,
            })
            for cb in self.callbacks:
                cb.on_train_begin(self)

        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        reason = StopReason.COMPLETED
        info: CheckpointInfo | None = None
        try:
            self._check_checkpointable("found before the first step")
            if self.eval_data is not None and not self._early_stop:
                self._preflight_validation()
            with self._profiling():
                reason = StopReason(self._train_loop())
            if (reason in self.final_validation_reasons and self.eval_data is not None
                    and self._validated_step != self.progress.step):
                self._validate()  # a run cut short by max_steps still reports its held-out metrics
            if reason != StopReason.COMPLETED or cfg.checkpoint_at_end:
                # Skip a duplicate write when checkpoint_every already saved this very step.
                info = self._saved_info if self._saved_step == self.progress.step else self._checkpoint()
        except BaseException as exc:
            if self.is_main:
                self.audit.record("training.stop", self.run_id, outcome="failure", details={
                    "steps": self.progress.step, "final_loss": self._last_loss, "reason": f"error:{type(exc).__name__}",
                })
                for cb in self.callbacks:
                    with contextlib.suppress(Exception):  # never mask the real error
                        cb.on_error(self, exc)
            raise
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
        self.model = self.unwrapped_model
        t = self.tracker
        best = None
        if t.best is not None:
            best = {"metric": t.metric, "value": t.best, "epoch": t.best_epoch, "step": t.best_step,
                    "checkpoint": str(self.best_checkpoint.path) if self.best_checkpoint else None}
        result = TrainResult(
            steps=self.progress.step, epoch=self.progress.epoch, final_loss=self._last_loss, reason=reason,
            checkpoint=info, resumed_from=resumed_from, device=str(device), precision=precision,
            validation=tuple(t.history), best=best,
            stop_signal=self._stop_signal if reason == StopReason.PREEMPTED else None,
            world_size=self.dist.world_size, profile_trace=self._profile_trace,
            memory=backend.memory_summary() if self.is_main else {},
        )
        if self.is_main:
            self.audit.record("training.stop", self.run_id, details={
                "steps": result.steps, "final_loss": result.final_loss, "reason": reason,
                "checkpoint_sha256": info.sha256 if info else None,
                "best": {k: v for k, v in (best or {}).items() if k != "checkpoint"} or None,
            })
            for cb in self.callbacks:
                cb.on_end(self, result)
        return result

    def _refuse_constant_norms(self) -> None:
        """:class:`ConstantNormError` before training when a normalisation layer normalises one value
        per sample and group (it outputs its bias whatever its input; :mod:`securetrain.training.constant_norm`):
        seen on one forward of the first training batch through ``loss_fn``, in eval mode, without
        gradients, with the RNG streams restored. No forward when no layer could be one (most models).
        Every rank checks its own first batch (so FSDP's collectives match)."""
        assert self.backend is not None and self.device is not None and self.feeder is not None
        model = self.unwrapped_model
        norms = suspect_norms(model)
        if not norms:
            return
        with eval_look(model, self.backend.device_type):
            # The feeder re-seeds its sampler and loader for every epoch it starts: this look leaves no trace.
            batch = next(iter(self.feeder.epoch(0)), None)
            if batch is None:
                return  # no batches: _train_loop says so
            if self.device.type != "cpu":
                batch = to_device(batch, self.device, self.backend.pin_memory)
            with st.buffers_kept(model):
                sizes, error = group_sizes(norms, lambda: self.loss_fn(model, batch))
        found = constant_outputs(norms, sizes)
        if error is not None and not found:
            # The model or loss_fn may not run in eval mode as in training; training's own forward
            # reports a real failure, so the check does not stand in its way.
            log.info("the constant-normalisation check could not run the first batch in eval mode (%s: %s)",
                     type(error).__name__, error)
        refuse_constant_norms(found, "seen on the first training batch before training")

    # --- the loop, as named steps --------------------------------------------------------
    def _train_loop(self) -> StopReason:
        """Epochs until ``epochs``/``max_steps``; returns why it stopped."""
        cfg = self.config
        if self._per_epoch == 0:
            raise TrainingError("the training data yields no batches", hint="check the dataset size and drop_last")
        self._window = self._new_window()
        self.model.train()
        p = self.progress
        if self._early_stop:  # resumed after early stopping: the run is over
            return StopReason.EARLY_STOPPED
        while cfg.epochs is None or p.epoch < cfg.epochs:
            if cfg.max_steps is not None and p.step >= cfg.max_steps:
                return StopReason.COMPLETED
            stop = self._train_epoch()
            if stop is not None:
                return stop
            stop = self._end_epoch()
            if stop is not None:
                return stop
        self._log_window()
        return StopReason.COMPLETED

    def _train_epoch(self) -> StopReason | None:
        """One pass over the (remaining) batches of ``progress.epoch``; a reason if the run must stop."""
        cfg = self.config
        p = self.progress
        accum = cfg.grad_accumulation
        in_window, window_size = 0, accum
        for batch in self.feeder.epoch(p.epoch, skip_batches=p.position):
            if in_window == 0 and self._per_epoch is not None:
                # The last window of an epoch may be short; divide by its true size so the
                # gradient is the mean over the micro-batches it really has.
                window_size = min(accum, self._per_epoch - p.position)
            in_window += 1
            p.position += 1
            self._micro_step(batch, window_size, last=in_window == window_size)
            if in_window < window_size:
                continue
            in_window = 0
            self._optimizer_step()
            stop = self._after_optimizer_step()
            if stop is not None:
                return stop
        if in_window:  # unsized data: flush the short tail window, rescaled to a mean
            for prm in self._params():
                if prm.grad is not None:
                    prm.grad.mul_(window_size / in_window)
            self._optimizer_step()
            return self._after_optimizer_step()  # a step like any other: logged, checkpointed, counted
        return None

    def _micro_step(self, batch: Any, window_size: int, *, last: bool) -> None:
        """Forward + backward of one micro-batch (gradients accumulate until the window's last).
        With a closure optimizer the batch is kept for the closure, which runs at the optimizer step."""
        assert self.device is not None and self.backend is not None
        if self.device.type != "cpu":
            batch = to_device(batch, self.device, self.backend.pin_memory)
        w = self._window
        n = batch_len(batch)
        w.samples += n
        self.progress.samples += n
        if self._closure:
            self._pending.append(batch)
            return
        loss = self._forward_backward(batch, window_size, last=last)
        w.loss_sum += loss.detach().float()
        w.micro_batches += 1

    def _single_sample_tail(self) -> int | None:
        """Samples per rank when every epoch of the engine's loader ends with a 1-sample batch."""
        sampler = getattr(self.feeder, "sampler", None)
        if (sampler is None or getattr(sampler, "batches", False) or sampler.per_rank is None
                or getattr(self.feeder, "drop_last", True) or self.feeder.batch_size <= 1):
            return None
        return sampler.per_rank if sampler.per_rank % self.feeder.batch_size == 1 else None

    @contextlib.contextmanager
    def _batchnorm_probe(self) -> Any:
        """First micro-batch only, when epochs end with a 1-sample batch: BatchNorm1d fed [N, C] then
        fails ("Expected more than 1 value per channel") at the end of the epoch; refuse it now."""
        per_rank = self._single_sample_tail() if self._probe_batchnorm else None
        self._probe_batchnorm = False
        layers = batchnorm_layers(self.unwrapped_model, (nn.BatchNorm1d,))
        if per_rank is None or not layers:
            yield
            return
        flat: list[str] = []
        hooks = [m.register_forward_pre_hook(
            lambda _m, args, name=name: flat.append(name) if args and getattr(args[0], "dim", lambda: 0)() == 2 else None)
            for name, m in layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
        if flat:
            raise TrainingError(
                f"every epoch ends with a batch of 1 sample ({per_rank} samples per process, batch_size "
                f"{self.feeder.batch_size}), which BatchNorm1d ({flat[0]}) cannot normalise on [N, C] inputs in training",
                hint="set drop_last: true, or a batch_size that does not leave one sample over")

    def _forward_backward(self, batch: Any, window_size: int, *, last: bool) -> torch.Tensor:
        """``loss_fn`` under autocast, then backward of ``loss / window_size``; returns the loss."""
        assert self.device is not None and self.scaler is not None
        if self._probe_batchnorm:
            with self._batchnorm_probe():
                return self._forward_backward(batch, window_size, last=last)
        model, scaler = self.model, self.scaler
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        sync = contextlib.nullcontext() if (ddp is None or last or self._per_epoch is None) else ddp.no_sync()
        if self._sharded:  # FSDP2: reduce-scatter gradients only on the window's last micro-batch
            self.unwrapped_model.set_requires_gradient_sync(last or self._per_epoch is None)  # type: ignore[operator]
        autocast = (
            torch.autocast(self.device.type, dtype=self._amp_dtype) if self._amp_dtype is not None
            else contextlib.nullcontext()
        )
        with sync:
            with autocast:
                try:
                    loss = self.loss_fn(model, batch)
                except RuntimeError as exc:
                    if ddp is None or "find_unused_parameters" not in str(exc):
                        raise
                    raise TrainingError(
                        "under DDP every trainable parameter must get a gradient in every step, and this model "
                        "has parameters its loss did not use", hint="set training.find_unused_parameters: true "
                        "(TrainingConfig(find_unused_parameters=True)), or freeze them with requires_grad_(False)",
                    ) from exc
            loss = check_loss(loss)
            scaled = loss / window_size if window_size != 1 else loss
            scaler.scale(scaled).backward() if scaler.is_enabled() else scaled.backward()
        return loss

    def _params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _optimizer_step(self) -> None:
        """Unscale, clip, step (optimizer, then scheduler), zero grads."""
        optimizer, scaler = self.optimizer, self.scaler
        assert optimizer is not None and scaler is not None
        if self._closure:
            self._closure_step()
        else:
            if scaler.is_enabled():
                scaler.unscale_(optimizer)
            if self.config.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self._params(), self.config.grad_clip, foreach=True)
            if scaler.is_enabled():
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        if self.scheduler is not None and not self._plateau:
            self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self._window.steps += 1

    def _closure_step(self) -> None:
        """``optimizer.step(closure)``: the closure zeroes the gradients, recomputes forward + backward
        over the window's micro-batches (their mean loss, as a plain step), clips, and returns the
        mean loss (all-reduced over ranks, so every rank's optimizer takes the same decisions, e.g.
        LBFGS' tolerance checks). The window logs the loss of the first evaluation (before the step)."""
        assert self.optimizer is not None and self.device is not None
        optimizer, batches = self.optimizer, self._pending
        self._pending = []
        first: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            with torch.enable_grad():
                optimizer.zero_grad(set_to_none=True)
                total = torch.zeros((), device=self.device)
                for i, batch in enumerate(batches):
                    total += self._forward_backward(batch, len(batches), last=i == len(batches) - 1).detach().float()
            if self.config.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self._params(), self.config.grad_clip, foreach=True)
            if not first:
                first.append(total)
            mean = total / len(batches)
            if self.dist.enabled:
                import torch.distributed as tdist

                tdist.all_reduce(mean)
                mean /= self.dist.world_size
            return mean

        optimizer.step(cast(Any, closure))  # torch types the closure as returning float; LBFGS float()s a tensor
        if first:
            self._window.loss_sum += first[0]
            self._window.micro_batches += len(batches)

    def _check_checkpointable(self, when: str) -> None:
        """Refuse now, with the :class:`UncheckpointableStateError` the first checkpoint would raise,
        state that no checkpoint can hold (a ``set`` in the optimizer state, an object in a param
        group, a callback's state): before the first step and again after it (when optimizers have
        created their per-parameter state), so no training time is spent on a run that cannot be
        checkpointed. Walks the structures only; no tensor is copied."""
        assert self.optimizer is not None
        for what, check in (("the optimizer's state_dict()", lambda: st.check_optimizer(self.optimizer.state_dict())),
                            ("the training state (scheduler, callbacks, scaler)", lambda: st.dumps(self._train_state()))):
            try:
                check()
            except UncheckpointableStateError as exc:
                raise UncheckpointableStateError(
                    f"{what} cannot be checkpointed ({when}): {exc.args[0]}", hint=exc.hint) from None

    def _after_optimizer_step(self) -> StopReason | None:
        """Log, honour a stop request, checkpoint, respect ``max_steps``."""
        cfg = self.config
        p = self.progress
        if not self._state_checked_after_step:
            self._state_checked_after_step = True
            self._check_checkpointable(f"found after step {p.step}, before any checkpoint")
        if self._profiler is not None:
            self._profiler.step()
        if self._window.steps >= cfg.log_every or p.step == self._total_steps:
            self._log_window()
        checkpoint_due = bool(cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0)
        if self._stop_check_due(checkpoint_due):
            self._log_window()
            return StopReason.PREEMPTED
        if checkpoint_due:
            self._checkpoint()
        if cfg.max_steps is not None and p.step >= cfg.max_steps:
            self._log_window()
            return StopReason.COMPLETED
        return None

    @contextlib.contextmanager
    def _profiling(self) -> Any:
        """``config.profile``: torch.profiler over ``wait`` + 1 warm-up + ``steps`` optimizer steps on
        the main rank; the Chrome trace goes to ``output_dir/profile/trace-rank<R>.json``."""
        spec = self.config.profile
        if spec is None or not self.is_main:
            yield
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        assert self.device is not None
        path = Path(self.config.output_dir) / "profile" / f"trace-rank{self.dist.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)

        def ready(prof: Any) -> None:
            prof.export_chrome_trace(str(path))
            self._profile_trace = path
            log.info("profile trace written to %s", path)

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities, schedule=schedule(wait=spec.wait, warmup=1, active=spec.steps, repeat=1),
                     on_trace_ready=ready, profile_memory=True) as prof:
            self._profiler = prof
            try:
                yield
            finally:
                self._profiler = None

    def _stop_check_due(self, checkpoint_due: bool) -> bool:
        """Whether the run stops now. One process: the local flag, every step (free). Several: the
        flag is all-reduced (a host sync) only every ``stop_check_every`` steps, at checkpoints and
        at the last step, on every rank alike, so all ranks stop after the same step."""
        if not self.dist.enabled:
            return self._stop_requested
        p, every = self.progress, self.config.stop_check_every
        if p.step % every and not checkpoint_due and p.step != self._total_steps:
            return False
        return self.dist.any_flag(self._stop_requested)

    def _end_epoch(self) -> StopReason | None:
        """Advance the epoch counter; validate when due; a reason if early stopping fired."""
        p = self.progress
        p.epoch += 1
        p.position = 0
        if self.eval_data is None or p.epoch % self.config.validation.every_epochs:
            return None
        self._log_window()
        self._validate()
        return StopReason.EARLY_STOPPED if self._early_stop else None

    def _validate(self) -> dict[str, Any]:
        """Metrics on ``eval_data`` (main rank), best tracking, early-stop decision (all ranks)."""
        assert self.device is not None and self.backend is not None
        metrics: dict[str, Any] = {}
        improved = False
        if self.is_main or self._sharded:  # FSDP: every rank runs the forward (it all-gathers weights)
            # Validation must not move the training RNG streams (or a resumed run would diverge).
            rng_t, rng_m = capture_rng_state(self.backend.device_type)
            model = self.unwrapped_model
            model.eval()
            try:
                outputs, targets = collect_outputs(model, self._eval_loader(), self.predict_fn, self._eval_to_device)
                if self.is_main:
                    metrics = plain_metrics(self.metrics_fn(outputs, targets))
            finally:
                model.train()
                restore_rng_state(rng_t, rng_m, self.backend.device_type)
        if self.is_main:
            if self.tracker.metric not in metrics:
                raise TrainingError(
                    f"validation.metric {self.tracker.metric!r} is not one of the validation metrics "
                    f"({', '.join(sorted(metrics))})", hint="name one of them in training.validation.metric")
            p = self.progress
            improved = self.tracker.update(metrics, epoch=p.epoch, step=p.step)
            if improved and not self._sharded:
                self._save_best(metrics)
            patience = self.config.validation.patience
            self._early_stop = patience is not None and self.tracker.bad_validations >= patience
            for cb in self.callbacks:
                hook = getattr(cb, "on_validation", None)
                if hook is not None:
                    hook(self, {"epoch": p.epoch, "step": p.step, **metrics})
        if self._plateau and self.scheduler is not None:
            # ReduceLROnPlateau: stepped per validation with its metric (the same value on every rank).
            value = metrics.get(self.tracker.metric) if self.is_main else None
            value = self.dist.broadcast_object(value)
            if value is not None and value == value:
                cast(Any, self.scheduler).step(float(value))
        if self._sharded and self.dist.broadcast_object(improved):
            self._save_best(metrics)  # collective: every rank gathers
        if self.dist.enabled:
            self._early_stop = bool(self.dist.broadcast_object(self._early_stop))
        self._validated_step = self.progress.step
        return metrics

    def _preflight_validation(self) -> None:
        """Run ``predict_fn`` and ``metrics_fn`` on the first held-out batch before training, so a
        model output, predict_fn or metrics_fn the validation cannot use, or a ``validation.metric``
        the metrics lack, fails now instead of after the first epoch. RNG streams, buffers and train
        mode are restored; nothing is recorded."""
        assert self.backend is not None
        error: BaseException | None = None
        if self.is_main or self._sharded:
            rng_t, rng_m = capture_rng_state(self.backend.device_type)
            model = self.unwrapped_model
            model.eval()
            try:
                first = list(itertools.islice(iter(self._eval_loader()), 1))
                # Runs again after a resume: a forward that updates buffers must leave no trace.
                with torch.no_grad(), st.buffers_kept(model):
                    outputs, targets = gather_outputs(model, first, self.predict_fn, self._eval_to_device)
                metrics: dict[str, Any] | None = None
                if self.is_main and first:
                    try:
                        metrics = plain_metrics(self.metrics_fn(outputs, targets))
                    except TrainingError:
                        raise  # the default metrics' refusals are about shapes: any batch has them
                    except Exception as exc:  # noqa: BLE001 - e.g. AUC of a batch with one class
                        log.warning("metrics_fn failed on the first held-out batch (%s: %s); it runs again on the "
                                    "whole held-out split at the first validation", type(exc).__name__, exc)
                if metrics is not None:
                    try:
                        st.dumps(metrics)  # what every checkpoint stores in the validation history
                    except UncheckpointableStateError as exc:
                        raise UncheckpointableStateError(
                            f"the validation metrics cannot be checkpointed (checked on the first held-out batch "
                            f"before training): {exc.args[0]}", hint=exc.hint) from None
                    if self.tracker.metric not in metrics:
                        raise TrainingError(
                            f"validation.metric {self.tracker.metric!r} is not one of the validation metrics "
                            f"({', '.join(sorted(metrics))}; checked on the first held-out batch before training)",
                            hint="name one of them in training.validation.metric, or return it from metrics_fn")
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
                error = exc
            finally:
                model.train()
                restore_rng_state(rng_t, rng_m, self.backend.device_type)
        if self.dist.any_flag(error is not None):
            if error is not None:
                raise error
            raise TrainingError("the validation check on rank 0 failed before training (see its error)")

    def _eval_to_device(self, batch: Any) -> Any:
        assert self.device is not None
        return to_device(batch, self.device, False) if self.device.type != "cpu" else batch

    def _eval_loader(self) -> Any:
        from torch.utils.data import DataLoader

        if isinstance(self.eval_data, DataLoader):
            return self.eval_data
        size = self.config.validation.batch_size or self.config.batch_size
        return DataLoader(self.eval_data, batch_size=size, shuffle=False, num_workers=self.num_workers,
                          generator=torch.Generator().manual_seed(0))

    def _new_window(self) -> _Window:
        assert self.device is not None
        return _Window(loss_sum=torch.zeros((), device=self.device), started=time.perf_counter())

    def _log_window(self) -> None:
        """Sync the window's mean loss to the host (the one sync per window) and call ``on_step``."""
        w = self._window
        if not self.is_main or w.micro_batches == 0:
            return
        assert self.optimizer is not None and self.backend is not None and self.scaler is not None
        loss = float((w.loss_sum / w.micro_batches).item())
        now = time.perf_counter()
        self._last_loss = loss
        if (loss != loss or loss in (float("inf"), float("-inf"))) and not self.scaler.is_enabled():
            # (with fp16 the scaler skips an overflowing step and lowers the scale instead)
            raise TrainingError(f"loss became non-finite ({loss}) at step {self.progress.step}",
                                hint="lower lr, enable grad_clip, or use precision=fp32")
        metrics = StepMetrics(
            step=self.progress.step, epoch=self.progress.epoch, loss=loss,
            samples_per_s=w.samples * self.dist.world_size / max(now - w.started, 1e-9),
            lr=float(self.optimizer.param_groups[0]["lr"]), memory=self.backend.memory_summary(),
            total_steps=self._total_steps,
        )
        for cb in self.callbacks:
            cb.on_step(self, metrics)
        self._window = self._new_window()


def _configured_optimizer(config: TrainingConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``config.optimizer``: the ``torch.optim`` class of that name with lr / weight_decay / kwargs."""
    spec = config.optimizer
    assert spec is not None
    classes = {name.lower(): cls for name, cls in vars(torch.optim).items()
               if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
    cls = classes.get(spec.name.lower())
    if cls is None:
        raise TrainingError(f"training.optimizer {spec.name!r} is not a torch.optim optimizer",
                            hint=f"use one of {', '.join(sorted(classes))}")
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepted = {}  # type: ignore[assignment]
    kwargs: dict[str, Any] = {}
    if "lr" in accepted:
        kwargs["lr"] = config.lr
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = config.weight_decay
    elif config.weight_decay:
        raise TrainingError(f"training.optimizer {spec.name!r} has no weight_decay, and training.weight_decay is "
                            f"{config.weight_decay}", hint="set training.weight_decay: 0 for this optimizer")
    kwargs.update(spec.kwargs)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise TrainingError(f"training.optimizer {spec.name!r} rejected its arguments: {exc}",
                            hint=f"see torch.optim.{cls.__name__} for the arguments it takes") from None


def _check_model_state(model: nn.Module, saved: Mapping[str, torch.Tensor], name: str) -> None:
    """Refuse (:class:`ResumeMismatchError`) a checkpoint whose ``model/`` tensors do not fit ``model``
    (renamed, added or removed modules, other layer sizes), naming the first differences."""
    mismatch = st.state_mismatch(model.state_dict(), saved)
    if mismatch is None:
        return
    raise ResumeMismatchError(
        f"cannot resume from {name}: the model does not match the checkpoint's ({mismatch})",
        hint="build the model that wrote it (same code and model kwargs), use a fresh output_dir, or set resume=false",
    )


def _info_to_json(info: CheckpointInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"path": str(info.path), "step": info.step, "sha256": info.sha256, "key_id": info.key_id}


def _info_from_json(data: Mapping[str, Any] | None) -> CheckpointInfo | None:
    if not data:
        return None
    from pathlib import Path

    return CheckpointInfo(Path(data["path"]), int(data["step"]), data["sha256"], data.get("key_id"))
