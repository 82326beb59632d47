"""The training engine: configure a :class:`Trainer`, call :meth:`Trainer.fit`.

Per optimizer step it does what a careful hand-written loop does and nothing more: forward under
autocast, (scaled) backward, optional accumulation, unscale + clip, step, zero grads. The loss is
accumulated on the device and synced to the host only every ``log_every`` steps.

Preemption: SIGTERM sets a flag; the current optimizer step finishes, a checkpoint is written and
:meth:`fit` returns with ``reason="preempted"`` (the CLI then exits with
:data:`PREEMPTED_EXIT_CODE`). Restarting with the same config resumes from that checkpoint and ends
with bit-identical weights to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.devices.backend import DeviceBackend
from securetrain.devices.registry import resolve_backend
from securetrain.training import state as st
from securetrain.training.callbacks import StepMetrics, TrainerCallback
from securetrain.training.checkpoint_store import CheckpointInfo, CheckpointStore
from securetrain.training.config import TrainingConfig
from securetrain.training.data import EpochFeeder
from securetrain.training.distributed import DistContext, init_distributed
from securetrain.training.errors import ResumeMismatchError, TrainingError
from securetrain.training.safetensors_store import SafetensorsCheckpointStore
from securetrain.training.seeding import capture_rng_state, restore_rng_state, seed_everything

#: Exit status for "stopped by SIGTERM after a clean checkpoint; rerun to resume" (BSD EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75
CHECKPOINT_FORMAT = "securetrain-train/1"
# Own metadata keys, distinct from the stores' (the encrypted store owns "securetrain.format").
TRAIN_FORMAT_KEY = "securetrain.train.format"
TRAIN_STATE_KEY = "securetrain.train.state"

INPUT_KEYS = ("inputs", "pixels", "features")
TARGET_KEYS = ("label", "labels", "target")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(x, y)`` from a ``(x, y, ...)`` tuple/list or a dict keyed as documented."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        y = next((batch[k] for k in TARGET_KEYS if k in batch), None)
        if x is not None and y is not None:
            return x, y
        raise TrainingError(
            f"cannot find inputs/targets in batch keys {sorted(map(str, batch))}",
            hint=f"use input keys {INPUT_KEYS} and target keys {TARGET_KEYS}, or pass loss_fn",
        )
    raise TrainingError(
        f"unsupported batch type {type(batch).__name__}", hint="yield (x, y) tuples or dicts, or pass loss_fn"
    )


def cross_entropy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Default loss: ``F.cross_entropy(model(x), y)``."""
    x, y = split_batch(batch)
    return F.cross_entropy(model(x), y)


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return next((_batch_len(v) for v in batch.values() if isinstance(v, torch.Tensor)), 0)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    return 0


@dataclass(frozen=True)
class TrainResult:
    steps: int
    epoch: int
    final_loss: float | None
    reason: str  # "completed" | "preempted"
    checkpoint: CheckpointInfo | None
    resumed_from: int | None
    device: str
    precision: str

    @property
    def exit_code(self) -> int:
        return PREEMPTED_EXIT_CODE if self.reason == "preempted" else 0


@dataclass
class _Progress:
    step: int = 0
    epoch: int = 0
    position: int = 0  # micro-batches of `epoch` already consumed
    samples: int = 0  # samples seen by this rank


class Trainer:
    """Configure, don't rewrite: model + optimizer (or factory) + data + :class:`TrainingConfig`.

    ``train_data`` is a map-style ``Dataset`` (the engine builds a deterministic, resumable,
    rank-sharded DataLoader) or a ``DataLoader`` (its dataset, batch size, collate_fn and workers are
    kept; its sampler is replaced by the deterministic one, unless it uses a custom batch sampler or
    an IterableDataset, which are used as they are).
    """

    def __init__(
        self,
        model: nn.Module,
        train_data: Any,
        config: TrainingConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        loss_fn: LossFn | None = None,
        store: CheckpointStore | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        audit: AuditRecorder | None = None,
        backend: DeviceBackend | None = None,
        run_id: str | None = None,
    ) -> None:
        self.config = config or TrainingConfig()
        self.model = model
        self.train_data = train_data
        self._optimizer_arg = optimizer
        self.loss_fn: LossFn = loss_fn or cross_entropy_loss
        self.store: CheckpointStore = store or SafetensorsCheckpointStore(
            self.config.output_dir / "checkpoints", keep_last=self.config.keep_last, audit=audit
        )
        self.callbacks = list(callbacks)
        self.audit: AuditRecorder = audit or NullAuditRecorder()
        self._backend_arg = backend
        self.run_id = run_id or str(self.config.output_dir)
        self.backend: DeviceBackend | None = None
        self.dist = DistContext()
        self.optimizer: torch.optim.Optimizer | None = None
        self.progress = _Progress()
        self._stop_requested = False
        self._last_loss: float | None = None

    # --- public helpers ------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def request_stop(self) -> None:
        """Ask the loop to stop after the current optimizer step (what SIGTERM does)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def unwrapped_model(self) -> nn.Module:
        return self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model

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

    def _build_optimizer(self) -> torch.optim.Optimizer:
        arg = self._optimizer_arg
        params = [p for p in self.model.parameters() if p.requires_grad]
        if arg is None:
            return torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        if isinstance(arg, torch.optim.Optimizer):
            return arg
        return arg(params)

    def _fingerprint(self, world_size: int, precision: str, dataset_len: int | None) -> dict[str, Any]:
        c = self.config
        # What must match for a resumed run to replay the same sample order and numerics.
        return {
            "seed": c.seed,
            "batch_size": c.batch_size,
            "grad_accumulation": c.grad_accumulation,
            "world_size": world_size,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "precision": precision,
            "dataset_len": dataset_len,
        }

    # --- checkpointing -------------------------------------------------------------------
    def _checkpoint(self, scaler: torch.amp.GradScaler, fingerprint: dict[str, Any]) -> CheckpointInfo | None:
        assert self.optimizer is not None and self.backend is not None
        rng_t, rng_m = capture_rng_state(self.backend.device_type)
        # Every rank's RNG is saved so dropout etc. continue exactly on each rank after resume.
        all_rng = self.dist.gather_objects((rng_t, rng_m))
        info: CheckpointInfo | None = None
        if self.is_main:
            tensors = {f"model/{k}": st.detach_for_save(v) for k, v in self.unwrapped_model.state_dict().items()}
            opt_t, opt_m = st.flatten_optimizer(self.optimizer.state_dict())
            tensors.update(opt_t)
            rng_meta = {}
            for rank, (rt, rm) in enumerate(all_rng):
                tensors.update({f"rng/{rank}/{k}": v.cpu() for k, v in rt.items()})
                rng_meta[str(rank)] = rm
            p = self.progress
            state = {
                "step": p.step, "epoch": p.epoch, "position": p.position, "samples": p.samples,
                "last_loss": self._last_loss, "fingerprint": fingerprint,
                "optimizer": opt_m, "scaler": scaler.state_dict(), "rng": rng_meta,
            }
            meta = {TRAIN_FORMAT_KEY: CHECKPOINT_FORMAT, TRAIN_STATE_KEY: st.dumps(state)}
            # The store records checkpoint.write itself (it knows the key id and ciphertext digest).
            info = self.store.save(p.step, tensors, meta)
            for cb in self.callbacks:
                cb.on_checkpoint(self, info)
        self.dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is durable
        return info

    def _resume(self, scaler: torch.amp.GradScaler, fingerprint: dict[str, Any]) -> int | None:
        assert self.optimizer is not None and self.backend is not None
        latest = self.store.latest() if self.is_main else None
        latest = self.dist.broadcast_object(latest)
        if latest is None:
            return None
        ckpt = self.store.load(latest)
        if ckpt.metadata.get(TRAIN_FORMAT_KEY) != CHECKPOINT_FORMAT:
            raise ResumeMismatchError(
                f"{latest.path.name} is not a securetrain training checkpoint",
                hint="use a fresh output_dir or set resume=false",
            )
        saved = st.loads(ckpt.metadata[TRAIN_STATE_KEY])
        diff = {k: (saved["fingerprint"].get(k), v) for k, v in fingerprint.items() if saved["fingerprint"].get(k) != v}
        if diff:
            what = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ResumeMismatchError(
                f"cannot resume exactly from {latest.path.name}: {what}",
                hint="restore the original settings, use a fresh output_dir, or set resume=false",
            )
        model_sd = {k.removeprefix("model/"): v for k, v in ckpt.tensors.items() if k.startswith("model/")}
        self.unwrapped_model.load_state_dict(model_sd, strict=True)
        self.optimizer.load_state_dict(st.unflatten_optimizer(ckpt.tensors, saved["optimizer"]))
        if saved["scaler"]:
            scaler.load_state_dict(saved["scaler"])
        rank = str(self.dist.rank)
        prefix = f"rng/{rank}/"
        restore_rng_state(
            {k.removeprefix(prefix): v for k, v in ckpt.tensors.items() if k.startswith(prefix)},
            saved["rng"][rank],
            self.backend.device_type,
        )
        self.progress = _Progress(saved["step"], saved["epoch"], saved["position"], saved["samples"])
        self._last_loss = saved["last_loss"]
        return int(saved["step"])

    # --- the loop ------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg = self.config
        backend = self._backend_arg
        if backend is None:
            from securetrain.training.distributed import from_env

            _, local_rank, world = from_env()
            backend = resolve_backend(cfg.device, index=local_rank if world > 1 else None)
        self.backend = backend
        self.dist = init_distributed(backend.collective_backend)
        device = backend.device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if backend.collective_backend != "gloo":
            self.dist.device = device
        try:
            return self._fit(backend, device)
        finally:
            self.dist.close()

    def _fit(self, backend: DeviceBackend, device: torch.device) -> TrainResult:
        cfg = self.config
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        precision, amp_dtype = self._resolve_precision(backend)
        seed_everything(cfg.seed + self.dist.rank)
        self.model.to(device)
        self.optimizer = self._build_optimizer()
        scaler = torch.amp.GradScaler(device.type, init_scale=4096, enabled=precision == "fp16")
        feeder = EpochFeeder(
            self.train_data, batch_size=cfg.batch_size, seed=cfg.seed, shuffle=cfg.shuffle, drop_last=cfg.drop_last,
            num_workers=cfg.num_workers, pin_memory=backend.pin_memory and device.type != "cpu",
            rank=self.dist.rank, world_size=self.dist.world_size,
        )
        fingerprint = self._fingerprint(self.dist.world_size, precision, feeder.dataset_length)
        resumed_from = self._resume(scaler, fingerprint) if cfg.resume else None
        if self.dist.enabled:
            self.model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None
            )
        if self.is_main:
            self.audit.record("training.start", self.run_id, details={
                "device": str(device), "backend": backend.name, "precision": precision,
                "world_size": self.dist.world_size, "seed": cfg.seed, "resumed_from_step": resumed_from,
                "parameters": sum(p.numel() for p in self.unwrapped_model.parameters()),
            })
            for cb in self.callbacks:
                cb.on_train_begin(self)

        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        reason = "completed"
        info: CheckpointInfo | None = None
        try:
            reason = self._loop(feeder, scaler, device, amp_dtype, fingerprint)
            if reason == "preempted" or cfg.checkpoint_at_end:
                # Skip a duplicate write when checkpoint_every already saved this very step.
                if self._saved_step == self.progress.step:
                    info = self._saved_info
                else:
                    info = self._checkpoint(scaler, fingerprint)
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
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self.model = self.unwrapped_model
        result = TrainResult(
            steps=self.progress.step, epoch=self.progress.epoch, final_loss=self._last_loss, reason=reason,
            checkpoint=info, resumed_from=resumed_from, device=str(device), precision=precision,
        )
        if self.is_main:
            self.audit.record("training.stop", self.run_id, details={
                "steps": result.steps, "final_loss": result.final_loss, "reason": reason,
                "checkpoint_sha256": info.sha256 if info else None,
            })
            for cb in self.callbacks:
                cb.on_end(self, result)
        return result

    def _loop(
        self, feeder: EpochFeeder, scaler: torch.amp.GradScaler, device: torch.device,
        amp_dtype: torch.dtype | None, fingerprint: dict[str, Any],
    ) -> str:
        cfg = self.config
        assert self.optimizer is not None and self.backend is not None
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        accum = cfg.grad_accumulation
        on_device = device.type != "cpu"
        non_blocking = on_device and self.backend.pin_memory
        autocast = (
            (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype is not None else contextlib.nullcontext
        )
        per_epoch = feeder.batches_in_epoch()
        total_steps = cfg.max_steps
        if per_epoch is not None and cfg.epochs is not None:
            by_epochs = cfg.epochs * -(-per_epoch // accum)
            total_steps = min(total_steps, by_epochs) if total_steps else by_epochs
        self._total_steps = total_steps
        self._saved_step: int | None = None
        self._saved_info: CheckpointInfo | None = None
        p = self.progress
        if per_epoch == 0:
            raise TrainingError("the training data yields no batches", hint="check the dataset size and drop_last")
        running = torch.zeros((), device=device)
        running_n = 0
        window_samples = 0
        t_window = time.perf_counter()
        steps_since_log = 0
        model.train()

        def finish_log() -> None:
            nonlocal running, running_n, window_samples, t_window, steps_since_log
            if not self.is_main or running_n == 0:
                return
            loss = float((running / running_n).item())  # the one host sync per log window
            now = time.perf_counter()
            self._last_loss = loss
            if loss != loss or loss in (float("inf"), float("-inf")):
                if scaler.is_enabled():
                    pass  # fp16 overflow: the scaler skips the step and lowers the scale
                else:
                    raise TrainingError(f"loss became non-finite ({loss}) at step {p.step}",
                                        hint="lower lr, enable grad_clip, or use precision=fp32")
            metrics = StepMetrics(
                step=p.step, epoch=p.epoch, loss=loss,
                samples_per_s=window_samples * self.dist.world_size / max(now - t_window, 1e-9),
                lr=float(optimizer.param_groups[0]["lr"]), memory=self.backend.memory_summary(),
                total_steps=total_steps,
            )
            for cb in self.callbacks:
                cb.on_step(self, metrics)
            running = torch.zeros((), device=device)
            running_n = window_samples = steps_since_log = 0
            t_window = now

        while cfg.epochs is None or p.epoch < cfg.epochs:
            if cfg.max_steps is not None and p.step >= cfg.max_steps:
                return "completed"
            in_window = 0
            window_size = accum
            for batch in feeder.epoch(p.epoch, skip_batches=p.position):
                if in_window == 0 and per_epoch is not None:
                    # The last window of an epoch may be short; divide by its true size so the
                    # gradient is the mean over the micro-batches it really has.
                    window_size = min(accum, per_epoch - p.position)
                if on_device:
                    batch = _to_device(batch, device, non_blocking)
                in_window += 1
                p.position += 1
                last_micro = in_window == window_size
                sync = contextlib.nullcontext() if (ddp is None or last_micro or per_epoch is None) else ddp.no_sync()
                with sync:
                    with autocast():
                        loss = loss_fn(model, batch)
                    scaled = loss / window_size if window_size != 1 else loss
                    scaler.scale(scaled).backward() if scaler.is_enabled() else scaled.backward()
                running += loss.detach().float()
                running_n += 1
                n = _batch_len(batch)
                window_samples += n
                p.samples += n
                if not last_micro:
                    continue
                self._optimizer_step(optimizer, scaler, params)
                in_window = 0
                steps_since_log += 1
                if steps_since_log >= cfg.log_every or p.step == total_steps:
                    finish_log()
                stop = self.dist.any_flag(self._stop_requested) if self.dist.enabled else self._stop_requested
                if stop:
                    finish_log()
                    return "preempted"
                if cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0:
                    self._saved_info = self._checkpoint(scaler, fingerprint)
                    self._saved_step = p.step
                if cfg.max_steps is not None and p.step >= cfg.max_steps:
                    finish_log()
                    return "completed"
            if in_window:  # unsized data: flush the short tail window, rescaled to a mean
                for prm in params:
                    if prm.grad is not None:
                        prm.grad.mul_(window_size / in_window)
                self._optimizer_step(optimizer, scaler, params)
                steps_since_log += 1
            p.epoch += 1
            p.position = 0
        finish_log()
        return "completed"

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, params: list[torch.Tensor]) -> None:
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip, foreach=True)
        if scaler.is_enabled():
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
