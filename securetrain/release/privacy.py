"""DP-SGD for the trainer, through Opacus (``PrivacyEngine.make_private_with_epsilon``).

:class:`DPTrainer` is a :class:`~securetrain.training.trainer.Trainer` whose named steps are
overridden where DP-SGD differs; everything else (checkpoints, validation, audit, preemption) is
the trainer's own.

- **Sampling.** Every optimizer step draws one *logical* batch by Poisson sampling (each sample is
  included independently with rate ``q = 1 / steps_per_epoch``, expected size
  ``batch_size x grad_accumulation``), as the accountant assumes. The sampler's generator is
  re-seeded from ``(seed, epoch)`` so the order is reproducible per seed and a resumed run re-draws
  the same batches.
- **Accumulation.** The logical batch is split into physical micro-batches of ``batch_size``;
  Opacus clips and accumulates each (``signal_skip_step``, as its ``BatchMemoryManager`` does) and
  adds noise once per logical batch, so one optimizer step is one accountant step at rate ``q``.
- **Clipping.** Per-sample clipping at ``privacy.max_grad_norm`` replaces ``grad_clip``.
- **Noise.** Drawn from torch's default generator, which the trainer seeds and saves per rank in
  every checkpoint: a resumed run adds the same noise as an uninterrupted one. (Opacus'
  ``secure_mode`` would need a CSPRNG and gives up reproducibility; it is not used.)
- **Budget.** The accountant's history is part of the encrypted checkpoint; ε is recorded in the
  audit log (``privacy.epsilon``) after every epoch and at the end (``privacy.final``), and the run
  stops (reason ``privacy_budget``) before an optimizer step whose ε would exceed ``target_epsilon``.
- **Model.** Layers Opacus cannot train per-sample are replaced by ``ModuleValidator.fix``
  (``privacy.fix_model``, e.g. BatchNorm -> GroupNorm: BatchNorm normalises each sample with its
  batch's statistics, so per-sample gradients through it are wrong), with a warning naming each
  replaced layer (the model trained is then a fixed copy, ``trainer.model``); every checkpoint
  records the replaced layers (:mod:`securetrain.training.architecture`), so loaders rebuild that
  architecture (:func:`rebuild_trained_architecture`) and a resume that would train another one is
  refused. Anything still unsupported, BatchNorm with ``fix_model: false``, or a replaced BatchNorm
  over flat ``[N, C]`` features (its GroupNorm would erase its input, :mod:`securetrain.release.flat_norm`;
  seen on one forward of the first training samples before training) raises
  :class:`PrivacyModelError` naming the layers by path and the fix; on the same forward, a
  normalisation layer of the user's own that normalises one value per group (refused for every
  trainer, :mod:`securetrain.training.constant_norm`) raises ``ConstantNormError``. A
  ``torch.compile`` wrapper is set aside: Opacus' per-sample hooks go on the user's module, which
  runs uncompiled.
- **Checks.** The plain trainer's: the default loss's refusals (it is the same loss), a
  ``loss_fn`` that does not return one scalar tensor (:func:`~securetrain.training.losses.check_loss`).
- **DDP.** With several processes the model is wrapped in Opacus' DPDDP; each rank Poisson-samples
  its shard, the clipped sums are all-reduced and the noise is added once (rank 0), so ranks stay
  identical and the accountant sees one step per optimizer step at the global rate ``q``.
- **Limits.** Precision is fp32 (per-sample gradients under autocast/GradScaler are not supported
  here); training data must be a map-style dataset.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from securetrain.release.errors import PrivacyError, PrivacyModelError
from securetrain.release.flat_norm import describe_erasing, suspect_groupnorms
from securetrain.training.architecture import ReplacedLayers, describe_fix, model_fix_metadata
from securetrain.training.batches import batch_len, strip_compile, to_device
from securetrain.training.config import PrivacyConfig, TrainingConfig
from securetrain.training.constant_norm import constant_outputs, group_sizes, refuse_constant_norms, suspect_norms
from securetrain.training.errors import ModelArchitectureError, ResumeMismatchError
from securetrain.training.losses import check_loss
from securetrain.training.seeding import epoch_seed, eval_look
from securetrain.training.stop import StopReason
from securetrain.training.trainer import (
    Trainer,
    TrainResult,
    batchnorm_layers,
    describe_layers,
    optimizer_needs_closure,
)

log = logging.getLogger("securetrain.release.privacy")

BUDGET_REASON = StopReason.PRIVACY_BUDGET
_SAMPLER_MIX = 0xD9_5A_3C


def trainer_class(config: TrainingConfig) -> type[Trainer]:
    """:class:`DPTrainer` when ``config.privacy`` is set, else the plain :class:`Trainer`."""
    return DPTrainer if config.privacy is not None else Trainer


def _require_opacus() -> Any:
    try:
        import opacus
    except ImportError:  # pragma: no cover - depends on the environment
        raise PrivacyError("training.privacy needs Opacus", hint="pip install 'securetrain[privacy]'") from None
    return opacus


_BATCHNORM_WHY = ("BatchNorm normalises each sample with its batch's statistics, so per-sample gradients "
                  "through it are wrong")


def fixed_for_dp(model: nn.Module) -> tuple[nn.Module, ReplacedLayers]:
    """Opacus' fixed copy of ``model`` (``ModuleValidator.fix``: BatchNorm -> GroupNorm, ...) and the
    layers it replaced, by path. Deterministic: the same model fixes to the same architecture, which
    is how a loader rebuilds what a DP run trained (:func:`rebuild_trained_architecture`)."""
    from opacus.validators import ModuleValidator

    before = {name: type(m) for name, m in model.named_modules()}
    fixed = ModuleValidator.fix(model)
    replaced = [{"layer": name, "from": before[name].__name__, "to": type(m).__name__}
                for name, m in fixed.named_modules() if name in before and before[name] is not type(m)]
    return fixed, replaced


def validate_model(model: nn.Module, *, fix: bool) -> nn.Module:
    """The model made DP-trainable (fixed by Opacus where allowed, with a warning naming each replaced
    layer) or :class:`PrivacyModelError` naming the layers (by path) and the fix."""
    return validate_and_fix(model, fix=fix)[0]


def validate_and_fix(model: nn.Module, *, fix: bool) -> tuple[nn.Module, ReplacedLayers]:
    """:func:`validate_model`, with the layers replaced (``[]``: none), as checkpoints record them."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    replaced: ReplacedLayers = []
    if errors and fix:
        model, replaced = fixed_for_dp(model)
        errors = ModuleValidator.validate(model, strict=False)
        if replaced:
            why = f"{_BATCHNORM_WHY}. " if any("BatchNorm" in r["from"] for r in replaced) else ""
            log.warning("DP-SGD (training.privacy.fix_model) replaced layers it cannot train per sample: %s. %sThe "
                        "model trained is that fixed copy, trainer.model, not the model passed in; its checkpoints "
                        "load into the fixed architecture (opacus.validators.ModuleValidator.fix(model))",
                        describe_fix(replaced), why)
    if errors:
        norms = batchnorm_layers(model)
        others = sorted({str(e) for e in errors if not str(e).startswith("BatchNorm")})
        parts = ([f"{describe_layers(norms)}: {_BATCHNORM_WHY}"] if norms else []) + others
        raise PrivacyModelError(
            f"the model has layers DP-SGD cannot train: {'; '.join(parts)}",
            hint=("replace " + ("BatchNorm with GroupNorm (nn.GroupNorm(groups, channels)) over feature maps, nn.LayerNorm(C) "
                                "over flat [N, C] features" if norms else "them")
                  + (", LSTM with opacus.layers.DPLSTM" if others else "")
                  + ("" if fix else ", or set training.privacy.fix_model: true to have Opacus replace them")),
        )
    return model, replaced


def rebuild_trained_architecture(model: nn.Module, recorded: ReplacedLayers) -> nn.Module:
    """``model`` (as built from its spec) made the architecture a DP run trained: fixed as training
    fixed it, when its checkpoint records replaced layers. :class:`ModelArchitectureError` if the
    fix now replaces other layers (the model's code or kwargs changed): its weights would not fit."""
    _require_opacus()
    fixed, replaced = fixed_for_dp(model)
    if replaced != recorded:
        raise ModelArchitectureError(
            f"the checkpoint was trained with DP-SGD on the model with {describe_fix(recorded)} "
            f"(training.privacy.fix_model), but the model built now fixes to {describe_fix(replaced)}",
            hint="build the model that was trained (same model.target code and model.kwargs)")
    return fixed if recorded else model


@contextlib.contextmanager
def _model_errors() -> Iterator[None]:
    """Opacus' "unsupported layer" errors as :class:`PrivacyModelError` (they name the layer)."""
    try:
        yield
    except NotImplementedError as exc:
        raise PrivacyModelError(f"the model has a layer DP-SGD cannot train: {exc}",
                                hint="replace the layer or register an Opacus grad sampler for it") from None


def _split(batch: Any, size: int) -> list[Any]:
    """Physical micro-batches of at most ``size`` samples from one logical batch (tensors along dim 0)."""
    n = batch_len(batch)
    if n <= size:
        return [batch]
    return [_slice(batch, i, i + size) for i in range(0, n, size)]


def _slice(batch: Any, a: int, b: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[a:b]
    if isinstance(batch, Mapping):
        return {k: _slice(v, a, b) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, a, b) for v in batch)
    return batch


class PoissonFeeder:
    """Duck-types :class:`~securetrain.training.data.EpochFeeder` over Opacus' ``DPDataLoader``."""

    def __init__(self, loader: Any, *, seed: int, dataset_length: int, rank: int = 0) -> None:
        self.loader = loader
        self.seed = seed
        self.rank = rank
        self.batch_size = loader.batch_sampler.sample_rate * dataset_length
        self._length = dataset_length

    @property
    def dataset_length(self) -> int:
        return self._length

    def batches_in_epoch(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[Any]:
        seed = epoch_seed(self.seed, epoch)
        sampler = self.loader.batch_sampler
        # Each rank draws its own independent Poisson masks (over its shard when distributed).
        sampler.generator = torch.Generator().manual_seed((seed ^ _SAMPLER_MIX) + 7919 * self.rank)
        if hasattr(sampler, "shuffle_seed"):  # DistributedUniformWithReplacementSampler: shard = f(seed, epoch)
            sampler.shuffle_seed, sampler.epoch = self.seed, epoch
        # The loader's own generator too: without one, iter() draws a base seed from the *global* RNG
        # (which also drives the noise), and a resumed run would diverge.
        self.loader.generator = torch.Generator().manual_seed(seed ^ 0x5EED)
        it = iter(self.loader)
        for _ in range(skip_batches):  # re-draw (and drop) the consumed batches: same masks as before
            next(it)
        return it


class DPTrainer(Trainer):
    """The trainer with DP-SGD (see the module docstring); ``config.privacy`` must be set."""

    final_validation_reasons = (StopReason.COMPLETED, BUDGET_REASON)

    def __init__(self, model: nn.Module, train_data: Any, config: TrainingConfig | None = None, **kwargs: Any) -> None:
        if config is None or config.privacy is None:
            raise PrivacyError("DPTrainer needs training.privacy", hint="set training.privacy.target_epsilon")
        _require_opacus()
        self.privacy_config: PrivacyConfig = config.privacy
        self.user_config = config
        # One optimizer step = one Poisson batch (split physically here); per-sample clipping replaces grad_clip.
        internal = config.model_copy(update={"grad_accumulation": 1, "grad_clip": None})
        super().__init__(model, train_data, internal, **kwargs)
        self.privacy_engine: Any = None
        self.noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self._dp_loader: Any = None
        self._logical_batch = config.batch_size * config.grad_accumulation
        self.replaced_layers: ReplacedLayers = []  # by the fix_model step, recorded in every checkpoint

    # --- setup ---------------------------------------------------------------------------
    def _resolve_precision(self, backend: Any) -> tuple[str, torch.dtype | None]:
        if self.config.precision not in ("auto", "fp32"):
            raise PrivacyError(f"training.privacy supports precision fp32 only (got {self.config.precision})",
                               hint="set training.precision: fp32 (or auto)")
        return "fp32", None

    @property
    def unwrapped_model(self) -> nn.Module:
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

        model = super().unwrapped_model
        model = getattr(model, "_module", model)  # opacus' GradSampleModule wraps the user's model ...
        return model.module if isinstance(model, DPDDP) else model  # ... which DPDDP may wrap

    def _dataset(self) -> tuple[Any, Any]:
        from torch.utils.data import DataLoader, IterableDataset

        data: Any = self.train_data  # a Dataset or a DataLoader (unwrapped below)
        collate = None
        if isinstance(data, DataLoader):
            if data.batch_size is None:
                raise PrivacyError("DP-SGD cannot use a DataLoader with a custom batch sampler",
                                   hint="pass the Dataset (Poisson sampling replaces the sampler)")
            data, collate = data.dataset, data.collate_fn
        if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
            raise PrivacyError("DP-SGD needs a map-style dataset (Poisson sampling picks samples by index)",
                               hint="pass a Dataset with __len__ and __getitem__")
        return data, collate

    def _planned_epochs(self, steps_per_epoch: int) -> int:
        p, cfg = self.privacy_config, self.config
        if p.plan_epochs is not None:
            return p.plan_epochs
        epochs = [cfg.epochs] if cfg.epochs is not None else []
        if cfg.max_steps is not None:
            epochs.append(math.ceil(cfg.max_steps / steps_per_epoch))
        return min(epochs)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader

        if isinstance(self._optimizer_arg, torch.optim.Optimizer):
            raise PrivacyError("DP-SGD needs an optimizer factory, not an optimizer instance",
                               hint="pass optimizer=lambda params: torch.optim.SGD(params, lr=...)")
        p = self.privacy_config
        if strip_compile(self.model) is not self.model:
            log.info("DP-SGD trains the module under torch.compile uncompiled (Opacus' per-sample hooks are on it)")
        model, self.replaced_layers = validate_and_fix(strip_compile(self.model), fix=p.fix_model)
        self.model = model.to(self.device)
        data, collate = self._dataset()
        if len(data) == 0:
            raise PrivacyError("the training data is empty")
        self._refuse_erasing_norms(data, collate)
        if self.dist.enabled:
            from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

            # Broadcasts rank 0's weights; Opacus then all-reduces the clipped sums and adds the noise
            # once (on rank 0), so every rank steps identically.
            self.model = DPDDP(self.model)
        optimizer = super()._build_optimizer()
        if self.config.closure or (self.config.closure is None and optimizer_needs_closure(optimizer)):
            raise PrivacyError(
                f"DP-SGD cannot drive an optimizer that takes a closure ({type(optimizer).__name__}): every "
                "extra evaluation of the closure would look at the batch again without clipping and noise",
                hint="use a first-order optimizer (SGD, Adam, AdamW) and training.closure unset")
        # One logical batch spans all ranks: q = 1 / ceil(N / (batch_size x grad_accumulation x world_size)).
        loader = DataLoader(data, batch_size=self._logical_batch * self.dist.world_size, collate_fn=collate,
                            num_workers=self.num_workers, shuffle=False)
        self.privacy_engine = PrivacyEngine(accountant=p.accountant, secure_mode=False)
        steps_per_epoch = len(loader)
        with warnings.catch_warnings(), _model_errors():
            warnings.filterwarnings("ignore", message="Secure RNG turned off")  # documented choice, see above
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            model, dp_optimizer, dp_loader = self.privacy_engine.make_private_with_epsilon(
                module=self.model, optimizer=optimizer, data_loader=loader,
                target_epsilon=p.target_epsilon, target_delta=p.delta, epochs=self._planned_epochs(steps_per_epoch),
                max_grad_norm=p.max_grad_norm, poisson_sampling=True,
            )
        self.model = model
        self._dp_loader = dp_loader
        self.noise_multiplier = float(dp_optimizer.noise_multiplier)
        self.sample_rate = 1 / steps_per_epoch
        self._dataset_len = len(data)
        return dp_optimizer

    def _refuse_erasing_norms(self, data: Any, collate: Any) -> None:
        """:class:`PrivacyModelError` before training when a GroupNorm the fix put in place of a
        BatchNorm sees flat ``[N, C]`` features (:mod:`securetrain.release.flat_norm`), and
        :class:`~securetrain.training.errors.ConstantNormError` when a normalisation layer of the
        user's own normalises one value per group (:mod:`securetrain.training.constant_norm`): both
        seen on one forward of the first training samples, in eval mode, with the RNG streams
        restored. No forward when no layer could be either."""
        from torch.utils.data import default_collate

        model = self.model
        flat = suspect_groupnorms(model, self.replaced_layers)
        own = suspect_norms(model, exclude={r["layer"] for r in self.replaced_layers})
        if not flat and not own:
            return  # no layer could erase its input: no forward needed
        assert self.backend is not None and self.device is not None
        with eval_look(model, self.backend.device_type):
            batch = (collate or default_collate)([data[i] for i in range(min(len(data), self.config.batch_size))])
            if self.device.type != "cpu":
                batch = to_device(batch, self.device, self.backend.pin_memory)
            sizes, error = group_sizes({**flat, **own}, lambda: self.loss_fn(model, batch))
        erasing, constant = describe_erasing(flat, self.replaced_layers, sizes), constant_outputs(own, sizes)
        if error is not None and not erasing and not constant:
            raise error
        if erasing:
            raise PrivacyModelError(
                "DP-SGD (training.privacy.fix_model) replaced BatchNorm with GroupNorm where it normalises flat "
                f"[N, C] features, and there GroupNorm erases its input (the model would train to nothing): "
                f"{'; '.join(erasing)}",
                hint="over flat features use nn.LayerNorm(C) (or no norm) instead of BatchNorm1d for DP-SGD, or set "
                     "training.privacy.fix_model: false and replace the BatchNorm yourself (nn.LayerNorm, or "
                     "nn.GroupNorm with several channels per group); BatchNorm over feature maps ([N, C, H, W], "
                     "[N, C, L]) is fixed soundly")
        refuse_constant_norms(constant, "seen on the first training samples before training")

    def _refuse_constant_norms(self) -> None:
        pass  # done with the fix's check, on the same forward (_refuse_erasing_norms), before Poisson sampling

    def _make_feeder(self, backend: Any, device: torch.device) -> Any:
        return PoissonFeeder(self._dp_loader, seed=self.config.seed, dataset_length=self._dataset_len,
                             rank=self.dist.rank)

    def _wrap_distributed(self, device: torch.device) -> None:
        pass  # already wrapped (Opacus' DPDDP) in _build_optimizer

    def _fingerprint(self, world_size: int, precision: str, dataset_len: int | None) -> dict[str, Any]:
        fp = super()._fingerprint(world_size, precision, dataset_len)
        p = self.privacy_config
        fp["privacy"] = {"target_epsilon": p.target_epsilon, "delta": p.delta, "max_grad_norm": p.max_grad_norm,
                         "accountant": p.accountant, "noise_multiplier": self.noise_multiplier,
                         "logical_batch": self._logical_batch, "physical_batch": self.config.batch_size}
        return fp

    def model_metadata(self) -> dict[str, str]:
        return {**super().model_metadata(), **model_fix_metadata(self.replaced_layers)}

    # --- accountant state (saved encrypted with every checkpoint) --------------------------
    def extra_state(self) -> dict[str, Any]:
        state = super().extra_state()
        state["privacy_accountant"] = self.privacy_engine.accountant.state_dict()
        return state

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        super().load_extra_state(state)
        saved = state.get("privacy_accountant")
        if saved is None:
            raise ResumeMismatchError("the checkpoint holds no privacy accountant state (written without DP?)",
                                      hint="use a fresh output_dir or set resume=false")
        self.privacy_engine.accountant.load_state_dict(dict(saved))

    # --- the budget ----------------------------------------------------------------------
    def epsilon(self, extra_steps: int = 0) -> float:
        """ε spent so far (Opacus' accountant, at ``privacy.delta``), or after ``extra_steps`` more steps.

        For the RDP accountant the per-step RDP curve of each ``(noise, rate)`` is computed once and
        scaled by the step count, exactly as ``RDPAccountant.get_privacy_spent`` does (its cost is
        in the curve, and this runs after every optimizer step); other accountants are asked directly.
        """
        accountant = self.privacy_engine.accountant
        history = list(getattr(accountant, "history", []))
        if extra_steps:
            history.append((self.noise_multiplier, self.sample_rate, extra_steps))
        if not history:
            return 0.0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            if accountant.mechanism() == "rdp":
                from opacus.accountants.analysis import rdp as rdp_analysis

                orders = accountant.DEFAULT_ALPHAS
                rdp = sum(self._rdp_curve(sigma, q) * n for sigma, q, n in history)
                eps, _ = rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=self.privacy_config.delta)
                return float(eps)
            if extra_steps:
                accountant = copy.deepcopy(accountant)
                for _ in range(extra_steps):
                    accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
            return float(accountant.get_epsilon(self.privacy_config.delta))

    def _rdp_curve(self, sigma: float, q: float) -> Any:
        cache = self.__dict__.setdefault("_rdp_cache", {})
        if (sigma, q) not in cache:
            from opacus.accountants.analysis import rdp as rdp_analysis

            orders = self.privacy_engine.accountant.DEFAULT_ALPHAS
            cache[(sigma, q)] = rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
        return cache[(sigma, q)]

    def _epsilon_after_next_step(self) -> float:
        return self.epsilon(extra_steps=1)

    def _budget_left(self) -> bool:
        return self._epsilon_after_next_step() <= self.privacy_config.target_epsilon

    def privacy_summary(self) -> dict[str, Any]:
        p = self.privacy_config
        return {"epsilon": self.epsilon(), "delta": p.delta, "target_epsilon": p.target_epsilon,
                "accountant": p.accountant, "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "max_grad_norm": p.max_grad_norm,
                "steps": self.progress.step, "expected_batch_size": self._logical_batch}

    def _record_epsilon(self, action: str) -> None:
        if self.is_main:
            summary = self.privacy_summary()
            self.audit.record(action, self.run_id, details={"epoch": self.progress.epoch, **summary})

    # --- the loop ------------------------------------------------------------------------
    def _train_loop(self) -> StopReason:
        if not self._early_stop and not self._budget_left():
            return BUDGET_REASON  # resumed with the budget already spent
        return super()._train_loop()

    def _micro_step(self, batch: Any, window_size: int, *, last: bool) -> None:
        """One Poisson batch: clip-and-accumulate each physical chunk; noise comes in ``_optimizer_step``."""
        assert self.device is not None and self.optimizer is not None and self.backend is not None
        if self.device.type != "cpu":
            batch = to_device(batch, self.device, self.backend.pin_memory)
        chunks = _split(batch, self.config.batch_size)
        w = self._window
        for i, chunk in enumerate(chunks):
            n = batch_len(chunk)
            loss = check_loss(self.loss_fn(self.model, chunk))  # the plain trainer's check of what loss_fn returns
            # An empty Poisson batch still takes a (pure-noise) step; its loss (NaN) is not logged.
            (loss if n else torch.nan_to_num(loss) * 0.0).backward()
            if i < len(chunks) - 1:
                cast(Any, self.optimizer).signal_skip_step(do_skip=True)  # Opacus' DPOptimizer
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if n:
                w.loss_sum += loss.detach().float() * n
                w.samples += n
                w.micro_batches += n  # the window's mean loss is per sample
                self.progress.samples += n

    def _after_optimizer_step(self) -> StopReason | None:
        stop = super()._after_optimizer_step()
        epoch_ends = self._per_epoch is not None and self.progress.position >= self._per_epoch
        if stop is None and not epoch_ends and not self._budget_left():
            self._log_window()
            return BUDGET_REASON
        return stop

    def _end_epoch(self) -> StopReason | None:
        stop = super()._end_epoch()  # an epoch that used up the budget still ends (validation, epsilon event)
        self._record_epsilon("privacy.epsilon")
        cfg, p = self.config, self.progress
        more = (cfg.epochs is None or p.epoch < cfg.epochs) and (cfg.max_steps is None or p.step < cfg.max_steps)
        if stop is None and more and not self._budget_left():
            self._log_window()
            return BUDGET_REASON
        return stop

    def _fit(self, backend: Any, device: torch.device) -> TrainResult:
        result = super()._fit(backend, device)
        self._record_epsilon("privacy.final")
        # The architecture trained, for whoever rebuilds it (result.json, provenance, the report).
        return replace(result, privacy={**self.privacy_summary(), "replaced_layers": self.replaced_layers})
