"""The training engine: deterministic, resumable, optionally distributed, audited.

>>> from securetrain.training import Trainer, TrainingConfig
>>> result = Trainer(model, dataset, TrainingConfig(epochs=2, output_dir="runs/x")).fit()

Names are imported lazily so that ``import securetrain.training.cli`` stays free of torch.
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports


_EXPORTS = {
    "MetricsHistory": "callbacks",
    "StepMetrics": "callbacks",
    "TrainerCallback": "callbacks",
    "CheckpointInfo": "checkpoint_store",
    "CheckpointStore": "checkpoint_store",
    "LoadedCheckpoint": "checkpoint_store",
    "TrainingConfig": "config",
    "CheckpointCorruptError": "errors",
    "CheckpointNotFoundError": "errors",
    "ResumeMismatchError": "errors",
    "TrainingError": "errors",
    "SafetensorsCheckpointStore": "safetensors_store",
    "StopReason": "stop",
    "INTERRUPTED_EXIT_CODE": "trainer",
    "PREEMPTED_EXIT_CODE": "trainer",
    "Trainer": "trainer",
    "TrainResult": "trainer",
    "cross_entropy_loss": "trainer",
    "split_batch": "trainer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
